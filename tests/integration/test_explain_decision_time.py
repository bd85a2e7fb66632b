"""A decision made with decision-time knowledge (issue 34): the second request of a prefix sees
the first one's pending blocks (no KV event ever came back) and Conductor's own in-flight work,
shared through Redis; `conductor explain` re-derives both decisions exactly from the log, the
first one's end taken from its request outcome."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from conductor.routing.explain import explain
from conductor.routing.local import LocalRouter
from conductor.routing.router import Router
from conductor.routing.stores import decision_index, decision_time_stores, redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings
from schemas import (
    BlocksStored,
    Heartbeat,
    RequestOutcome,
    Role,
    RoutingDecision,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
    envelope,
)
from state.inflight import FirstToken, encode_op
from state.keys import ViewKeys
from state.redis_view import RedisViewStore
from state.shared_log import SharedLog
from streams import kafka
from streams.replay import replay_into
from streams.topics import topics

pytestmark = pytest.mark.integration

NODES: tuple[tuple[str, Role], ...] = (("p-a", "prefill"), ("p-b", "prefill"), ("d-0", "decode"))


async def _route_two(settings: Settings, *, late_release: bool = False) -> dict[str, RoutingDecision]:
    """Route dt-1, release its first token, route dt-2 after it. ``late_release``: the release is
    made by a door (its own producer on the shared stream) before dt-2 is decided but reaches the
    router only after (held in the door's buffer); then dt-3 is routed once it has arrived."""
    now = int(time.time() * 1000)
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    prod = kafka.producer(settings.kafka())
    await prod.start()
    for i, (node, role) in enumerate(NODES):
        hb = (Heartbeat(role=role, rack="r0") if role == "prefill" else
              Heartbeat(role=role, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000))
        await prod.send_and_wait(t.heartbeats.name, encode(envelope(hb, producer_id=node, producer_seq=i, ts_ms=now)),
                                 key=node.encode())
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)
    await view.close()
    reader, resv = redis_stores(settings, producer_id="dt-test")
    pending, inflight = decision_time_stores(settings, resv.client, "dt-test")
    router = Router(settings, reader, resv, pending=pending, inflight=inflight)
    worker = RouterWorker(settings, router, router_id="dt-test", decisions=decision_index(settings, resv.client))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    cons = kafka.consumer(settings.kafka(), t.dispatch.name, group_id=None)
    await cons.start()
    got: dict[str, RoutingDecision] = {}
    prompt = list(range(7000, 7000 + 32 * settings.block_size))

    async def route(rid: str, tokens: list[int], seq: int) -> RoutingDecision:
        r = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), releases=True)
        await prod.send_and_wait(t.requests.name, encode(envelope(r, producer_id="gw", producer_seq=seq,
                                                                  ts_ms=int(time.time() * 1000))),
                                 key=rid.encode())
        deadline = time.monotonic() + 30
        while rid not in got:
            assert time.monotonic() < deadline, f"{rid} was not routed"
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    assert isinstance(body, RoutingDecision), body
                    got[body.request_id] = body
        return got[rid]

    try:
        first = await route("dt-1", prompt, 1)
        assert first.view_now_ms is not None
        # The gateway's part: the first token came back 5 ms after the decision (on the view's clock).
        ft = first.view_now_ms + 5
        door = None
        if late_release:
            door = SharedLog(resv.client, ViewKeys(settings.view_namespace).inflight, producer_id="door",
                             retain_ms=60_000, apply=lambda _: None, flush_after_s=3600.0)
            event = door.append(encode_op(FirstToken("dt-1", ft)), ft)
            outcome = RequestOutcome(request_id="dt-1", gateway="gw", status=200, attempts=["dt-1"],
                                     first_token_view_ms=ft, release_producer="door", first_token_event=event)
        else:
            inflight.first_token("dt-1", ft)
            outcome = RequestOutcome(request_id="dt-1", gateway="gw", status=200, attempts=["dt-1"],
                                     first_token_view_ms=ft)
        await prod.send_and_wait(t.request_outcomes.name, encode(envelope(outcome, producer_id="gw", producer_seq=9,
                                                                          ts_ms=int(time.time() * 1000))),
                                 key=b"dt-1")
        await asyncio.sleep(0.05)  # past the first token on the view's clock
        await route("dt-2", prompt + list(range(64)), 2)
        if door is not None:
            await door.flush()  # the release arrives now
            deadline = time.monotonic() + 10
            while inflight.log.cut().get("door") is None:
                assert time.monotonic() < deadline, "the door's release never reached the router"
                await asyncio.sleep(0.02)
            await route("dt-3", prompt + list(range(128)), 3)
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()
        await prod.stop()
    return got


