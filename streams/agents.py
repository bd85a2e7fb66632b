"""The stream worker's agents: ``kv-events`` and ``heartbeats`` → :class:`streams.ingest.Ingestor`.

Each agent takes batches (``stream.take_events``), passes them through a
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
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import faust

from schemas import DeadLetter, encode, headers
from schemas.errors import ViewRefused, ViewStoreError
from streams.app import make_app
from streams.ingest import BatchResult, IngestMetrics, Ingestor, RawRecord
from streams.resume import LogReader, ResumeGuard
from streams.topics import topics

log = logging.getLogger(__name__)

BATCH_MAX = 2000
BATCH_WITHIN_S = 0.01
COMPACT_EVERY_S = 60.0
GENERATION_EVERY_S = 0.5
"""How often each worker checks the view's generation and the partitions left to rebuild."""


@dataclass
class Worker:
    app: faust.App
    ingestor: Ingestor


def build_worker(settings: Any, store: Any, *, metrics: bool = True, **app_overrides: Any) -> Worker:
    """Declare the app, its topics and agents over ``store`` (a ViewStore)."""
    app = make_app(settings, **app_overrides)
    t = topics(settings)
    kv_topic = app.topic(t.kv_events.name, partitions=t.kv_events.partitions, value_serializer="raw", key_serializer="raw")
    hb_topic = app.topic(t.heartbeats.name, partitions=t.heartbeats.partitions, value_serializer="raw", key_serializer="raw")
    dl_topic = app.topic(t.dead_letter.name, partitions=t.dead_letter.partitions, value_serializer="raw", key_serializer="raw")

    async def send_dead_letter(dl: DeadLetter) -> None:
        env = ingestor.dead_letter_envelope(dl)
        await dl_topic.send(key=dl.source_topic.encode(), value=encode(env), headers=headers(env))

    ingestor = Ingestor(
        t,
        store,
        dead_letter=send_dead_letter,
        metrics=IngestMetrics(lambda: ingestor.live_nodes(settings.heartbeat_ttl_s)) if metrics else None,
    )

    # One guard, log reader and lock per topic: the agent's batches and the generation
    # watcher's catch-up of the same partitions never interleave.
    all_parts = [f"{tp.name}:{p}" for tp in (t.kv_events, t.heartbeats) for p in range(tp.partitions)]
    guards: dict[str, tuple[ResumeGuard, LogReader, asyncio.Lock]] = {}

    def guard_of(topic: str) -> tuple[ResumeGuard, LogReader, asyncio.Lock]:
        if topic not in guards:
            reader = LogReader(settings)
            guard = ResumeGuard(store.watermark, reader.fetch_range, metrics=metrics, view=store)
            guard.all_partitions = all_parts
            guards[topic] = (guard, reader, asyncio.Lock())
        return guards[topic]

    async def apply_batch(topic: str, batch: list[RawRecord]) -> None:
        guard, _, lock = guard_of(topic)
        while True:
            try:
                async with lock:
                    async for part in admit_until_done(guard, batch):
                        await process_until_done(ingestor, part)
                return
            except ViewRefused as e:  # the view lost writes: admit again from its fences
                log.warning("%s; checking the batch against the view's fences again", e)
                await asyncio.sleep(0.05)

    async def consume(topic: str, stream: Any) -> None:
        # Each agent resumes its own topic's partitions from the view's fences, reading
        # back from the log what the consumer skipped (see streams.resume).
        try:
            async for events in stream.take_events(BATCH_MAX, within=BATCH_WITHIN_S):
                batch = [
                    RawRecord(e.message.topic, e.message.partition, e.message.offset, e.message.key, e.message.value,
                              int(e.message.timestamp * 1000) if e.message.timestamp else 0)
                    for e in events
                ]
                await apply_batch(topic, batch)
        finally:
            if topic in guards:
                await guards.pop(topic)[1].close()

    # The highest fence seen per partition under one generation. Fences never move back under
    # the same generation, unless the view lost its last writes: a replica promoted while it
    # lagged its primary, or a restore of an older copy. Then the partition is read back too.
    seen: dict[str, Any] = {"gen": None, "high": {}}

    async def watch_generation() -> None:
        """A lost or replaced view is rebuilt at once, traffic or not: every assigned partition
        is read from the log up to its end, and ``ns|rebuild`` tells routers when it is done.
        So is a view whose fences moved back (it lost its last writes, same generation)."""
        if not hasattr(store, "fences"):
            return
        try:
            gen, wm = await store.fences()
            pending = await store.rebuild_pending()
            assigned = [(tp.topic, tp.partition) for tp in app.consumer.assignment()]
        except Exception as e:  # Redis down or not assigned yet: the next tick tries again
            log.debug("generation check skipped: %s", e)
            return
        mine = [tp for tp in assigned if f"{tp[0]}:{tp[1]}" in pending]
        if seen["gen"] != gen:
            seen["gen"], seen["high"] = gen, {}
        high = seen["high"]
        rolled_back = {k: (high[k], v) for k, v in wm.items() if v < high.get(k, -1)}
        rolled_back.update({k: (h, -1) for k, h in high.items() if k not in wm})
        seen["high"] = dict(wm)
        if rolled_back:
            log.warning(
                "the view's fences moved back (%s): it lost its last writes (a lagging replica promoted?); "
                "reading those partitions back from the log",
                ", ".join(f"{k} {was} -> {now}" for k, (was, now) in sorted(rolled_back.items())),
            )
        if gen is not None and gen == store.generation and not mine and not rolled_back:
            return
        for name in (t.kv_events.name, t.heartbeats.name):
            tps = [tp for tp in assigned if tp[0] == name]
            if not tps:
                continue
            guard, reader, lock = guard_of(name)
            try:
                async with lock:
                    await guard.fences()  # adopts the new generation (marking all partitions rebuilding)
                    gen_now = store.generation
                    ends = await reader.end_offsets(tps)
                    await store.mark_rebuilding({f"{a}:{b}": e for (a, b), e in ends.items()}, gen_now)
                    async for part in guard.catch_up(tps, ends):
                        await process_until_done(ingestor, part)
                    await store.mark_rebuilding({f"{a}:{b}": e for (a, b), e in ends.items()}, gen_now)
            except ViewRefused as e:
                log.warning("rebuild of %s interrupted (%s); trying again", name, e)
            except Exception as e:
                log.error("rebuild of %s failed, will retry: %s", name, e)

    app.timer(GENERATION_EVERY_S, name="view-generation")(watch_generation)

    # Two functions, not one: Faust names an agent after its function.
    async def kv_events(stream: Any) -> None:
        await consume(t.kv_events.name, stream)

    async def heartbeats(stream: Any) -> None:
        await consume(t.heartbeats.name, stream)

    app.agent(kv_topic, name="kv-events")(kv_events)
    app.agent(hb_topic, name="heartbeats")(heartbeats)

    if hasattr(store, "compact"):
        # Cleared/restarted nodes leave retired slots behind; the leader sweeps them.
        async def compact_view() -> None:
            try:
                out = await store.compact()
                if out["slots_freed"]:
                    log.info("view compaction: %s", out)
            except ViewStoreError as e:
                log.error("view compaction failed (will retry): %s", e)

        app.timer(COMPACT_EVERY_S, on_leader=True, name="compact-view")(compact_view)
    return Worker(app, ingestor)


async def admit_until_done(guard: ResumeGuard, batch: list[RawRecord]) -> AsyncIterator[list[RawRecord]]:
    """``guard.admit(batch)``, started again while the view or the log cannot be read (a part
    already applied is then dropped by the fence the second time round)."""
    delay = 0.1
    while True:
        try:
            async for part in guard.admit(batch):
                yield part
            return
        except Exception as e:  # the view or the log unreachable: hold the batch, try again
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
