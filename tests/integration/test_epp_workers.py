"""`conductor epp --workers 2` end to end: two pickers on one gRPC port (SO_REUSEPORT), each deciding
under its own id on the real broker and Redis, the proxy's connections spread over them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from kvstream import read_all

from conductor.harness.epp_cluster import EppCluster
from conductor.routing.explain import explain
from conductor.settings import Settings
from schemas import RoutingDecision
from streams.topics import topics

pytestmark = [pytest.mark.epp, pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--workers needs Linux")]

CONNECTIONS = 16
"""Envoy's worker threads each open a connection; with 16 the chance that the kernel's hash puts
them all on one of two workers is 2 in 65,536."""


def completion(i: int) -> bytes:
    return json.dumps({"model": "default", "prompt": f"request {i} " + "tok " * 40, "max_tokens": 4}).encode()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_workers_share_the_port_and_each_decides_under_its_own_id(settings: Settings,
                                                                             tmp_path: Path) -> None:
    async with EppCluster(settings, tmp_path / "logs", time_scale=20.0, max_output_tokens=4,
                          epp_args=["--workers", "2"]) as c:
        ready = c.epp_ready
        ids = [f"{c.epp_id}-w0", f"{c.epp_id}-w1"]
        assert ready["workers"] == 2 and ready["worker_ids"] == ids and len(set(ready["worker_pids"])) == 2
        assert ready["address"].endswith(f":{ready['port']}")
        pids = [int(p) for p in ready["worker_pids"]]
        envoys = [c.envoy(own_connection=True) for _ in range(CONNECTIONS)]
        try:
            answers = await asyncio.gather(*(e.request(completion(i), headers={"x-request-id": f"r{i}"})
                                             for i, e in enumerate(envoys)))
        finally:
            for e in envoys:
                await e.close()
        assert all(a.status == 200 for a in answers), [a.error for a in answers if a.status != 200]
        by_worker = {w: [a for a in answers if a.headers["x-conductor-request-id"].startswith(f"{w}-")] for w in ids}
        assert all(by_worker.values()), {w: len(v) for w, v in by_worker.items()}  # both served some
        # Each decision is on the log under the worker that made it, and explain re-derives it.
        tps = topics(settings.topic_config())
        decided = {b.request_id: b.decided_by for b in await read_all(settings, tps.dispatch.name, CONNECTIONS)
                   if isinstance(b, RoutingDecision)}
        for w, served in by_worker.items():
            for a in served:
                assert decided[a.headers["x-conductor-request-id"]] == w
        # Every decision, not one: the two workers decide at once and see each other's reservations
        # a flush later; explain applies what each decision's cut says it had (state.events).
        for a in answers:
            rid = a.headers["x-conductor-request-id"]
            ex = await explain(settings, rid)
            assert ex.matches, (rid, ex.differences)
    # Stopping the command stops its workers.
    for _ in range(50):
        if not any(alive(p) for p in pids):
            break
        await asyncio.sleep(0.2)
    assert not any(alive(p) for p in pids)
