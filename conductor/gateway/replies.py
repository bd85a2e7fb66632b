"""A gateway's inbox: the decisions of the requests it sent, read from its own reply topic.

Routers write every decision to ``dispatch`` (the audit log) and, when the request names
a ``reply_to`` gateway, to that gateway's reply topic as well (``Topics.replies``). The
gateway reads only that one-partition topic, so it never decodes anybody else's
decisions, however many gateways and routers run. A reply nobody waits for (a request
that timed out, a second decision after a router crash) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from conductor.settings import Settings
from schemas import DecodeError, RoutingDecision, RoutingRejection, decode
from streams.kafka import consumer, ensure_topics
from streams.topics import topics

log = logging.getLogger(__name__)

Answer = RoutingDecision | RoutingRejection


class ReplyInbox:
    """Futures by request id, resolved from the gateway's reply topic."""

    def __init__(self, settings: Settings, gateway_id: str) -> None:
        self.settings = settings
        self.topic = topics(settings.topic_config()).replies(gateway_id)
        self._waiting: dict[str, asyncio.Future[Answer]] = {}
        self.counts: Counter[str] = Counter()
        self._ready = asyncio.Event()

    def expect(self, request_id: str) -> asyncio.Future[Answer]:
        """A future for ``request_id``'s answer; register it *before* sending the request."""
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        return fut

    def waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def on_record(self, value: bytes) -> None:
        try:
            body = decode(value).body
        except DecodeError as e:
            self.counts[f"bad_record:{e.reason}"] += 1
            log.warning("skipping a bad reply record: %s", e)
            return
        if not isinstance(body, (RoutingDecision, RoutingRejection)):
            self.counts["wrong_kind"] += 1
            return
        fut = self._waiting.pop(body.request_id, None)
        if fut is None or fut.done():
            self.counts["unclaimed"] += 1
            return
        fut.set_result(body)
        self.counts["answered"] += 1

    @property
    def ready(self) -> bool:
        """Reading the reply topic (requests sent from now on get their answers)."""
        return self._ready.is_set()

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Create the reply topic, read it from now on, resolve futures until ``stop``."""

        await ensure_topics(self.settings.kafka(), (self.topic,))
        # A short fetch wait: an idle gateway's first decision must not sit in the broker.
        wait_ms = self.settings.embedded_fetch_wait_ms if self.settings.embedded else 5
        cons = consumer(self.settings.kafka(), group_id=None, fetch_max_wait_ms=wait_ms)
        await cons.start()
        try:
            tp = TopicPartition(self.topic.name, 0)
            cons.assign([tp])
            since = int(time.time() * 1000) - 1000
            found = {}
            try:
                found = await cons.offsets_for_times({tp: since})
            except KafkaError as e:  # a broker without timestamp lookups: read from the start
                log.info("offsets by time unavailable (%s); reading the reply topic from its start", e)
            hit = found.get(tp)
            if hit is not None:
                cons.seek(tp, hit.offset)
            elif self.settings.profile == "production":
                await cons.seek_to_end(tp)
            else:
                await cons.seek_to_beginning(tp)  # the embedded broker's "latest" is wrong
            self._ready.set()
            while not stop.is_set():
                batches = await cons.getmany(timeout_ms=100, max_records=1000)
                for records in batches.values():
                    for rec in records:
                        self.on_record(rec.value or b"")
        finally:
            for fut in self._waiting.values():
                if not fut.done():
                    fut.cancel()
            await cons.stop()
