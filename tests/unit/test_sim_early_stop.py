"""A replay stopped once its SLO attainment cannot reach a share: the same verdict as the full replay, sooner."""

from __future__ import annotations

import pytest

from conductor.harness.sim.cluster import load_cluster
from conductor.harness.sim.session import Bench, miss_budget
from tests.unit.test_sim_cli import tiny_trace


@pytest.mark.parametrize(
    "requests,share,budget",
    [
        (100, 0.99, 1),
        (100, 0.95, 5),
        (100, 1.0, 0),
        (7, 0.5, 3),
        (12_031, 0.99, 120),
        (30_000, 0.99, 301),
        (0, 0.9, 0),
        (10, 0.0, 10),
    ],
)
def test_miss_budget_is_the_most_misses_the_rounded_attainment_allows(requests, share, budget):
    # 30,000 requests: 301 misses leave 0.98997, which the summary reports as 0.99.
    assert miss_budget(requests, share) == budget
    if requests:
        assert round((requests - budget) / requests, 4) >= share
        assert budget == requests or round((requests - budget - 1) / requests, 4) < share


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    trace = tmp_path_factory.mktemp("trace") / "t.jsonl"
    tiny_trace(trace, n=240)
    return Bench(trace, load_cluster())


@pytest.mark.parametrize("counts,speed", [("1P1D", 16.0), ("2P1D", 32.0)])
def test_a_cluster_that_misses_stops_early_with_bounds_below_the_share(bench, counts, speed):
    bench.cluster = load_cluster().with_counts(counts)
    full, _ = bench.run("kvcache-centric", speed)
    assert full["slo_attainment"] < 0.9 and not full["stopped_early"]
    cut, raw = bench.run("kvcache-centric", speed, stop_below=0.9)
    assert cut["stopped_early"] and raw.stopped_s is not None and raw.stopped_s < full["makespan_s"]
    assert raw.missed == miss_budget(240, 0.9) + 1
    # upper bounds: no lower than the whole replay's, and still below the share asked for
    for k in ("slo_attainment", "ttft_slo_attainment", "tbt_slo_attainment"):
        assert full[k] <= cut[k]
    assert cut["slo_attainment"] < 0.9
    assert sum(o.first_token_s == o.first_token_s for o in raw.outcomes) < full["served"]  # not every request ran


def test_a_cluster_that_meets_the_share_runs_to_the_end_unchanged(bench):
    bench.cluster = load_cluster().with_counts("8P4D")
    full, _ = bench.run("kvcache-centric", 1.0)
    assert full["slo_attainment"] >= 0.9
    cut, raw = bench.run("kvcache-centric", 1.0, stop_below=0.9)
    assert raw.stopped_s is None
    assert {k: v for k, v in cut.items() if k != "sim_wall_s"} == {k: v for k, v in full.items() if k != "sim_wall_s"}


def test_the_planner_reuses_a_stopped_run_only_for_a_question_it_answers(bench):
    from conductor.harness.plan.planner import _Runs

    runs = _Runs(bench, load_cluster(), "kvcache-centric", 16.0, None)
    assert runs.summary(1, 1, stop_below=0.9)["stopped_early"] and runs.runs == 1
    assert runs.summary(1, 1, stop_below=0.95)["stopped_early"] and runs.runs == 1  # below 0.9: below 0.95 too
    lower = runs.summary(1, 1, stop_below=0.5)  # below 0.9 says nothing about 0.5: run again (this one meets it)
    assert runs.runs == 2 and not lower["stopped_early"] and lower["slo_attainment"] >= 0.5
    assert runs.summary(1, 1) is lower and runs.runs == 2 and runs.stopped == 1
