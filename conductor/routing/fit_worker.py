"""``conductor fit``: the cost-model agent's process (the fit itself: :mod:`conductor.costmodel.fitting`).

A small aiokafka consumer, not a Faust agent: it keeps a window of a few hundred samples in
memory and writes nothing but the rare ``set_profile`` record, so it needs no table, no
changelog and no consumer group. On start it folds the ``control`` topic (the profiles already
published, and the offsets they took effect at), then follows ``request-outcomes`` from its end
and ``control`` after what it folded. A restarted fitter starts a fresh window under the profile
in force. One fitter per cluster (two would publish twice: harmless, each record is a whole
profile, but noisy).
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import metrics

from conductor.costmodel.fitting import CostFitter, FitConfig, sample_of
from conductor.costmodel.guard import FitGuard, GuardConfig
from conductor.costmodel.profiles import load_profile
from conductor.routing.control_log import control_records, publish_control
from conductor.settings import Settings
from schemas import ControlCommand, RequestOutcome
from streams.follow import At, Follower, Latest, OnBad, Record, Start
from streams.kafka import ensure_topics
from streams.topics import Topic, topics

log = logging.getLogger(__name__)

ERROR_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0)
"""Relative error buckets: fine where a good model lives (p50 <= 15 %, p90 <= 40 %)."""


class FitMetrics:
    """Prediction error as decided (the profile in force), and the fit's own out-of-sample error."""

    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.ttft_error = m.create_histogram(
            "conductor_fit_ttft_prediction_error", unit="1",
            description="|predicted - real| / real TTFT of each served request, as its decision predicted it",
            explicit_bucket_boundaries_advisory=ERROR_BUCKETS)
        self.tbt_error = m.create_histogram(
            "conductor_fit_tbt_prediction_error", unit="1",
            description="|predicted - real| / real TBT (p50 of the request's token gaps)",
            explicit_bucket_boundaries_advisory=ERROR_BUCKETS)
        self.fitted_error = m.create_gauge(
            "conductor_fit_ttft_error", unit="1",
            description="the published fit's out-of-sample TTFT error, by quantile (p50, p90)")
        self.fitted_tbt_error = m.create_gauge(
            "conductor_fit_tbt_error", unit="1", description="the published fit's out-of-sample TBT error, by quantile")
        self.published = m.create_counter("conductor_fit_published", description="set_profile records published")
        self.reverts = m.create_counter(
            "conductor_fit_reverts",
            description="set_profile records reverted because early rejection turned requests away after them")

    def outcome(self, fitter: CostFitter, o: RequestOutcome) -> None:
        s = sample_of(o, fitter.profile_at(o.control_offset))
        if s is None or s.predicted_ttft_s is None:
            return
        self.ttft_error.record(abs(s.predicted_ttft_s - s.ttft_s) / s.ttft_s)
        if s.tbt_ms and s.predicted_tbt_ms is not None:
            self.tbt_error.record(abs(s.predicted_tbt_ms - s.tbt_ms) / s.tbt_ms)

    def profile(self, fitter: CostFitter) -> None:
        p = fitter.published
        for q, v, t in (("p50", p.ttft_error_p50, p.tbt_error_p50), ("p90", p.ttft_error_p90, p.tbt_error_p90)):
            if v is not None:
                self.fitted_error.set(v, {"quantile": q})
            if t is not None:
                self.fitted_tbt_error.set(t, {"quantile": q})


async def run_fit_worker(settings: Settings, config: FitConfig, *, stop: asyncio.Event | None = None) -> None:
    """Follow outcomes and control until ``stop``; publish each fit that moved."""
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.request_outcomes, t.control))
    base = load_profile(settings.model_profile)
    guard = FitGuard(base, guard_config(settings), model=config.model)
    fitter = CostFitter(base, config, vet=guard.review)
    done = -1
    for offset, cmd in await control_records(settings):
        fitter.on_control(offset, cmd)
        guard.on_control(offset, cmd)
        done = offset
    m = FitMetrics()
    m.profile(fitter)
    log.info("fitting %s from %s (profile in force: %s)", config.model or "every model", t.request_outcomes.name,
             fitter.published.name)
    # Other owners' topics: what does not decode is skipped (they dead-letter it).
    starts: list[tuple[Topic, Start]] = [(t.request_outcomes, Latest()), (t.control, At({0: done + 1}))]
    async with Follower(settings.kafka(), starts, on_bad=OnBad.SKIP, name="fit worker", fetch_wait_ms=200,
                        poll_ms=500, max_records=None) as follower:
        async for rec in follower.records(stop or asyncio.Event()):
            await _take(settings, fitter, guard, m, rec.topic == t.control.name, rec)


def guard_config(settings: Settings) -> GuardConfig:
    """What a fit passes before it is published, and when a set_profile is reverted (``fit_*`` settings)."""
    return GuardConfig(min_interval_s=settings.fit_min_interval_s, min_gain=settings.fit_min_gain,
                       watch_s=settings.fit_revert_watch_s, watch_min_requests=settings.fit_revert_min_requests,
                       rejection_jump=settings.fit_revert_rejection_jump)


async def _take(settings: Settings, fitter: CostFitter, guard: FitGuard, m: FitMetrics, control: bool,
                rec: Record) -> None:
    body = rec.env.body if rec.env is not None else None
    ts_ms = (rec.env.ts_ms if rec.env is not None else 0) or rec.timestamp_ms
    if control and isinstance(body, ControlCommand):
        fitter.on_control(rec.offset, body)
        guard.on_control(rec.offset, body, ts_ms)
        m.profile(fitter)
    elif isinstance(body, RequestOutcome):
        m.outcome(fitter, body)
        revert = guard.on_outcome(body, ts_ms)
        if revert is not None:
            at = await publish_control(settings, revert, producer_id="conductor-fit")
            fitter.on_control(at, revert)
            guard.on_control(at, revert, ts_ms)
            m.reverts.add(1)
            m.profile(fitter)
            log.error("control offset %d: reverted to %s (%s)", at, fitter.published.name, revert.reason)
            return
        cmd = fitter.on_outcome(body, ts_ms)
        if cmd is not None:
            at = await publish_control(settings, cmd, producer_id="conductor-fit")
            fitter.on_control(at, cmd)
            guard.on_control(at, cmd, ts_ms)
            m.published.add(1)
            m.profile(fitter)
            log.info("control offset %d: published %s (%s)", at, cmd.profile and cmd.profile.get("name"), cmd.reason)


__all__ = ["FitMetrics", "guard_config", "run_fit_worker"]
