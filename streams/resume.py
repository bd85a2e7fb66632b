"""Apply every partition from where the view stopped, not from where the consumer group says.

The view records, atomically with each write, the highest offset it has applied per
topic-partition (its fence). That is the fact about what has been applied; the consumer
group's committed offset is only a claim. Faust commits acknowledged offsets on a timer and
takes offset jumps for acknowledged gaps, and the successor of a SIGKILLed worker was seen
starting past records the view never got: their blocks stayed wrong and their nodes
showed a sequence gap. So before a batch goes to the ingestor, :meth:`ResumeGuard.admit`

- puts each partition's records in offset order, each offset once, and drops those the
  view has applied (a batch can hold records fetched before a rebalance and again after);
- checks that they continue from the view's fence; at a hole it reads the missing offsets
  straight from the log (``fetch_range``, in parts of ``fill_max``) and puts them first.

Each record it yields names the offset it continues from (``RawRecord.after``: the fence,
or the record before it), and the view refuses a write whose fence is not exactly that
(``Outcome.HOLE``), so nothing is ever written on top of a view that lost what came before.

The view has a generation (``ns|gen``, :meth:`state.redis_view.RedisViewStore.adopt_generation`).
The guard reads it with the fences in one atomic step; a new or missing generation means the
view was lost or replaced: the guard adopts (or creates) the new one, and its partitions read
from the log's start (a missing fence means "rebuild", never "-1"). Writes folded on the old
generation are refused whole (``Outcome.LOST``). :meth:`ResumeGuard.catch_up` reads assigned
partitions up to their end with no new record needed (the stream worker runs it on a timer,
so partitions without traffic are rebuilt too).

Offsets the log no longer has (retention, or a transactional producer's markers) are let
through as a hole, logged and counted: nothing can fill them, and the fold counts the
sequence gap on the node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry import metrics
from opentelemetry.metrics import Counter

from state.view import GenerationalView
from streams.config import KafkaConnection
from streams.ingest import RawRecord
from streams.kafka import consumer, end_offsets

log = logging.getLogger(__name__)

FetchRange = Callable[[str, int, int, int], Awaitable[list[RawRecord]]]
"""``fetch_range(topic, partition, start, end)``: the records of offsets ``start`` to
``end - 1`` that the log still holds, in offset order."""


@functools.cache
def _counters() -> tuple[Counter, Counter]:
    """The guard's two counters, created once per process (both agents share them)."""
    m = metrics.get_meter(__name__)
    return (
        m.create_counter("conductor_records_refetched", description="records read back from the log to fill a hole after the view's fence"),
        m.create_counter("conductor_records_lost", description="offsets after the view's fence that the log no longer holds"),
    )