async def test_the_second_request_follows_the_first_ones_pending_blocks_and_explain_agrees(
        settings: Settings) -> None:
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "policy_params": {"remote_reuse": False}})
    got = await _route_two(s)
    first, second = got["dt-1"], got["dt-2"]
    assert first.reused_tokens == 0 and first.pending_ttl_ms == int(s.pending_ttl_s * 1000)
    assert second.prefill_instance == first.prefill_instance
    assert second.reused_tokens == 32 * s.block_size and second.reuse_source == first.prefill_instance
    assert second.queued_tokens_ahead == 0  # the first one's prefill ended at its first token
    for rid in ("dt-1", "dt-2"):
        ex = await explain(s, rid)
        assert ex.matches, ex.differences
    ex = await explain(s, "dt-2")
    assert ex.pending_placements >= 1 and ex.in_flight == 1 and ex.outcomes == 1
    assert ex.rederived["reused_tokens"] == second.reused_tokens


async def test_explain_counts_only_the_releases_the_router_had_when_it_decided(settings: Settings) -> None:
    """The first request's first token is released (stamped) before the second is decided, but
    reaches the router only after: the second decision still counts that prefill as queued, and
    explain, going by what the decision recorded it had seen, agrees (by time it would not). The
    third, decided once the release arrived, counts it released, and explain agrees again."""
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "policy_params": {"remote_reuse": False},
                                    "view_namespace": settings.view_namespace + "-late"})
    got = await _route_two(s, late_release=True)
    first, second, third = got["dt-1"], got["dt-2"], got["dt-3"]
    assert second.prefill_instance == third.prefill_instance == first.prefill_instance
    assert second.queued_tokens_ahead == 32 * s.block_size  # dt-1's prefill: not known to be done
    assert third.queued_tokens_ahead == 64  # dt-2's uncached tokens only: dt-1's prefill is done
    assert second.seen_inflight is not None and "door" not in second.seen_inflight
    assert third.seen_inflight is not None and "door" in third.seen_inflight
    assert second.event is not None and second.event_producer == "dt-test"
    for rid in ("dt-1", "dt-2", "dt-3"):
        ex = await explain(s, rid)
        assert ex.matches, (rid, ex.differences)
    assert (await explain(s, "dt-2")).in_flight == 1


async def test_a_spill_to_a_group_mate_is_re_derived_by_explain(settings: Settings, tmp_path: Path) -> None:
    """Two aggregated engines in one capacity group; the one holding the shared system prompt
    has its cache full (its KV events against its KV size): the request goes to its mate, says
    why, and explain, folding the same events to the decision's watermark, re-derives it."""
    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                                "capacity_groups": {"core1": ["e0", "e1"]}}))
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "topology_file": str(topo),
                                    "view_namespace": settings.view_namespace + "-spill"})
    bs = s.block_size
    now = int(time.time() * 1000)
    t = topics(s.topic_config())
    await kafka.ensure_topics(s.kafka(), t.all())
    prod = kafka.producer(s.kafka())
    await prod.start()
    system = list(range(1, 1 + 2 * bs))
    try:
        for i, node in enumerate(("e0", "e1")):
            hb = Heartbeat(role="both", rack="r0", total_kv_blocks=60, free_kv_blocks=60)
            await prod.send_and_wait(t.heartbeats.name, encode(envelope(hb, producer_id=node, producer_seq=i,
                                                                        ts_ms=now)), key=node.encode())
        held = [*chain_keys(system, bs), *range(900_000, 900_055)]  # 57 of 60 blocks
        ev = BlocksStored(block_keys=held, block_size=bs)
        await prod.send_and_wait(t.kv_events.name, encode(envelope(ev, producer_id="e0", producer_seq=0, ts_ms=now)),
                                 key=b"e0")
        view = RedisViewStore.connect(s.redis(), s.view_namespace)
        await replay_into(s.kafka(), s.topic_config(), view, idle_timeout_s=1.0)
        await view.close()
        local = LocalRouter(s, producer_id="gw-spill")
        await local.start()
        try:
            tokens = system + list(range(70_000, 70_000 + 8 * bs))
            d = await local.decide(RoutingRequest(request_id="spill-1", token_ids=tokens, prompt_tokens=len(tokens),
                                                  releases=True))
        finally:
            await local.close()
    finally:
        await prod.stop()
    assert isinstance(d, RoutingDecision) and d.prefill_instance == "e1"
    assert d.left_holder is not None and d.left_holder.startswith("cache full on e0 (57 of 60 blocks held")
    ex = await explain(s, "spill-1")
    assert ex.matches, ex.differences
