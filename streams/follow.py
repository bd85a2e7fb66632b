"""The one way to follow topics: a :class:`Follower` owns the consumer, where each partition
starts, the records' decoding, the bad-record policy, the positions and the stop.

A caller says where to start (:class:`Earliest`, :class:`Latest`, :class:`Since` a time,
:class:`At` given offsets, or the :class:`Tail` of each partition), which :class:`OnBad` policy
applies, and handles what comes: every fetch as :class:`Batch`-es of decoded :class:`Record`-s
with their positions (:meth:`Follower.polls`: a fetch that brought nothing is yielded too, so a
caller can keep time), or record by record (:meth:`Follower.records`). In a consumer group,
:meth:`Follower.commit` commits what was read once this follower's dead letters are acknowledged.

The embedded broker's quirks live here and nowhere else: its "latest" offset is wrong (a start
at the end uses :func:`streams.kafka.end_offsets`; a :class:`Since` that finds no record starts
at the partition's beginning there, at its end on Kafka), and it answers a fetch only when the
fetch's wait runs out (callers that wait on a reply pass a short ``fetch_wait_ms``). So a short
wait is a fetch every few milliseconds, new records or not: a follower with one is paced by
:class:`streams.kafka.FetchPace` (after 2 s without a record it waits 100 ms per fetch, after
10 s 500 ms, and goes back to its short wait with the first record).
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import DecodeError, Envelope

from .config import KafkaConnection
from .dead_letters import DeadLetters
from .kafka import FetchPace, consumer, end_offsets
from .topics import Topic

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Earliest:
    """From each partition's first record (in a consumer group: from the group's committed offset)."""


@dataclass(frozen=True, slots=True)
class Latest:
    """From each partition's end: only records written from now on."""


@dataclass(frozen=True, slots=True)
class Since:
    """From each partition's first record stamped at or after ``at_ms``; where none is, from the
    end on a broker whose end is right (Kafka), else from the start (the embedded broker)."""

    at_ms: int


@dataclass(frozen=True, slots=True)
class At:
    """From the given offset of each partition (``offsets[partition]``; others from ``default``)."""

    offsets: Mapping[int, int]
    default: int = 0


@dataclass(frozen=True, slots=True)
class Tail:
    """The last ``records`` of each partition, then what comes."""

    records: int


Start = Earliest | Latest | Since | At | Tail


class OnBad(enum.Enum):
    """What a follower does with a record that does not decode. Each is counted (``counts``)."""

    SKIP = "skip"
    """Nothing else: the topic's owner sets it aside (a reader that is not the topic's owner)."""
    LOG_AND_SKIP = "log_and_skip"
    """Logged with its position, then skipped."""
    DEAD_LETTER = "dead_letter"
    """Logged and set aside on the dead-letter topic (this reader owns the topic)."""
    DEAD_LETTER_AND_ANSWER = "dead_letter_and_answer"
    """Handed to the caller undecoded: the caller judges each record (a bad request is answered,
    a rejection under its key) and sets bad ones aside with :meth:`Follower.dead_letter`."""


@dataclass(frozen=True, slots=True)
class Record:
    """One record and where it is. ``env`` is None only under ``DEAD_LETTER_AND_ANSWER``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int
    env: Envelope | None


@dataclass(frozen=True, slots=True)
class Batch:
    """One partition's records of one fetch, in offset order, and its high watermark then."""

    topic: str
    partition: int
    records: tuple[Record, ...]
    highwater: int | None


