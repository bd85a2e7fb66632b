"""``conductor epp --workers N``: N picker processes serving one gRPC port.

One Python process is one core at most; a picker deciding colocated spends its CPU on the
decision and on the gRPC stream, so a busy gateway needs more than one. Each worker is a whole
``conductor epp`` (its own gRPC server, producer and colocated router, its id ``<epp id>-w<i>``
naming it on the log), all bound to the same port with ``SO_REUSEPORT``: the kernel spreads the
proxy's connections over them (connections, not streams: Envoy opens one per worker thread).
Reservations, pending blocks and in-flight work are shared through Redis as between any two
pickers. Workers are started as new processes (not forked: gRPC's core does not survive a
fork), and this process holds the port bound (without listening) while they start, so a port
given as 0 is one free port for all of them.

The kernel balances ``SO_REUSEPORT`` listeners on Linux only (elsewhere the last one bound takes
every connection, or the option is missing): :func:`reuse_port_problem` says so at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from conductor.errors import ConfigError

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long a worker gets to stop after SIGTERM (its own gRPC grace is 2 s) before it is killed."""
READY_TIMEOUT_S = 120.0


def worker_id(epp_id: str, i: int) -> str:
    """Worker ``i``'s id: its producer id on the log (and its reply topic with ``--routing log``)."""
    return f"{epp_id}-w{i}"


def reuse_port_problem(platform: str = sys.platform) -> str | None:
    """Why ``--workers`` above 1 cannot work here (None: it can)."""
    if not platform.startswith("linux"):
        return (f"--workers above 1 needs Linux: it shares the port with SO_REUSEPORT, which only Linux balances "
                f"across processes (this is {platform}); run one picker per core as separate pods instead")
    if not hasattr(socket, "SO_REUSEPORT"):
        return "--workers above 1 needs SO_REUSEPORT, which this Python's socket module does not offer"
    return None


def hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and not listening (0: a free port), kept
    open while the workers bind the same port; :class:`ConfigError` naming ``--port`` when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--port {port}: cannot bind {host}:{port} ({e.strerror or e})") from None
    return sock


@dataclass
class Worker:
    index: int
    epp_id: str
    proc: asyncio.subprocess.Process
    ready: dict[str, Any] | None = None


async def supervise(args_of: Callable[[int, str], Sequence[str]], *, epp_id: str, workers: int, host: str, port: int,
                    stop: asyncio.Event, metrics_port: int = 0,
                    on_ready: Callable[[dict[str, Any]], None] = lambda _: None) -> int:
    """Start ``workers`` pickers (``python -m conductor`` with ``args_of(i, worker_port)``) on one
    port, report one ready line when all are ready, and stop them all on ``stop``. A worker that
    exits ends the others: the exit status is 1 (the orchestrator restarts the pod), 0 on ``stop``.
    Worker ``i`` serves its metrics on ``metrics_port + i`` (none when 0)."""
    problem = reuse_port_problem()
    if problem is not None:
        raise ConfigError(problem)
    held = hold_port(host, port)
    bound = held.getsockname()[1]
    procs: list[Worker] = []
    try:
        for i in range(workers):
            env = dict(os.environ)
            env["CONDUCTOR_METRICS_PORT"] = str(metrics_port + i if metrics_port else 0)
            wid = worker_id(epp_id, i)
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "conductor", *args_of(i, str(bound)),
                                                        env=env, stdout=asyncio.subprocess.PIPE)
            procs.append(Worker(i, wid, proc))
        try:
            await asyncio.wait_for(asyncio.gather(*(_ready(w) for w in procs)), READY_TIMEOUT_S)
        except (TimeoutError, _WorkerDied) as e:
            log.error("the workers did not all start: %s", e)
            return 1
        first = procs[0].ready or {}
        on_ready({**first, "epp_id": epp_id, "workers": workers, "worker_ids": [w.epp_id for w in procs],
                  "worker_pids": [w.proc.pid for w in procs]})
        exits = [asyncio.ensure_future(w.proc.wait()) for w in procs]
        stopped = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([*exits, stopped], return_when=asyncio.FIRST_COMPLETED)
        if stopped in done:
            return 0
        for w in procs:
            if w.proc.returncode is not None:
                log.error("worker %s (pid %d) exited with status %s: stopping the others", w.epp_id, w.proc.pid,
                          w.proc.returncode)
        return 1
    finally:
        await _stop_all(procs)
        held.close()


class _WorkerDied(Exception):
    pass


async def _ready(w: Worker) -> None:
    """Read ``w``'s stdout until its ready line; the rest of its output is passed on."""
    assert w.proc.stdout is not None
    while True:
        line = await w.proc.stdout.readline()
        if not line:
            raise _WorkerDied(f"worker {w.epp_id} exited (status {await w.proc.wait()}) before it was ready")
        try:
            msg = json.loads(line)
        except ValueError:
            sys.stdout.write(line.decode(errors="replace"))
            continue
        if isinstance(msg, dict) and msg.get("event") == "ready":
            w.ready = msg
            asyncio.ensure_future(_pass_on(w))
            return


async def _pass_on(w: Worker) -> None:
    assert w.proc.stdout is not None
    while line := await w.proc.stdout.readline():
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


async def _stop_all(procs: list[Worker]) -> None:
    for w in procs:
        if w.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
    for w in procs:
        try:
            await asyncio.wait_for(w.proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            log.warning("worker %s did not stop in %gs: killed", w.epp_id, STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            await w.proc.wait()
