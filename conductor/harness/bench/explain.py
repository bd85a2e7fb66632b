"""``conductor bench explain``: `conductor explain` against topics of growing size, while live.

The heartbeats topic gets ``records`` of history (an hour old, from nodes long gone: what a
day's retention of heartbeats holds), then a live cluster of four nodes beats and takes new
requests at ``rate`` records a second for the rest of the run. A router (with the decision
index) decides one request on a view of the live records; ``explain`` is then timed with the
index and without it (the bounded backward scans), and each answer checked against the
recorded decision. Repeated for each size, the history growing between them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from conductor.routing.explain import explain
from conductor.routing.router import Router
from conductor.routing.stores import decision_index, redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings
from schemas import BlocksStored, Heartbeat, Role, RoutingDecision, RoutingRequest, chain_keys, decode, encode, envelope
from state.redis_view import RedisViewStore
from streams.ingest import Ingestor, RawRecord
from streams.kafka import consumer, ensure_topics, producer
from streams.spans import Span, SpanReader
from streams.topics import topics

LIVE: tuple[tuple[str, Role], ...] = (("p-0", "prefill"), ("p-1", "prefill"), ("d-0", "decode"), ("d-1", "decode"))
PROMPT = list(range(5000, 5000 + 32 * 16))


def _beat(node: str, role: Role, seq: int, ts_ms: int) -> bytes:
    hb = (Heartbeat(role=role, rack="r0", queued_prefill_tokens=(seq * 37) % 900) if role == "prefill" else
          Heartbeat(role=role, rack="r0", total_kv_blocks=10_000, free_kv_blocks=10_000))
    return encode(envelope(hb, producer_id=node, producer_seq=seq, ts_ms=ts_ms))


async def _history(prod: AIOKafkaProducer, name: str, n: int, start: int) -> None:
    """``n`` heartbeats of 100 departed nodes, stamped an hour ago (record and envelope)."""
    old = int(time.time() * 1000) - 3_600_000
    templates = [_beat(f"gone-{i % 100}", "decode", start // 100 + i // 100, old) for i in range(1000)]
    for i in range(n):
        await prod.send(name, templates[i % 1000], key=b"gone-%d" % (i % 100), timestamp_ms=old + (start + i) // 1000)
    await prod.flush()


async def _live(settings: Settings, rate: float, stop: asyncio.Event, sent: list[int]) -> None:
    """The live cluster's records until ``stop``: each node's heartbeat, and a request, in turn."""
    t = topics(settings.topic_config())
    prod = producer(settings.kafka())
    await prod.start()
    try:
        seq = 0
        while not stop.is_set():
            seq += 1
            now = int(time.time() * 1000)
            for node, role in LIVE:
                await prod.send(t.heartbeats.name, _beat(node, role, seq, now), key=node.encode())
            req = RoutingRequest(request_id=f"bg-{seq}", token_ids=list(range(64)), prompt_tokens=64)
            await prod.send(t.requests.name, encode(envelope(req, producer_id="gw-bg", producer_seq=seq, ts_ms=now)),
                            key=req.request_id.encode())
            sent[0] += len(LIVE) + 1
            await asyncio.sleep((len(LIVE) + 1) / rate)
    finally:
        await prod.stop()


async def _follow(settings: Settings, since: dict[TopicPartition, int], caught_up: asyncio.Event,
                  stop: asyncio.Event) -> None:
    """What a stream worker does, for the bench's namespace: fold the records from ``since`` on
    into the Redis view, and keep folding the live ones until ``stop``."""
    t = topics(settings.topic_config())
    store = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    at = dict(since)
    try:
        ingestor = Ingestor(t, store)
        async with SpanReader(settings.kafka()) as log:
            tps = [tp for name in (t.kv_events.name, t.heartbeats.name) for tp in await log.partitions(name)]
            while not stop.is_set():
                bounds = await log.bounds(tps)
                async for batch in log.read({tp: Span(at.get(tp, b.start), b.stop) for tp, b in bounds.items()}):
                    await ingestor.process([RawRecord(m.topic, m.partition, m.offset, m.key, m.value,
                                                      m.timestamp or 0) for m in batch])
                at = {tp: b.stop for tp, b in bounds.items()}
                caught_up.set()
                await asyncio.sleep(0.1)
    finally:
        await store.close()


async def _decide(settings: Settings, request_id: str) -> RoutingDecision:
    t = topics(settings.topic_config())
    reader, resv = redis_stores(settings, producer_id="bench-explain")
    worker = RouterWorker(settings, Router(settings, reader, resv), router_id="bench-explain",
                          decisions=decision_index(settings, resv.client))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    prod = producer(settings.kafka())
    cons = consumer(settings.kafka(), t.dispatch.name, group_id=None)
    await prod.start()
    await cons.start()
    try:
        req = RoutingRequest(request_id=request_id, token_ids=PROMPT + list(range(64)), prompt_tokens=len(PROMPT) + 64)
        await prod.send_and_wait(t.requests.name, encode(envelope(req, producer_id="gw", producer_seq=1,
                                                                  ts_ms=int(time.time() * 1000))),
                                 key=request_id.encode())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    if getattr(body, "request_id", None) == request_id:
                        if not isinstance(body, RoutingDecision):
                            raise RuntimeError(f"the bench request was not placed: {body}")
                        return body
        raise RuntimeError("the bench request was not routed within 60 s")
    finally:
        stop.set()
        await cons.stop()
        await prod.stop()
        await asyncio.wait_for(task, 10)
        await reader.close()


async def _ends(settings: Settings, names: Sequence[str]) -> dict[TopicPartition, int]:
    async with SpanReader(settings.kafka()) as log:
        tps = [tp for name in names for tp in await log.partitions(name)]
        return {tp: s.stop for tp, s in (await log.bounds(tps)).items()}


async def run_explain_bench(settings: Settings, *, sizes: Sequence[int], rate: float,
                            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda _: None)
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), t.all())
    prod = producer(settings.kafka(), linger_ms=20)
    await prod.start()
    stop, sent = asyncio.Event(), [0]
    live: asyncio.Task[None] | None = None
    rows: list[dict[str, Any]] = []
    try:
        have = 0
        for size in sorted(sizes):
            t0 = time.monotonic()
            await _history(prod, t.heartbeats.name, size - have, have)
            say(f"{size - have} history records in {time.monotonic() - t0:.1f}s ({size} on {t.heartbeats.name})")
            have = size
            since = await _ends(settings, (t.kv_events.name, t.heartbeats.name))
            since = {tp: 0 if tp.topic == t.kv_events.name else off for tp, off in since.items()}
            if live is None:  # the live cluster starts, its prompt's prefix held by p-0
                live = asyncio.create_task(_live(settings, rate, stop, sent))
                await prod.send_and_wait(t.kv_events.name, encode(envelope(
                    BlocksStored(block_keys=chain_keys(PROMPT, settings.block_size)), producer_id="p-0",
                    producer_seq=0, ts_ms=int(time.time() * 1000))), key=b"p-0")
            await asyncio.sleep(1.0)  # a second of live heartbeats
            s = settings.model_copy(update={"view_namespace": f"{settings.view_namespace[:20]}x{size}"})
            caught_up, done = asyncio.Event(), asyncio.Event()
            worker = asyncio.create_task(_follow(s, since, caught_up, done))
            rid = f"explain-{size}"
            try:
                await asyncio.wait_for(caught_up.wait(), 120)
                d = await _decide(s, rid)
            finally:
                done.set()
                await worker
            row: dict[str, Any] = {"records": size}
            for label, index in (("indexed", True), ("scan", None)):
                t0 = time.monotonic()
                ex = await explain(s, rid, index=index)
                row[f"explain_s_{label}"] = round(time.monotonic() - t0, 3)
                if not ex.matches or ex.recorded["prefill_instance"] != d.prefill_instance:
                    raise RuntimeError(f"explain of {rid} did not re-derive the decision: {ex.differences}")
            say(f"{size} records: {row}")
            rows.append(row)
    finally:
        stop.set()
        if live is not None:
            await live
        await prod.stop()
    return {"rows": rows, "live_records_sent": sent[0], "live_rate_per_s": rate,
            "heartbeats_topic_records": have}


__all__ = ["run_explain_bench"]
