"""The stream worker's agents: ``kv-events`` and ``heartbeats`` → :class:`streams.ingest.Ingestor`.

Each agent takes batches (:func:`streams.batches.take_batches`: up to 2,000 records, closed
10 ms after the first, no timer while none comes), passes them through a
:class:`streams.resume.ResumeGuard` (each partition continues from the view's own fence,
in order and without a hole, whatever offsets Faust resumed from or re-delivered), hands
them to the ingestor, and keeps going whatever the records hold: a bad record is
dead-lettered by the ingestor; a view that cannot be written (Redis down) is retried with
backoff, holding the batch until it can. Faust's committed offsets only say where fetching
starts; what has been applied is the view's fence. Per-node stream state and block data
live only in the view (written in one atomic step with each record's position); the
agents keep no tables.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import faust

from schemas import DeadLetter, encode, headers
from schemas.errors import ViewRefused, ViewStoreError
from state.view import RebuildingView, ViewStore
from streams.app import EmbeddedApp, make_app
from streams.batches import take_batches
from streams.config import WorkerConfig
from streams.generation import GenerationWatcher
from streams.ingest import BatchResult, IngestMetrics, Ingestor, RawRecord
from streams.resume import ResumeGuard, TopicLane, TopicLanes
from streams.topics import Topic, topics

log = logging.getLogger(__name__)

BATCH_MAX = 2000
BATCH_WITHIN_S = 0.002
"""A batch closes this long after its first record (or at BATCH_MAX). A fetch's records reach the
agent together, and while a batch is written the next one fills, so under load batches are as
large with 2 ms as with 10; at a light rate a longer window only held each record back: 10 -> 2 ms
took `bench ingest`'s staleness p50 / p99 from ~19 / ~26 ms to ~11.5 / ~17 ms at the same rate."""
HEARTBEAT_BATCH_WITHIN_S = BATCH_WITHIN_S
"""Heartbeats close their batch as soon as kv-events do. A longer window (250 ms was tried) saves
a fence read and a view write per heartbeat only when many nodes beat within it, about 1 % of a
core at 16 nodes beating once a second, and it made every heartbeat's load a quarter second
older: `bench ingest`'s staleness p99 went from ~30 ms to ~260 ms."""
COMPACT_EVERY_S = 60.0
GENERATION_EVERY_S = 0.5
"""How often each worker's generation watcher ticks (a tick with nothing new reads nothing)."""
GENERATION_CHECK_EVERY_S = 2.0
"""How often it reads the view's generation, fences and the partitions left to rebuild when
nothing new happened (:class:`streams.generation.GenerationWatcher`)."""


@dataclass
class Worker:
    app: faust.App
    ingestor: Ingestor


@runtime_checkable
class _CompactableView(Protocol):
    async def compact(self) -> dict[str, int]: ...


def build_worker(config: WorkerConfig, store: ViewStore, *, metrics: bool = True, **app_overrides: Any) -> Worker:
    """Declare the app, its topics and agents over ``store``."""
    t = topics(config.topics)
    # Heartbeats alone (every second or so per engine) do not keep the embedded consumer's
    # fetches at 10 ms: their staleness counts against the liveness TTL, seconds (streams/app.py).
    app = make_app(config, quiet_topics=frozenset({t.heartbeats.name}), **app_overrides)

    def raw_topic(topic: Topic) -> faust.TopicT:
        return app.topic(topic.name, partitions=topic.partitions, value_serializer="raw", key_serializer="raw")

    dl_topic = raw_topic(t.dead_letter)

    async def send_dead_letter(dl: DeadLetter) -> None:
        env = ingestor.dead_letter_envelope(dl)
        await dl_topic.send(key=dl.source_topic.encode(), value=encode(env), headers=headers(env))

    ingestor = Ingestor(
        t,
        store,
        dead_letter=send_dead_letter,
        metrics=IngestMetrics(lambda: ingestor.live_nodes(config.heartbeat_ttl_s)) if metrics else None,
    )
    view = store if isinstance(store, RebuildingView) else None
    all_parts = [f"{tp.name}:{p}" for tp in (t.kv_events, t.heartbeats) for p in range(tp.partitions)]
    lanes = TopicLanes(config.kafka, store.watermark, view, all_parts, metrics=metrics)

    # Two functions, not one: Faust names an agent after its function.
    def folded() -> None:  # the embedded consumer is not idle while its records are being folded
        if isinstance(app, EmbeddedApp):
            app.folded_at = time.monotonic()

    async def kv_events(stream: faust.StreamT[Any]) -> None:
        await consume(stream, ingestor, lanes, t.kv_events.name, applied=folded)

    async def heartbeats(stream: faust.StreamT[Any]) -> None:
        await consume(stream, ingestor, lanes, t.heartbeats.name, within_s=HEARTBEAT_BATCH_WITHIN_S)

    app.agent(raw_topic(t.kv_events), name="kv-events")(kv_events)
    app.agent(raw_topic(t.heartbeats), name="heartbeats")(heartbeats)

    if view is not None:
        watcher = GenerationWatcher(
            view, (t.kv_events.name, t.heartbeats.name),
            assigned=lambda: [(tp.topic, tp.partition) for tp in app.consumer.assignment()],
            lane=lanes,
            process=functools.partial(process_until_done, ingestor),
            check_every_s=GENERATION_CHECK_EVERY_S,
        )
        app.timer(GENERATION_EVERY_S, name="view-generation")(watcher.tick)
    if isinstance(store, _CompactableView):
        compactable = store

        async def compact() -> None:  # cleared/restarted nodes leave retired slots behind; the leader sweeps them
            await compact_view(compactable)

        app.timer(COMPACT_EVERY_S, on_leader=True, name="compact-view")(compact)
    return Worker(app, ingestor)


