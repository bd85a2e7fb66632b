"""Reads of live topics end: `conductor explain`, the admin API's explain and `conductor simulate
--from-topics` answer while heartbeats and requests keep arriving (before, each read waited for
its topic to be quiet for a second, which a live cluster never is), with the same answer as on
quiet topics; a decision is found through the routers' decision index."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx
import pytest
from pydantic import SecretStr

from conductor.admin.api import create_app
from conductor.admin.feed import LogFeed
from conductor.routing.explain import explain
from conductor.routing.router import Router
from conductor.routing.stores import decision_index, redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings, settings_env
from schemas import BlocksStored, Heartbeat, RoutingDecision, RoutingRequest, chain_keys, decode, encode, envelope
from state.memory import InMemoryViewStore
from state.redis_view import RedisViewStore
from streams import kafka
from streams.replay import replay_into
from streams.topics import topics

pytestmark = pytest.mark.integration

SHARED = list(range(9000, 9000 + 24 * 16))
NODES = (("p-holder", "prefill"), ("p-idle", "prefill"), ("d-0", "decode"), ("d-1", "decode"))
TOKEN = "admin-token-explain-live-0001"


def _beat(node: str, role: str, seq: int, queued: int = 0) -> bytes:
    hb = (Heartbeat(role=role, rack="r0", queued_prefill_tokens=queued) if role == "prefill" else
          Heartbeat(role=role, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000))
    return encode(envelope(hb, producer_id=node, producer_seq=seq, ts_ms=int(time.time() * 1000)))


class Traffic:
    """What a live cluster keeps writing: heartbeats (``rate`` a second over the nodes) and new
    requests (one in five records), until stopped."""

    def __init__(self, settings: Settings, rate: float = 40.0) -> None:
        self.settings = settings
        self.rate = rate
        self.sent = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._prod = kafka.producer(self.settings.kafka())
        await self._prod.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        t = topics(self.settings.topic_config())
        seq = 1_000
        while not self._stop.is_set():
            seq += 1
            for node, role in NODES:
                await self._prod.send(t.heartbeats.name, _beat(node, role, seq), key=node.encode())
            req = RoutingRequest(request_id=f"live-{seq}", token_ids=list(range(64)), prompt_tokens=64)
            await self._prod.send(t.requests.name, encode(envelope(req, producer_id="gw-live", producer_seq=seq,
                                                                   ts_ms=int(time.time() * 1000))),
                                  key=req.request_id.encode())
            self.sent += len(NODES) + 1
            await asyncio.sleep((len(NODES) + 1) / self.rate)

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
        await self._prod.stop()


async def _routed(settings: Settings) -> dict[str, RoutingDecision]:
    """Six requests routed by a router that keeps the decision index, on a view of four nodes."""
    now = int(time.time() * 1000)
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    prod = kafka.producer(settings.kafka())
    await prod.start()
    for i, (node, role) in enumerate(NODES):
        await prod.send_and_wait(t.heartbeats.name, _beat(node, role, 0, queued=3000 - 1000 * i), key=node.encode())
    await prod.send_and_wait(t.kv_events.name, encode(envelope(
        BlocksStored(block_keys=chain_keys(SHARED, settings.block_size)), producer_id="p-holder", producer_seq=0,
        ts_ms=now)), key=b"p-holder")
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)
    await view.close()
    reader, resv = redis_stores(settings, producer_id="live-test")
    worker = RouterWorker(settings, Router(settings, reader, resv), router_id="live-test",
                          decisions=decision_index(settings, resv.client))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    cons = kafka.consumer(settings.kafka(), t.dispatch.name, group_id=None)
    await cons.start()
    got: dict[str, RoutingDecision] = {}
    try:
        for i in range(6):
            r = RoutingRequest(request_id=f"r{i}", token_ids=SHARED + list(range(100 * i, 100 * i + 64)),
                               prompt_tokens=len(SHARED) + 64)
            await prod.send_and_wait(t.requests.name, encode(envelope(r, producer_id="gw", producer_seq=i, ts_ms=now)),
                                     key=r.request_id.encode())
        deadline = time.monotonic() + 30
        while len(got) < 6:
            assert time.monotonic() < deadline, f"only {sorted(got)} were routed"
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    assert isinstance(body, RoutingDecision), body
                    got[body.request_id] = body
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()
        await prod.stop()
    return got


async def test_explain_answers_while_heartbeats_and_requests_keep_coming(settings):
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})  # live for the whole test, however slow
    got = await _routed(s)
    quiet = {rid: _derived((await explain(s, rid)).as_dict()) for rid in ("r0", "r5")}
    assert all(q["matches"] for q in quiet.values()), quiet
    index = decision_index(s)
    assert index is not None
    try:
        pos = (await index.lookup(["r5"]))["r5"]
    finally:
        await index.close()
    assert pos.request_offset >= 0 and pos.offset >= 0

    async with Traffic(s) as traffic:
        await asyncio.sleep(1.5)  # the topics are never quiet from here on
        for rid in ("r0", "r5"):
            t0 = time.monotonic()
            live = _derived((await asyncio.wait_for(explain(s, rid), 60)).as_dict())
            took = time.monotonic() - t0
            assert live == quiet[rid]
            assert took < 10, f"explain took {took:.1f}s with the topics live"
            # Without the index: the decision and its request found by bounded scans, same answer.
            assert _derived((await asyncio.wait_for(explain(s, rid, index=None), 60)).as_dict()) == quiet[rid]
        assert traffic.sent / (time.monotonic() - t0 + 1.5) >= 20 or traffic.sent > 100
    assert quiet["r5"]["recorded"]["prefill_instance"] == got["r5"].prefill_instance


def _derived(explanation: dict) -> dict:
    """An explanation without its stage times (this process's clock: they differ run to run)."""
    assert all(v >= 0 for v in explanation["stage_ms"].values()) and "candidates" in explanation["stage_ms"]
    return {k: v for k, v in explanation.items() if k != "stage_ms"}


async def test_the_admin_explain_answers_while_topics_are_live_and_caps_what_it_reads(settings):
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "admin_token": SecretStr(TOKEN)})
    await _routed(s)
    quiet = _derived((await explain(s, "r3")).as_dict())
    auth = {"Authorization": f"Bearer {TOKEN}"}
    app = create_app(s, feed=LogFeed(s), view=InMemoryViewStore())
    async with Traffic(s), httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as c:
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        r = await asyncio.wait_for(c.get("/api/explain/r3", headers=auth), 60)
        assert r.status_code == 200, r.text
        assert _derived(r.json()) == quiet and time.monotonic() - t0 < 10
        capped = create_app(s.model_copy(update={"admin_explain_max_records": 3}), feed=LogFeed(s),
                            view=InMemoryViewStore())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=capped), base_url="http://admin") as c2:
            r = await c2.get("/api/explain/r3", headers=auth)
        assert r.status_code == 413 and "admin_explain_max_records" in r.json()["detail"]


