"""The cost model learned from served requests: outcomes in, ``set_profile`` control records out.

:class:`CostFitter` is the pure part of ``conductor fit`` (:mod:`conductor.routing.fit_worker`
reads the topics and publishes): it keeps a sliding window of served requests per model, each
paired with the profile its decision was made under (the outcome names its decision's control
offset; the fitter folds the ``set_profile`` records it sees; a window holds the requests of one
profile: a new one starts it again), refits the profile
(:func:`~conductor.costmodel.profiles.fit_outcomes`) every ``refit_every`` new requests, and returns a
``set_profile`` command when the fit moved beyond ``threshold`` from the one in force. The
routers apply it in log order, so every later decision records the offset of the profile it
was made with and ``explain`` re-derives it exactly.

The outcome carries what the fit needs of its decision (predicted TTFT and TBT, predicted
reuse, control offset), so no join with ``dispatch`` is needed: one topic, one record per request.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from conductor.costmodel.profiles import (
    CostFit,
    ModelProfile,
    OutcomeSample,
    fit_moved,
    fit_outcomes,
    predicted_queue_s,
)
from conductor.errors import ConfigError
from conductor.stats import percentile
from schemas import ControlCommand, RequestOutcome

log = logging.getLogger(__name__)

ALL_MODELS = "*"
"""The window key when the fitter pools every model (``FitConfig.model`` None)."""


@dataclass(frozen=True, slots=True)
class FitConfig:
    window: int = 400
    """Served requests kept per model (the newest)."""
    min_rows: int = 30
    """No fit before this many."""
    refit_every: int = 20
    """Refit after this many new requests."""
    threshold: float = 0.10
    """Publish when the fit's predictions move by more than this (relative)."""
    model: str | None = None
    """Fit this model's requests only (routers hold one profile); None: every model pooled."""

    def __post_init__(self) -> None:
        if self.window < 4 or self.min_rows < 4 or self.min_rows > self.window:
            raise ConfigError(f"fit window {self.window} and min_rows {self.min_rows}: need 4 <= min_rows <= window")
        if self.refit_every < 1 or not self.threshold >= 0:
            raise ConfigError("fit refit_every must be >= 1 and threshold >= 0")


def sample_of(o: RequestOutcome, profile: ModelProfile) -> OutcomeSample | None:
    """The fit's view of one outcome decided under ``profile``; None when it was not served
    with a first token and a prediction (rejections, failures, outcomes of v1 gateways)."""
    if (o.status != 200 or o.error is not None or o.ttft_s is None or o.decided_s is None
            or o.predicted_ttft_s is None or o.prompt_tokens <= 0):
        return None
    ttft = o.ttft_s - o.decided_s
    if ttft <= 0:
        return None
    reused = o.reused_tokens or 0
    return OutcomeSample(
        prompt_tokens=o.prompt_tokens, reused_tokens=reused,
        queue_s=predicted_queue_s(profile, o.predicted_ttft_s, o.prompt_tokens, reused),
        ttft_s=ttft, predicted_ttft_s=o.predicted_ttft_s,
        tbt_ms=o.tbt_p50_ms if o.output_tokens > 1 else None, predicted_tbt_ms=o.predicted_tbt_ms)


@dataclass(frozen=True, slots=True)
class Span:
    """When a served request held its instance: from its decision to its end (ms since the epoch)."""

    node: str
    decided_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True)
class _Entry:
    sample: OutcomeSample
    span: Span | None
    profile: ModelProfile
    predicted_ttft_s: float


def span_of(o: RequestOutcome, ts_ms: int | None) -> Span | None:
    """The span of a served outcome published at ``ts_ms`` (its envelope's time: the request's end)."""
    if ts_ms is None or o.decided_s is None or not o.prefill_instance:
        return None
    start = ts_ms - 1000.0 * o.total_s
    return Span(o.prefill_instance, start + 1000.0 * o.decided_s, float(ts_ms))


def running_at(span: Span, spans: Iterable[Span]) -> int:
    """Requests holding ``span``'s instance when it was decided (what the router counts as its batch)."""
    return sum(1 for x in spans if x.node == span.node and x.decided_ms < span.decided_ms < x.end_ms and x != span)


Vet = Callable[[CostFit, ModelProfile, Sequence[tuple[OutcomeSample, ModelProfile]]], str | None]
"""(the fit, the profile in force, the window's samples with the profile each was decided under) ->
why the fit must not be published, or None."""


