"""Recorded traffic → simulator workload, and the calibration of the cost model to observed TTFTs."""

from __future__ import annotations

import math
import random

import pytest

from conductor.costmodel.profiles import load_profile
from conductor.errors import ConfigError
from conductor.harness.sim.cluster import load_cluster
from conductor.harness.sim.errors import SimulationError
from conductor.harness.sim.recorded import (
    calibrate,
    latest_heartbeats,
    parse_time,
    recorded_traffic,
    request_span,
    scale_compute,
)
from conductor.harness.sim.session import Bench
from schemas import Heartbeat, RequestOutcome, RoutingDecision, RoutingRequest, envelope
from schemas.records import request_chain_keys

BS = 16
T0 = 1_750_000_000_000


def _hb(node: str, role: str, ts: int, **kw) -> object:
    return envelope(Heartbeat(role=role, **kw), producer_id=node, producer_seq=0, ts_ms=ts)


def _traffic_envelopes(n: int = 40, seed: int = 1):
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(BS * 20)] for _ in range(3)]
    reqs, outs = [], []
    for i in range(n):
        tokens = systems[i % 3] + [rng.randrange(1, 30000) for _ in range(BS * rng.randrange(2, 30))]
        req = RoutingRequest(request_id=f"r{i}", token_ids=tokens, prompt_tokens=len(tokens), lora_name=None)
        reqs.append(envelope(req, producer_id="gw", producer_seq=i, ts_ms=T0 + 250 * i))
        outs.append(envelope(RequestOutcome(request_id=f"r{i}", gateway="gw", status=200, prompt_tokens=len(tokens),
                                            cached_tokens=0, output_tokens=5 + i, ttft_s=0.5, routing_ms=20.0),
                             producer_id="gw", producer_seq=i, ts_ms=T0 + 250 * i + 900))
    hbs = [_hb("p-a", "prefill", T0 - 500, total_kv_blocks=400, tier_capacity={"hbm": 400, "dram": 1000}),
           _hb("p-b", "prefill", T0 - 400, total_kv_blocks=400),
           _hb("d-a", "decode", T0 - 300, total_kv_blocks=5000),
           _hb("d-b", "decode", T0 - 200, total_kv_blocks=4000),
           _hb("gone", "prefill", T0 - 3_600_000)]
    return reqs, hbs, outs


def _base():
    return load_cluster().model_copy(update={"ttft_slo_s": 30.0, "tbt_slo_ms": 100.0})


def test_requests_keep_the_routers_block_keys_and_the_cluster_its_heartbeats() -> None:
    reqs, hbs, outs = _traffic_envelopes()
    retry = RoutingRequest(request_id="r0-retry", token_ids=[1] * 64, prompt_tokens=64, retry_of="r0")
    keyed = RoutingRequest(request_id="k", block_keys=[11, 12, 13], prompt_tokens=40)
    reqs += [envelope(retry, producer_id="gw", producer_seq=99, ts_ms=T0 + 1),
             envelope(keyed, producer_id="gw", producer_seq=100, ts_ms=T0 + 2)]
    dec = RoutingDecision(request_id="r0", prefill_instance="p-a", decode_instance="d-a", reused_tokens=0,
                          predicted_ttft_s=0.1, predicted_tbt_ms=10, policy="least-loaded", params={"x": 1})
    t = recorded_traffic(reqs, hbs, outs, [envelope(dec, producer_id="router", producer_seq=0, ts_ms=T0 + 5)],
                         base=_base(), block_size=BS)
    assert t.skipped == {"retry": 1}
    assert len(t.records) == 41 and t.request_ids[:3] == ["r0", "k", "r1"]
    first = reqs[0].body
    assert list(t.records[0].hash_ids) == request_chain_keys(first, BS) and t.records[0].keyed
    assert t.records[1].hash_ids == (11, 12)  # cut to the prompt's full blocks
    assert t.records[0].output_length == 5 and t.records[1].output_length == 256  # observed, else expected
    c = t.cluster
    assert (c.prefill_names, c.decode_names) == (("p-a", "p-b"), ("d-a", "d-b"))  # "gone" is an hour stale
    assert c.block_size == BS and c.prefill_cache_blocks == 1400 and c.prefill_cache_tier == "dram"
    assert c.decode_kv_tokens == 5000 * BS
    assert (t.recorded_policy, t.recorded_params) == ("least-loaded", {"x": 1})
    assert t.observed_ttft_s("r3") == pytest.approx(0.48)