class ResumeGuard:
    """Keep each partition's records contiguous with what the view applied; see the module docstring."""

    def __init__(
        self,
        watermark: Callable[[], Awaitable[dict[str, int]]],
        fetch_range: FetchRange,
        *,
        fill_max: int = 20_000,
        metrics: bool = False,
        view: GenerationalView | None = None,
    ) -> None:
        self.watermark = watermark
        self.view = view
        """The store, when it has a generation (then its fences are read with it, not ``watermark``)."""
        self.all_partitions: Sequence[str] = ()
        """Every ``topic:partition`` of the pipeline: marked as rebuilding (``ns|rebuild``) when
        this guard creates a generation (set by the stream worker)."""
        self.generations = 0
        """Times the guard found the view's generation changed (lost or replaced) and adopted a new one."""
        self.fetch_range = fetch_range
        self.fill_max = fill_max
        self._refetched_counter: Counter | None = None
        self._lost_counter: Counter | None = None
        if metrics:
            self._refetched_counter, self._lost_counter = _counters()
        self.refetched = 0
        """Records read back from the log to fill a hole."""
        self.lost = 0
        """Offsets of holes the log could not fill."""
        self.already_applied = 0
        """Records dropped as applied already or as a second copy in the batch."""

    async def admit(self, batch: Sequence[RawRecord]) -> AsyncIterator[list[RawRecord]]:
        """Yield the records to apply for ``batch``, in parts to apply one after the other:
        per partition in offset order, without a hole after the view's fence (missing
        offsets read back from the log, at most ``fill_max`` at a time), none applied already."""
        if not batch:
            return
        by_tp: dict[tuple[str, int], dict[int, RawRecord]] = {}
        for r in batch:
            by_tp.setdefault((r.topic, r.partition), {}).setdefault(r.offset, r)
        self.already_applied += len(batch) - sum(map(len, by_tp.values()))  # second copies
        wm = await self.fences()
        out: list[RawRecord] = []
        for (topic, partition), recs in by_tp.items():
            applied = wm.get(f"{topic}:{partition}", -1)
            fresh = [recs[o] for o in sorted(recs) if o > applied]
            self.already_applied += len(recs) - len(fresh)
            prev = applied  # the offset the next record continues from (-1: the partition's first)
            for r in fresh:
                if r.offset > prev + 1:
                    if out:  # what comes before the hole goes first
                        yield out
                        out = []
                    log.warning(
                        "%s:%d: offsets %d..%d are not in the view (the consumer resumed past them, or the view was lost); reading them back from the log",
                        topic, partition, prev + 1, r.offset - 1,
                    )
                    async for part in self._fill_hole(topic, partition, prev, r.offset):
                        prev = part[-1].offset
                        yield part
                out.append(dataclasses.replace(r, after=prev))
                prev = r.offset
        if out:
            yield out

    async def fences(self) -> dict[str, int]:
        """The view's fences; with a view that has a generation, read atomically with it, and a
        changed or missing generation adopted (created when missing) before they are used."""
        if self.view is None:
            return await self.watermark()
        gen, wm = await self.view.fences()
        if gen is None or gen != self.view.generation:
            had = self.view.generation
            new, created = await self.view.adopt_generation(list(self.all_partitions))
            if had is not None:
                self.generations += 1
                log.warning(
                    "the view's generation is %s (%s); reading every partition back from the log where its fence stops",
                    new, "created: the view was lost or is new" if created else "replaced",
                )
            gen, wm = await self.view.fences()
            if gen != new:  # replaced again meanwhile: the next write is refused and admitted again
                log.warning("the view's generation moved again while adopting it")
        return wm

    async def catch_up(self, tps: Sequence[tuple[str, int]], end: dict[tuple[str, int], int]) -> AsyncIterator[list[RawRecord]]:
        """Yield, in parts, every record of ``tps`` after the view's fence up to ``end`` (the
        offset after each partition's last record): a partition rebuilt with no new traffic."""
        wm = await self.fences()
        for topic, partition in tps:
            applied = wm.get(f"{topic}:{partition}", -1)
            stop = end.get((topic, partition), 0)
            if stop > applied + 1:
                log.warning("%s:%d: reading offsets %d..%d back from the log (the view stops at %d)",
                            topic, partition, applied + 1, stop - 1, applied)
                async for part in self._fill_hole(topic, partition, applied, stop):
                    yield part

    async def _fill_hole(self, topic: str, partition: int, prev: int, end: int) -> AsyncIterator[list[RawRecord]]:
        """The records of offsets ``prev + 1`` to ``end - 1`` from the log, each naming the one before it."""
        for start in range(prev + 1, end, self.fill_max):
            part = await self._fill(topic, partition, start, min(start + self.fill_max, end))
            if part:
                chained = []
                for r in part:
                    chained.append(dataclasses.replace(r, after=prev))
                    prev = r.offset
                yield chained

    async def _fill(self, topic: str, partition: int, start: int, end: int) -> list[RawRecord]:
        got = [r for r in await self.fetch_range(topic, partition, start, end) if start <= r.offset < end]
        self.refetched += len(got)
        missing = (end - start) - len(got)
        self.lost += missing
        attrs = {"topic": topic}
        if self._refetched_counter is not None and got:
            self._refetched_counter.add(len(got), attrs)
        if self._lost_counter is not None and missing:
            self._lost_counter.add(missing, attrs)
        if missing:
            log.error(
                "%s:%d: %d of offsets %d..%d are not in the log (retention?); the view misses them",
                topic, partition, missing, start, end - 1,
            )
        return got


