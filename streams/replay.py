"""Replaying ``kv-events`` and ``heartbeats`` from offset 0 into a view (``conductor view rebuild``).

A plain aiokafka reader (no consumer group, nothing committed) assigned every partition
of both topics, reading up to the end offsets it saw at start, and feeding the same
:class:`streams.ingest.Ingestor` the live worker uses. Dead letters are counted, not
re-published (the live worker already published them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from state.view import ViewStore
from streams.config import KafkaConnection
from streams.ingest import Ingestor, RawRecord
from streams.kafka import consumer, end_offsets
from streams.topics import TopicConfig, topics


@dataclass
class ReplayResult:
    records: int = 0
    applied: int = 0
    dead: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    end_offsets: dict[str, int] = field(default_factory=dict)


async def replay_into(
    kafka: KafkaConnection,
    topic_config: TopicConfig,
    store: ViewStore,
    *,
    progress: Callable[[int, int], None] | None = None,
    idle_timeout_s: float = 3.0,
    batch: int = 5000,
    until: dict[str, int] | None = None,
) -> ReplayResult:
    """Fold every record of both topics, from the beginning, into ``store``.

    ``progress(done, total)`` is called after each batch. Stops when every partition has
    reached the end offset seen at start, or after ``idle_timeout_s`` without records.
    ``until`` (a view watermark: ``topic:partition`` → highest offset to apply) rebuilds
    the view as it stood at that watermark; partitions it does not name contribute nothing.
    """
    t = topics(topic_config)
    names = (t.kv_events.name, t.heartbeats.name)
    c = consumer(kafka, group_id=None)
    await c.start()
    res = ReplayResult()
    t0 = time.monotonic()
    try:
        existing = await c.topics()
        tps = [
            TopicPartition(name, p)
            for name in names
            if name in existing
            for p in sorted(c.partitions_for_topic(name) or ())
        ]
        if not tps:
            return res
        c.assign(tps)
        end = await end_offsets(c, tps)
        await c.seek_to_beginning(*tps)
        begin = await c.beginning_offsets(tps)
        if until is not None:
            end = {tp: min(off, until.get(f"{tp.topic}:{tp.partition}", -1) + 1) for tp, off in end.items()}
        res.end_offsets = {f"{tp.topic}:{tp.partition}": off for tp, off in end.items()}
        total = sum(max(end[tp] - begin[tp], 0) for tp in tps)
        remaining = {tp for tp in tps if end[tp] > begin[tp]}
        ingestor = Ingestor(t, store)
        if progress:
            progress(0, total)
        last = time.monotonic()
        while remaining:
            got = await c.getmany(timeout_ms=200, max_records=batch)
            if not got:
                if time.monotonic() - last > idle_timeout_s:
                    break
                continue
            last = time.monotonic()
            for tp, msgs in got.items():
                msgs = [m for m in msgs if m.offset < end[tp]]
                if msgs:
                    r = await ingestor.process(
                        [RawRecord(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp or 0) for m in msgs]
                    )
                    res.records += r.records
                    res.applied += r.applied
                    for k, v in r.dead.items():
                        res.dead[k] = res.dead.get(k, 0) + v
                if await c.position(tp) >= end[tp]:
                    remaining.discard(tp)
                    c.pause(tp)
            if progress:
                progress(res.records, total)
    finally:
        await c.stop()
        res.seconds = time.monotonic() - t0
    return res


def diff_dumps(a: dict[str, Any], b: dict[str, Any], limit: int = 10) -> list[str]:
    """Human-readable differences between two ``dump()`` pictures (empty when equal)."""
    out: list[str] = []
    for section in ("nodes", "blocks", "watermark"):
        x, y = a.get(section, {}), b.get(section, {})
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                out.append(f"{section}[{k}]: {x.get(k)!r} != {y.get(k)!r}")
                if len(out) >= limit:
                    return out
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)
