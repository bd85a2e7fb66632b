"""`conductor explain`: a past decision re-derived from the topics alone, on the real broker and Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.routing.explain import AuditError, explain
from conductor.routing.router import Router
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from schemas import BlocksStored, Heartbeat, RoutingDecision, RoutingRequest, chain_keys, decode, encode, envelope
from state.redis_view import RedisViewStore
from streams import kafka
from streams.replay import replay_into
from streams.topics import topics

pytestmark = pytest.mark.integration

SHARED = list(range(7000, 7000 + 24 * 16))  # a 24-block prefix every request shares


async def _publish(prod, topic, envs):
    for e in envs:
        await prod.send_and_wait(topic, encode(e), key=e.producer_id.encode())


async def _route(settings, reqs, now):
    t = topics(settings.topic_config())
    prod = kafka.producer(settings.kafka())
    await prod.start()
    for i, r in enumerate(reqs):
        await prod.send_and_wait(t.requests.name, encode(envelope(r, producer_id="gw", producer_seq=i, ts_ms=now)),
                                 key=r.request_id.encode())
    await prod.stop()


async def test_a_past_decision_is_rederived_and_explained(settings):
    # Each node beats once, at the start: the nodes must stay live until the last request is
    # decided. The set-up (topics, replay, the router's start) took 3.6 s of the default 5 s TTL
    # on an idle 2-core machine and over 5 s under load, when every request was rejected
    # (no_live_instance). A TTL longer than the test makes the outcome not depend on its speed.
    settings = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    now = int(time.time() * 1000)
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    keys = chain_keys(SHARED, settings.block_size)
    prod = kafka.producer(settings.kafka())
    await prod.start()
    await _publish(prod, t.heartbeats.name, [
        envelope(Heartbeat(role="prefill", rack="r0", queued_prefill_tokens=q), producer_id=n, producer_seq=0, ts_ms=now)
        for n, q in (("p-holder", 3000), ("p-idle", 0), ("p-other", 500))
    ] + [envelope(Heartbeat(role="decode", rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000),
                  producer_id=n, producer_seq=0, ts_ms=now) for n in ("d-0", "d-1")])
    await _publish(prod, t.kv_events.name, [
        envelope(BlocksStored(block_keys=keys), producer_id="p-holder", producer_seq=0, ts_ms=now)])
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)  # what the stream worker does, with positions
    assert len(await view.nodes()) == 5, "the replay left heartbeats out"

    reader, resv = redis_stores(settings, producer_id="audit-test")
    worker = RouterWorker(settings, Router(settings, reader, resv), router_id="audit-test")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    reqs = [RoutingRequest(request_id=f"r{i}", token_ids=SHARED + list(range(100 * i, 100 * i + 64)),
                           prompt_tokens=len(SHARED) + 64) for i in range(6)]
    await _route(settings, reqs, now)
    cons = kafka.consumer(settings.kafka(), t.dispatch.name, group_id=None)
    await cons.start()
    got: dict[str, RoutingDecision] = {}
    seq: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(got) < len(reqs):
            assert time.monotonic() < deadline, f"only {sorted(got)} were routed"
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    env = decode(rec.value)
                    got[env.body.request_id] = env.body
                    seq[env.body.request_id] = env.producer_seq
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()
    rejected = {rid: (d.reason, d.message) for rid, d in got.items() if not isinstance(d, RoutingDecision)}
    assert rejected == {}, rejected

    # The view moves on after the decisions: the audit must read it as it was.
    await _publish(prod, t.kv_events.name, [
        envelope(BlocksStored(block_keys=keys), producer_id="p-idle", producer_seq=0, ts_ms=now + 1)])
    await prod.stop()

    for rid in ("r0", "r4"):
        ex = await explain(settings, rid)
        assert ex.matches, ex.differences
        d = got[rid]
        assert ex.recorded["prefill_instance"] == d.prefill_instance
        assert ex.rederived["prefill_instance"] == d.prefill_instance
        assert ex.rederived["reused_tokens"] == d.reused_tokens
        assert {r["instance"] for r in ex.prefill} == {"p-holder", "p-idle", "p-other"}
        assert {r["instance"] for r in ex.decode} == {"d-0", "d-1"}
        chosen = next(r for r in ex.prefill if r["instance"] == d.prefill_instance)
        assert chosen["ttft_s"] == pytest.approx(d.predicted_ttft_s, rel=1e-3)
        assert ex.prefill[0]["ttft_s"] <= chosen["ttft_s"] + 1e-6  # rows are sorted by predicted TTFT
    # Every decision the router made before the last one was still in flight (no heartbeat since).
    last = max(seq, key=seq.get)
    assert (await explain(settings, last)).reservations == len(reqs) - 1
    # p-idle's copy arrived after every watermark: no explanation may see it.
    ex = await explain(settings, "r0")
    assert next(r for r in ex.prefill if r["instance"] == "p-idle")["cached_blocks"] == [0, 0, 0]
    with pytest.raises(AuditError, match="no decision"):
        await explain(settings, "never-sent")
    await view.clear()
    await view.close()


@pytest.mark.parametrize("view_reader", ["raw", "tracking"])
async def test_every_decision_of_a_run_with_live_heartbeats_is_rederived(settings, tmp_path, view_reader):
    """Heartbeats land between decisions (each one drops the reservations its node has seen):
    every decision of the run, not a sample, re-derives exactly, at the view time it recorded.
    With the tracking reader every request repeats one prompt, so the decisions made between
    two heartbeats are made from the cache with no round trip, at the last read's watermark."""
    from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
    from conductor.harness.devstack import free_port

    s = settings.model_copy(update={"web_port": free_port(), "view_reader": view_reader})
    t = topics(s.topic_config())
    await kafka.ensure_topics(s.kafka(), t.all())
    keys = chain_keys(SHARED, s.block_size)
    prod = kafka.producer(s.kafka())
    await prod.start()
    worker = start_worker_process(s, tmp_path / "worker.log")
    nodes = [("p-0", "prefill"), ("p-1", "prefill"), ("d-0", "decode"), ("d-1", "decode")]
    beats = {"n": 0}
    stop_beats = asyncio.Event()

    async def beat():
        while not stop_beats.is_set():
            i = beats["n"]
            for n, role in nodes:
                hb = (Heartbeat(role=role, rack="r0", queued_prefill_tokens=(i * 37) % 900) if role == "prefill" else
                      Heartbeat(role=role, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000 - i))
                await prod.send(t.heartbeats.name, encode(envelope(hb, producer_id=n, producer_seq=i,
                                                                   ts_ms=int(time.time() * 1000))), key=n.encode())
            beats["n"] += 1
            await asyncio.sleep(0.03 if view_reader == "raw" else 0.05)

    beater = asyncio.create_task(beat())
    await _publish(prod, t.kv_events.name, [
        envelope(BlocksStored(block_keys=keys), producer_id="p-0", producer_seq=0, ts_ms=int(time.time() * 1000))])
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    deadline = time.monotonic() + 60
    while len(await view.nodes()) < len(nodes):
        assert time.monotonic() < deadline and worker.poll() is None, "the worker never applied the heartbeats"
        await asyncio.sleep(0.05)
    reader, resv = redis_stores(s, producer_id="audit-all")
    router_worker = RouterWorker(s, Router(s, reader, resv), router_id="audit-all")
    stop = asyncio.Event()
    task = asyncio.create_task(router_worker.run(stop))
    tail = (lambda i: list(range(64))) if view_reader == "tracking" else (lambda i: list(range(100 * i, 100 * i + 64)))
    reqs = [RoutingRequest(request_id=f"a{i}", token_ids=SHARED + tail(i), prompt_tokens=len(SHARED) + 64)
            for i in range(20 if view_reader == "raw" else 12)]
    cons = kafka.consumer(s.kafka(), t.dispatch.name, group_id=None)
    await cons.start()
    got: dict[str, object] = {}
    try:
        for i, r in enumerate(reqs):  # spread over heartbeats
            await prod.send_and_wait(t.requests.name, encode(envelope(r, producer_id="gw", producer_seq=i,
                                                                      ts_ms=int(time.time() * 1000))),
                                     key=r.request_id.encode())
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 30
        while len(got) < len(reqs):
            assert time.monotonic() < deadline, f"only {sorted(got)} were routed"
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    got[decode(rec.value).body.request_id] = decode(rec.value).body
    finally:
        stop.set()
        stop_beats.set()
        await beater
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()
        stop_worker_process(worker)
        await prod.stop()
    assert all(d.view_now_ms is not None for d in got.values())
    mismatched = {}
    for rid in sorted(got):
        ex = await explain(s, rid)
        if not ex.matches:
            mismatched[rid] = ex.differences
    assert mismatched == {}, mismatched
    assert beats["n"] > 10  # heartbeats really landed during the run
    if view_reader == "tracking":
        assert reader.stats["cached_reads"] > 0 and reader.stats["node_pushes"] > 0, reader.stats
    await view.clear()
    await view.close()
