"""A fit cannot lock the cluster out (issue 36, item 3): bounded profiles, a fit published only when
it beats the profile in force on the same window and not too soon after the last, and an automatic
revert when early rejection turns requests away after a ``set_profile``."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from conductor.costmodel.fitting import CostFitter, FitConfig
from conductor.costmodel.guard import REVERT, FitGuard, GuardConfig, in_force_errors, wire
from conductor.costmodel.profiles import (
    DEFAULT_PROFILE,
    CostFit,
    ModelProfile,
    OutcomeSample,
    fit_outcomes,
    load_profile,
    profile_from_dict,
)
from conductor.errors import ConfigError
from conductor.routing.control import ControlState, apply_control
from schemas import ControlCommand, RequestOutcome

BASE = load_profile(DEFAULT_PROFILE)


def engine_ttft(prompt: int, reused: int) -> float:
    return 0.030 + 50e-6 * (prompt - reused)


def window(n: int, seed: int = 0) -> list[tuple[OutcomeSample, ModelProfile]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randrange(64, 4096)
        out.append((OutcomeSample(prompt, 0, 0.0, engine_ttft(prompt, 0), predicted_ttft_s=BASE.prefill_seconds(prompt)),
                    BASE))
    return out


def good_fit(n: int = 60) -> CostFit:
    return fit_outcomes([s for s, _ in window(n)], BASE)


# --- bounds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("a", math.inf), ("b", 1e300), ("effective_flops", math.nan),
                                         ("ttft_ratio_p90", 20.0), ("ttft_error_p90", 9.0),
                                         ("hbm_bandwidth", 1e300), ("running_wait_s", 1e6)])
def test_the_schema_refuses_implausible_coefficients(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        profile_from_dict({**BASE.model_dump(), field: value})
    # Every router's fold skips such a set_profile (the profile in force stays).
    st = apply_control(ControlState(), ControlCommand(action="set_profile", profile={**wire(BASE), field: value}), 1)
    assert st.profile is None and "skipped" in st.last_error


def test_the_shipped_profiles_are_within_bounds() -> None:
    assert profile_from_dict({**BASE.model_dump(), "ttft_ratio_p90": 4.0}).ttft_ratio_p90 == 4.0


# --- before publishing -------------------------------------------------------------------------


def test_a_fit_that_beats_the_profile_in_force_on_the_window_passes() -> None:
    g = FitGuard(BASE)
    assert g.review(good_fit(), BASE, window(60)) is None


def test_a_fit_out_of_bounds_is_not_published() -> None:
    fit = good_fit()
    stalled = CostFit(fit.profile.model_copy(update={"ttft_ratio_p90": 25.0}), fit.rows, fit.ttft_errors, ())
    why = FitGuard(BASE).review(stalled, BASE, window(60))
    assert why is not None and "out of bounds" in why and "ttft_ratio_p90" in why


def test_a_fit_no_better_than_the_profile_in_force_is_not_published() -> None:
    fit = good_fit()
    # As good as the profile in force on the same requests: nothing gained, not published.
    same = CostFit(fit.profile, fit.rows, tuple(in_force_errors(BASE, window(60))), ())
    why = FitGuard(BASE).review(same, BASE, window(60))
    assert why is not None and "does not beat" in why
    worse = CostFit(fit.profile, fit.rows, tuple(e + 5.0 for e in fit.ttft_errors), ())
    assert "does not beat" in (FitGuard(BASE).review(worse, BASE, window(60)) or "")


def test_publications_are_spaced() -> None:
    g = FitGuard(BASE, GuardConfig(min_interval_s=600))
    g.on_control(3, ControlCommand(action="set_profile", profile=wire(good_fit().profile)), ts_ms=1_000_000)
    g.on_outcome(RequestOutcome(request_id="r", gateway="gw", status=200), ts_ms=1_000_000 + 599_000)
    why = g.review(good_fit(), BASE, window(60))
    assert why is not None and "under 600 s ago" in why
    g.on_outcome(RequestOutcome(request_id="r", gateway="gw", status=200), ts_ms=1_000_000 + 601_000)
    assert g.review(good_fit(), BASE, window(60)) is None


def test_the_fitter_asks_the_guard_and_keeps_its_profile_when_refused() -> None:
    asked: list[int] = []

    def refuse(fit: CostFit, in_force: ModelProfile, win: Sequence[tuple[OutcomeSample, ModelProfile]]) -> str:
        asked.append(len(win))
        assert in_force is BASE and all(p is BASE for _, p in win)
        return "no"

    f = CostFitter(BASE, FitConfig(window=100, min_rows=10, refit_every=10), vet=refuse)
    for i in range(10):
        p = 200 + 37 * i
        o = RequestOutcome(request_id=f"r{i}", gateway="gw", status=200, prompt_tokens=p, output_tokens=1,
                           predicted_ttft_s=BASE.prefill_seconds(p), decided_s=0.001,
                           ttft_s=0.001 + engine_ttft(p, 0), control_offset=-1)
        assert f.on_outcome(o) is None
    assert asked == [10] and f.published is BASE and len(f.windows["*"]) == 10


# --- after publishing --------------------------------------------------------------------------


def served(i: int) -> RequestOutcome:
    return RequestOutcome(request_id=f"s{i}", gateway="gw", status=200)


def turned_away(i: int) -> RequestOutcome:
    return RequestOutcome(request_id=f"x{i}", gateway="gw", status=429, error="ttft_slo")


def test_rejections_jumping_after_a_set_profile_revert_it() -> None:
    g = FitGuard(BASE, GuardConfig(watch_s=300, watch_min_requests=20, rejection_jump=0.25))
    t = 1_000_000
    for i in range(100):  # 10 % rejected before
        assert g.on_outcome(turned_away(i) if i % 10 == 0 else served(i), t + i) is None
    bad = good_fit().profile.model_copy(update={"name": "stalled-fit"})
    g.on_control(7, ControlCommand(action="set_profile", profile=wire(bad)), ts_ms=t + 200)
    out = [g.on_outcome(turned_away(100 + i), t + 300 + i) for i in range(20)]
    assert out[:19] == [None] * 19
    cmd = out[19]
    assert cmd is not None and cmd.action == "set_profile" and cmd.reason.startswith(REVERT)
    assert cmd.profile is not None and cmd.profile["name"] == BASE.name and "offset 7" in cmd.reason
    assert g.reverts == 1
    # The revert itself is not watched (no flip-flop), and the record read back is taken once.
    g.on_control(8, cmd, ts_ms=t + 400)
    g.on_control(8, cmd, ts_ms=t + 400)
    assert g.watch is None and g.in_force.name == BASE.name
    assert all(g.on_outcome(turned_away(200 + i), t + 500 + i) is None for i in range(50))


def test_no_revert_when_rejections_hold_or_the_watch_ended() -> None:
    g = FitGuard(BASE, GuardConfig(watch_s=60, watch_min_requests=10, rejection_jump=0.25))
    t = 5_000_000
    for i in range(50):
        g.on_outcome(turned_away(i) if i % 2 else served(i), t + i)  # 50 % rejected before
    g.on_control(1, ControlCommand(action="set_profile", profile=wire(good_fit().profile)), ts_ms=t + 100)
    assert all(g.on_outcome(turned_away(i) if i % 2 else served(i), t + 200 + i) is None for i in range(40))
    g.on_control(2, ControlCommand(action="set_profile", profile=wire(good_fit().profile)), ts_ms=t + 1000)
    # A minute later, the set_profile is no longer watched: what comes then is not its doing.
    assert all(g.on_outcome(turned_away(i), t + 62_000 + i) is None for i in range(40))
    # Folded at start (no time): never watched.
    g2 = FitGuard(BASE)
    g2.on_control(1, ControlCommand(action="set_profile", profile=wire(good_fit().profile)))
    assert g2.watch is None


def test_in_force_errors_are_those_it_predicts_on_the_window() -> None:
    win = window(10)
    errs = in_force_errors(BASE, win)
    s = win[3][0]
    assert len(errs) == 10 and errs[3] == pytest.approx(abs(BASE.prefill_seconds(s.prompt_tokens) - s.ttft_s) / s.ttft_s)


def test_guard_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        GuardConfig(rejection_jump=2.0)