def test_what_simulate_from_topics_keeps_of_the_log_changes_nothing() -> None:
    """The bounded reads keep each node's last heartbeat around the requests and the outcomes of
    the requests in range (conductor/harness/sim/from_topics.py): the same traffic comes out."""
    reqs, hbs, outs = _traffic_envelopes()
    hbs = [_hb("p-a", "prefill", T0 - 90_000, total_kv_blocks=100)] + hbs + [  # too early; later beats win
        _hb(n, r, T0 + 250 * i, total_kv_blocks=999) for i in range(30) for n, r in (("p-b", "prefill"),
                                                                                   ("d-a", "decode"))]
    for since, until in ((None, None), (T0 + 2_000, T0 + 5_000)):
        span = request_span(reqs, since_ms=since, until_ms=until)
        assert span is not None
        first, last, ids = span
        kept = latest_heartbeats(hbs, first, last)
        assert len(kept) == len({e.producer_id for e in kept}) <= 4
        a = recorded_traffic(reqs, hbs, outs, base=_base(), block_size=BS, since_ms=since, until_ms=until)
        b = recorded_traffic(reqs, kept, [o for o in outs if o.body.request_id in ids], base=_base(), block_size=BS,
                             since_ms=since, until_ms=until)
        assert (a.records, a.request_ids, a.cluster, a.roles) == (b.records, b.request_ids, b.cluster, b.roles)
        assert {r: a.observed_ttft_s(r) for r in a.request_ids} == {r: b.observed_ttft_s(r) for r in b.request_ids}
        assert (first, last) == (a.first_ms, a.last_ms)
    assert request_span(reqs, since_ms=T0 + 10**9) is None


def test_the_time_range_selects_requests_and_an_empty_one_says_so() -> None:
    reqs, hbs, outs = _traffic_envelopes()
    t = recorded_traffic(reqs, hbs, outs, base=_base(), block_size=BS, since_ms=T0 + 1000, until_ms=T0 + 2000)
    assert t.request_ids == ["r4", "r5", "r6", "r7", "r8"]
    with pytest.raises(SimulationError, match="no routing requests"):
        recorded_traffic(reqs, hbs, outs, base=_base(), block_size=BS, since_ms=T0 + 10**9)
    with pytest.raises(SimulationError, match="0 decode"):
        recorded_traffic(reqs, hbs[:2], outs, base=_base(), block_size=BS)


@pytest.mark.parametrize("text,expected", [
    ("30m", T0 - 1_800_000), ("2h", T0 - 7_200_000), ("1d", T0 - 86_400_000), ("1.5s", T0 - 1500),
    ("1749999999000", 1_749_999_999_000), ("2025-06-15T15:06:40+00:00", 1_750_000_000_000),
])
def test_parse_time(text: str, expected: int) -> None:
    assert parse_time(text, T0) == expected


def test_parse_time_names_the_flag_on_bad_input() -> None:
    with pytest.raises(ConfigError, match="--until 'yesterday'"):
        parse_time("yesterday", T0, "--until")


def test_scale_calibration_recovers_a_known_compute_speed() -> None:
    """Observations made by a cluster 3x slower at prefill than the profile: calibration finds ~3x."""
    reqs, hbs, _ = _traffic_envelopes(n=60, seed=3)
    t = recorded_traffic(reqs, hbs, [], base=_base(), block_size=BS)
    profile = load_profile(t.cluster.model_profile)
    bench = Bench(t.records, t.cluster, bucket_ms=1.0, profile=scale_compute(profile, 3.0))
    truth = bench.run("least-loaded", 1.0)[1]
    for o in truth.outcomes:
        rid = t.request_ids[o.index]
        t.observed[rid] = RequestOutcome(request_id=rid, gateway="gw", status=200, ttft_s=o.ttft_s)

    def simulate(p):
        bench.profile = p
        return bench.run("least-loaded", 1.0)[1]

    fitted, cal = calibrate(t, profile, simulate, policy="least-loaded", method="scale", tolerance=0.02)
    assert cal.requests == 60 and cal.iterations >= 2
    assert cal.simulated_ttft_p50_s < cal.observed_ttft_p50_s  # the uncalibrated profile is too fast
    assert cal.compute_scale == pytest.approx(3.0, rel=0.1)
    assert abs(cal.calibrated_ttft_p50_s / cal.observed_ttft_p50_s - 1) <= 0.02
    assert cal.error_p50 < 0.1 and fitted.effective_flops < profile.effective_flops
    assert "x" in cal.describe() and math.isfinite(cal.error_p50)


