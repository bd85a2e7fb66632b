"""Two `conductor worker`s on one host: the second takes a free Faust web port and both stay up;
an explicitly set port that is taken is one line naming CONDUCTOR_WEB_PORT, not a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_for

from conductor.settings import child_environment
from schemas import Heartbeat, encode, envelope
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `scripts/test -m slow`

WORKER = [sys.executable, "-c", "from conductor.cli import main; main()", "worker", "--loglevel", "warning"]


def start_worker(s, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(WORKER, env=child_environment(s), stdout=log.open("wb"), stderr=subprocess.STDOUT)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on (Linux: its socket inodes looked up in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


async def answers_http(port: int) -> bool:
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        w.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        return (await asyncio.wait_for(r.readline(), 2)).startswith(b"HTTP/1.")
    except (OSError, TimeoutError):
        return False
    finally:
        w.close()


async def test_a_second_worker_takes_a_free_web_port_and_both_stay_up(settings, tmp_path):
    s = settings.model_copy(update={"web_port": None})  # unset: the default port, else the next free one
    t = topics(s.topic_config())
    await ensure_topics(s.kafka(), t.all())
    procs = {name: start_worker(s, tmp_path / f"{name}.log") for name in ("worker-a", "worker-b")}  # at once
    store = RedisViewStore.connect(s.redis(), s.view_namespace)
    prod = producer(s.kafka())
    try:
        async def web_ports() -> dict[str, int] | None:
            ports = {name: listening_ports(p.pid) for name, p in procs.items()}
            if not all(ports.values()):
                return None
            served = {name: port for name, ps in ports.items() for port in ps if await answers_http(port)}
            return served if len(served) == 2 else None

        served = await wait_for("both workers' web servers", web_ports, procs, tmp_path, timeout=60)
        assert served["worker-a"] != served["worker-b"]
        # Both work: heartbeats of several nodes (over both partitions) reach the view.
        await prod.start()
        nodes = [f"hb-{i}" for i in range(4)]
        for n in nodes:
            env = envelope(Heartbeat(role="prefill"), producer_id=n, producer_seq=0, ts_ms=int(time.time() * 1000))
            await prod.send(t.heartbeats.name, encode(env), key=n.encode())
        await prod.flush()

        async def in_view() -> bool:
            return {n.node_id for n in (await store.snapshot([])).nodes} >= set(nodes)

        await wait_for("the heartbeats in the view", in_view, procs, tmp_path, timeout=60)

        # An explicit port that is taken: one line naming the variable, exit 2, no traceback.
        taken = s.model_copy(update={"web_port": served["worker-a"]})
        third = await asyncio.create_subprocess_exec(*WORKER, env=child_environment(taken),
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out = (await asyncio.wait_for(third.communicate(), 30))[0].decode(errors="replace")
        assert third.returncode == 2, out
        assert "CONDUCTOR_WEB_PORT" in out and f":{served['worker-a']}" in out
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited"
    finally:
        await prod.stop()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        await store.clear()
        await store.close()
