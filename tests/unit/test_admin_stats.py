"""The admin feed's stats: observed TTFT from the gateways' outcomes, predicted against observed
over time, and the two per-instance reuse figures (a log feed fed by hand)."""

from __future__ import annotations

import pytest

from conductor.admin.feed import SERIES_POINTS, LogFeed
from conductor.settings import load_settings
from schemas import RequestOutcome, RoutingDecision

NOW = 1_800_000_000_000


@pytest.fixture
def feed() -> LogFeed:
    return LogFeed(load_settings(kafka_url=None, redis_url=None))


def served(rid: str, ttft: float, predicted: float, routing_ms: float = 0.0, **kw: object) -> RequestOutcome:
    return RequestOutcome(request_id=rid, gateway="gw", status=200, prefill_instance="p0", prompt_tokens=1000,
                          cached_tokens=100, predicted_ttft_s=predicted, ttft_s=ttft, routing_ms=routing_ms or None,
                          **kw)  # type: ignore[arg-type]


def test_observed_ttft_comes_from_the_outcomes(feed: LogFeed) -> None:
    assert feed.stats(now_ms=NOW)["observed_ttft_p50_s"] is None  # no outcome yet: nothing observed
    for i in range(10):  # 0.1 .. 1.0 s as the client saw it, 50 ms of it routing
        feed.on_outcome(served(f"r{i}", 0.1 * (i + 1), 0.2, routing_ms=50.0), NOW - 1000)
    feed.on_outcome(RequestOutcome(request_id="x", gateway="gw", status=429, error="ttft_slo"), NOW - 1000)
    feed.on_outcome(RequestOutcome(request_id="y", gateway="gw", status=200, error="engine_failed"), NOW - 1000)
    feed.on_outcome(served("old", 9.0, 0.2), NOW - 60_000)  # outside the 10 s window
    st = feed.stats(now_ms=NOW)
    assert st["observed_requests"] == 10
    assert st["observed_ttft_p50_s"] == pytest.approx(0.45)  # the engines' part: routing taken out
    assert st["observed_ttft_p90_s"] == pytest.approx(0.85)
    assert st["client_ttft_p50_s"] == pytest.approx(0.5)
    assert st["engine_cache_hit_ratio"] == 0.1


def test_ttft_series_pairs_prediction_and_observation_per_bucket(feed: LogFeed) -> None:
    feed.on_outcome(served("a", 1.0, 0.5), NOW - 25_000)
    feed.on_outcome(served("b", 3.0, 0.5), NOW - 21_000)
    feed.on_outcome(served("c", 0.4, 0.3), NOW - 1_000)
    feed.on_outcome(served("gone", 1.0, 0.5), NOW - (SERIES_POINTS + 1) * 10_000)
    series = feed.stats(window_s=10.0, now_ms=NOW)["ttft_series"]
    assert series == [
        {"t_ms": NOW - 20_000, "requests": 2, "predicted_ttft_p50_s": 0.5, "observed_ttft_p50_s": 1.0},
        {"t_ms": NOW, "requests": 1, "predicted_ttft_p50_s": 0.3, "observed_ttft_p50_s": 0.4},
    ]


def test_hit_rate_and_reuse_ratio_are_two_definitions_both_given(feed: LogFeed) -> None:
    """Every request reuses its 32-token system prompt of a 1,000-token prompt: a hit rate of
    100 % beside a token reuse of 3.2 % (what a console showed unlabelled: 90-100 % against 4.5 %)."""
    for i in range(20):
        feed.prompt_tokens[f"r{i}"] = 1000
        feed.on_dispatch(RoutingDecision(request_id=f"r{i}", prefill_instance="p0", decode_instance="d0",
                                         reused_tokens=32, predicted_ttft_s=0.1, predicted_tbt_ms=10,
                                         policy="kvcache-centric"), NOW - 500)
    st = feed.stats(now_ms=NOW)
    assert st["hit_rate_by_instance"] == {"p0": 1.0}
    assert st["reuse_ratio_by_instance"] == {"p0": 0.032} == {"p0": st["reuse_ratio"]}
