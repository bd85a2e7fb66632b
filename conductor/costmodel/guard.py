"""What keeps ``conductor fit`` from locking the cluster out: the checks a fit passes before it is
published, and the automatic revert of a profile after which requests are rejected.

A fit drives early rejection (its ``ttft_ratio_p90`` is the margin a prediction is held to), and a
rejected request yields no sample to correct it: a window of stalled requests once fitted into a
ratio of 5-50 would admit nothing, for good. So :class:`FitGuard`

- refuses a fit the profile schema refuses (every coefficient bounded, ``ttft_ratio_p90`` at most
  :data:`~conductor.costmodel.profiles.MAX_TTFT_RATIO_P90`, no ``inf``),
- refuses a fit that does not beat the profile in force on the same window, out of sample (its
  p90 TTFT error lower by ``min_gain``, its p50 no higher),
- spaces publications by ``min_interval_s`` (from any ``set_profile``, an operator's too),
- watches the rejections in ``request-outcomes`` (early rejections come back as outcomes with their
  reason) for ``watch_s`` after each ``set_profile``; when their share jumps by ``rejection_jump``
  over the share before it, it returns a ``set_profile`` of the profile that was in force before.

Times are the log's (the outcomes' envelope times), so a replay decides the same. Pure.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, get_args

from conductor.costmodel.profiles import CostFit, ModelProfile, OutcomeSample, predict_ttft, profile_from_dict
from conductor.errors import ConfigError
from conductor.stats import percentile
from schemas import ControlCommand, RequestOutcome
from schemas.records import PolicyRejectReason

log = logging.getLogger(__name__)

MAX_DESCRIPTION = 256
"""A control record's text values are at most this long (``schemas``' scalar bound)."""

REVERT = "revert:"
"""The reason of a ``set_profile`` the guard published to undo one (never watched itself)."""

COST_REJECTIONS = frozenset(get_args(PolicyRejectReason)) - {"no_live_instance"}
"""Rejection reasons a cost model moves (an SLO predicted missed, an instance predicted overloaded)."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    min_interval_s: float = 600.0
    """No publication sooner than this after the last ``set_profile``."""
    min_gain: float = 0.05
    """The fit's out-of-sample p90 TTFT error must be this much (relative) below the one in force's."""
    watch_s: float = 300.0
    """How long after a ``set_profile`` its rejections are watched."""
    watch_min_requests: int = 20
    """Outcomes after a ``set_profile`` needed before it is judged."""
    rejection_jump: float = 0.25
    """Revert when the rejected share after a ``set_profile`` exceeds the share before by this; 0: never."""
    baseline: int = 200
    """Outcomes before a ``set_profile`` its rejection share is measured on."""

    def __post_init__(self) -> None:
        if not (self.min_interval_s >= 0 and self.min_gain >= 0 and self.watch_s >= 0
                and 0 <= self.rejection_jump <= 1 and self.watch_min_requests >= 1 and self.baseline >= 1):
            raise ConfigError("fit guard: intervals and gain >= 0, rejection_jump in [0, 1], counts >= 1")


def rejected(o: RequestOutcome) -> bool:
    """Whether ``o`` is a request a cost model's prediction turned away."""
    return o.error in COST_REJECTIONS


def in_force_errors(in_force: ModelProfile, window: Sequence[tuple[OutcomeSample, ModelProfile]]) -> list[float]:
    """|predicted - real| / real TTFT of the window's samples as ``in_force`` predicts them (each
    sample with the profile it was decided under): out of sample, the profile was fitted before."""
    return [abs(predict_ttft(in_force, s, under) - s.ttft_s) / s.ttft_s for s, under in window if s.ttft_s > 0]


@dataclass(slots=True)
class _Watch:
    offset: int
    since_ms: int
    before: float
    """The rejected share before the ``set_profile``."""
    previous: ModelProfile
    model: str | None
    seen: int = 0
    rejected: int = 0