async def test_the_decision_index_costs_about_a_hundred_bytes_an_entry(settings):
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    await _routed(s)
    index = decision_index(s)
    assert index is not None
    try:
        entries = await index.lookup([f"r{i}" for i in range(6)])
        assert len(entries) == 6
        sizes = [await index.client.memory_usage(index.key(rid)) for rid in entries]
        ttl_ms = await index.client.pttl(index.key("r0"))
    finally:
        await index.close()
    print("decision index bytes per entry:", sizes)
    assert max(sizes) <= 160
    assert 0 < ttl_ms <= s.decision_index_ttl_s * 1000


async def test_simulate_from_topics_finishes_while_traffic_flows(settings: Settings, tmp_path: Path) -> None:
    from tests.integration.test_simulate_from_topics import _record

    now = int(time.time() * 1000)
    await _record(settings, now)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    env.update(settings_env(settings))
    async with Traffic(settings):
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        try:
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", "from conductor.cli import main; main()", "simulate", "--from-topics",
                 "--since", "10m", "--policy", "recorded", "--json"],
                env=env, capture_output=True, timeout=120, check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail("simulate --from-topics did not finish in 120 s while the topics were live")
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    runs = [json.loads(line) for line in out.stdout.decode().splitlines() if line.startswith("{")]
    assert [r["policy"] for r in runs] == ["round-robin"]
    print(f"simulate --from-topics took {time.monotonic() - t0:.1f}s with the topics live")
