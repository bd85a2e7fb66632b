"""``conductor gateway --workers 2`` (issue 35 item 4) on the real broker and Redis: one port, two
gateway processes with ids of their own, both serving, one ready line, a SIGTERM that ends
them all, and a conversation whose turns reach both workers kept on one instance."""

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
from schemas import RequestOutcome, RoutingDecision
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


async def test_a_conversation_spread_over_the_workers_stays_on_its_instance(settings: Settings,
                                                                           tmp_path: Path) -> None:
    """Turns of one conversation (the OpenAI ``user`` field), each on a new connection, land on
    whichever worker the kernel picks; none of their prompts shares a block with another, so only
    the session says where the conversation is. Every turn after the first is decided knowing the
    session's instance, whichever worker decides it, and stays there (the engines are idle between
    turns: leaving never pays)."""
    async with GatewayCluster(settings, tmp_path / "logs", time_scale=50.0, max_output_tokens=4,
                              gateway_args=["--workers", "2"]) as c:
        tag = f"conv{time.time_ns() % 10**9}"
        turns: list[str] = []
        served_by: set[str] = set()
        for i in range(40):  # until both workers served turns (the kernel spreads new connections)
            async with httpx.AsyncClient(base_url=c.gateway_url, headers=c.auth_headers, timeout=30) as cl:
                rid = f"{tag}-t{i}"
                r = await cl.post("/v1/completions", headers={"x-request-id": rid},
                                  json={"model": "default", "prompt": f"{i} turn words " * 30 + f"turn {i}",
                                        "max_tokens": 4, "user": tag})
                assert r.status_code == 200, r.text
                turns.append(rid)
                # "<worker id>-<client's id>": the worker that took the turn
                served_by.add(r.headers["x-conductor-request-id"].removesuffix(f"-{rid}"))
            if i >= 7 and len(served_by) == 2:
                break
        decided = await _decisions(settings, tag, len(turns))
        assert {d.decided_by for d in decided.values()} == {f"{c.gateway_id}-w0", f"{c.gateway_id}-w1"}
        order = [decided[k] for k in sorted(decided, key=lambda k: int(k.rsplit("-t", 1)[1]))]
        home = order[0].prefill_instance
        assert order[0].session_instance is None
        for d in order[1:]:
            assert d.session_instance == home, (d.request_id, d.decided_by, d.session_instance, home)
            assert d.prefill_instance == home and d.left_holder is None, (d.request_id, d.left_holder)


async def _decisions(settings: Settings, tag: str, n: int) -> dict[str, RoutingDecision]:
    """The ``n`` decisions of the conversation ``tag`` on ``dispatch``, by the client's request id."""
    got: dict[str, RoutingDecision] = {}
    deadline = time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        for b in await read_all(settings, topics(settings.topic_config()).dispatch.name, 10_000, wait_s=1.0):
            if isinstance(b, RoutingDecision) and f"-{tag}-t" in b.request_id:
                got[b.request_id[b.request_id.index(tag):]] = b  # "<worker id>-<tag>-t<i>" → "<tag>-t<i>"
    assert len(got) == n, sorted(got)
    return got


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
