"""The dispatcher client: what an engine or a gateway uses to read its decisions.

``async for a in decisions_for(settings, "prefill-0"): ...`` yields an
:class:`Assignment` for every routing decision that names the instance as its
prefill or decode instance, joined with the request it decides (read from the
``requests`` topic), so that an engine has the prompt's tokens in hand.

Decisions are read from every partition of ``dispatch`` (a decode instance's
decisions are keyed by their prefill instance, so they may be anywhere). A
record that does not decode is logged and counted, and reading goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from conductor.settings import Settings
from schemas import RoutingDecision, RoutingRejection, RoutingRequest
from streams.follow import Earliest, Follower, OnBad, Since, Start
from streams.kafka import ensure_topics
from streams.topics import Topic, topics

log = logging.getLogger(__name__)

MAX_REMEMBERED_REQUESTS = 20_000
MAX_PENDING_DECISIONS = 10_000
REQUEST_LOOKBACK_MS = 60_000
"""How far before ``since_ms`` requests are read (a decision can follow its request by this much)."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """One decision for this instance, with its request (None when it was never seen)."""

    decision: RoutingDecision
    request: RoutingRequest | None
    request_ts_ms: int
    """When the request was published (its envelope's clock); 0 if unknown."""
    decision_ts_ms: int
    prefill: bool
    """This instance runs the request's prefill."""
    decode: bool
    """This instance runs the request's decode."""


class _Joiner:
    """Join decisions with their requests, whichever arrives first. Pure, bounded."""

    def __init__(self, instance_id: str, since_ms: int, with_requests: bool) -> None:
        self.instance_id = instance_id
        self.since_ms = since_ms
        self.with_requests = with_requests
        self.requests: OrderedDict[str, tuple[RoutingRequest, int]] = OrderedDict()
        self.pending: OrderedDict[str, tuple[RoutingDecision, int, float]] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def _assignment(self, d: RoutingDecision, ts: int, req: tuple[RoutingRequest, int] | None) -> Assignment:
        return Assignment(
            decision=d,
            request=req[0] if req else None,
            request_ts_ms=req[1] if req else 0,
            decision_ts_ms=ts,
            prefill=d.prefill_instance == self.instance_id,
            decode=d.decode_instance == self.instance_id,
        )

    def on_request(self, req: RoutingRequest, ts_ms: int) -> list[Assignment]:
        waiting = self.pending.pop(req.request_id, None)
        if waiting is not None:
            return [self._assignment(waiting[0], waiting[1], (req, ts_ms))]
        self.requests[req.request_id] = (req, ts_ms)
        while len(self.requests) > MAX_REMEMBERED_REQUESTS:
            self.requests.popitem(last=False)
        return []

    def on_decision(self, d: RoutingDecision, ts_ms: int, now: float) -> list[Assignment]:
        if self.instance_id not in (d.prefill_instance, d.decode_instance) or ts_ms < self.since_ms:
            return []
        if not self.with_requests:
            return [self._assignment(d, ts_ms, None)]
        req = self.requests.pop(d.request_id, None)
        if req is not None:
            return [self._assignment(d, ts_ms, req)]
        self.pending[d.request_id] = (d, ts_ms, now)
        while len(self.pending) > MAX_PENDING_DECISIONS:
            self.pending.popitem(last=False)
            self.counts["pending_dropped"] += 1
        return []

    def expire(self, now: float, wait_s: float) -> list[Assignment]:
        """Decisions whose request never showed up are handed out without it."""
        out = []
        while self.pending:
            rid, (d, ts, seen) = next(iter(self.pending.items()))
            if now - seen < wait_s:
                break
            del self.pending[rid]
            self.counts["request_missing"] += 1
            out.append(self._assignment(d, ts, None))
        return out


async def decisions_for(
    settings: Settings,
    instance_id: str,
    *,
    with_requests: bool = True,
    since_ms: int = 0,
    request_wait_s: float = 10.0,
    stop: asyncio.Event | None = None,
    counts: Counter[str] | None = None,
) -> AsyncIterator[Assignment]:
    """Yield every decision naming ``instance_id`` (published at or after ``since_ms``).

    With ``with_requests`` each decision comes with its request; a decision whose
    request has not arrived after ``request_wait_s`` is yielded without it.
    Rejections name no instance and are never yielded. ``counts`` (if given) receives
    what was skipped and why.
    """

    tps = topics(settings.topic_config())
    wanted = (tps.dispatch, tps.requests) if with_requests else (tps.dispatch,)
    await ensure_topics(settings.kafka(), wanted)
    joiner = _Joiner(instance_id, since_ms, with_requests)
    if counts is not None:
        joiner.counts = counts
    # Older records would be filtered out anyway: starting at ``since_ms`` spares a restarted
    # engine the whole history of dispatch (its requests from a little earlier).
    since = {tps.dispatch.name: since_ms, tps.requests.name: since_ms - REQUEST_LOOKBACK_MS}
    starts: list[tuple[Topic, Start]] = [(t, Since(since[t.name]) if since[t.name] > 0 else Earliest())
                                         for t in wanted]
    async with Follower(settings.kafka(), starts, on_bad=OnBad.LOG_AND_SKIP, name=f"dispatch-{instance_id}",
                        fetch_wait_ms=50, counts=joiner.counts) as follower:
        async for batches in follower.polls(stop or asyncio.Event()):
            now = time.monotonic()
            ready: list[Assignment] = []
            for batch in batches:
                for rec in batch.records:
                    body = rec.env.body if rec.env is not None else None
                    ts_ms = rec.env.ts_ms if rec.env is not None else 0
                    if isinstance(body, RoutingDecision):
                        ready.extend(joiner.on_decision(body, ts_ms, now))
                    elif isinstance(body, RoutingRequest):
                        if with_requests:
                            ready.extend(joiner.on_request(body, ts_ms))
                    elif isinstance(body, RoutingRejection):
                        joiner.counts["rejections"] += 1
                    else:
                        joiner.counts["wrong_kind"] += 1
            ready.extend(joiner.expire(now, request_wait_s))
            for a in ready:
                joiner.counts["assignments"] += 1
                yield a
