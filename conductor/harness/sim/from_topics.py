"""What ``conductor simulate --from-topics`` reads from the log, in bounded reads.

Each topic is read up to the end offsets taken when the read starts (live traffic does not
keep it going), from the first record of the time range on (``--since``, less a clock slack)
to the last (``--until``, plus the slack); the heartbeats only around the requests it finds,
reduced to each node's last one as they stream (:func:`~conductor.harness.sim.recorded.latest_heartbeats`),
and the outcomes only of those requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from aiokafka import TopicPartition

from conductor.harness.sim.recorded import HEARTBEAT_SLACK_MS, latest_heartbeats, request_span
from conductor.settings import Settings
from schemas import DecodeError, Envelope, RequestOutcome, decode
from streams.spans import Span, SpanReader
from streams.topics import topics

CLOCK_SLACK_MS = 60_000
"""A record's timestamp (its producer's clock when produced) and its envelope's time differ by
up to this: every window by record time is this much wider."""

OUTCOME_WAIT_MS = 3_600_000
"""A request's outcome is looked for up to this long after the range's last request."""


async def _window(log: SpanReader, name: str, lo_ms: int | None, hi_ms: int | None) -> dict[TopicPartition, Span]:
    bounds = await log.bounds(await log.partitions(name))
    start = await log.offsets_at(lo_ms - CLOCK_SLACK_MS, bounds) if lo_ms is not None else {}
    stop = await log.offsets_at(hi_ms + CLOCK_SLACK_MS + 1, bounds) if hi_ms is not None else {}
    return {tp: Span(start.get(tp, b.start), stop.get(tp, b.stop)) for tp, b in bounds.items()}


def _decoded(record: Any) -> Envelope | None:
    try:
        return decode(record.value)
    except DecodeError:
        return None  # dead-lettered by the live consumers


async def _envelopes(log: SpanReader, spans: Mapping[TopicPartition, Span]) -> AsyncIterator[Envelope]:
    async for batch in log.read(spans):
        for m in batch:
            env = _decoded(m)
            if env is not None:
                yield env


async def _kept(log: SpanReader, spans: Mapping[TopicPartition, Span],
                keep: Callable[[Envelope], bool]) -> list[Envelope]:
    return [env async for env in _envelopes(log, spans) if keep(env)]


async def read_recorded(settings: Settings, since_ms: int | None, until_ms: int | None,
                        ) -> tuple[list[Envelope], list[Envelope], list[Envelope], list[Envelope]]:
    """(requests, heartbeats, outcomes, dispatch) of the range, for
    :func:`~conductor.harness.sim.recorded.recorded_traffic`."""
    t = topics(settings.topic_config())
    lo = since_ms if since_ms is not None else -1
    hi = until_ms if until_ms is not None else float("inf")

    def inside(env: Envelope) -> bool:
        return lo <= env.ts_ms <= hi

    async with SpanReader(settings.kafka(), deadline_s=600.0) as log:
        reqs = await _kept(log, await _window(log, t.requests.name, since_ms, until_ms), inside)
        disp = await _kept(log, await _window(log, t.dispatch.name, since_ms, until_ms), inside)
        span = request_span(reqs, since_ms=since_ms, until_ms=until_ms)
        if span is None:  # recorded_traffic says so, with what it left out
            return reqs, [], [], disp
        first, last, ids = span
        beats = await _window(log, t.heartbeats.name, first - HEARTBEAT_SLACK_MS, last + HEARTBEAT_SLACK_MS)
        hbs: list[Envelope] = []
        async for batch in log.read(beats):  # folded batch by batch: one heartbeat per node kept
            hbs = latest_heartbeats(hbs + [env for env in map(_decoded, batch) if env is not None], first, last)
        outs = await _kept(log, await _window(log, t.request_outcomes.name, first, last + OUTCOME_WAIT_MS),
                           lambda env: isinstance(env.body, RequestOutcome) and env.body.request_id in ids)
    return reqs, hbs, outs, disp
