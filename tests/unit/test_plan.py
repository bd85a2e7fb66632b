"""``conductor plan``'s search, forecast and record: the minimum on toy cost models, then end to end on a tiny trace."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conductor.cli import app
from conductor.errors import ConfigError
from conductor.harness.bench.plan import difference_points, measured_attainment, ttft_split
from conductor.harness.demo import RunStats
from conductor.harness.plan.forecast import forecast_growth
from conductor.harness.plan.planner import ClusterScore, Plan, PlanConfig
from conductor.harness.plan.search import Probe, SearchLimits, find_plan
from conductor.harness.plan.serve import plan_record
from conductor.settings import Settings
from schemas import decode, encode, envelope
from schemas.records import CapacityPlan
from tests.unit.test_sim_cli import tiny_trace


def toy(load: float, *, per_prefill: float = 1.0, per_decode: float = 2.5, joint: bool = False,
        unservable: float = 0.0):
    """A cluster where each role serves its share of ``load`` in proportion to its instances; ``joint``
    couples the roles (attainment is the product, as when a slow prefill delays decode), and
    ``unservable`` of the requests are missed by any cluster."""
    calls: list[tuple[int, int]] = []

    def evaluate(p: int, d: int, stop_below: float | None = None) -> Probe:
        calls.append((p, d))
        ttft = min(1.0, p * per_prefill / load) * (1 - unservable)
        tbt = min(1.0, d * per_decode / load)
        both = ttft * tbt if joint else min(ttft, tbt)
        if stop_below is not None and both < stop_below:
            # As a stopped replay reports it: bounds, somewhere between the truth and the share asked for.
            cut = lambda x: x + (1.0 - x) * 0.5 * (stop_below - both) / max(1e-9, 1.0 - both)
            return Probe(p, d, cut(both), cut(ttft), cut(tbt), stopped=True)
        return Probe(p, d, both, ttft, tbt)

    return evaluate, calls


def brute_force(evaluate, goal: float, top: int = 64) -> set[tuple[int, int]]:
    """Every pair of least total size meeting ``goal``."""
    ok = [(p, d) for p, d in itertools.product(range(1, top + 1), repeat=2) if evaluate(p, d).slo_attainment >= goal]
    least = min(p + d for p, d in ok)
    return {(p, d) for p, d in ok if p + d == least}


@pytest.mark.parametrize("load,start", [(10.0, (16, 8)), (37.0, (16, 8)), (3.0, (2, 1)), (100.0, (4, 4))])
def test_finds_the_minimum_of_independent_roles(load, start):
    evaluate, calls = toy(load)
    found = find_plan(evaluate, start=start, target=0.99)
    assert found.target_met and found.at_plan.slo_attainment >= 0.99
    assert (found.prefill, found.decode) in brute_force(toy(load)[0], 0.99, top=256)
    assert found.prefill == math.ceil(0.99 * load) and found.decode == math.ceil(0.99 * load / 2.5)
    # the doublings to the bracket, then about log2 of it per role and the joint check: not P x D
    bracket = max(*start, found.prefill, found.decode)
    assert len(set(calls)) <= 3 * math.ceil(math.log2(2 * bracket)) + 2


def test_coupled_roles_are_checked_together_and_the_plan_meets_the_target():
    evaluate, _ = toy(20.0, joint=True)
    found = find_plan(evaluate, start=(16, 8), target=0.95)
    assert found.at_plan.slo_attainment >= 0.95
    least = min(p + d for p, d in brute_force(toy(20.0, joint=True)[0], 0.95))
    assert found.prefill + found.decode <= least + 2  # each step up is one instance here


def test_more_traffic_never_plans_fewer_instances():
    plans = [find_plan(toy(load)[0], start=(8, 4), target=0.99) for load in (2.0, 5.0, 9.0, 17.0, 40.0)]
    for a, b in itertools.pairwise(plans):
        assert b.prefill >= a.prefill and b.decode >= a.decode
    assert plans[-1].prefill > plans[0].prefill


def test_a_target_no_cluster_meets_plans_for_the_best_reachable_and_says_so():
    evaluate, calls = toy(10.0, unservable=0.02)
    found = find_plan(evaluate, start=(16, 8), target=0.99)
    assert not found.target_met
    assert found.goal == pytest.approx(0.98 - SearchLimits().slack)
    assert (found.prefill, found.decode) in brute_force(toy(10.0, unservable=0.02)[0], found.goal)
    assert max(p for p, _ in calls) <= 32  # doubling stopped once it no longer helped


def test_the_budget_bounds_the_simulations():
    evaluate, calls = toy(300.0)
    found = find_plan(evaluate, start=(1, 1), target=0.99, limits=SearchLimits(max_instances=1024, max_runs=6))
    assert len(calls) == 6 and found.exhausted
    assert found.at_plan.slo_attainment >= found.goal or not found.target_met


def test_limits_and_config_are_checked():
    with pytest.raises(ConfigError):
        SearchLimits(max_runs=1)
    with pytest.raises(ConfigError, match="--trace FILE or --since"):
        PlanConfig()
    with pytest.raises(ConfigError, match="--forecast"):
        PlanConfig(since="1h", forecast=True, growth=1.5)


def test_forecast_follows_the_trend_and_never_plans_below_today():
    rising = [t * 1000.0 for t in range(3600) for _ in range(1 + t // 1200)]  # 1, 2, then 3 req/s
    fc = forecast_growth(rising, horizon_s=3600.0)
    assert fc.growth > 1.5 and fc.slope_rps_per_h > 0
    flat = [t * 500.0 for t in range(7200)]
    assert forecast_growth(flat).growth == pytest.approx(1.0, abs=0.02)
    falling = [t * 1000.0 for t in range(3600) for _ in range(3 - t // 1200)]
    assert forecast_growth(falling).growth == 1.0
    assert forecast_growth([]).growth == 1.0


def _score(p: int, d: int, att: float) -> ClusterScore:
    return ClusterScore(prefill=p, decode=d, predicted_slo_attainment=att, ttft_attainment=att, tbt_attainment=1.0,
                        goodput_rps=3.3, rejection_rate=0.01, ttft_p90_s=2.0, tbt_p90_ms=40.0, headroom=0.2)


def test_the_plan_record_crosses_the_wire():
    plan = Plan(plan=_score(6, 3, 0.991), cluster=_score(16, 8, 0.995), target=0.99, goal=0.99, target_met=True,
                growth=1.5, forecast=None, speed=1.5, arrival_rps=5.1, policy="kvcache-centric",
                model_profile="llama3-70b-a800x8", ttft_slo_s=30.0, tbt_slo_ms=100.0, source="topics", requests=900,
                window_ms=(1_700_000_000_000, 1_700_003_600_000), simulations=11, stopped_early=4, exhausted=False, plan_wall_s=40.0,
                probes=())
    rec = plan_record(plan)
    back = decode(encode(envelope(rec, producer_id="planner-a", producer_seq=1, ts_ms=1)))
    assert isinstance(back.body, CapacityPlan) and back.body == rec
    assert (rec.prefill, rec.decode, rec.cluster_prefill, rec.cluster_decode) == (6, 3, 16, 8)
    out = plan.as_dict()
    assert (out["prefill"], out["decode"], out["predicted_slo_attainment"]) == (6, 3, 0.991)
    assert out["cluster"]["prefill"] == 16 and out["cluster"]["predicted_slo_attainment"] == 0.995


def test_plan_end_to_end_on_a_tiny_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    tiny_trace(trace, n=90)
    res = CliRunner().invoke(app, ["plan", "--trace", str(trace), "--cluster", "4P2D", "--target", "0.9",
                                   "--growth", "2", "--no-headroom", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("{")))
    assert out["cluster"]["prefill"] == 4 and out["cluster"]["decode"] == 2 and out["growth"] == 2
    for side in (out, out["plan"], out["cluster"]):  # what issue 37 asks --json to print, for both clusters
        assert isinstance(side["prefill"], int) and isinstance(side["decode"], int)
        assert 0.0 <= side["predicted_slo_attainment"] <= 1.0
    assert (out["prefill"], out["decode"]) == (out["plan"]["prefill"], out["plan"]["decode"])
    assert out["requests"] == 90 and out["simulations"] == len({(p, d) for p, d, _ in out["probes"]})
    assert out["predicted_slo_attainment"] >= out["goal"]
    smaller = [a for p, d, a in out["probes"] if (p, d) in ((out["prefill"] - 1, out["decode"]),
                                                            (out["prefill"], out["decode"] - 1))]
    assert all(a < out["goal"] for a in smaller)  # one fewer of either role misses, where it was tried


def test_time_scale_replays_the_log_in_model_time():
    assert PlanConfig(since="1h", time_scale=10.0).simulate_config(Settings()).speed == pytest.approx(0.1)
    assert PlanConfig(since="1h").simulate_config(Settings()).speed is None
    with pytest.raises(ConfigError, match="--time-scale"):
        PlanConfig(trace=Path("t.jsonl"), time_scale=10.0)
    with pytest.raises(ConfigError, match="--time-scale"):
        PlanConfig(since="1h", time_scale=0.0)


@pytest.mark.parametrize("ttft,tbt,both,ttft_share,tbt_share,served", [
    ({"a": 1.0, "b": 2.0, "c": 40.0}, {"a": 20.0, "b": 150.0, "c": 20.0}, 0.25, 0.5, 0.5, 3),  # d unanswered
    ({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 1.0, 1.0, 1.0, 4),
    ({}, {}, 0.0, 0.0, 0.0, 0),  # everything rejected: nothing met
])
def test_measured_attainment_counts_every_request_sent(ttft, tbt, both, ttft_share, tbt_share, served):
    att = measured_attainment(["a", "b", "c", "d"], ttft, tbt, ttft_slo_s=30.0, tbt_slo_ms=100.0)
    assert (att.requests, att.served, att.both, att.ttft, att.tbt) == (4, served, both, ttft_share, tbt_share)


def test_a_served_request_without_a_decode_report_is_counted_and_said():
    att = measured_attainment(["a", "b"], {"a": 1.0, "b": 1.0}, {"a": 10.0}, ttft_slo_s=30.0, tbt_slo_ms=100.0)
    assert att.both == 1.0 and att.without_tbt == 1
    assert difference_points(0.9412, 0.9882) == -4.7 and difference_points(1.0, 0.9) == 10.0


@pytest.mark.parametrize("load,joint,unservable", [(10.0, False, 0.0), (37.0, False, 0.0), (20.0, True, 0.0),
                                                   (10.0, False, 0.02)])
def test_probes_stopped_once_the_goal_is_out_of_reach_find_the_same_plan(load, joint, unservable):
    stopping, _ = toy(load, joint=joint, unservable=unservable)
    full = find_plan(lambda p, d, stop_below=None: stopping(p, d), start=(16, 8), target=0.99)
    found = find_plan(stopping, start=(16, 8), target=0.99)
    assert (found.prefill, found.decode, found.goal) == (full.prefill, full.decode, full.goal)
    assert not found.at_plan.stopped and not found.probes[0].stopped  # the plan and today's cluster: full runs
    assert any(p.stopped for p in found.probes) and all(p.slo_attainment < found.goal for p in found.probes if p.stopped)


def test_the_measured_ttft_splits_into_real_path_time_and_emulated_engine_time():
    stats = RunStats("kvcache-centric", speed=10.0)
    for rid, wall, model in (("a", 2.0, 10.0), ("b", 5.0, 20.0), ("c", 0.5, 10.0)):  # c: clocks overlap
        stats.on_client(rid, wall, 0.1)
        stats.emulated_s[rid] = model
    stats.on_client("no-reports", 3.0, 0.1)  # a retry under another id: no engine reports, left out
    split = ttft_split(stats)
    assert (split["path_p50_s"], split["engines_p50_s"]) == (1.0, 10.0)  # paths 1.0, 3.0 and 0.0
    assert split["path_p90_s"] == pytest.approx(2.6) and split["engines_p90_s"] == pytest.approx(18.0)
    assert ttft_split(RunStats("kvcache-centric")) == dict.fromkeys(split)
