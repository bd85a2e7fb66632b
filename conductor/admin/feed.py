"""What the admin API shows from the log: recent decisions, dead letters, the control state.

One consumer (no group: every admin process sees everything) follows ``dispatch``,
``dead-letter`` and ``request-outcomes`` (what the gateways observed) from their last ``keep``
records, ``requests`` for prompt sizes, and ``control`` from the start (folded with the same
check every router applies), and keeps bounded in-memory windows. Nothing here decides
anything; it is a read model.

Two reuse figures, two definitions (the console labels them so):

* ``reuse_ratio`` (and ``reuse_ratio_by_instance``): prompt tokens the decisions planned to read
  from cache over all their prompt tokens, token-weighted;
* ``hit_rate_by_instance``: the share of an instance's decisions that reused any prefix at all
  (a request whose system prompt alone is cached counts as a hit). A chat fleet sits near 100 %
  here with a token reuse of a few per cent: most requests share a short prefix.
* ``engine_cache_hit_ratio``: the prompt tokens the engines themselves reported as cached
  (``request-outcomes``), over all prompt tokens: the realised counterpart of ``reuse_ratio``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from conductor.routing.control import ControlState, apply_control
from conductor.routing.control_log import policy_check
from conductor.settings import Settings
from schemas import (
    ControlCommand,
    DeadLetter,
    Envelope,
    RequestOutcome,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
)
from streams.follow import Earliest, Follower, OnBad, Start, Tail
from streams.kafka import ensure_topics
from streams.topics import Topic, topics

log = logging.getLogger(__name__)


@dataclass
class DecisionRow:
    at_ms: int
    request_id: str
    rejected: bool
    prefill_instance: str | None
    decode_instance: str | None
    reused_tokens: int
    prompt_tokens: int | None
    predicted_ttft_s: float | None
    reason: str | None
    policy: str | None
    control_offset: int
    degraded: bool

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    """What a gateway observed of one served request (``request-outcomes``)."""

    at_ms: int
    request_id: str
    prefill_instance: str | None
    prompt_tokens: int
    cached_tokens: int
    predicted_ttft_s: float | None
    ttft_s: float
    """The gateway's TTFT less its routing time: what ``predicted_ttft_s`` predicts."""
    client_ttft_s: float
    """The gateway's TTFT as the client saw it (arrival to first token, routing included)."""

    @classmethod
    def of(cls, o: RequestOutcome, at_ms: int) -> OutcomeRow | None:
        """The row of a served request's outcome; None for a rejection, a failure or no first token."""
        if o.status != 200 or o.error is not None or o.ttft_s is None:
            return None
        engine = o.ttft_s - (o.routing_ms or 0.0) / 1000.0
        return cls(at_ms, o.request_id, o.prefill_instance, o.prompt_tokens, o.cached_tokens, o.predicted_ttft_s,
                   max(engine, 0.0), o.ttft_s)


SERIES_POINTS = 30
"""Buckets of ``ttft_series`` in ``stats`` (each ``window_s`` long): the console's chart."""


