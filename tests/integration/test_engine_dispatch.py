"""The dispatcher client's join of decisions with their requests (pure), and its start position (real broker)."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.harness.dispatch import _Joiner, decisions_for
from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRequest, encode, envelope, headers
from streams.kafka import ensure_topics, producer
from streams.topics import topics


def req(rid: str) -> RoutingRequest:
    return RoutingRequest(request_id=rid, token_ids=[1, 2, 3], prompt_tokens=3)


def dec(rid: str, p: str = "p0", d: str = "d0") -> RoutingDecision:
    return RoutingDecision(request_id=rid, prefill_instance=p, decode_instance=d, reused_tokens=0,
                           predicted_ttft_s=1.0, predicted_tbt_ms=10.0, policy="t")


def test_a_decision_waits_for_its_request_whichever_comes_first() -> None:
    j = _Joiner("p0", since_ms=0, with_requests=True)
    assert j.on_request(req("a"), 10) == []
    [a] = j.on_decision(dec("a"), 11, now=0.0)
    assert a.request == req("a") and a.request_ts_ms == 10 and a.prefill and not a.decode
    assert j.on_decision(dec("b"), 12, now=0.0) == []  # its request is not here yet
    [b] = j.on_request(req("b"), 9)
    assert b.decision.request_id == "b" and b.request_ts_ms == 9


def test_only_this_instances_recent_decisions_and_missing_requests_expire() -> None:
    j = _Joiner("d0", since_ms=100, with_requests=True)
    assert j.on_decision(dec("x", "p0", "d1"), 200, now=0.0) == []  # another instance's
    assert j.on_decision(dec("y"), 50, now=0.0) == []  # from before this instance started
    assert j.on_decision(dec("z"), 200, now=0.0) == []
    assert j.expire(5.0, wait_s=10.0) == []
    [z] = j.expire(11.0, wait_s=10.0)
    assert z.request is None and z.decode and not z.prefill
    assert j.counts["request_missing"] == 1


@pytest.mark.integration
async def test_a_restarted_instance_skips_decisions_made_before_it_started(settings: Settings) -> None:
    tps = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), tps.all())
    prod = producer(settings.kafka())
    await prod.start()

    async def send(topic: str, body, seq: int) -> None:  # type: ignore[no-untyped-def]
        env = envelope(body, producer_id="t", producer_seq=seq, ts_ms=time.time_ns() // 1_000_000)
        await prod.send_and_wait(topic, encode(env), key=b"p0", headers=headers(env))

    try:
        await send(tps.requests.name, req("old"), 1)
        await send(tps.dispatch.name, dec("old"), 2)
        await asyncio.sleep(0.05)
        since = time.time_ns() // 1_000_000
        await asyncio.sleep(0.05)
        await send(tps.requests.name, req("new"), 3)
        await send(tps.dispatch.name, dec("new"), 4)
        stream = decisions_for(settings, "p0", since_ms=since)
        try:
            first = await asyncio.wait_for(stream.__anext__(), 20)
        finally:
            await stream.aclose()
        assert first.decision.request_id == "new" and first.request == req("new")
    finally:
        await prod.stop()