class FitGuard:
    """Checks fits before they are published, and reverts a ``set_profile`` that made requests rejected.

    Fed in log order: :meth:`on_outcome` with every outcome (and its envelope time), :meth:`on_control`
    with every ``set_profile`` applied (``ts_ms`` None: from the fold at start, not watched)."""

    def __init__(self, in_force: ModelProfile, config: GuardConfig | None = None, *, model: str | None = None) -> None:
        self.config = config or GuardConfig()
        self.model = model
        self.in_force = in_force
        self.offset = -1
        """The last control offset taken (a record seen twice, once published, once read back, counts once)."""
        self.now_ms: int | None = None
        self.last_set_ms: int | None = None
        self.recent: deque[bool] = deque(maxlen=self.config.baseline)
        self.watch: _Watch | None = None
        self.reverts = 0

    # --- before publishing ----------------------------------------------------------------

    def review(self, fit: CostFit, in_force: ModelProfile,
               window: Sequence[tuple[OutcomeSample, ModelProfile]]) -> str | None:
        """Why ``fit`` must not be published now (None: it may)."""
        cfg = self.config
        if self.now_ms is not None and self.last_set_ms is not None:
            wait_s = cfg.min_interval_s - (self.now_ms - self.last_set_ms) / 1000.0
            if wait_s > 0:
                return f"the last set_profile was under {cfg.min_interval_s:g} s ago (next in {wait_s:.0f} s)"
        try:
            profile_from_dict(fit.profile.model_dump(), source="the fit")
        except ConfigError as e:
            return f"out of bounds: {e}"
        new50, new90 = percentile(fit.ttft_errors, 50), percentile(fit.ttft_errors, 90)
        old = in_force_errors(in_force, window)
        old50, old90 = percentile(old, 50), percentile(old, 90)
        if new50 is None or new90 is None or old50 is None or old90 is None:
            return "no TTFT error to compare on the window"
        if not (new90 <= old90 * (1.0 - cfg.min_gain) and new50 <= old50):
            return (f"it does not beat the profile in force on the same {len(old)} requests: TTFT error "
                    f"p50 {new50:.1%} / p90 {new90:.1%} against {old50:.1%} / {old90:.1%}")
        return None

    # --- after publishing -----------------------------------------------------------------

    def on_control(self, offset: int, cmd: ControlCommand, ts_ms: int | None = None) -> None:
        """A ``set_profile`` applied at ``offset`` (published at ``ts_ms``, None when folded at start)."""
        if cmd.action != "set_profile" or not cmd.profile or offset <= self.offset:
            return
        self.offset = offset
        try:
            prof = profile_from_dict(dict(cmd.profile), source=f"control offset {offset}")
        except ConfigError:
            return  # the routers skip it too: what is in force did not change
        previous, self.in_force = self.in_force, prof
        if ts_ms is None:
            return
        self.last_set_ms = ts_ms
        self.watch = None
        if self.config.rejection_jump > 0 and self.config.watch_s > 0 and not cmd.reason.startswith(REVERT):
            before = sum(self.recent) / len(self.recent) if self.recent else 0.0
            self.watch = _Watch(offset, ts_ms, before, previous, cmd.model)

    def on_outcome(self, o: RequestOutcome, ts_ms: int) -> ControlCommand | None:
        """Take one outcome; a ``set_profile`` reverting the one watched when its rejections jumped."""
        self.now_ms = ts_ms if self.now_ms is None else max(self.now_ms, ts_ms)
        if self.model is not None and o.model != self.model:
            return None
        bad = rejected(o)
        w = self.watch
        if w is None:
            self.recent.append(bad)
            return None
        if (self.now_ms - w.since_ms) / 1000.0 > self.config.watch_s:
            self.watch = None
            self.recent.append(bad)
            return None
        w.seen += 1
        w.rejected += bad
        if w.seen < self.config.watch_min_requests:
            return None
        share = w.rejected / w.seen
        if share < w.before + self.config.rejection_jump:
            return None
        self.watch = None
        self.reverts += 1
        log.error("control offset %d: %d of %d requests rejected since its set_profile (%.0f%% before): "
                  "reverting to %s", w.offset, w.rejected, w.seen, 100 * w.before, w.previous.name)
        return ControlCommand(
            action="set_profile", profile=wire(w.previous), model=w.model, operator="conductor-fit",
            reason=f"{REVERT} {w.rejected} of {w.seen} requests rejected after the set_profile at offset "
                   f"{w.offset} ({w.before:.0%} before)")


def wire(profile: ModelProfile) -> dict[str, Any]:
    """``profile`` as a ``set_profile`` carries it (a record's text fields are short: a shipped
    profile's long description is cut)."""
    return {**profile.model_dump(), "description": profile.description[:MAX_DESCRIPTION]}


__all__ = ["COST_REJECTIONS", "REVERT", "FitGuard", "GuardConfig", "in_force_errors", "rejected", "wire"]
