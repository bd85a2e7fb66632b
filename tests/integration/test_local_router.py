"""The colocated router (conductor.routing.local) on the real broker and Redis: two gateways'
routers share their reservations, every decision is on the log before it is handed back, a
router of ``requests`` leaves decided requests alone, explain re-derives them, and a broker
that does not take the decision is said, not served."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from kvstream import read_all

from conductor.frontdoor.decide import Colocated
from conductor.routing.explain import explain
from conductor.routing.local import LocalRouter, LogUnavailable
from conductor.routing.router import Router
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings
from schemas import Heartbeat, RoutingDecision, RoutingRequest, encode, envelope, headers
from state.claim import ProducerIdInUse
from state.shared_log import RedisInflight
from state.view import SourcePosition
from streams.kafka import ensure_topics, producer
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = list(range(1, 4097))  # 4,096 tokens: a prefill long enough that a queue of one shows


def request(rid: str, tokens: list[int] = PROMPT, session: str | None = None) -> RoutingRequest:
    return RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), expected_output_tokens=16,
                          ttft_slo_s=600.0, session=session)


@contextlib.asynccontextmanager
async def cluster(settings: Settings) -> AsyncIterator[Settings]:
    """Two idle prefill instances and one decode instance live in the view; a router of ``requests`` running."""
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "policy": "kvcache-centric"})
    await ensure_topics(s.kafka(), topics(s.topic_config()).all())
    view, resv = redis_stores(s, producer_id="test-local")
    now = int(time.time() * 1000)
    beats = [envelope(Heartbeat(role="prefill", rack="r0"), producer_id=node, producer_seq=0, ts_ms=now)
             for node in ("p0", "p1")]
    beats.append(envelope(Heartbeat(role="decode", rack="r0"), producer_id="d0", producer_seq=0, ts_ms=now))
    prod = producer(s.kafka())
    await prod.start()
    try:  # on the topic (explain replays it), and into the view at their positions, as the stream worker folds them
        for b in beats:
            md = await prod.send_and_wait(topics(s.topic_config()).heartbeats.name, encode(b),
                                          key=b.producer_id.encode(), headers=headers(b))
            await view.apply([(b, SourcePosition(md.topic, md.partition, md.offset))])
    finally:
        await prod.stop()
    stop = asyncio.Event()
    worker = asyncio.create_task(RouterWorker(s, Router(s, view, resv), router_id="r-standalone").run(stop))
    try:
        yield s
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        await resv.clear()
        await view.close()


async def test_two_gateways_share_reservations_and_every_decision_is_logged_once(settings: Settings) -> None:
    async with cluster(settings) as s:
        a, b = LocalRouter(s, producer_id="gw-a"), LocalRouter(s, producer_id="gw-b")
        await a.start()
        await b.start()
        try:
            first = await a.decide(request("a-1"))
            assert isinstance(first, RoutingDecision) and first.decided_by == "gw-a" and first.ordinal == 0
            # b learns a's in-flight work through Redis (no heartbeat has counted it yet) ...
            deadline = time.monotonic() + 10
            ledger = b.inflight
            assert isinstance(ledger, RedisInflight)
            while ledger.log.applied < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert ledger.log.applied >= 1
            assert first.view_now_ms is not None
            assert ledger.load(first.prefill_instance, first.view_now_ms).prefill_requests == 1
            # ... so the same-sized prompt (nothing of it cached) goes to the other, idle prefill instance.
            second = await b.decide(request("b-1", [t + 10_000 for t in PROMPT]))
            assert isinstance(second, RoutingDecision) and second.decided_by == "gw-b"
            assert second.prefill_instance != first.prefill_instance
            # Decisions in arrival order, each numbered: the turn explain re-derives with.
            more = await asyncio.gather(*(a.decide(request(f"a-{i}", [t + 20_000 * i for t in PROMPT]))
                                          for i in range(2, 6)))
            assert [d.ordinal for d in more if isinstance(d, RoutingDecision)] == [1, 2, 3, 4]
        finally:
            await a.close()
            await b.close()
        t = topics(s.topic_config())
        reqs = [r for r in await read_all(s, t.requests.name, 6) if isinstance(r, RoutingRequest)]
        assert sorted(r.request_id for r in reqs) == ["a-1", "a-2", "a-3", "a-4", "a-5", "b-1"]
        assert {r.request_id: r.decided_by for r in reqs} == {rid: f"gw-{rid[0]}" for rid in ["a-1", "a-2", "a-3", "a-4",
                                                                                               "a-5", "b-1"]}
        # Asking for one more than there should be: the stand-alone router has 3 s to (wrongly) decide them again.
        decs = [d for d in await read_all(s, t.dispatch.name, 7, wait_s=3.0) if isinstance(d, RoutingDecision)]
        assert sorted(d.request_id for d in decs) == sorted(r.request_id for r in reqs)  # once each
        ex = await explain(s, "b-1")
        assert ex.matches, ex.differences
        assert ex.in_flight >= 1  # a's decision was in flight when b decided, and explain counts it


async def test_a_session_placed_by_one_gateway_is_kept_by_another(settings: Settings) -> None:
    """A conversation's turns reach different gateway processes (``--workers``, replicas behind a
    balancer): the session's instance is shared on the pending blocks' log, so the gateway that
    decides the next turn knows it even when the prompt shares no block with the last one."""
    async with cluster(settings) as s:
        a, b = LocalRouter(s, producer_id="gw-a"), LocalRouter(s, producer_id="gw-b")
        await a.start()
        await b.start()
        try:
            first = await a.decide(request("a-1", PROMPT[:256], session="conv-1"))  # a short first turn
            assert isinstance(first, RoutingDecision) and first.session_instance is None
            deadline = time.monotonic() + 10
            while b.router.sessions.get("conv-1") is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert b.router.sessions.get("conv-1") == first.prefill_instance
            other = [t + 50_000 for t in PROMPT]  # no block in common with the first turn
            turn = await b.decide(request("b-1", other, session="conv-1"))
            assert isinstance(turn, RoutingDecision)
            # The session's instance has only the short first turn queued: leaving does not pay.
            assert turn.session_instance == first.prefill_instance and turn.left_holder is None
            assert turn.prefill_instance == first.prefill_instance
            # A later placement wins over an older one read late; an unknown session has no instance.
            assert b.router.decision_time.session_of("conv-2") is None
            b.router.decision_time._place_session("conv-1", "p9", (turn.view_now_ms or 0) - 60_000)
            assert b.router.sessions["conv-1"] == turn.prefill_instance
        finally:
            await a.close()
            await b.close()
        ex = await explain(s, "b-1")
        assert ex.matches, ex.differences  # explain re-derives it from the decision's recorded session


async def test_a_decision_the_broker_does_not_take_is_said_not_handed_back(settings: Settings) -> None:
    async with cluster(settings) as s:
        local = LocalRouter(s, producer_id="gw-c", ack_timeout_s=2.0)
        await local.start()
        try:
            assert local.problem() is None
            await local._producer.stop()  # the broker is out of reach for this producer
            with pytest.raises(LogUnavailable, match="c-1"):
                await local.decide(request("c-1"))
        finally:
            await local.close()


async def test_a_gateway_that_died_has_its_charges_ended_by_another_within_seconds(settings: Settings) -> None:
    """A gateway killed with requests in flight says nothing more: the others hear it go silent
    (every producer with open charges appends at least every fifth of ``inflight_lost_after_s``),
    one of them (the first to claim it) ends its charges as its own failures, with a
    ``request_outcome`` that says so, and explain re-derives a later decision with them ended. A
    gateway that is alive but idle on a long request keeps its charge."""
    async with cluster(settings.model_copy(update={"inflight_lost_after_s": 1.0})) as s:
        a, b, c = (LocalRouter(s, producer_id=f"gw-{x}") for x in "abc")
        for r in (a, b, c):
            await r.start()
        try:
            gone = [await a.decide(request(f"a-{i}", [t + 30_000 * i for t in PROMPT]).model_copy(
                update={"releases": True})) for i in (1, 2)]
            kept = await b.decide(request("b-1", [t + 90_000 for t in PROMPT]).model_copy(update={"releases": True}))
            assert all(isinstance(d, RoutingDecision) for d in [*gone, kept])
            # gw-a dies: no release, no keep-alive, no close (kill -9).
            ledger_a = a.router.decision_time.inflight
            assert isinstance(ledger_a, RedisInflight) and ledger_a._keepalive is not None
            ledger_a._keepalive.cancel()
            assert a._reaper is not None
            a._reaper.cancel()
            ledgers = [r.router.decision_time.inflight for r in (b, c)]
            assert all(isinstance(x, RedisInflight) for x in ledgers)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(
                    {"a-1", "a-2"} & x.local.in_flight() for x in ledgers):  # type: ignore[union-attr]
                await asyncio.sleep(0.1)
            for x in ledgers:
                assert isinstance(x, RedisInflight)
                assert not {"a-1", "a-2"} & x.local.in_flight()
                assert "b-1" in x.local.in_flight()  # gw-b's, idle on it but alive: kept
            assert b.reaped + c.reaped == 2  # one of them, once
            later = await c.decide(request("c-1", [t + 150_000 for t in PROMPT]).model_copy(update={"releases": True}))
            assert isinstance(later, RoutingDecision)
        finally:
            for r in (b, c):
                await r.close()
            with contextlib.suppress(Exception):
                await a.close()
        t = topics(s.topic_config())
        lost = [o for o in await read_all(s, t.request_outcomes.name, 2) if getattr(o, "error", None) == "gateway_lost"]
        assert sorted(o.request_id for o in lost) == ["a-1", "a-2"]
        assert {o.gateway for o in lost} == {"gw-a"} and {o.release_producer for o in lost} <= {"gw-b", "gw-c"}
        assert all(o.finished_view_ms is not None and o.finished_event is not None for o in lost)
        assert {o.request_id: o.prefill_instance for o in lost} == {d.request_id: d.prefill_instance for d in gone
                                                                    if isinstance(d, RoutingDecision)}
        ex = await explain(s, "c-1")
        assert ex.matches, ex.differences


async def test_a_gateway_restarted_under_its_own_id_ends_its_earlier_runs_charges_at_start(settings: Settings) -> None:
    """A gateway killed with requests in flight and started again under the same id (a fixed
    ``--gateway-id``) is heard alive at once, so nobody takes its earlier run's charges for lost:
    the new process reads them when it starts and ends each before its first decision, with a
    ``request_outcome`` (``gateway_restarted``), well before the lease or the lost-producer
    delay; the other gateways stop counting them, and explain re-derives the new process's
    next decision with them ended."""
    async with cluster(settings.model_copy(update={"inflight_lost_after_s": 60.0})) as s:
        first, other = LocalRouter(s, producer_id="gw-fixed"), LocalRouter(s, producer_id="gw-other")
        for r in (first, other):
            await r.start()
        again = None
        try:
            left = [await first.decide(request(f"f-{i}", [t + 30_000 * i for t in PROMPT]).model_copy(
                update={"releases": True})) for i in (1, 2)]
            assert all(isinstance(d, RoutingDecision) for d in left)
            ledger_other = other.router.decision_time.inflight
            assert isinstance(ledger_other, RedisInflight)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not {"f-1", "f-2"} <= ledger_other.local.in_flight():
                await asyncio.sleep(0.05)
            assert {"f-1", "f-2"} <= ledger_other.local.in_flight()
            # The first run dies (kill -9: no release, no keep-alive, no close) and starts again.
            ledger_first = first.router.decision_time.inflight
            assert isinstance(ledger_first, RedisInflight) and ledger_first._keepalive is not None
            ledger_first._keepalive.cancel()
            assert first._reaper is not None and first.claim is not None
            first._reaper.cancel()
            first.claim.abandon()
            started = time.monotonic()
            again = LocalRouter(s, producer_id="gw-fixed")
            await again.start()
            assert again.reaped == 2
            ledger_again = again.router.decision_time.inflight
            assert isinstance(ledger_again, RedisInflight)
            assert not {"f-1", "f-2"} & ledger_again.local.in_flight()
            while time.monotonic() < started + 5 and {"f-1", "f-2"} & ledger_other.local.in_flight():
                await asyncio.sleep(0.05)
            assert not {"f-1", "f-2"} & ledger_other.local.in_flight()
            assert time.monotonic() - started < 5  # the lease is 60 s, the lost-producer delay 60 s
            assert other.reaped == 0
            # Were the first run alive after all (stalled, cut off from Redis), it would learn it lost
            # its id and stop deciding: the door answers 503 producer_id_in_use.
            assert first.problem() is None and not await first.claim.renew()
            down = Colocated(first).down("gateway")
            assert down is not None and down.code == "producer_id_in_use" and "gw-fixed" in down.message
            later = await again.decide(request("c-1", [t + 30_000 for t in PROMPT]).model_copy(update={"releases": True}))
            assert isinstance(later, RoutingDecision)
        finally:
            for r in (again, other):
                if r is not None:
                    await r.close()
            with contextlib.suppress(Exception):
                await first.close()
        t = topics(s.topic_config())
        ended = [o for o in await read_all(s, t.request_outcomes.name, 2)
                 if getattr(o, "error", None) == "gateway_restarted"]
        assert sorted(o.request_id for o in ended) == ["f-1", "f-2"]
        assert {o.gateway for o in ended} == {"gw-fixed"} and {o.release_producer for o in ended} == {"gw-fixed"}
        assert {o.request_id: o.prefill_instance for o in ended} == {d.request_id: d.prefill_instance for d in left
                                                                     if isinstance(d, RoutingDecision)}
        ex = await explain(s, "c-1")
        assert ex.matches, ex.differences


async def test_a_second_gateway_under_a_live_gateways_id_fails_at_start_and_the_first_goes_on(
        settings: Settings) -> None:
    """Two live processes under one id would skip each other's decision-time records and end each
    other's charges: the second one to start is refused before it writes anything, naming the
    option, and the first keeps deciding; once the first is closed (its claim given back) the id
    starts at once."""
    async with cluster(settings) as s:
        first = LocalRouter(s, producer_id="gw-twin")
        await first.start()
        twin = LocalRouter(s, producer_id="gw-twin")
        try:
            with pytest.raises(ProducerIdInUse, match="--gateway-id"):
                await twin.start()
            assert first.problem() is None
            d = await first.decide(request("t-1"))
            assert isinstance(d, RoutingDecision)
        finally:
            with contextlib.suppress(Exception):
                await twin.close()
            await first.close()
        again = LocalRouter(s, producer_id="gw-twin")
        t0 = time.monotonic()
        await again.start()
        try:
            assert time.monotonic() - t0 < 10 and again.problem() is None
            assert isinstance(await again.decide(request("t-2")), RoutingDecision)
        finally:
            await again.close()
