"""Turning a batch of raw Kafka records into one view write: decode → fold → apply.

:class:`Ingestor` holds no Kafka and no Faust: the Faust agents (``streams.agents``),
``conductor view rebuild`` and the tests all hand it lists of :class:`RawRecord`. Per
batch it

1. decodes each record; a record that does not decode, or whose kind the topic does not
   carry, becomes a :class:`schemas.DeadLetter` (reason, error, source position, original
   bytes) handed to ``dead_letter`` — and the batch goes on;
2. folds the good ones from the per-node stream state the view recorded with its effects
   and writes all their operations in one fenced call (``state.write.fold_and_write``: one
   read and one write per batch, folded again if another writer moved a node's stream).
   The view is the only home of the stream state: it moves in the same atomic step as the
   effects, so nothing can lag behind it, and the offset fence drops what is re-delivered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from schemas import DeadLetter, DecodeError, Envelope, Heartbeat, decode, envelope
from state.fold import Folded, Op, UnfoldableRecord
from state.view import Outcome, SourcePosition
from state.write import fold_and_write
from streams.topics import Topics

log = logging.getLogger(__name__)

MAX_CLOCK_SKEW_MS = 30_000
"""A heartbeat stamped further ahead of its Kafka record's timestamp is a fault
(``future_timestamp``, dead-lettered): it would keep its node live past its death. Within it,
the heartbeat counts from the earlier of the two: liveness follows what the log observed.
The same bound holds for every record's epoch (``future_epoch``): an epoch is a restart's
wall-clock ms, and one far ahead would turn every later record of its node into a straggler."""

@dataclass(frozen=True, slots=True)
class RawRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int = 0
    after: int | None = field(default=None, compare=False)
    """The offset this record continues from in its partition (set by ``streams.resume``);
    the view refuses the write unless its fence is exactly that (``SourcePosition.after``)."""

    @property
    def position(self) -> SourcePosition:
        return SourcePosition(self.topic, self.partition, self.offset, self.after)


@dataclass(slots=True)
class BatchResult:
    records: int = 0
    applied: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Outcome → count for records that changed nothing (duplicate, old_epoch, fenced)."""
    dead: dict[str, int] = field(default_factory=dict)
    block_events: int = 0
    gaps: int = 0
    staleness_ms: list[float] = field(default_factory=list)
    """Publish (producer ts) → applied, per applied KV event."""
    heartbeats: dict[str, int] = field(default_factory=dict)
    """Node → last heartbeat ts_ms applied in this batch."""
    refolds: int = 0
    """Times a write found a node's stream moved by another writer and folded the rest again."""


class IngestMetrics:
    """The pipeline's OpenTelemetry instruments (no-ops until ``setup_metrics`` runs)."""

    def __init__(self, live_nodes: Callable[[], int] | None = None) -> None:
        m = metrics.get_meter(__name__)
        self.applied = m.create_counter("conductor_events_applied", description="records applied to the view")
        self.block_events = m.create_counter("conductor_block_events_applied", description="block keys in applied KV events")
        self.skipped = m.create_counter("conductor_events_skipped", description="records that changed nothing, by outcome")
        self.dead = m.create_counter("conductor_dead_letters", description="records sent to dead-letter, by reason")
        self.gaps = m.create_counter("conductor_sequence_gaps", description="producer sequence gaps seen")
        self.conflicts = m.create_counter(
            "conductor_view_write_conflicts", description="batches refolded because another writer moved a node's stream"
        )
        self.skew = m.create_histogram(
            "conductor_producer_clock_skew_ms", unit="ms",
            description="a producer's stamp minus its Kafka record's timestamp (positive: its clock runs ahead)",
        )
        self.staleness = m.create_histogram(
            "conductor_view_staleness_ms", unit="ms", description="producer timestamp to applied in the view"
        )
        if live_nodes is not None:
            def observe(_: CallbackOptions) -> list[Observation]:
                return [Observation(live_nodes())]

            m.create_observable_gauge("conductor_live_nodes", callbacks=[observe], description="nodes with a fresh heartbeat")

    def record(self, topic: str, r: BatchResult) -> None:
        attrs = {"topic": topic}
        if r.applied:
            self.applied.add(r.applied, attrs)
        if r.block_events:
            self.block_events.add(r.block_events, attrs)
        for outcome, n in r.skipped.items():
            self.skipped.add(n, {"topic": topic, "outcome": outcome})
        for reason, n in r.dead.items():
            self.dead.add(n, {"topic": topic, "reason": reason})
        if r.gaps:
            self.gaps.add(r.gaps, attrs)
        if r.refolds:
            self.conflicts.add(r.refolds, attrs)
        for s in r.staleness_ms:
            self.staleness.record(s)