class LogReader:
    """Reads offset ranges straight from the log, with a consumer of its own (no group).

    Between reads its partitions are let go: an assigned partition is fetched in the background
    whether or not anyone reads it (two fetches a second each on the embedded broker, for as long
    as the worker runs: each lane's reader did that after its first rebuild). The next read's
    ``assign`` starts them again."""

    def __init__(self, kafka: KafkaConnection, *, timeout_s: float = 30.0) -> None:
        self.kafka = kafka
        self.timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            self._consumer = consumer(self.kafka, group_id=None)
            await self._consumer.start()
        return self._consumer

    async def end_offsets(self, tps: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The offset after each partition's last record."""
        if not tps:
            return {}
        c = await self._started()
        tpl = [TopicPartition(t, p) for t, p in tps]
        c.assign(tpl)
        try:
            got = await end_offsets(c, tpl)
        finally:
            _pause_all(c)
        return {(tp.topic, tp.partition): off for tp, off in got.items()}

    async def fetch_range(self, topic: str, partition: int, start: int, end: int) -> list[RawRecord]:
        c = await self._started()
        tp = TopicPartition(topic, partition)
        c.assign([tp])
        c.seek(tp, start)  # below the log's start, the consumer resets to it (earliest)
        out: list[RawRecord] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            while loop.time() < deadline:
                got = await c.getmany(tp, timeout_ms=200)
                for m in got.get(tp, []):
                    if start <= m.offset < end:
                        out.append(RawRecord(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp or 0))
                if await c.position(tp) >= end:
                    break
            else:
                log.error("%s:%d: reading offsets %d..%d timed out after %.0fs", topic, partition, start, end - 1,
                          self.timeout_s)
        finally:
            _pause_all(c)
        return out

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None


def _pause_all(c: AIOKafkaConsumer) -> None:
    """No more background fetches for ``c``'s partitions until they are assigned again, and no
    fetcher waking: the partitions are let go, not paused (aiokafka's fetcher looks at paused
    partitions every 200 ms, ten wake-ups a second for the worker's two readers, for good; with
    nothing assigned it sleeps until the next ``assign``)."""
    if c.assignment():
        c.unsubscribe()


class RangeReader(Protocol):
    """What a :class:`TopicLane` reads the log with (:class:`LogReader`)."""

    async def end_offsets(self, tps: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]: ...

    async def fetch_range(self, topic: str, partition: int, start: int, end: int) -> list[RawRecord]: ...

    async def close(self) -> None: ...


@dataclasses.dataclass
class TopicLane:
    """One topic's resume guard, the log reader that fills its holes, and the lock that keeps
    the agent's batches and the generation watcher's catch-up of its partitions apart."""

    guard: ResumeGuard
    reader: RangeReader
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class TopicLanes:
    """The stream worker's lanes, one per topic, each made on first use with a log reader of its
    own and a guard over the view (shared by the topic's agent and the generation watcher)."""

    def __init__(self, kafka: KafkaConnection, watermark: Callable[[], Awaitable[dict[str, int]]],
                 view: GenerationalView | None, all_partitions: Sequence[str], *, metrics: bool) -> None:
        self.kafka = kafka
        self.watermark = watermark
        self.view = view
        self.all_partitions = all_partitions
        self.metrics = metrics
        self._lanes: dict[str, TopicLane] = {}

    def __call__(self, topic: str) -> TopicLane:
        lane = self._lanes.get(topic)
        if lane is None:
            reader = LogReader(self.kafka)
            guard = ResumeGuard(self.watermark, reader.fetch_range, metrics=self.metrics, view=self.view)
            guard.all_partitions = self.all_partitions
            lane = self._lanes[topic] = TopicLane(guard, reader)
        return lane

    async def close(self, topic: str) -> None:
        """Close the topic's log reader (a later call makes a new lane)."""
        lane = self._lanes.pop(topic, None)
        if lane is not None:
            await lane.reader.close()