def _p(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` (nearest rank below), None when empty."""
    return values[int(q * (len(values) - 1))] if values else None


@dataclass
class DeadLetterRow:
    topic: str
    partition: int
    offset: int
    at_ms: int
    letter: DeadLetter

    def summary(self) -> dict[str, Any]:
        d = self.letter
        return {"partition": self.partition, "offset": self.offset, "at_ms": self.at_ms,
                "source_topic": d.source_topic, "source_partition": d.partition, "source_offset": d.offset,
                "reason": d.reason, "error": d.error,
                "original_bytes": len(d.original) if d.original_size is None else d.original_size,
                "original_sha256": d.original_sha256, "complete": d.complete,
                "key": None if d.key is None else d.key.decode("utf-8", "backslashreplace")}


@dataclass
class LogFeed:
    settings: Settings
    keep: int = 2000
    decisions: collections.deque[DecisionRow] = field(default_factory=collections.deque)
    dead_letters: collections.deque[DeadLetterRow] = field(default_factory=collections.deque)
    outcomes: collections.deque[OutcomeRow] = field(default_factory=collections.deque)
    control: ControlState = field(default_factory=ControlState)
    prompt_tokens: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    """Records that did not decode, by reason: skipped here (a bad request is dead-lettered by the
    routers; on dispatch, control and dead-letter nobody sets one aside: streams/dead_letters.py)."""

    def __post_init__(self) -> None:
        self.topics = topics(self.settings.topic_config())
        self._check = policy_check(self.settings)
        self._task: asyncio.Task[None] | None = None

    # --- following the log -------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        t = self.topics
        while True:
            try:
                await ensure_topics(self.settings.kafka(),
                                    (t.requests, t.dispatch, t.dead_letter, t.control, t.request_outcomes))
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the broker went away: say so, retry
                self.error = f"{type(e).__name__}: {e}"
                log.warning("admin feed: %s; retrying in 2s", self.error)
                await asyncio.sleep(2.0)

    async def _follow(self) -> None:
        t = self.topics
        # Control from its start (the state is its whole fold); the others' last ``keep`` records.
        # A record that does not decode is counted (``skipped``): its topic's own consumer sets it aside.
        starts: list[tuple[Topic, Start]] = [
            (topic, Earliest() if topic == t.control else Tail(self.keep))
            for topic in (t.requests, t.dispatch, t.dead_letter, t.control, t.request_outcomes)]
        async with Follower(self.settings.kafka(), starts, on_bad=OnBad.SKIP, name="admin feed", max_records=2000,
                            counts=self.skipped, count_prefix="", track_end=True) as follower:
            self.error = ""
            async for batches in follower.polls(asyncio.Event()):
                for batch in batches:
                    for rec in batch.records:
                        if rec.env is not None:
                            self._on_record(rec.topic, rec.partition, rec.offset, rec.env)
                if follower.caught_up:
                    self.ready.set()

    def _on_record(self, topic: str, partition: int, offset: int, env: Envelope) -> None:
        b = env.body
        t = self.topics
        if topic == t.requests.name and isinstance(b, RoutingRequest):
            self.prompt_tokens[b.request_id] = b.prompt_tokens
            while len(self.prompt_tokens) > 4 * self.keep:
                self.prompt_tokens.popitem(last=False)
        elif topic == t.dispatch.name and isinstance(b, (RoutingDecision, RoutingRejection)):
            self.on_dispatch(b, env.ts_ms)
        elif topic == t.dead_letter.name and isinstance(b, DeadLetter):
            self.dead_letters.append(DeadLetterRow(topic, partition, offset, env.ts_ms, b))
            while len(self.dead_letters) > self.keep:
                self.dead_letters.popleft()
        elif topic == t.control.name and isinstance(b, ControlCommand):
            self.control = apply_control(self.control, b, offset, self._check)
        elif topic == t.request_outcomes.name and isinstance(b, RequestOutcome):
            self.on_outcome(b, env.ts_ms)

    def on_outcome(self, o: RequestOutcome, at_ms: int) -> None:
        row = OutcomeRow.of(o, at_ms)
        if row is None:
            return
        self.outcomes.append(row)
        while len(self.outcomes) > self.keep:
            self.outcomes.popleft()

    def on_dispatch(self, b: RoutingDecision | RoutingRejection, at_ms: int) -> None:
        dec = b if isinstance(b, RoutingDecision) else None
        rej = b if isinstance(b, RoutingRejection) else None
        self.decisions.append(DecisionRow(
            at_ms=at_ms, request_id=b.request_id, rejected=rej is not None,
            prefill_instance=dec.prefill_instance if dec else None,
            decode_instance=dec.decode_instance if dec else None,
            reused_tokens=dec.reused_tokens if dec else 0,
            prompt_tokens=self.prompt_tokens.get(b.request_id),
            predicted_ttft_s=dec.predicted_ttft_s if dec else None,
            reason=rej.reason if rej else None,
            policy=b.policy, control_offset=b.control_offset,
            degraded=dec.degraded if dec else False,
        ))
        while len(self.decisions) > self.keep:
            self.decisions.popleft()

    # --- reading --------------------------------------------------------------------------

    def dead_letter(self, partition: int, offset: int) -> DeadLetterRow | None:
        for row in self.dead_letters:
            if row.partition == partition and row.offset == offset:
                return row
        return None

    def stats(self, window_s: float = 10.0, now_ms: int | None = None) -> dict[str, Any]:
        """Decisions per second, reuse, predicted against observed TTFT and rejections over the
        window; per-instance reuse over the decisions kept; TTFT over time (``ttft_series``)."""
        now_ms = now_ms or int(time.time() * 1000)
        since = now_ms - window_s * 1000
        recent = [d for d in self.decisions if d.at_ms >= since]
        placed = [d for d in recent if not d.rejected]
        reasons = collections.Counter(d.reason for d in recent if d.rejected)
        ttfts = sorted(d.predicted_ttft_s for d in placed if d.predicted_ttft_s is not None)
        served = [o for o in self.outcomes if o.at_ms >= since]
        observed = sorted(o.ttft_s for o in served)
        per_instance: dict[str, list[DecisionRow]] = {}
        for d in self.decisions:
            if not d.rejected and d.prefill_instance is not None:
                per_instance.setdefault(d.prefill_instance, []).append(d)
        engine_prompt = sum(o.prompt_tokens for o in served)
        return {
            "window_s": window_s,
            "decisions_per_s": round(len(recent) / window_s, 3),
            "placed": len(placed),
            "rejected": len(recent) - len(placed),
            "rejections_by_reason": dict(reasons),
            "reuse_ratio": _reuse_ratio(placed),
            "engine_cache_hit_ratio": round(sum(o.cached_tokens for o in served) / engine_prompt, 4)
            if engine_prompt else None,
            "predicted_ttft_p50_s": _p(ttfts, 0.5),
            "predicted_ttft_p90_s": _p(ttfts, 0.9),
            "observed_ttft_p50_s": _p(observed, 0.5),
            "observed_ttft_p90_s": _p(observed, 0.9),
            "client_ttft_p50_s": _p(sorted(o.client_ttft_s for o in served), 0.5),
            "observed_requests": len(served),
            "ttft_series": self.ttft_series(window_s, now_ms),
            "hit_rate_by_instance": {k: round(sum(1 for d in v if d.reused_tokens) / len(v), 4)
                                     for k, v in per_instance.items()},
            "reuse_ratio_by_instance": {k: _reuse_ratio(v) for k, v in per_instance.items()},
            "total_decisions_seen": len(self.decisions),
        }

    def ttft_series(self, bucket_s: float, now_ms: int) -> list[dict[str, Any]]:
        """Predicted against observed TTFT of the served requests, p50 per ``bucket_s`` bucket, the
        last :data:`SERIES_POINTS` buckets, oldest first (a bucket with no request is left out).
        Both figures come from the same requests' outcomes: the prediction their decision made,
        the TTFT the gateway saw less its routing."""
        width = bucket_s * 1000
        first = now_ms - SERIES_POINTS * width
        buckets: dict[int, list[OutcomeRow]] = {}
        for o in self.outcomes:
            if o.at_ms > first:
                buckets.setdefault(int((o.at_ms - first - 1) // width), []).append(o)
        out = []
        for i in sorted(buckets):
            rows = buckets[i]
            predicted = sorted(o.predicted_ttft_s for o in rows if o.predicted_ttft_s is not None)
            out.append({"t_ms": int(first + (i + 1) * width), "requests": len(rows),
                        "predicted_ttft_p50_s": _p(predicted, 0.5),
                        "observed_ttft_p50_s": _p(sorted(o.ttft_s for o in rows), 0.5)})
        return out


def _reuse_ratio(decisions: list[DecisionRow]) -> float | None:
    """Tokens the decisions reuse over their prompt tokens (those whose prompt size is known)."""
    sized = [d for d in decisions if d.prompt_tokens]
    total = sum(d.prompt_tokens or 0 for d in sized)
    return round(sum(d.reused_tokens for d in sized) / total, 4) if total else None


__all__ = ["DeadLetterRow", "DecisionRow", "LogFeed", "OutcomeRow"]
