"""``conductor gateway --workers 2`` (issue 35 item 4) on the real broker and Redis: one port, two
gateway processes with ids of their own, both serving, one ready line, and a SIGTERM that ends
them all."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from kvstream import read_all

from conductor.harness.gateway_cluster import GatewayCluster, child_pids
from conductor.settings import Settings
from schemas import RequestOutcome
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]  # `scripts/test -m slow`


async def test_two_workers_share_the_port_and_stop_together(settings: Settings, tmp_path: Path) -> None:
    async with GatewayCluster(
        settings,
        tmp_path / "logs",
        time_scale=50.0,
        max_output_tokens=4,
        gateway_args=["--workers", "2", "--drain-s", "5"],
    ) as c:
        pids = c.gateway_pids()
        parent = pids["gateway"]
        assert parent is not None and len(pids) == 3, pids  # the parent and its two workers

        async def one(i: int, cl: httpx.AsyncClient) -> int:
            r = await cl.post(
                "/v1/completions", json={"model": "default", "prompt": f"request {i} " * 20, "max_tokens": 4}
            )
            return r.status_code

        statuses: list[int] = []
        for _ in range(5):  # new connections each round: each is accepted by whichever worker is free
            async with httpx.AsyncClient(base_url=c.gateway_url, headers=c.auth_headers, timeout=30) as cl:
                statuses += await asyncio.gather(*(one(i, cl) for i in range(12)))
        assert statuses.count(200) == len(statuses), statuses
        outs = [
            b
            for b in await read_all(settings, topics(settings.topic_config()).request_outcomes.name, len(statuses))
            if isinstance(b, RequestOutcome)
        ]
        by = {o.gateway for o in outs}
        assert by == {f"{c.gateway_id}-w0", f"{c.gateway_id}-w1"}, by

        os.kill(parent, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (child_pids(parent) or _alive(parent)):
            await asyncio.sleep(0.1)
        assert not child_pids(parent), "a worker outlived the SIGTERM"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
