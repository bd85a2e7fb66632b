"""Bounded reads of the log on the real embedded broker: where a partition ends, where a time
falls, and a read that ends while a producer keeps appending."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition

from streams.kafka import consumer, ensure_topics, producer
from streams.spans import Span, SpanReader
from streams.topics import topics

pytestmark = pytest.mark.integration


async def _fill(settings, name: str, base_ms: int) -> None:
    """Partition 0: 3,000 records in many batches, one every 10 ms of record time;
    partition 1: 2,000 records in one batch (Tansu's "latest" says 1 for it)."""
    prod = producer(settings.kafka(), linger_ms=5, max_batch_size=16 << 10)
    await prod.start()
    try:
        for i in range(3000):
            await prod.send(name, b"p0-%d" % i, partition=0, timestamp_ms=base_ms + 10 * i)
            if i % 97 == 0:
                await prod.flush()
        await prod.flush()
    finally:
        await prod.stop()
    prod = producer(settings.kafka(), linger_ms=500)
    await prod.start()
    try:
        for i in range(2000):
            await prod.send(name, b"p1-%d" % i, partition=1, timestamp_ms=base_ms + 5 * i)
        await prod.flush()
    finally:
        await prod.stop()


async def test_ends_and_times_are_right_on_the_embedded_broker(settings):
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.heartbeats,))
    name = t.heartbeats.name
    base = int(time.time() * 1000) - 3_600_000
    await _fill(settings, name, base)
    tps = [TopicPartition(name, 0), TopicPartition(name, 1)]

    raw = consumer(settings.kafka(), group_id=None)
    await raw.start()
    try:
        raw.assign(tps)
        reported = await raw.end_offsets(tps)
        by_time = await raw.offsets_for_times({tp: base + 10_000 for tp in tps})
    finally:
        await raw.stop()
    # What the broker itself answers, for the record (Kafka: 3000 / 2000 and 1000 / 2000).
    print("ListOffsets latest:", {tp.partition: reported[tp] for tp in tps},
          "by time:", {tp.partition: v and v.offset for tp, v in by_time.items()})

    async with SpanReader(settings.kafka()) as r:
        assert await r.partitions(name) == tps
        bounds = await r.bounds(tps)
        assert bounds == {tps[0]: Span(0, 3000), tps[1]: Span(0, 2000)}
        for at_ms, want in ((base - 1, (0, 0)), (base, (0, 0)), (base + 10_000, (1000, 2000)),
                            (base + 5_005, (501, 1001)), (base + 29_990, (2999, 2000)),
                            (base + 10_000_000, (3000, 2000))):
            got = await r.offsets_at(at_ms, bounds)
            assert (got[tps[0]], got[tps[1]]) == want, at_ms - base
        # Inside a narrower span the answer stays in it.
        assert (await r.offsets_at(base, {tps[0]: Span(100, 200)}))[tps[0]] == 100
        assert (await r.offsets_at(base + 10_000_000, {tps[0]: Span(100, 200)}))[tps[0]] == 200


async def test_a_read_ends_at_the_end_it_started_with_while_records_keep_coming(settings):
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.heartbeats,))
    name = t.heartbeats.name
    prod = producer(settings.kafka())
    await prod.start()
    stop = asyncio.Event()

    async def keep_producing() -> None:
        i = 0
        while not stop.is_set():
            await prod.send(name, b"hb-%d" % i, partition=i % 2)
            i += 1
            await asyncio.sleep(0.01)

    for i in range(500):
        await prod.send(name, b"first-%d" % i, partition=i % 2)
    await prod.flush()
    task = asyncio.create_task(keep_producing())
    try:
        async with SpanReader(settings.kafka(), deadline_s=20) as r:
            tps = await r.partitions(name)
            spans = await r.bounds(tps)
            assert sum(len(s) for s in spans.values()) >= 500
            seen = {tp: [] for tp in tps}
            t0 = time.monotonic()
            async for batch in r.read(spans):
                seen[TopicPartition(batch[0].topic, batch[0].partition)] += [m.offset for m in batch]
            assert time.monotonic() - t0 < 10
            for tp in tps:
                assert seen[tp] == list(range(spans[tp].start, spans[tp].stop))
            assert r.records_read == sum(len(s) for s in spans.values())
    finally:
        stop.set()
        await task
        await prod.stop()
