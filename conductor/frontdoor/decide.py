"""Who decides for the picker: a router in this process (the default) or the routers through the log.

Both write the routing request and its decision to the log before the picker answers the
proxy, so ``dispatch`` stays the record of every decision and ``conductor explain`` re-derives
it; they differ in where :meth:`~conductor.routing.router.Router.route` runs:

- ``colocated`` (:class:`conductor.routing.local.LocalRouter`): in this process, reading the view and
  sharing reservations through Redis, the request and the decision sent with the broker's
  acknowledgement (the request marked ``decided_by``: routers skip it);
- ``log`` (:class:`LogDecider`): the request goes onto ``requests`` with ``reply_to`` = the
  picker's id and a router's decision comes back on the picker's reply topic, as the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Literal, Protocol

from conductor.gateway.replies import InboxClosed, ReplyInbox
from conductor.routing.local import LocalRouter
from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRejection, RoutingRequest, encode, envelope, headers
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

Routing = Literal["colocated", "log"]
ROUTINGS: tuple[Routing, ...] = ("colocated", "log")


class Decider(Protocol):
    """Decides one routing request and records it in the log."""

    async def start(self) -> None: ...

    async def decide(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        """The decision or the rejection; :class:`TimeoutError` when none came in time."""
        ...

    def problem(self) -> str | None:
        """Why no decision can be made now (None: healthy)."""
        ...

    async def close(self) -> None: ...


class LogDecider:
    """Through the log: ``requests`` → a router → the picker's reply topic (as the gateway routes)."""

    def __init__(self, settings: Settings, *, producer_id: str, timeout_s: float = 5.0) -> None:
        self.settings = settings
        self.producer_id = producer_id
        self.timeout_s = timeout_s
        self.topics = topics(settings.topic_config())
        self.inbox = ReplyInbox(settings, producer_id)
        self._prod: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = 0

    async def start(self) -> None:
        t = self.topics
        await ensure_topics(self.settings.kafka(), (t.requests, t.dispatch))
        self._prod = producer(self.settings.kafka(), linger_ms=0)
        await self._prod.start()
        self._task = asyncio.create_task(self.inbox.run(self._stop))
        await asyncio.wait_for(asyncio.shield(self.inbox.wait_ready(60)), 60)

    def problem(self) -> str | None:
        return self.inbox.problem()

    async def decide(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        rid = req.request_id
        req = req.model_copy(update={"reply_to": self.producer_id})
        fut = self.inbox.expect(rid)
        self._seq += 1
        env = envelope(req, producer_id=self.producer_id, producer_seq=self._seq, ts_ms=time.time_ns() // 1_000_000)

        async def ask() -> RoutingDecision | RoutingRejection:
            sent = await self._prod.send(self.topics.requests.name, encode(env), key=rid.encode(), headers=headers(env))
            await acknowledged(self._prod, [sent], warn_after_s=1.0, what=f"routing request {rid}")
            return await fut

        try:
            # The send is inside the timeout too: a producer that cannot take the record never hangs the proxy.
            return await asyncio.wait_for(ask(), self.timeout_s)
        finally:
            self.inbox.forget(rid)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5)
        if self._prod is not None:
            await self._prod.stop()


def make_decider(settings: Settings, mode: Routing, *, producer_id: str, timeout_s: float) -> Decider:
    """The decider of ``mode``; ``timeout_s`` bounds a log-mode round trip and a local decision's
    wait for the broker's acknowledgement."""
    if mode == "log":
        return LogDecider(settings, producer_id=producer_id, timeout_s=timeout_s)
    return LocalRouter(settings, producer_id=producer_id, ack_timeout_s=timeout_s)


__all__ = ["ROUTINGS", "Decider", "InboxClosed", "LogDecider", "Routing", "make_decider"]