class CostFitter:
    """Outcomes and control records in log order in; ``set_profile`` commands out.

    The running requests a decision met are counted from the outcomes themselves: those whose
    span (decision to end) on the same instance covers its decision instant."""

    def __init__(self, base: ModelProfile, config: FitConfig | None = None, *, vet: Vet | None = None) -> None:
        self.config = config or FitConfig()
        self.vet = vet
        """Asked before a fit that moved is published: why not (None: publish); ``conductor fit`` passes
        :meth:`conductor.costmodel.guard.FitGuard.review`."""
        self._offsets: list[int] = [-1]
        self._profiles: list[ModelProfile] = [base]
        self.windows: dict[str, deque[_Entry]] = {}
        self.spans: deque[Span] = deque(maxlen=4 * self.config.window)
        self._since: dict[str, int] = {}
        self.last_fit: dict[str, CostFit] = {}
        self.published: ModelProfile = base
        """The profile in force (the last ``set_profile`` seen or returned)."""

    def profile_at(self, offset: int | None) -> ModelProfile:
        """The profile a decision of control offset ``offset`` was made under."""
        i = bisect.bisect_right(self._offsets, -1 if offset is None else offset) - 1
        return self._profiles[max(i, 0)]

    def on_control(self, offset: int, cmd: ControlCommand) -> None:
        if cmd.action != "set_profile" or not cmd.profile or offset <= self._offsets[-1]:
            return
        try:
            prof = ModelProfile.model_validate(dict(cmd.profile))
        except ValueError as e:
            log.warning("control offset %d: set_profile skipped: %s", offset, e)
            return
        self._offsets.append(offset)
        self._profiles.append(prof)
        self.published = prof

    def on_outcome(self, o: RequestOutcome, ts_ms: int | None = None) -> ControlCommand | None:
        """Take one outcome (``ts_ms``: its envelope's time); a ``set_profile`` to publish when a
        refit moved enough."""
        cfg = self.config
        span = span_of(o, ts_ms) if o.status == 200 and o.error is None else None
        if span is not None:
            self.spans.append(span)  # every model's requests share the instance
        if cfg.model is not None and o.model != cfg.model:
            return None
        prof = self.profile_at(o.control_offset)
        s = sample_of(o, prof)
        if s is None or o.predicted_ttft_s is None:
            return None
        key = (o.model or "default") if cfg.model is not None else ALL_MODELS
        win = self.windows.setdefault(key, deque(maxlen=cfg.window))
        win.append(_Entry(s, span, prof, o.predicted_ttft_s))
        self._since[key] = self._since.get(key, 0) + 1
        if len(win) < cfg.min_rows or self._since[key] < cfg.refit_every:
            return None
        self._since[key] = 0
        return self.refit(key)

    def samples(self, key: str) -> list[OutcomeSample]:
        """The window's samples with the running requests each met (and its queue wait without them)."""
        spans = list(self.spans)
        out = []
        for e in self.windows.get(key, ()):
            s = e.sample
            if e.span is not None:
                n = running_at(e.span, spans)
                s = dataclasses.replace(s, running=float(n), queue_s=predicted_queue_s(
                    e.profile, e.predicted_ttft_s, s.prompt_tokens, s.reused_tokens, float(n)))
            out.append(s)
        return out

    def refit(self, key: str) -> ControlCommand | None:
        # Every sample's queue wait was derived under the profile its decision used, and the fit
        # maps those waits onto real ones: refit from the profile in force, keeping its l, d, FLOP/s.
        base = self.published
        samples = self.samples(key)
        try:
            fit = fit_outcomes(samples, base)
        except ConfigError as e:
            log.info("no fit yet: %s", e)
            return None
        self.last_fit[key] = fit
        if not fit_moved(base, fit.profile, self.config.threshold):
            return None
        window = [(s, e.profile) for s, e in zip(samples, self.windows[key])]
        why = None if self.vet is None else self.vet(fit, base, window)
        if why is not None:
            log.warning("fit of %d requests not published: %s", fit.rows, why)
            return None
        self.published = fit.profile
        # The window's queue waits were predicted under the old profile: start a new window.
        self.windows[key].clear()
        return ControlCommand(
            action="set_profile", profile=fit.profile.model_dump(), model=None if key == ALL_MODELS else key,
            reason=f"fitted on {fit.rows} served requests: TTFT error p50 {fit.profile.ttft_error_p50:.1%}, "
                   f"p90 {fit.profile.ttft_error_p90:.1%} (out of sample)",
            operator="conductor-fit")


def prediction_error_summary(outcomes: Iterable[RequestOutcome], time_scale: float = 1.0) -> dict[str, float | None]:
    """TTFT and TBT prediction error (|predicted - real| / real, p50 and p90) of served requests'
    outcomes, as their decisions predicted them, and the TTFT error's sign (``ttft_prediction_bias_p50``:
    the median of (predicted - real) / real; below 0: the predictions are too short). ``time_scale``:
    real seconds are this many model seconds (an emulated engine run faster than its profile)."""
    ttft: list[float] = []
    bias: list[float] = []
    tbt: list[float] = []
    for o in outcomes:
        if o.status != 200 or o.error is not None or o.ttft_s is None or o.decided_s is None:
            continue
        real = (o.ttft_s - o.decided_s) * time_scale
        if o.predicted_ttft_s is not None and real > 0:
            ttft.append(abs(o.predicted_ttft_s - real) / real)
            bias.append((o.predicted_ttft_s - real) / real)
        if o.tbt_p50_ms and o.output_tokens > 1 and o.predicted_tbt_ms is not None:
            real_tbt = o.tbt_p50_ms * time_scale
            tbt.append(abs(o.predicted_tbt_ms - real_tbt) / real_tbt)

    def q(v: list[float], p: float) -> float | None:
        x = percentile(v, p)
        return None if x is None else round(x, 4)

    return {"ttft_prediction_error_p50": q(ttft, 50), "ttft_prediction_error_p90": q(ttft, 90),
            "ttft_prediction_bias_p50": q(bias, 50),
            "tbt_prediction_error_p50": q(tbt, 50), "tbt_prediction_error_p90": q(tbt, 90)}


__all__ = ["ALL_MODELS", "CostFitter", "FitConfig", "Span", "prediction_error_summary", "running_at", "sample_of",
           "span_of"]
