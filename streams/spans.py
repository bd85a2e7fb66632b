"""Bounded reads of the log: fixed offset spans, found by end offset or by time, streamed.

What ``conductor explain``, the admin API's explain and ``conductor simulate --from-topics``
read with. Each read has an end fixed when it starts (a live topic that never falls quiet
still ends), may start at a time instead of offset 0, and hands its records on batch by
batch (the caller folds them; nothing collects a whole topic).

Where a partition ends and where a time falls, on either broker (measured against the
embedded Tansu by ``tests/integration/test_log_spans.py``):

* ``ListOffsets`` for "latest" (aiokafka's ``end_offsets`` and ``seek_to_end``): Kafka answers
  the high watermark; Tansu the base offset of the partition's last record *batch* plus one
  (1 for a partition of one 20,000-record batch). The high watermark a *Fetch* response
  carries is right on both, so :func:`streams.kafka.end_offsets` fetches once and keeps
  the larger.
* ``ListOffsets`` by timestamp (``offsets_for_times``): Kafka answers the first offset whose
  record timestamp is at or after the time (from its time index); Tansu answered offset 0
  for every time, past or future. So :meth:`SpanReader.offsets_at` checks the broker's answer
  against the records on either side of it (two one-record fetches), and where it is wrong
  finds the offset by bisection over one-record fetches (timestamps rise with offsets within
  a partition, up to producer clock skew, which callers cover with a margin).

No quiet-for-a-second fallback is left: both calls have a correct answer on both brokers.
A read that has not reached its end by its deadline raises :class:`LogReadError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas.errors import ConductorError

from .config import KafkaConnection
from .kafka import consumer, end_offsets

PROBE_FETCH_BYTES = 64 << 10
"""A one-record probe fetches at most this per partition (Kafka still sends a larger first batch whole)."""


class LogReadError(ConductorError):
    """A bounded read of the log did not reach its end in time."""


@dataclass(frozen=True, slots=True)
class Span:
    """Offsets ``start`` (inclusive) to ``stop`` (exclusive) of one partition."""

    start: int
    stop: int

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)


class SpanReader:
    """Reads spans of partitions with consumers of its own (no group, nothing committed).

    Use as ``async with SpanReader(kafka) as r:``. ``deadline_s`` bounds each call.
    """

    def __init__(self, kafka: KafkaConnection, *, deadline_s: float = 60.0, batch: int = 5000) -> None:
        self.kafka = kafka
        self.deadline_s = deadline_s
        self.batch = batch
        self.records_read = 0
        # The probe: small fetches and a short broker wait (Tansu holds a fetch until its wait
        # runs out); the bulk reader: large fetches.
        self._probe: AIOKafkaConsumer = consumer(kafka, group_id=None, fetch_max_wait_ms=10,
                                                 max_partition_fetch_bytes=PROBE_FETCH_BYTES, fetch_max_bytes=4 << 20)
        self._bulk: AIOKafkaConsumer = consumer(kafka, group_id=None, fetch_max_wait_ms=50)
        self._probe_tps: set[TopicPartition] = set()
        self._partitions: dict[str, list[int]] = {}

    async def __aenter__(self) -> Self:
        await self._probe.start()
        try:
            # Every topic's partitions, read before anything is assigned: once it is, a consumer's
            # metadata follows only its assigned topics (and ``topics()`` does not refresh it).
            self._partitions = {name: sorted(self._probe.partitions_for_topic(name) or ())
                                for name in await self._probe.topics()}
            await self._bulk.start()
        except BaseException:
            await self._probe.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._bulk.stop()
        await self._probe.stop()

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.deadline_s

    async def partitions(self, name: str) -> list[TopicPartition]:
        """Every partition of topic ``name`` when the reader started (none if it did not exist)."""
        return [TopicPartition(name, p) for p in self._partitions.get(name, ())]

    def _assign_probe(self, tps: Sequence[TopicPartition]) -> None:
        if not set(tps) <= self._probe_tps:
            self._probe_tps |= set(tps)
            self._probe.assign(sorted(self._probe_tps))
        for tp in self._probe_tps:
            if tp in tps:
                self._probe.resume(tp)
            else:
                self._probe.pause(tp)

    async def bounds(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, Span]:
        """Each partition's first offset and the offset after its last record, now."""
        if not tps:
            return {}
        self._assign_probe(tps)
        begin = await self._probe.beginning_offsets(list(tps))
        end = await end_offsets(self._probe, list(tps))
        return {tp: Span(int(begin[tp]), max(int(end[tp]), int(begin[tp]))) for tp in tps}

    async def stamps(self, at: Mapping[TopicPartition, int]) -> dict[TopicPartition, tuple[int, int] | None]:
        """The (offset, timestamp) of the first record at or after each offset (None: none came)."""
        if not at:
            return {}
        tps = list(at)
        self._assign_probe(tps)
        for tp, off in at.items():
            self._probe.seek(tp, off)
        out: dict[TopicPartition, tuple[int, int] | None] = {}
        pending = set(tps)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.deadline_s, 5.0)
        while pending and loop.time() < deadline:
            got = await self._probe.getmany(*pending, timeout_ms=100, max_records=1)
            for tp, msgs in got.items():
                if msgs and tp in pending:
                    out[tp] = (msgs[0].offset, msgs[0].timestamp)
                    pending.discard(tp)
            for tp in list(pending):
                hw = self._probe.highwater(tp)
                if hw is not None and at[tp] >= hw:  # past the end: no record to come
                    pending.discard(tp)
        for tp in tps:
            out.setdefault(tp, None)
        return out

    async def offsets_at(self, ts_ms: int, spans: Mapping[TopicPartition, Span]) -> dict[TopicPartition, int]:
        """In each span, the first offset whose record's timestamp is at or after ``ts_ms``
        (the span's stop when none is); see the module docstring for why it is checked."""
        if not spans:
            return {}
        try:
            found: Mapping[TopicPartition, Any] = await self._probe.offsets_for_times({tp: ts_ms for tp in spans})
        except (KafkaError, ValueError):  # a broker without lookups by time: bisect
            found = {}
        guess = {}
        for tp, s in spans.items():
            hit = found.get(tp)
            guess[tp] = min(max(hit.offset if hit is not None else s.stop, s.start), s.stop)
        # The answer o holds if the record before it is earlier than ts_ms and the one at it is not.
        before = await self.stamps({tp: o - 1 for tp, o in guess.items() if o > spans[tp].start})
        at = await self.stamps({tp: o for tp, o in guess.items() if o < spans[tp].stop})
        wrong = {}
        for tp, s in spans.items():
            b, a = before.get(tp), at.get(tp)
            ok_before = guess[tp] <= s.start or (b is not None and b[0] < guess[tp] and b[1] < ts_ms)
            ok_at = guess[tp] >= s.stop or (a is not None and (a[0] >= s.stop or a[1] >= ts_ms))
            if not (ok_before and ok_at):
                wrong[tp] = s
        return {**guess, **await self._bisect(ts_ms, wrong)}

    async def _bisect(self, ts_ms: int, spans: Mapping[TopicPartition, Span]) -> dict[TopicPartition, int]:
        lo = {tp: s.start for tp, s in spans.items()}
        hi = {tp: s.stop for tp, s in spans.items()}
        loop = asyncio.get_running_loop()
        deadline = self._deadline()
        while any(lo[tp] < hi[tp] for tp in spans):
            if loop.time() > deadline:
                raise LogReadError(f"finding the offsets at {ts_ms} ms took over {self.deadline_s:.0f}s")
            mid = {tp: (lo[tp] + hi[tp]) // 2 for tp in spans if lo[tp] < hi[tp]}
            got = await self.stamps(mid)
            for tp, m in mid.items():
                st = got[tp]
                if st is None or st[0] >= hi[tp] or st[1] >= ts_ms:
                    hi[tp] = m
                else:
                    lo[tp] = st[0] + 1
        return lo

    async def read(self, spans: Mapping[TopicPartition, Span]) -> AsyncIterator[Sequence[ConsumerRecord[Any, Any]]]:
        """The records of each span, batch by batch (each batch from one partition, in offset
        order); ends when every span is read, :class:`LogReadError` past the deadline."""
        todo = {tp: s for tp, s in spans.items() if len(s) > 0}
        if not todo:
            return
        c = self._bulk
        c.assign(list(todo))
        for tp, s in todo.items():
            c.seek(tp, s.start)  # below the log's start (retention), the consumer resets to it
        loop = asyncio.get_running_loop()
        deadline = self._deadline()
        while todo:
            if loop.time() > deadline:
                left = ", ".join(f"{tp.topic}:{tp.partition} {s.start}..{s.stop}" for tp, s in sorted(todo.items()))
                raise LogReadError(f"reading {left} did not finish within {self.deadline_s:.0f}s")
            got = await c.getmany(*todo, timeout_ms=200, max_records=self.batch)
            for tp, msgs in got.items():
                span = todo.get(tp)
                if span is None:
                    continue
                inside = [m for m in msgs if m.offset < span.stop]
                if inside:
                    self.records_read += len(inside)
                    yield inside
                if (msgs and msgs[-1].offset + 1 >= span.stop) or await c.position(tp) >= span.stop:
                    del todo[tp]
                    c.pause(tp)
            for tp in list(todo):  # a span whose records were deleted (retention) ends where the log does
                hw = c.highwater(tp)
                if hw is not None and await c.position(tp) >= hw and hw <= todo[tp].start:
                    del todo[tp]


__all__ = ["LogReadError", "Span", "SpanReader"]
