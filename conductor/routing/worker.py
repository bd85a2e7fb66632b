"""The routing worker: ``requests`` (one consumer group) → :class:`~conductor.routing.router.Router`
→ ``dispatch`` (and the waiting gateway's reply topic).

A record that does not decode or validate is dead-lettered and, when its key names a request
id, answered with an ``invalid_request`` rejection under that id; the worker goes on.

Delivery is at least once: offsets are committed after the batch's decisions are
acknowledged by the broker, so a crash may decide a request twice (the same seed,
possibly a newer view); dispatchers drop a second decision for a request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry import metrics

from conductor.errors import ViewStoreError
from conductor.routing.control_follow import ControlFollower
from conductor.routing.ordered import Turns
from conductor.routing.router import DECIDED, Router, Unreadable
from conductor.routing.stores import default_router_id
from conductor.settings import Settings
from schemas import Envelope, decided_by, envelope
from state.decisions import DecisionIndex, DecisionPosition
from streams.dead_letters import DeadLetters
from streams.follow import Earliest, Follower, OnBad, Record
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import Encoded, topics

log = logging.getLogger(__name__)


class RouterWorker:
    """Consumes ``requests`` in a consumer group and produces onto ``dispatch``."""

    GROUP = "conductor-router"

    def __init__(self, settings: Settings, router: Router, *, router_id: str | None = None,
                 decisions: DecisionIndex | None = None) -> None:

        self.settings = settings
        self.router = router
        self.decisions = decisions
        """Where each decision landed on dispatch, for `explain` (written after the broker's ack,
        in the background; None: not kept, explain scans)."""
        self._indexing: asyncio.Task[None] | None = None
        self.topics = topics(settings.topic_config())
        self.router_id = router_id or default_router_id()
        self._seq = 0
        self._turns = Turns()
        self.routed = 0
        self.lag: dict[int, int] = {}  # requests partition → records not yet routed (the last fetch's view)

        def observe_lag(_: Any) -> list[metrics.Observation]:
            return [metrics.Observation(v, {"partition": str(p)}) for p, v in self.lag.items()]

        metrics.get_meter(__name__).create_observable_gauge(
            "conductor_router_consumer_lag", callbacks=[observe_lag],
            description="requests not yet routed by this router, per partition")

    def _wrap(self, body: Any) -> Envelope:
        self._seq += 1
        return envelope(body, producer_id=self.router_id, producer_seq=self._seq, ts_ms=int(time.time() * 1000))

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Route until ``stop``: each fetched batch decided in offset order, its answers
        acknowledged by the broker, then its offsets committed. ``ready`` is set once the
        control topic is caught up and the consumer started."""
        t, s = self.topics, self.settings
        await ensure_topics(s.kafka(), (t.requests, t.dispatch, t.dead_letter, t.control))
        prod = producer(s.kafka(), linger_ms=0)  # a waiting gateway's reply goes out at once
        letters = DeadLetters(s.kafka(), t.dead_letter, self.router_id, producer=prod, wrap=self._wrap)
        # The embedded broker answers a fetch only when its wait runs out, new records or not:
        # a short wait keeps a waiting gateway's decision from sitting there (Kafka returns early).
        requests = Follower(s.kafka(), [(t.requests, Earliest())], on_bad=OnBad.DEAD_LETTER_AND_ANSWER,
                            name=self.router_id, group=s.topic_prefix + self.GROUP, letters=letters,
                            fetch_wait_ms=s.embedded_fetch_wait_ms if s.embedded else None,
                            skip=lambda h: decided_by(h) is not None)  # decided where it arrived: logged already
        control = ControlFollower(s, self.router)
        await prod.start()
        await control.start()  # caught up with every control record before the first decision
        await requests.start()
        await self.router.start()
        try:
            if ready is not None:
                ready.set()
            while not stop.is_set():
                await control.poll()
                batches = await requests.fetch()
                if not batches:
                    continue
                sends: list[Any] = []
                placed: list[tuple[int, Envelope, Any, int, int]] = []  # (send, env, decision, request position)
                for batch in batches:
                    if batch.highwater is not None and batch.records:
                        self.lag[batch.partition] = max(0, batch.highwater - batch.records[-1].offset - 1)
                    handled = await self._decide(batch.records)
                    # Metadata of every reply topic first, before this batch's first send: a new
                    # topic's metadata fetch that ran while a dispatch batch waited in the producer was
                    # seen to strand that batch (its delivery never came, the loop stalled for good).
                    for gateway in {r for _, _, r in handled if r}:
                        with contextlib.suppress(ValueError):
                            await prod.partitions_for(t.replies(gateway).name)
                    for rec, (key, out, reply_to) in zip(batch.records, handled):
                        if out is DECIDED:
                            continue
                        if isinstance(out, Unreadable):
                            sends.append(await requests.dead_letter(rec, out.error))
                            if out.rejection is None:
                                continue
                            out = out.rejection
                        env = self._wrap(out)
                        wire = Encoded.of(env)
                        placed.append((len(sends), env, out, rec.partition, rec.offset))
                        sends.append(await t.dispatch.send(prod, wire, key))
                        if reply_to:
                            # The waiting gateway reads only its own topic; dispatch stays the audit log.
                            try:
                                reply = t.replies(reply_to)
                            except ValueError as e:
                                log.warning("request %s: no reply sent: %s", out.request_id, e)
                            else:
                                sends.append(await reply.send(prod, wire, out.request_id))
                        self.routed += 1
                await acknowledged(prod, sends, warn_after_s=10.0, what="dispatch record(s)")
                await self._index(sends, placed)
                await requests.commit()
        finally:
            if self._indexing is not None:
                with contextlib.suppress(Exception):
                    await self._indexing
            await self.router.close()
            await requests.stop()
            await control.stop()
            await prod.stop()

    async def _decide(self, records: Sequence[Record]) -> list[tuple[str, Any, str | None]]:
        """Each record handled by the router, up to ``router_concurrency`` view reads in flight at
        once; the decisions still happen one after another in offset order (each waits for the one
        before it between its read and its decision, :class:`~conductor.routing.ordered.Turns`), so
        each sees the reservations of those before it, and dispatch's order is the order they were
        made in."""
        n = self.settings.router_concurrency
        handled: list[tuple[str, Any, str | None]] = []
        for i in range(0, len(records), n):
            handled += await asyncio.gather(*(
                self._turns.take(functools.partial(self.router.handle_with_reply, r.value, r.key, r.offset))
                for r in records[i : i + n]))
        return handled

    async def _index(self, sends: Sequence[Any], placed: Sequence[tuple[int, Envelope, Any, int, int]]) -> None:
        """Hand the batch's dispatch positions to the decision index, in the background; a
        batch waits only if the one before it is still being written (Redis slower than routing)."""
        if self.decisions is None or not placed:
            return
        positions = []
        for i, env, out, req_partition, req_offset in placed:
            md = sends[i].result()
            positions.append(DecisionPosition(out.request_id, md.partition, md.offset, env.ts_ms, req_partition,
                                              req_offset))
        if self._indexing is not None and not self._indexing.done():
            await asyncio.wait([self._indexing])
        self._indexing = asyncio.create_task(self._write_index(self.decisions, positions))

    @staticmethod
    async def _write_index(index: DecisionIndex, positions: list[DecisionPosition]) -> None:
        try:
            await index.record(positions)
        except ViewStoreError as e:  # explain falls back to a scan for these
            log.warning("%s", e)