def _dead_letter(rec: RawRecord, reason: str, error: str) -> DeadLetter:
    value = rec.value if isinstance(rec.value, (bytes, bytearray, memoryview)) else None
    key = rec.key if isinstance(rec.key, (bytes, bytearray, memoryview)) else None
    return DeadLetter.of(rec.topic, rec.partition, rec.offset, reason, error, value, key)


class Ingestor:
    """Decode, fold and apply batches of raw records; see the module docstring."""

    def __init__(
        self,
        topics: Topics,
        store: Any,
        *,
        dead_letter: Callable[[DeadLetter], Awaitable[None]] | None = None,
        metrics: IngestMetrics | None = None,
        clock_ms: Callable[[], float] = lambda: time.time() * 1000,
        producer_id: str = "conductor-worker",
    ) -> None:
        self.topics = topics
        self.store = store
        self.dead_letter = dead_letter
        self.metrics = metrics
        self.clock_ms = clock_ms
        self.producer_id = producer_id
        self._dl_seq = 0
        self.last_heartbeat_ms: dict[str, int] = {}
        self.clock_skew_ms: dict[str, int] = {}
        """Producer → its last record's stamp minus the Kafka record timestamp (ms)."""

    def dead_letter_envelope(self, dl: DeadLetter) -> Envelope:
        """Wrap a dead letter for the dead-letter topic (keyed by source topic)."""
        self._dl_seq += 1
        return envelope(dl, producer_id=self.producer_id, producer_seq=self._dl_seq, ts_ms=int(self.clock_ms()))

    async def process(self, records: Sequence[RawRecord]) -> BatchResult:
        res = BatchResult(records=len(records))
        # (record, envelope); envelope None for a dead-lettered record, which still moves its
        # partition's fence (an empty write): it has been dealt with, and a consumer that
        # resumes from the fence (streams.resume) must not send it round again.
        good: list[tuple[RawRecord, Envelope | None]] = []
        for rec in records:
            try:
                topic = self.topics.by_name(rec.topic)
            except KeyError:
                await self._dead(res, rec, "unknown_topic", f"{rec.topic} is not a pipeline topic")
                continue
            if rec.value is None:
                await self._dead(res, rec, "malformed", "empty record value")
                good.append((rec, None))
                continue
            try:
                env = decode(rec.value)
            except DecodeError as e:
                await self._dead(res, rec, e.reason, str(e))
                good.append((rec, None))
                continue
            if env.schema_name not in topic.kinds:
                await self._dead(res, rec, "wrong_kind", f"{env.schema_name} does not belong on {rec.topic}")
                good.append((rec, None))
                continue
            if rec.timestamp_ms > 0 and env.epoch > rec.timestamp_ms + MAX_CLOCK_SKEW_MS:
                # Epochs are a restart's wall-clock ms (or a small counter): one from the far
                # future would make every later record of the node a straggler, muting it for good.
                await self._dead(res, rec, "future_epoch",
                                 f"epoch {env.epoch} is past its Kafka record's timestamp {rec.timestamp_ms} "
                                 f"by more than {MAX_CLOCK_SKEW_MS} ms")
                good.append((rec, None))
                continue
            if rec.timestamp_ms > 0:
                skew = env.ts_ms - rec.timestamp_ms
                self._skew(env, skew)
                if isinstance(env.body, Heartbeat):
                    if skew > MAX_CLOCK_SKEW_MS:
                        await self._dead(res, rec, "future_timestamp",
                                         f"heartbeat stamped {skew} ms after its Kafka record (at most {MAX_CLOCK_SKEW_MS})")
                        good.append((rec, None))
                        continue
                    if skew > 0:  # freshness by what the log observed, never later than it
                        env = env.model_copy(update={"ts_ms": rec.timestamp_ms})
            good.append((rec, env))

        # Folds start from the view's own stream state (written atomically with the effects);
        # each write is a compare-and-set on that state, so a second writer cannot interleave
        # (state.write).
        w = await fold_and_write(self.store, [(env, rec.position) for rec, env in good])
        res.refolds = w.refolds
        now = self.clock_ms()
        for (rec, written), flag, f in zip(good, w.flags, w.folds):
            if isinstance(f, UnfoldableRecord):  # defensive: topic.kinds already filtered
                await self._dead(res, rec, f.reason, str(f))
                continue
            if written is None or f is None:  # dead-lettered (counted then); its fence has moved
                continue
            self._count(res, written, f, f.outcome if flag == Outcome.APPLIED else Outcome.FENCED, now)
        if self.metrics is not None and records:
            self.metrics.record(records[0].topic, res)
        return res

    def _skew(self, env: Envelope, skew_ms: int) -> None:
        """Record a producer's clock skew (its stamp minus the Kafka record's timestamp)."""
        self.clock_skew_ms[env.producer_id] = skew_ms
        # A histogram takes no negative value (the SDK drops it and logs a warning, per record:
        # that was a tenth of the worker's CPU). A clock behind is the normal case (the producer
        # stamps before it sends), and only a clock ahead is a fault; it is what the histogram shows.
        if self.metrics is not None and skew_ms > 0:
            self.metrics.skew.record(skew_ms, {"producer": env.producer_id})

    def _count(self, res: BatchResult, env: Envelope, f: Folded, outcome: Outcome, now: float) -> None:
        """Account for one record whose write has been decided (applied or skipped)."""
        if outcome != Outcome.APPLIED:
            res.skipped[outcome.value] = res.skipped.get(outcome.value, 0) + 1
            return
        res.applied += 1
        if isinstance(env.body, Heartbeat):
            res.heartbeats[env.producer_id] = env.ts_ms
            self.last_heartbeat_ms[env.producer_id] = max(self.last_heartbeat_ms.get(env.producer_id, 0), env.ts_ms)
        else:
            res.block_events += len(getattr(env.body, "block_keys", None) or ()) or _derived(f.ops)
            res.staleness_ms.append(max(now - env.ts_ms, 0.0))
            if f.gap:
                res.gaps += 1
                log.warning("node %s: sequence gap of %d before seq %d (epoch %d)", env.producer_id, f.gap, env.producer_seq, env.epoch)

    async def _dead(self, res: BatchResult, rec: RawRecord, reason: str, error: str) -> None:
        """Count, log and dead-letter one record. A dead letter that cannot be sent (the broker
        refuses it) is counted and logged with the record's position, and the batch goes on:
        one record never takes its batch down."""
        res.dead[reason] = res.dead.get(reason, 0) + 1
        size = len(rec.value) if isinstance(rec.value, (bytes, bytearray)) else 0
        log.warning("dead-letter %s:%d@%d (%d bytes): %s: %s", rec.topic, rec.partition, rec.offset, size, reason, error[:200])
        if self.dead_letter is not None:
            try:
                await self.dead_letter(_dead_letter(rec, reason, error))
            except Exception as e:  # noqa: BLE001 - counted and logged; the record's fence still moves
                res.dead["dead_letter_unsent"] = res.dead.get("dead_letter_unsent", 0) + 1
                log.error("could not send the dead letter of %s:%d@%d (%d bytes, %s): %s: %s",
                          rec.topic, rec.partition, rec.offset, size, reason, type(e).__name__, e)

    def live_nodes(self, ttl_s: float) -> int:
        now = self.clock_ms()
        return sum(1 for ts in self.last_heartbeat_ms.values() if now - ts <= ttl_s * 1000)


def _derived(ops: Sequence[Op]) -> int:
    return sum(len(getattr(op, "keys", ())) for op in ops)