async def consume(stream: faust.StreamT[Any], ingestor: Ingestor, lanes: TopicLanes, topic: str, *,
                  within_s: float = BATCH_WITHIN_S, applied: Callable[[], None] | None = None) -> None:
    """An agent's loop: each batch of ``topic``'s records (closed ``within_s`` after its first)
    through its lane to the view. The lane resumes each partition from the view's fence, reading
    back from the log what the consumer skipped (see streams.resume). ``applied``: called after
    each batch."""
    try:
        async for events in take_batches(stream, BATCH_MAX, within_s):
            await apply_batch(ingestor, lanes(topic), [raw_record(e.message) for e in events])
            if applied is not None:
                applied()
    finally:
        await lanes.close(topic)


def raw_record(m: Any) -> RawRecord:
    """A Faust event's message (``faust.types.Message``) as the ingestor takes it."""
    return RawRecord(m.topic, m.partition, m.offset, m.key, m.value, int(m.timestamp * 1000) if m.timestamp else 0)


async def apply_batch(ingestor: Ingestor, lane: TopicLane, batch: list[RawRecord]) -> None:
    """Admit ``batch`` through the lane's guard and apply it; admitted again from the view's fences
    whenever the view refuses a write because it lost writes."""
    while True:
        try:
            async with lane.lock:
                async for part in admit_until_done(lane.guard, batch):
                    await process_until_done(ingestor, part)
            return
        except ViewRefused as e:
            log.warning("%s; checking the batch against the view's fences again", e)
            await asyncio.sleep(0.05)


async def compact_view(store: _CompactableView) -> None:
    """Drop retired slots' holder entries (logged; a failure waits for the next run)."""
    try:
        out = await store.compact()
        if out["slots_freed"]:
            log.info("view compaction: %s", out)
    except ViewStoreError as e:
        log.error("view compaction failed (will retry): %s", e)


async def admit_until_done(guard: ResumeGuard, batch: list[RawRecord]) -> AsyncIterator[list[RawRecord]]:
    """``guard.admit(batch)``, started again while the view or the log cannot be read (a part
    already applied is then dropped by the fence the second time round)."""
    delay = 0.1
    while True:
        try:
            async for part in guard.admit(batch):
                yield part
            return
        except Exception as e:  # noqa: BLE001 (the view or the log unreachable, whatever it raised: hold the batch)
            log.error("could not check the batch against the view's fences, retrying in %.1fs: %s", delay, e)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def process_until_done(ingestor: Ingestor, batch: list[RawRecord]) -> None:
    """Apply ``batch``; retry while the view is unreachable; never raise, except
    :class:`ViewRefused` (the view lost writes: the caller admits the batch again).

    An unexpected error is dealt with per record, never per batch: the batch is applied
    again one record at a time, and only a record that fails on its own is dead-lettered
    (``internal_error``) and its fence moved past it."""
    delay = 0.1
    while True:
        try:
            await ingestor.process(batch)
            return
        except ViewRefused:
            raise
        except ViewStoreError as e:
            log.error("view write failed, retrying in %.1fs: %s", delay, e)
        except Exception as e:  # a bug must not kill the worker nor take the batch's good records with it
            if len(batch) > 1:
                log.exception("batch of %d records failed; applying it one record at a time", len(batch))
                for rec in batch:
                    await process_until_done(ingestor, [rec])
                return
            rec = batch[0]
            log.exception("record %s:%d@%d failed; dead-lettering it", rec.topic, rec.partition, rec.offset)
            try:
                await ingestor._dead(_empty_result(), rec, "internal_error", f"{type(e).__name__}: {e}")
            except Exception:
                log.exception("could not dead-letter %s:%d@%d (counted, logged)", rec.topic, rec.partition, rec.offset)
            # Dealt with: move the fence past it, so that a consumer resuming from it does not send it round again.
            try:
                await ingestor.store.apply_groups([(rec.position, ())])
            except ViewRefused:
                raise
            except Exception:
                log.exception("could not move the fence past %s:%d@%d", rec.topic, rec.partition, rec.offset)
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


def _empty_result() -> Any:

    return BatchResult()