def test_calibration_without_outcomes_keeps_the_profile() -> None:
    reqs, hbs, _ = _traffic_envelopes(n=5)
    t = recorded_traffic(reqs, hbs, [], base=_base(), block_size=BS)
    profile = load_profile(t.cluster.model_profile)
    same, cal = calibrate(t, profile, lambda p: pytest.fail("no run needed"), policy="least-loaded")
    assert same is profile and cal.method == "off" and "no served request-outcomes" in cal.note
    with pytest.raises(ConfigError, match="--calibrate"):
        calibrate(t, profile, lambda p: None, policy="x", method="guess")


def test_fit_calibration_refits_the_prefill_coefficients_to_the_observations() -> None:
    reqs, hbs, _ = _traffic_envelopes(n=40, seed=4)
    t = recorded_traffic(reqs, hbs, [], base=_base(), block_size=BS)
    profile = load_profile(t.cluster.model_profile)
    bench = Bench(t.records, t.cluster, bucket_ms=1.0, profile=scale_compute(profile, 2.0))
    for o in bench.run("round-robin", 1.0)[1].outcomes:
        rid = t.request_ids[o.index]
        t.observed[rid] = RequestOutcome(request_id=rid, gateway="gw", status=200, ttft_s=o.ttft_s,
                                         prompt_tokens=o.input_length, cached_tokens=o.reused_tokens)

    def simulate(p):
        bench.profile = p
        return bench.run("round-robin", 1.0)[1]

    fitted, cal = calibrate(t, profile, simulate, policy="round-robin", method="fit")
    assert cal.method == "fit" and cal.fit_rmse_s is not None and fitted.name.endswith("-fit")
    before = abs(cal.simulated_ttft_p50_s - cal.observed_ttft_p50_s)
    assert abs(cal.calibrated_ttft_p50_s - cal.observed_ttft_p50_s) < before
    assert "fitted to 40 observed" in cal.describe()


def test_off_keeps_a_given_profile_and_says_how_well_it_matches() -> None:
    """A profile measured on the engines (``simulate --profile FILE``): no calibration, but the
    recorded policy is simulated once and its TTFT p50/p90 set against the observed ones."""
    reqs, hbs, _ = _traffic_envelopes(n=40, seed=5)
    t = recorded_traffic(reqs, hbs, [], base=_base(), block_size=BS)
    measured = scale_compute(load_profile(t.cluster.model_profile), 2.0)
    bench = Bench(t.records, t.cluster, bucket_ms=1.0, profile=measured)
    for o in bench.run("round-robin", 1.0)[1].outcomes:
        rid = t.request_ids[o.index]
        t.observed[rid] = RequestOutcome(request_id=rid, gateway="gw", status=200, ttft_s=o.ttft_s)

    def simulate(p):
        bench.profile = p
        return bench.run("round-robin", 1.0)[1]

    same, cal = calibrate(t, measured, simulate, policy="round-robin", method="off")
    assert same is measured and cal.method == "off" and cal.requests == 40
    assert cal.calibrated_ttft_p50_s == pytest.approx(cal.observed_ttft_p50_s)
    assert cal.calibrated_ttft_p90_s == pytest.approx(cal.observed_ttft_p90_s)
    assert cal.error_p50 == pytest.approx(0.0) and "the profile as given" in cal.describe()


def test_engines_and_policy_can_run_on_different_profiles() -> None:
    """A measured profile times the simulated engines; the policy still predicts with the routers'
    profile, as the recorded decisions did."""
    reqs, hbs, _ = _traffic_envelopes(n=20, seed=6)
    t = recorded_traffic(reqs, hbs, [], base=_base(), block_size=BS)
    routers = load_profile(t.cluster.model_profile)
    measured = scale_compute(routers, 5.0)
    alone = Bench(t.records, t.cluster, bucket_ms=1.0, profile=measured).run("least-loaded", 1.0)[1]
    split = Bench(t.records, t.cluster, bucket_ms=1.0, profile=measured, policy_profile=routers)
    res = split.run("least-loaded", 1.0)[1]
    by_index = {o.index: o for o in alone.outcomes}
    for o in res.outcomes:
        assert o.ttft_s == pytest.approx(by_index[o.index].ttft_s)  # the engines' time: the measured profile
        assert o.predicted_ttft_s < by_index[o.index].predicted_ttft_s / 2  # the policy's: the routers' (5x faster)
