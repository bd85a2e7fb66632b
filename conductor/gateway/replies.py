"""A gateway's inbox: the decisions of the requests it sent, read from its own reply topic.

Routers write every decision to ``dispatch`` (the audit log) and, when the request names
a ``reply_to`` gateway, to that gateway's reply topic as well (``Topics.replies``). The
gateway reads only that one-partition topic, so it never decodes anybody else's
decisions, however many gateways and routers run. A reply nobody waits for (a request
that timed out, a second decision after a router crash) is dropped.

:meth:`ReplyInbox.problem` says why the inbox cannot answer (not started, its task ended, its
consumer lost the partition, it stopped polling): the gateway's ``/health`` answers 503 with
that reason, and requests get 503 ``reply_inbox_down`` at once instead of a decision timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from conductor.settings import Settings
from schemas import DecodeError, Envelope, RoutingDecision, RoutingRejection
from streams.follow import Follower, OnBad, Since
from streams.kafka import ensure_topics
from streams.topics import topics

log = logging.getLogger(__name__)

Answer = RoutingDecision | RoutingRejection

STALL_S = 30.0
"""An inbox that has not come back to poll its consumer for this long is not reading (a poll
returns within 100 ms, records or not)."""


class InboxClosed(RuntimeError):
    """The inbox stopped: the decision a request waits for will never be read."""


class ReplyInbox:
    """Futures by request id, resolved from the gateway's reply topic."""

    def __init__(self, settings: Settings, gateway_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.topic = topics(settings.topic_config()).replies(gateway_id)
        self._waiting: dict[str, asyncio.Future[Answer]] = {}
        self.counts: Counter[str] = Counter()
        self._ready = asyncio.Event()
        self.clock = clock
        self._polled_at = clock()
        self._ended: str | None = None
        self._assigned: Callable[[], bool] = lambda: True
        self.task: asyncio.Task[Any] | None = None
        """The task running :meth:`run` (set by it)."""

    def expect(self, request_id: str) -> asyncio.Future[Answer]:
        """A future for ``request_id``'s answer; register it *before* sending the request."""
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        if self._ended is not None:
            fut.set_exception(InboxClosed(self._ended))
            return fut
        self._waiting[request_id] = fut
        return fut

    def waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def on_record(self, value: bytes) -> DecodeError | None:
        """Answer the request ``value`` decides; a record that is no decision comes back as the
        error to dead-letter it with."""
        try:
            env = self.topic.decode(value)
        except DecodeError as e:
            self.counts[f"bad_record:{e.reason}"] += 1
            log.warning("skipping a bad reply record: %s", e)
            return e
        return self.on_envelope(env)

    def on_envelope(self, env: Envelope) -> DecodeError | None:
        """:meth:`on_record` for a record decoded already."""
        body = env.body
        if not isinstance(body, (RoutingDecision, RoutingRejection)):
            self.counts["wrong_kind"] += 1
            return DecodeError("wrong_kind", f"a {body.kind} record on a reply topic")
        fut = self._waiting.pop(body.request_id, None)
        if fut is None or fut.done():
            self.counts["unclaimed"] += 1
            return None
        fut.set_result(body)
        self.counts["answered"] += 1
        return None

    @property
    def ready(self) -> bool:
        """Reading the reply topic (requests sent from now on get their answers)."""
        return self._ready.is_set()

    def problem(self) -> str | None:
        """Why decisions cannot be read now, or None while the inbox reads its topic."""
        if self._ended is not None:
            return self._ended
        if not self.ready:
            return "not reading its reply topic yet"
        if self.task is not None and self.task.done():
            return "the reply inbox's task ended"
        if not self._assigned():
            return f"the reply consumer holds no assignment of {self.topic.name}"
        stalled = self.clock() - self._polled_at
        if stalled > STALL_S:
            return f"the reply inbox has not polled its topic for {stalled:.0f}s"
        return None

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Create the reply topic, read it from now on, resolve futures until ``stop``. However it
        ends, :meth:`problem` says so from then on and every waiting request gets :class:`InboxClosed`."""
        self.task = asyncio.current_task()
        reason = "the reply inbox stopped"
        try:
            await self._read(stop)
        except asyncio.CancelledError:
            reason = "the reply inbox's task was cancelled"
            raise
        except Exception as e:
            reason = f"the reply inbox failed: {type(e).__name__}: {e}"
            log.error("%s; the gateway answers 503 until it is restarted", reason)
            raise
        finally:
            self._ended = reason
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(InboxClosed(reason))
                    fut.exception()  # retrieved here too: a request that gave up meanwhile leaves no warning

    async def _read(self, stop: asyncio.Event) -> None:
        await ensure_topics(self.settings.kafka(), (self.topic,))
        # A short fetch wait: an idle gateway's first decision must not sit in the broker.
        wait_ms = self.settings.embedded_fetch_wait_ms if self.settings.embedded else 5
        # This gateway is its topic's one reader: it sets a bad record aside (on a producer of its own).
        follower = Follower(self.settings.kafka(), [(self.topic, Since(int(time.time() * 1000) - 1000))],
                            on_bad=OnBad.DEAD_LETTER, name=f"inbox-{self.topic.name}",
                            dead_letter=topics(self.settings.topic_config()).dead_letter, fetch_wait_ms=wait_ms,
                            poll_ms=100, max_records=1000, counts=self.counts)
        try:
            await follower.start()
            self._assigned = follower.assigned
            self._polled_at = self.clock()
            self._ready.set()
            while not stop.is_set():
                batches = await follower.fetch()
                self._polled_at = self.clock()
                for batch in batches:
                    for rec in batch.records:
                        assert rec.env is not None  # (DEAD_LETTER: only what decodes comes through)
                        bad = self.on_envelope(rec.env)
                        if bad is not None:
                            await follower.dead_letter(rec, bad)
        finally:
            with contextlib.suppress(Exception):
                await follower.stop()
