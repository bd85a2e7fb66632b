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

Either way the door reports back what only it sees (:meth:`Decider.released`): a decision's
first token (its prefill's in-flight work ends) and its end (the rest; a failure or a cancel
also ends its pending blocks), on the shared decision-time records (``state.shared_log``) every
router reads. Colocated, through :class:`~conductor.routing.local.LocalRouter`; through the log,
written onto the same shared streams by :class:`SharedReleases` (the view's Redis), the time on
the view's clock counted from the decision's ``view_now_ms`` and its arrival at the door.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from conductor.frontdoor.protocol import ReleaseMark
from conductor.gateway.replies import InboxClosed, ReplyInbox
from conductor.routing.local import LocalRouter, LogUnavailable
from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRejection, RoutingRequest, encode, envelope, headers
from state.connect import open_client
from state.inflight import Finished, FirstToken
from state.inflight import encode_op as encode_inflight
from state.keys import ViewKeys
from state.pending import Released
from state.pending import encode_op as encode_pending
from state.shared_log import EventSeq, LogGroup, SharedLog
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

Routing = Literal["colocated", "log"]
ROUTINGS: tuple[Routing, ...] = ("colocated", "log")
Answer = RoutingDecision | RoutingRejection
Release = Literal["first_token", "finished"]
"""What a door reports back about a decision: its first token came, or it ended."""


MAX_TRACKED = 100_000
"""Decisions whose arrival a log-mode door remembers for their view-clock times (the oldest
forgotten first: a request that outlives that many later ones is past any lease)."""


@dataclass(frozen=True)
class Down:
    """Why a door can decide nothing now: its error ``code`` and ``message``."""

    code: str
    """``starting`` (not ready yet), ``router_down``, ``reply_inbox_down`` or ``producer_id_in_use``
    (another live process holds this door's id: :mod:`state.claim`)."""
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

    def released(self, decision: RoutingDecision, at: Release, monotonic_s: float,
                 failed: bool = False) -> ReleaseMark | None:
        """``decision``'s first token came (``first_token``: its prefill's in-flight work ends) or it
        ended (``finished``: all of it; ``failed``, an error or a cancel: its pending blocks too) at
        ``monotonic_s`` (``time.monotonic()``), told to the shared decision-time records. Returns
        that time on the view's clock and the release's number on the shared streams (what the
        outcome records and ``explain`` applies), None when the decision was made without those
        records. Called for every attempt; a repeat is harmless."""
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
        claim = self.router.claim
        if claim is not None and claim.problem is not None:
            return Down("producer_id_in_use", claim.problem)
        why = self.router.problem()
        if why is None:
            return None
        return Down("starting" if not self.router.ready else "router_down", why)

    def waiting(self, request_id: str) -> bool:
        return self.router.waiting(request_id)

    def released(self, decision: RoutingDecision, at: Release, monotonic_s: float,
                 failed: bool = False) -> ReleaseMark | None:
        if decision.view_now_ms is None:
            return None
        view_ms = self.router.view_ms(decision, monotonic_s)  # before on_finish forgets the decision
        if at == "first_token":
            event = self.router.on_first_token(decision, monotonic_s)
        else:
            event = self.router.on_finish(decision, monotonic_s, failed)
        return ReleaseMark(view_ms, self.router.router.decision_time.producer_id if event is not None else None, event)

    async def close(self) -> None:
        await self.router.close()


class SharedReleases:
    """A door's releases written onto the shared pending-block and in-flight streams
    (``ns|pend-log``, ``ns|infl-log``: :mod:`state.shared_log`) without following them: a door
    deciding through the log reads neither, the routers that decided apply what it writes."""

    def __init__(self, settings: Settings, producer_id: str, client: Any = None) -> None:
        if client is None:
            conn = settings.redis()
            client = open_client(conn.connection_url(), decode_responses=False, **conn.tls_options(),
                                 socket_timeout=2.0, socket_connect_timeout=2.0)
        keys = ViewKeys(settings.view_namespace)
        self.events = EventSeq()  # one number per release across both streams
        # Trimmed as the routers trim them (2 x the TTL, 2 x the lease: state.shared_log's readers).
        group = LogGroup(client)  # a failed request's two releases are one append
        self.pending = SharedLog(client, keys.pending, producer_id=producer_id, events=self.events,
                                 retain_ms=2 * max(int(settings.pending_ttl_s * 1000), 1), apply=_unread, group=group)
        self.inflight = SharedLog(client, keys.inflight, producer_id=producer_id, events=self.events,
                                  retain_ms=2 * max(int(settings.inflight_lease_s * 1000), 1), apply=_unread, group=group)

    def first_token(self, request_id: str, at_ms: int) -> int:
        """Share the release of ``request_id``'s prefill work; returns its event number."""
        return self.inflight.append(encode_inflight(FirstToken(request_id, at_ms)), at_ms)

    def finish(self, request_id: str, at_ms: int, failed: bool) -> int:
        """Share the end of ``request_id`` (``failed``: its pending blocks' release too); returns its
        event number."""
        with self.events.event() as event:
            self.inflight.append(encode_inflight(Finished(request_id, at_ms)), at_ms)
            if failed:
                self.pending.append(encode_pending(Released(request_id, at_ms)), at_ms)
        return event

    async def close(self) -> None:
        await self.inflight.close()
        await self.pending.close()


def _unread(_: Any) -> None:
    """A :class:`SharedReleases` stream is never followed."""


class LogDecider:
    """Through the log: ``requests`` → a router → the door's reply topic.

    ``producer``: a started producer to send with (the door's own; left open at :meth:`close`),
    else one of its own; ``seq``: the door's producer sequence on the log, else its own."""

    late = "(are the routers running?)"

    def __init__(self, settings: Settings, *, producer_id: str, timeout_s: float = 5.0, producer: Any = None,
                 seq: Iterator[int] | None = None, sees_answers: bool = True) -> None:
        """``sees_answers``: the door releases its requests' work (the gateway); a door that does
        not (the picker) asks the routers not to charge it (``RoutingRequest.releases``)."""
        self.settings = settings
        self.producer_id = producer_id
        self.sees_answers = sees_answers
        self.timeout_s = timeout_s
        self.topics = topics(settings.topic_config())
        self.inbox = ReplyInbox(settings, producer_id)
        self._prod: Any = producer
        self._own_producer = producer is None
        self._seq = seq if seq is not None else itertools.count(1)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.releases: SharedReleases | None = None
        """Where releases go (None: no Redis configured, the routers' leases end the charges)."""
        self._arrived: OrderedDict[str, float] = OrderedDict()
        """request id -> when its decision reached this door (``time.monotonic()``)."""

    async def start(self) -> None:
        t = self.topics
        await ensure_topics(self.settings.kafka(), (t.requests, t.dispatch))
        if self.releases is None and self.settings.redis_url:
            self.releases = SharedReleases(self.settings, self.producer_id)
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

    def released(self, decision: RoutingDecision, at: Release, monotonic_s: float,
                 failed: bool = False) -> ReleaseMark | None:
        if decision.view_now_ms is None:
            return None
        # The router's clock is elsewhere: counted from the decision's arrival here (early by its
        # trip back, which only ends the charge a little sooner than the engine does).
        came = self._arrived.get(decision.request_id)
        view_ms = decision.view_now_ms + (0 if came is None else max(int((monotonic_s - came) * 1000), 0))
        rel, rid = self.releases, decision.request_id
        event: int | None = None
        if at == "first_token":
            if rel is not None and decision.inflight_lease_ms is not None:
                event = rel.first_token(rid, view_ms)
        else:
            if rel is not None and (decision.inflight_lease_ms is not None or decision.pending_ttl_ms is not None):
                event = rel.finish(rid, view_ms, failed)
            self._arrived.pop(rid, None)
        return ReleaseMark(view_ms, self.producer_id if event is not None else None, event)

    async def decide(self, req: RoutingRequest) -> Answer:
        rid = req.request_id
        req = req.model_copy(update={"reply_to": self.producer_id,
                                     "releases": self.sees_answers and self.releases is not None})
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
            answer = await asyncio.wait_for(ask(), self.timeout_s)
        finally:
            self.inbox.forget(rid)
        if isinstance(answer, RoutingDecision):
            self._arrived[rid] = time.monotonic()
            if len(self._arrived) > MAX_TRACKED:
                self._arrived.popitem(last=False)
        return answer

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
        if self.releases is not None:
            with contextlib.suppress(Exception):
                await self.releases.close()
        if self._own_producer and self._prod is not None:
            await self._prod.stop()


def make_decider(settings: Settings, mode: Routing, *, producer_id: str, timeout_s: float, producer: Any = None,
                 seq: Iterator[int] | None = None, sees_answers: bool = True) -> Decider:
    """The decider of ``mode``; ``timeout_s`` bounds a log-mode round trip and a colocated decision's
    wait for the broker's acknowledgement. ``producer``, ``seq``: the door's own, for log mode
    (:class:`LogDecider`). ``sees_answers``: the door sees each answer's first token and end, so
    its colocated decisions charge the shared in-flight ledger (``LocalRouter.charges_work``)."""
    if mode == "log":
        return LogDecider(settings, producer_id=producer_id, timeout_s=timeout_s, producer=producer, seq=seq,
                          sees_answers=sees_answers)
    return Colocated(LocalRouter(settings, producer_id=producer_id, ack_timeout_s=timeout_s,
                                 charges_work=sees_answers))


def parse_routing(text: str) -> Routing | None:
    """``text`` as a routing mode, or None."""
    for mode in ROUTINGS:
        if text == mode:
            return mode
    return None


__all__ = ["ROUTINGS", "Answer", "Colocated", "Decider", "Down", "InboxClosed", "LogDecider", "LogUnavailable",
           "Release", "ReleaseMark", "Routing", "SharedReleases", "make_decider", "parse_routing"]
