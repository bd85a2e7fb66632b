"""`conductor bench decision-record`: the fold it times is the real one, and bad rates are refused."""

from __future__ import annotations

from typer.testing import CliRunner

from conductor.cli import app
from conductor.harness.bench.decision_record import run_decision_record_bench


def test_each_rate_keeps_a_ttl_of_placements_live_and_reports_its_cost() -> None:
    out = run_decision_record_bench([50, 200], seconds=4.0, ttl_s=1.0)
    for rate in (50, 200):
        r = out["rates"][str(rate)]
        assert r["decisions"] == rate * 4
        # Requests placed in the last TTL (1 s) are still pending; older ones expired.
        assert rate * 0.9 <= r["placements_live"] <= rate * 1.1, r
        assert 0 < r["us_per_decision_p50"] <= r["us_per_decision_p99"]
        assert r["core_share_at_rate"] > 0


def test_rates_that_are_not_integers_are_refused_naming_the_option() -> None:
    res = CliRunner().invoke(app, ["bench", "decision-record", "--rates", "100,lots"])
    assert res.exit_code == 2
    assert "--rates" in res.output
