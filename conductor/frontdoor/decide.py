"""Who decides for a front door: a router in this process (the default) or the routers through the log.

Both write the routing request and its decision to the log before the door answers, so
``dispatch`` stays the record of every decision and ``conductor explain`` re-derives it; they
differ in where :meth:`~conductor.routing.router.Router.route` runs:

- ``colocated`` (:class:`Colocated` over :class:`conductor.routing.local.LocalRouter`): in this
  process, reading the view and sharing reservations through Redis, the request and the decision
  sent with the broker's acknowledgement (the request marked ``decided_by``: routers skip it);
- ``log`` (:class:`LogDecider`): the request goes onto ``requests`` with ``reply_to`` = the door's
  id and a router's decision comes back on the door's reply topic
  (:class:`~conductor.gateway.replies.ReplyInbox`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from conductor.gateway.replies import InboxClosed, ReplyInbox
from conductor.routing.local import LocalRouter, LogUnavailable
from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRejection, RoutingRequest, encode, envelope, headers
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

Routing = Literal["colocated", "log"]
ROUTINGS: tuple[Routing, ...] = ("colocated", "log")
Answer = RoutingDecision | RoutingRejection


@dataclass(frozen=True)
class Down:
    """Why a door can decide nothing now: its error ``code`` and ``message``."""

    code: str
    """``starting`` (not ready yet), ``router_down`` or ``reply_inbox_down``."""
    message: str


class Decider(Protocol):
    """Decides one routing request and records it in the log."""

    @property
    def late(self) -> str:
        """What a decision that did not come in time suggests (said in the 503)."""
        ...

    async def start(self) -> None: ...

    async def decide(self, req: RoutingRequest) -> Answer:
        """The decision or the rejection, on the log; :class:`TimeoutError` when none came in time,
        :class:`LogUnavailable` when the broker did not take it, :class:`InboxClosed` when the
        door can no longer read its decisions."""
        ...

    def problem(self) -> str | None:
        """Why no decision can be made now (None: healthy)."""
        ...

    def down(self, door: str) -> Down | None:
        """:meth:`problem` as ``door`` (``gateway``, ``picker``) answers it; None: healthy."""
        ...

    def waiting(self, request_id: str) -> bool:
        """Whether ``request_id`` is being decided now (a door picks another id for a new request)."""
        ...

    async def close(self) -> None: ...


class Colocated:
    """The colocated router (:class:`~conductor.routing.local.LocalRouter`) as a :class:`Decider`."""

    late = "(is the broker taking records?)"

    def __init__(self, router: LocalRouter) -> None:
        self.router = router

    async def start(self) -> None:
        await self.router.start()

    async def decide(self, req: RoutingRequest) -> Answer:
        return await self.router.decide(req)

    def problem(self) -> str | None:
        return self.router.problem()

    def down(self, door: str) -> Down | None:
        why = self.router.problem()
        if why is None:
            return None
        return Down("starting" if not self.router.ready else "router_down", why)

    def waiting(self, request_id: str) -> bool:
        return self.router.waiting(request_id)

    async def close(self) -> None:
        await self.router.close()


class LogDecider:
    """Through the log: ``requests`` → a router → the door's reply topic.

    ``producer``: a started producer to send with (the door's own; left open at :meth:`close`),
    else one of its own; ``seq``: the door's producer sequence on the log, else its own."""

    late = "(are the routers running?)"

    def __init__(self, settings: Settings, *, producer_id: str, timeout_s: float = 5.0, producer: Any = None,
                 seq: Iterator[int] | None = None) -> None:
        self.settings = settings
        self.producer_id = producer_id
        self.timeout_s = timeout_s
        self.topics = topics(settings.topic_config())
        self.inbox = ReplyInbox(settings, producer_id)
        self._prod: Any = producer
        self._own_producer = producer is None
        self._seq = seq if seq is not None else itertools.count(1)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        t = self.topics
        await ensure_topics(self.settings.kafka(), (t.requests, t.dispatch))
        if self._own_producer:
            self._prod = producer(self.settings.kafka(), linger_ms=0)
            await self._prod.start()
        self._task = asyncio.create_task(self.inbox.run(self._stop))
        await asyncio.wait_for(asyncio.shield(self.inbox.wait_ready(60)), 60)

    def problem(self) -> str | None:
        return self.inbox.problem()

    def down(self, door: str) -> Down | None:
        why = self.inbox.problem()
        if why is None:
            return None
        return Down("starting" if not self.inbox.ready else "reply_inbox_down",
                    f"the {door} cannot read its decisions: {why}")

    def waiting(self, request_id: str) -> bool:
        return self.inbox.waiting(request_id)

    async def decide(self, req: RoutingRequest) -> Answer:
        rid = req.request_id
        req = req.model_copy(update={"reply_to": self.producer_id})
        fut = self.inbox.expect(rid)
        env = envelope(req, producer_id=self.producer_id, producer_seq=next(self._seq),
                       ts_ms=time.time_ns() // 1_000_000)

        async def ask() -> Answer:
            delivery = await self._prod.send(self.topics.requests.name, encode(env), key=rid.encode(),
                                             headers=headers(env))
            asyncio.ensure_future(self._watch_delivery(delivery, rid))
            return await fut

        try:
            # The send is inside the timeout too: a producer that cannot take the record never hangs a client.
            return await asyncio.wait_for(ask(), self.timeout_s)
        finally:
            self.inbox.forget(rid)

    async def _watch_delivery(self, delivery: asyncio.Future[Any], rid: str) -> None:
        """The routing request's acknowledgement (``streams.kafka.acknowledged``, warning after 1 s);
        a send that failed is logged: the decision timeout answers the client."""
        try:
            await acknowledged(self._prod, [delivery], warn_after_s=1.0, what=f"routing request {rid}")
        except Exception as e:  # noqa: BLE001 - the decision timeout answers the client
            log.warning("routing request %s not published: %s", rid, e)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5)
        if self._own_producer and self._prod is not None:
            await self._prod.stop()


def make_decider(settings: Settings, mode: Routing, *, producer_id: str, timeout_s: float, producer: Any = None,
                 seq: Iterator[int] | None = None) -> Decider:
    """The decider of ``mode``; ``timeout_s`` bounds a log-mode round trip and a colocated decision's
    wait for the broker's acknowledgement. ``producer``, ``seq``: the door's own, for log mode
    (:class:`LogDecider`)."""
    if mode == "log":
        return LogDecider(settings, producer_id=producer_id, timeout_s=timeout_s, producer=producer, seq=seq)
    return Colocated(LocalRouter(settings, producer_id=producer_id, ack_timeout_s=timeout_s))


def parse_routing(text: str) -> Routing | None:
    """``text`` as a routing mode, or None."""
    for mode in ROUTINGS:
        if text == mode:
            return mode
    return None


__all__ = ["ROUTINGS", "Answer", "Colocated", "Decider", "Down", "InboxClosed", "LogDecider", "LogUnavailable",
           "Routing", "make_decider", "parse_routing"]
