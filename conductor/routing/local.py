"""A router in the caller's own process: decide where the request is, then log it.

A gateway (or the endpoint picker) that routes through the log pays a round trip through the
broker twice per request (its request onto ``requests``, a router's fetch, the decision back on
its reply topic). :class:`LocalRouter` runs the same :class:`~conductor.routing.router.Router`
in the caller's process instead:

1. read the view and decide (reads overlap; decisions happen one after another in arrival
   order, each seeing the reservations of those before it, as a router's batch does);
2. write the request (``decided_by`` = this process, so the routers of ``requests`` skip it)
   and its decision (``decided_by``, and the ``ordinal`` it was decided at) to the log, and
   wait for the broker's acknowledgement of both;
3. only then hand the decision back: the caller calls the engines on a decision the log holds,
   so ``dispatch`` stays the system of record and ``conductor explain`` re-derives it unchanged.

Pending blocks and the in-flight ledger (:mod:`state.shared_log`) are shared by every gateway,
router and picker through Redis, so several gateways see each other's placements and do not
overbook one instance. The caller reports back what only it sees: :meth:`LocalRouter.on_first_token`
(the prefill's work ends) and :meth:`LocalRouter.on_finish` (the rest; a failure also releases
the request's pending blocks), times converted to the view's clock (:meth:`LocalRouter.view_ms`). The control topic is followed as a router follows it, and the decision index is
written after the acknowledgement, as the router worker does.

A decision once begun runs to its end even when its caller goes away (a client that hung
up): its reservation is taken, so its record belongs on the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

from conductor.errors import ConductorError
from conductor.routing.control_follow import ControlFollower
from conductor.routing.ordered import Turns
from conductor.routing.router import Router
from conductor.routing.stores import decision_index, decision_time_stores, redis_stores
from conductor.settings import Settings
from schemas import RequestOutcome, RoutingDecision, RoutingRejection, RoutingRequest, envelope
from state.claim import ProducerClaim
from state.decisions import DecisionIndex, DecisionPosition
from state.inflight import InflightLedger
from state.pending import PendingStore
from state.shared_log import RedisInflight, RedisPendingBlocks
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

CONTROL_POLL_MS = 200
"""How long one poll of the control topic waits: a control record reaches the router within this."""
INDEX_BATCH = 256
"""Decision-index entries written in one Redis round trip."""
MAX_TRACKED = 100_000
"""Decisions whose monotonic time this process remembers for :meth:`LocalRouter.view_ms` (the
oldest forgotten first: a request that outlives that many later ones is past any lease)."""


class LogUnavailable(ConductorError):
    """The broker did not acknowledge a decision: it was not served (the log is the system of record)."""


class LocalRouter:
    """Decides requests in this process and writes each request and decision to the log.

    ``producer_id`` names this process in the log (the records' producer, the decisions'
    ``decided_by``, the reservations' owner); a gateway uses its gateway id. ``router``:
    one to use instead of the settings' (tests); ``ack_timeout_s``: how long a decision
    waits for the broker before :class:`LogUnavailable`."""

    def __init__(self, settings: Settings, *, producer_id: str, router: Router | None = None,
                 ack_timeout_s: float = 5.0, charges_work: bool = True) -> None:
        """``charges_work``: charge each decision's work to the shared in-flight ledger. Only a door
        that sees its answers end (the gateway) can release a charge; one that does not (the picker:
        Envoy sends it no response phases) counts its work through reservations cleared by the
        engines' heartbeats instead, so its charges never outlive the requests by a lease."""
        self.settings = settings
        self.charges_work = charges_work
        self.producer_id = producer_id
        self.topics = topics(settings.topic_config())
        self.ack_timeout_s = ack_timeout_s
        self._router = router
        self._producer: Any = None
        self._control: ControlFollower | None = None
        self._control_task: asyncio.Task[None] | None = None
        self._index: DecisionIndex | None = None
        self._index_queue: list[DecisionPosition] = []
        self._index_task: asyncio.Task[None] | None = None
        self._seq = itertools.count(1)
        self._ordinal = itertools.count()
        self._turns = Turns()
        self._deciding: set[str] = set()
        self._decided_at: OrderedDict[str, tuple[int, float]] = OrderedDict()
        """request id -> (its decision's view time, this process's monotonic time when it was made)."""
        self._started = False
        self.decided = 0
        self._reaper: asyncio.Task[None] | None = None
        self.claim: ProducerClaim | None = None
        """This process's claim on ``producer_id`` (:mod:`state.claim`) while its decision-time records
        are shared through Redis: one live process per id."""
        self.reaped = 0
        """Charges this process ended for the process that made them: lost producers'
        (:meth:`reap_lost`) and its own earlier run's (:meth:`end_leftovers`)."""

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("LocalRouter.start() was not called")
        return self._router

    # --- life ---------------------------------------------------------------------

    async def start(self) -> None:
        """Make the topics, start the producer, the shared reservations and the control follower
        (caught up before the first decision, as a router is)."""
        t = self.topics
        await ensure_topics(self.settings.kafka(), (t.requests, t.dispatch, t.control, t.request_outcomes))
        if self._router is None:
            view, reservations = redis_stores(self.settings, producer_id=self.producer_id)
            pending, inflight = decision_time_stores(self.settings, reservations.client, self.producer_id,
                                                     follow_client=reservations.follow_client)
            self._router = Router(self.settings, view, reservations, pending=pending,
                                  inflight=inflight if self.charges_work else None)
            self._index = decision_index(self.settings, getattr(reservations, "client", None))
        self.claim = self._claim_of(self.router)
        if self.claim is not None:
            # Before anything is written under the id: a second live process under it fails here.
            await self.claim.take()
            self.claim.start()
        self._producer = producer(self.settings.kafka(), linger_ms=0)
        await self._producer.start()
        await self.router.start()
        self._control = ControlFollower(self.settings, self.router)
        await self._control.start()
        self._control_task = asyncio.create_task(self._follow_control(self._control))
        if isinstance(self.router.decision_time.inflight, RedisInflight):
            await self.end_leftovers()
            self._reaper = asyncio.create_task(self._reap_lost_forever(self.router.decision_time.inflight))
        self._started = True

    def _claim_of(self, router: Router) -> ProducerClaim | None:
        """A claim on this process's id when its decision-time records go through Redis (else none:
        they stay in this process)."""
        for store in (router.decision_time.inflight, router.decision_time.pending):
            if isinstance(store, RedisInflight | RedisPendingBlocks):
                return ProducerClaim(store.log.client, self.settings.view_namespace, self.producer_id)
        return None

    async def close(self) -> None:
        """Wait for the decisions in flight, then stop following and close the producer."""
        if self._turns.last is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._turns.last), self.ack_timeout_s)
        for task in (self._control_task, self._reaper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._index_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._index_task, 5.0)
        if self._index is not None:
            with contextlib.suppress(Exception):
                await self._index.close()
        if self._router is not None:
            await self._router.close()
        if self._control is not None:
            await self._control.stop()
        if self._producer is not None:
            await self._producer.stop()
        if self.claim is not None:
            await self.claim.close()  # last: the router's last releases were written under it
        self._started = False

    def problem(self) -> str | None:
        """Why this router cannot decide now (None: it can)."""
        if not self._started:
            return "the colocated router is starting"
        if self._control_task is not None and self._control_task.done():
            return "the colocated router stopped following the control topic"
        if self.claim is not None and self.claim.problem is not None:
            return self.claim.problem
        return None

    @property
    def ready(self) -> bool:
        return self._started

    def waiting(self, request_id: str) -> bool:
        """Whether ``request_id`` is being decided now (a caller picks another id for a new request)."""
        return request_id in self._deciding

    # --- decision-time records: what the caller reports back ------------------------------

    @property
    def pending(self) -> PendingStore | None:
        """The pending blocks the router records its placements in (shared through Redis)."""
        return self.router.pending

    @property
    def inflight(self) -> InflightLedger | None:
        """The in-flight ledger the router charges its placements to (shared through Redis)."""
        return self.router.inflight

    def view_ms(self, decision: RoutingDecision, monotonic_s: float) -> int:
        """``monotonic_s`` (``time.monotonic()``) on the view's clock: the decision's
        ``view_now_ms`` plus the monotonic time since this process made it (what the request's
        outcome records as ``first_token_view_ms`` and ``finished_view_ms``)."""
        at = self._decided_at.get(decision.request_id)
        base = decision.view_now_ms or 0
        if at is None:
            return base
        return at[0] + max(int((monotonic_s - at[1]) * 1000), 0)

    def on_first_token(self, decision: RoutingDecision, monotonic_s: float) -> int | None:
        """The request's first token came back at ``monotonic_s``: its prefill's in-flight work
        ends. Returns the release's event number on the shared streams (None: not shared)."""
        return self.router.decision_time.first_token(decision.request_id, self.view_ms(decision, monotonic_s))

    def on_finish(self, decision: RoutingDecision, monotonic_s: float, failed: bool) -> int | None:
        """The request ended at ``monotonic_s`` (``failed``: an error or a cancel): its in-flight
        work ends, and a failed request's pending blocks too (its engine will not hold them).
        Returns the release's event number on the shared streams (None: not shared)."""
        event = self.router.decision_time.end(decision.request_id, self.view_ms(decision, monotonic_s), failed)
        self._decided_at.pop(decision.request_id, None)
        return event

    # --- one request -----------------------------------------------------------------

    async def decide(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        """Decide ``req``, write it and its answer to the log, and return the answer once the broker
        acknowledged both (:class:`LogUnavailable` when it did not within ``ack_timeout_s``)."""
        if not self._started:
            raise LogUnavailable("the colocated router is not started")
        if req.decided_by != self.producer_id:
            req = req.model_copy(update={"decided_by": self.producer_id, "reply_to": None})
        self._deciding.add(req.request_id)
        task = asyncio.ensure_future(self._decide_and_log(req, self._turns.take(functools.partial(self._decide, req))))
        task.add_done_callback(lambda _: self._deciding.discard(req.request_id))
        return await asyncio.shield(task)  # a caller that goes away does not unmake a decision

    async def _decide_and_log(self, req: RoutingRequest,
                              turn: Awaitable[RoutingDecision | RoutingRejection]) -> RoutingDecision | RoutingRejection:
        out = await turn  # the next request's decision may begin while this one is logged
        try:
            await self._log(req, out)
        except BaseException:
            # Not served (the log did not take it, or the task was cancelled): its charge and its
            # pending blocks end now, not a lease later; nobody will report on this decision.
            if isinstance(out, RoutingDecision):
                self.on_finish(out, self.router.clock(), failed=True)
                await asyncio.shield(self.router.unreserve(req, out))
            raise
        return out

    async def _decide(self, req: RoutingRequest, after: Awaitable[None] | None) -> RoutingDecision | RoutingRejection:
        ordinal = next(self._ordinal)
        try:
            out = await self.router.route(req, ordinal, after, decided_by=self.producer_id)
            if isinstance(out, RoutingDecision) and out.view_now_ms is not None:
                self._decided_at[out.request_id] = (out.view_now_ms, self.router.clock())
                if len(self._decided_at) > MAX_TRACKED:
                    self._decided_at.popitem(last=False)
            return out
        except Exception as e:  # a bug must not leave the caller without an answer
            log.exception("routing %s failed", req.request_id)
            # Whatever the router recorded before it failed is not served (idempotent, a no-op if none).
            self.router.decision_time.end(req.request_id, self.router.decision_time.last_ms, failed=True)
            return self.router.reject(req.request_id, "invalid_request", f"router error: {type(e).__name__}: {e}")

    async def _log(self, req: RoutingRequest, out: RoutingDecision | RoutingRejection) -> None:
        t, prod = self.topics, self._producer
        now_ms = time.time_ns() // 1_000_000
        env_req = envelope(req, producer_id=self.producer_id, producer_seq=next(self._seq), ts_ms=now_ms)
        env_out = envelope(out, producer_id=self.producer_id, producer_seq=next(self._seq), ts_ms=now_ms)
        key = out.prefill_instance if isinstance(out, RoutingDecision) else out.request_id
        try:
            sends = [
                await t.requests.send(prod, env_req, req.request_id),
                await t.dispatch.send(prod, env_out, key),
            ]
            await asyncio.wait_for(acknowledged(prod, sends, warn_after_s=1.0, what=f"decision {req.request_id}"),
                                   self.ack_timeout_s)
        except (TimeoutError, OSError, ConductorError) as e:
            raise LogUnavailable(f"the broker did not take the decision for {req.request_id} within "
                                 f"{self.ack_timeout_s:g}s: {e or type(e).__name__}") from e
        except Exception as e:  # aiokafka's errors: the same for the caller
            raise LogUnavailable(f"the decision for {req.request_id} was not logged: {type(e).__name__}: {e}") from e
        self.decided += 1
        if self._index is not None:
            at_req, at_out = sends[0].result(), sends[1].result()
            self._index_queue.append(DecisionPosition(out.request_id, at_out.partition, at_out.offset, env_out.ts_ms,
                                                      at_req.partition, at_req.offset))
            if self._index_task is None or self._index_task.done():
                self._index_task = asyncio.create_task(self._write_index(self._index))

    async def _write_index(self, index: DecisionIndex) -> None:
        """Write the queued decision positions, a batch at a time, until none is left."""
        while self._index_queue:
            batch, self._index_queue = self._index_queue[:INDEX_BATCH], self._index_queue[INDEX_BATCH:]
            try:
                await index.record(batch)
            except Exception as e:  # noqa: BLE001 - explain falls back to a scan for these
                log.warning("decision index: %d entries not written: %s", len(batch), e)

    # --- lost producers ------------------------------------------------------------------

    async def reap_lost(self) -> list[str]:
        """End the open charges of every producer that went silent (a gateway or picker that died:
        ``state.shared_log.RedisInflight.lost``) and that this process claims first: each ends as
        a failure of this process's own, shared at once, with a ``request_outcome`` (error
        ``gateway_lost``, this process its ``release_producer``) so that ``explain`` re-derives the
        same picture. Returns the request ids ended."""
        ledger = self.router.decision_time.inflight
        if not isinstance(ledger, RedisInflight):
            return []
        now = await ledger.now_ms()
        ended: list[str] = []
        for lost_id, rids in ledger.lost(now).items():
            if not await ledger.claim(lost_id):
                continue
            silent_s = (now - ledger.heard.get(lost_id, 0)) / 1000
            await self._end_charges(ledger, lost_id, rids, now, "gateway_lost",
                                    f"{lost_id} went silent {silent_s:.1f}s ago with this request in flight; "
                                    f"{self.producer_id} ended its charge")
            log.warning("%s went silent %.1fs ago with %d request(s) in flight: their charges ended here (%s)",
                        lost_id, silent_s, len(rids), _some(rids))
            ended += rids
        self.reaped += len(ended)
        return ended

    async def end_leftovers(self) -> list[str]:
        """At start, end the charges an earlier process under this producer id left open (it was
        killed or restarted with requests in flight; a process that just started has none, and
        the others hear this id alive again, so none of them would take those for lost): each
        ends as a failure, with a ``request_outcome`` (error ``gateway_restarted``). Returns the
        request ids ended."""
        ledger = self.router.decision_time.inflight
        if not isinstance(ledger, RedisInflight):
            return []
        rids = ledger.leftovers()
        if not rids:
            return []
        await self._end_charges(ledger, self.producer_id, rids, await ledger.now_ms(), "gateway_restarted",
                                f"{self.producer_id} started again with this request in flight from its "
                                "earlier run; its charge ended at start")
        ledger.inherited.difference_update(rids)  # ended: nothing of the earlier run is left to end
        log.warning("%d request(s) were in flight under %s when it last stopped: their charges ended at "
                    "start (%s); another process running under the same id would have lost its charges too",
                    len(rids), self.producer_id, _some(rids))
        self.reaped += len(rids)
        return rids

    async def _end_charges(self, ledger: RedisInflight, owner: str, rids: list[str], now_ms: int, error: str,
                           message: str) -> None:
        """End ``owner``'s charges ``rids`` as failures of this process's own, shared at once, each with
        a ``request_outcome`` (``error``, ``message``, this process its ``release_producer``)."""
        at = max(now_ms, self.router.decision_time.last_ms)
        sends = []
        for rid in rids:
            charge = ledger.local.charged(rid)
            event = self.router.decision_time.end(rid, at, failed=True)
            outcome = RequestOutcome(
                request_id=rid, gateway=owner, status=502, error=error, message=message,
                attempts=[rid], prefill_instance=charge.prefill if charge else None,
                decode_instance=charge.decode if charge else None,
                finished_view_ms=at, finished_event=event, release_producer=self.producer_id)
            env = envelope(outcome, producer_id=self.producer_id, producer_seq=next(self._seq),
                           ts_ms=time.time_ns() // 1_000_000)
            sends.append(await self.topics.request_outcomes.send(self._producer, env, rid))
        self.router.metrics.lost_charges.add(len(rids), {"producer": owner, "reason": error})
        with contextlib.suppress(Exception):
            await acknowledged(self._producer, sends, warn_after_s=1.0, what=f"{owner}'s ended requests")

    async def _reap_lost_forever(self, ledger: RedisInflight) -> None:
        while True:
            await asyncio.sleep(ledger.keepalive_ms / 1000)
            try:
                await self.reap_lost()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis or the broker away: the next look retries
                log.warning("looking for lost producers' charges failed: %s", e)

    async def _follow_control(self, control: ControlFollower) -> None:
        while True:
            try:
                await control.poll(timeout_ms=CONTROL_POLL_MS)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - said by problem(); the next poll tries again
                log.warning("control topic: %s", e)
                await asyncio.sleep(1.0)


def _some(rids: list[str]) -> str:
    """The first few of ``rids``, for a log line."""
    return ", ".join(rids[:5]) + (" ..." if len(rids) > 5 else "")


__all__ = ["LocalRouter", "LogUnavailable"]