class Follower:
    """Follows ``starts`` (each topic with where it starts); see the module docstring.

    ``group``: read in that consumer group (the topics are subscribed; starts must be
    :class:`Earliest`); None: every partition assigned, no group. ``name`` names the follower in
    logs and on the dead letters it writes. ``counts`` (the caller's, else its own) counts bad
    records by ``count_prefix`` + their reason. ``track_end``: find each partition's end at start
    (:attr:`ends`, :attr:`caught_up`); starts at the end or the tail find it anyway. ``skip``:
    records whose Kafka headers it says yes to are passed over before any decoding (their positions
    move on; counted in :attr:`skipped`), e.g. requests decided where they arrived
    (:func:`schemas.decided_by`); records without such a header are handed over as any other.
    ``fetch_wait_ms`` (paced, :class:`streams.kafka.FetchPace`) and ``idle_steps`` (its steps;
    None: the default ones): see the module docstring.
    """

    def __init__(self, kafka: KafkaConnection, starts: Sequence[tuple[Topic, Start]], *, on_bad: OnBad,
                 name: str, dead_letter: Topic | None = None, group: str | None = None,
                 fetch_wait_ms: int | None = None, poll_ms: int = 200, max_records: int | None = 500,
                 counts: Counter[str] | None = None, count_prefix: str = "bad_record:",
                 track_end: bool = False, letters: DeadLetters | None = None,
                 skip: Callable[[Sequence[tuple[str, bytes]]], bool] | None = None,
                 idle_steps: Sequence[tuple[float, int]] | None = None) -> None:
        if group is not None and any(not isinstance(s, Earliest) for _, s in starts):
            raise ValueError("a consumer group starts where the group stopped: give Earliest")
        if on_bad in (OnBad.DEAD_LETTER, OnBad.DEAD_LETTER_AND_ANSWER) and letters is None and dead_letter is None:
            raise ValueError(f"{on_bad.name} needs the dead-letter topic")
        self.kafka = kafka
        self.starts = tuple(starts)
        self._topics = {t.name: t for t, _ in starts}
        self.on_bad = on_bad
        self.name = name
        self.group = group
        self.poll_ms = poll_ms
        self.max_records = max_records
        self.counts: Counter[str] = Counter() if counts is None else counts
        self.count_prefix = count_prefix
        self.track_end = track_end
        self.skip = skip
        self.skipped = 0
        """Records passed over by ``skip`` (never decoded)."""
        self.letters = letters
        if letters is None and dead_letter is not None:
            self.letters = DeadLetters(kafka, dead_letter, name)
        self._own_letters = letters is None
        self._acks: list[Any] = []
        self._consumer: AIOKafkaConsumer = consumer(
            kafka, *([t.name for t, _ in starts] if group is not None else []), group_id=group,
            **({"fetch_max_wait_ms": fetch_wait_ms} if fetch_wait_ms is not None else {}))
        self._pace = FetchPace(fetch_wait_ms, steps=idle_steps) if fetch_wait_ms is not None else None
        self.partitions: list[TopicPartition] = []
        self.ends: dict[tuple[str, int], int] = {}
        """Each partition's end when the follower started (with ``track_end``, or a start that needs it)."""
        self.positions: dict[tuple[str, int], int] = {}
        """The offset after the last record handed over, per partition read so far."""

    # --- life ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the consumer and put each partition where its start says."""
        c = self._consumer
        await c.start()
        if self.group is not None:
            return
        by_topic: dict[str, Start] = {}
        for topic, start in self.starts:
            parts = c.partitions_for_topic(topic.name) or set()
            if not parts:
                await c.topics()  # fetches the metadata that partitions_for_topic reads
                parts = c.partitions_for_topic(topic.name) or set()
            self.partitions += [TopicPartition(topic.name, p) for p in sorted(parts)]
            by_topic[topic.name] = start
        c.assign(self.partitions)
        if self.track_end or any(isinstance(s, Latest | Tail) for s in by_topic.values()):
            got = await end_offsets(c, self.partitions)
            self.ends = {(tp.topic, tp.partition): off for tp, off in got.items()}
        await self._seek({tp: by_topic[tp.topic] for tp in self.partitions})

    async def _seek(self, starts: dict[TopicPartition, Start]) -> None:
        c = self._consumer
        since = {tp: s.at_ms for tp, s in starts.items() if isinstance(s, Since)}
        found: dict[Any, Any] = {}
        if since:
            try:
                found = await c.offsets_for_times(since)
            except Exception as e:  # noqa: BLE001 - a broker without timestamp lookups (aiokafka raises several kinds)
                log.info("%s: offsets by time unavailable (%s); reading from the start", self.name, e)
        for tp, s in starts.items():
            end = self.ends.get((tp.topic, tp.partition), 0)
            if isinstance(s, Earliest):
                await c.seek_to_beginning(tp)
            elif isinstance(s, Latest):
                c.seek(tp, end)  # the probed end: the embedded broker's "latest" falls short
            elif isinstance(s, Tail):
                c.seek(tp, max(0, end - s.records))
            elif isinstance(s, At):
                c.seek(tp, s.offsets.get(tp.partition, s.default))
            elif (hit := found.get(tp)) is not None:
                c.seek(tp, hit.offset)
            elif self.kafka.profile == "production" and tp in since:
                await c.seek_to_end(tp)
            else:
                await c.seek_to_beginning(tp)  # the embedded broker's "latest" is wrong

    async def stop(self) -> None:
        """Stop the consumer (and the dead letters' producer this follower started)."""
        try:
            await self._consumer.stop()
        finally:
            if self.letters is not None and self._own_letters:
                await self.letters.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # --- reading ------------------------------------------------------------------

    async def fetch(self, timeout_ms: int | None = None) -> list[Batch]:
        """One fetch (waiting up to ``timeout_ms``, default ``poll_ms``): its records, decoded,
        bad ones dealt with by the policy, per partition."""
        got = await self._consumer.getmany(timeout_ms=self.poll_ms if timeout_ms is None else timeout_ms,
                                           max_records=self.max_records)
        out = []
        skip = self.skip
        wanted = False  # a record not passed over by ``skip`` came (what keeps a paced wait short)
        for tp, msgs in got.items():
            recs = []
            for m in msgs:
                self.positions[(tp.topic, tp.partition)] = m.offset + 1
                if skip is not None and m.headers and skip(m.headers):
                    self.skipped += 1
                    continue
                wanted = True
                rec = await self._record(m)
                if rec is not None:
                    recs.append(rec)
            out.append(Batch(tp.topic, tp.partition, tuple(recs), self._consumer.highwater(tp)))
        if self._pace is not None:
            # Records passed over do not count: a router following requests that gateways decided
            # themselves has nothing to answer quickly, so it paces as if idle.
            self._pace.after_fetch(self._consumer, wanted)
        return out

    async def polls(self, stop: Any) -> AsyncIterator[list[Batch]]:
        """:meth:`fetch` after fetch until ``stop`` (an ``asyncio.Event``) is set; empty fetches too."""
        while not stop.is_set():
            yield await self.fetch()

    async def records(self, stop: Any) -> AsyncIterator[Record]:
        """Each record, in each partition's order, until ``stop`` is set."""
        async for batches in self.polls(stop):
            for b in batches:
                for r in b.records:
                    yield r

    @property
    def caught_up(self) -> bool:
        """Whether every partition was read up to the end it had at start (:attr:`ends`)."""
        return all(self.positions.get(tp, 0) >= end for tp, end in self.ends.items() if end > 0)

    def assigned(self) -> bool:
        """Whether the consumer still holds every partition it was given."""
        held = self._consumer.assignment()
        return all(tp in held for tp in self.partitions)

    async def commit(self) -> None:
        """Commit what was handed over (a consumer group), once the dead letters written so far
        are acknowledged: a record is never both uncommitted-for-good and lost."""
        acks, self._acks = self._acks, []
        for ack in acks:
            await ack
        await self._consumer.commit()

    async def dead_letter(self, rec: Record, error: DecodeError) -> Any:
        """Set ``rec`` aside on the dead-letter topic with ``error``; the broker's acknowledgement
        (also awaited by :meth:`commit`)."""
        if self.letters is None:
            raise RuntimeError(f"{self.name}: no dead-letter topic given")
        ack = await self.letters.send(rec.topic, rec.partition, rec.offset, error.reason, str(error), rec.value,
                                      rec.key)
        self._acks.append(ack)
        return ack

    async def _record(self, m: Any) -> Record | None:
        rec = Record(m.topic, m.partition, m.offset, m.key, m.value, tuple(m.headers or ()), m.timestamp or 0, None)
        if self.on_bad is OnBad.DEAD_LETTER_AND_ANSWER:
            return rec
        try:
            env = self._topics[m.topic].decode(m.value)
        except DecodeError as e:
            self.counts[f"{self.count_prefix}{e.reason}"] += 1
            if self.on_bad is not OnBad.SKIP:
                log.warning("%s: skipping a bad record at %s[%d]@%d: %s", self.name, m.topic, m.partition,
                            m.offset, e)
            if self.on_bad is OnBad.DEAD_LETTER:
                await self.dead_letter(rec, e)
            return None
        return Record(rec.topic, rec.partition, rec.offset, rec.key, rec.value, rec.headers, rec.timestamp_ms, env)


__all__ = ["At", "Batch", "Earliest", "Follower", "Latest", "OnBad", "Record", "Since", "Start", "Tail"]
