"""Routing policies on hand-built snapshots: one table of cases per behaviour."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.errors import ConfigError
from conductor.routing.policies import POLICIES, Placement, Rejection, list_policies, make_policy
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest

PROFILE = load_profile(DEFAULT_PROFILE)
BS = 16


def P(node: str, prefix: tuple[int, int, int] = (0, 0, 0), queued: int = 0, nq: int = 0, rack: str = "r0", **kw) -> Instance:
    return Instance(node, kw.pop("role", "prefill"), prefix_blocks=prefix, queued_prefill_tokens=queued,
                    queued_requests=nq, rack=rack, **kw)


def D(node: str, batch: int = 0, ctx: int = 0, free: int = 0, total: int = 0, **kw) -> Instance:
    return Instance(node, "decode", batch_size=batch, decode_context_tokens=ctx, free_kv_blocks=free,
                    total_kv_blocks=total, **kw)


def snap(*instances: Instance) -> ClusterSnapshot:
    return ClusterSnapshot(instances=tuple(instances), block_size=BS)


def req(tokens: int = 2048, **kw) -> PolicyRequest:
    return PolicyRequest(request_id=kw.pop("rid", "r1"), prompt_tokens=tokens, chain_len=tokens // BS, **kw)


def decide(name: str, r: PolicyRequest, s: ClusterSnapshot, seed: int = 0, **params) -> Placement | Rejection:
    return make_policy(name, params, PROFILE).decide(r, s, random.Random(seed))


# --- cache-aware prefill: lowest TTFT, not the longest match ----------------------------

LONG_QUEUE = {"queued": 60_000, "nq": 10}  # ten 6k-token prompts: several seconds of prefill

PREFILL_CASES = [
    # (id, policy, params, instances, expected prefill, expected reuse source, expected reused blocks)
    ("long local match behind a long queue loses to a short queue", "kvcache-centric", {},
     [P("p0", (128, 128, 128), **LONG_QUEUE), P("p1")], "p1", "p0", 128),
    ("same for the cache-aware baseline (which recomputes)", "global-cache-aware", {},
     [P("p0", (128, 128, 128), **LONG_QUEUE), P("p1")], "p1", None, 0),
    ("an idle local match wins outright", "kvcache-centric", {},
     [P("p0", (128, 128, 128)), P("p1")], "p0", "p0", 128),
    ("cheap remote copy from the store beats recompute", "kvcache-centric", {},
     [P("p0"), P("p1", queued=500), Instance("s0", "store", prefix_blocks=(0, 128, 128), rack="r0")], "p0", "s0", 128),
    ("remote reuse switched off recomputes", "kvcache-centric", {"remote_reuse": False},
     [P("p0"), Instance("s0", "store", prefix_blocks=(0, 128, 128))], "p0", None, 0),
    ("a cross-rack copy still beats recompute", "kvcache-centric", {},
     [P("p0", rack="r1"), Instance("s0", "store", prefix_blocks=(128, 128, 128), rack="r0")], "p0", "s0", 128),
    ("the balancing threshold keeps a slightly longer remote prefix away", "kvcache-centric",
     {"kvcache_balancing_threshold": 2.0},
     [P("p0", (100, 100, 100)), P("p1", (110, 110, 110), **LONG_QUEUE)], "p0", "p0", 100),
    ("below the threshold, the longer remote prefix is copied", "kvcache-centric", {},
     [P("p0", (100, 100, 100)), P("p1", (128, 128, 128), **LONG_QUEUE)], "p0", "p1", 128),
    ("local-cache-aware takes the longest match regardless of its queue", "local-cache-aware", {},
     [P("p0", (128, 128, 128), **LONG_QUEUE), P("p1")], "p0", "p0", 128),
    ("local-cache-aware breaks equal matches by queue", "local-cache-aware", {},
     [P("p0", (64, 64, 64), queued=5000), P("p1", (64, 64, 64), queued=100)], "p1", "p1", 64),
    ("least-loaded ignores the cache", "least-loaded", {},
     [P("p0", (128, 128, 128), queued=10), P("p1")], "p1", None, 0),
    ("sglang-style: balanced and a good match -> the match", "sglang-style", {},
     [P("p0", (128, 128, 128), nq=3), P("p1", nq=1)], "p0", "p0", 128),
    ("sglang-style: imbalanced -> shortest queue", "sglang-style", {},
     [P("p0", (128, 128, 128), nq=200), P("p1", nq=1)], "p1", None, 0),
    ("sglang-style: poor match -> the emptiest cache", "sglang-style", {},
     [P("p0", (8, 8, 8), free_kv_blocks=10, total_kv_blocks=100), P("p1", free_kv_blocks=90, total_kv_blocks=100)],
     "p1", None, 0),
    ("dynamo-style: overlap outweighs a small queue", "dynamo-style", {},
     [P("p0", (128, 128, 128), queued=512), P("p1")], "p0", "p0", 128),
    ("dynamo-style: only HBM overlap counts", "dynamo-style", {},
     [P("p0", (0, 0, 128), queued=512), P("p1")], "p1", None, 0),
    ("dynamo-style: weight 0 makes it cache-blind", "dynamo-style", {"overlap_score_weight": 0.0},
     [P("p0", (128, 128, 128), free_kv_blocks=10, total_kv_blocks=100), P("p1", free_kv_blocks=90, total_kv_blocks=100)],
     "p1", None, 0),
    ("llm-d-style: prefix weight dominates by default", "llm-d-style", {},
     [P("p0", (128, 128, 128), queued=4000), P("p1")], "p0", "p0", 128),
    ("llm-d-style: queue weight can win", "llm-d-style", {"prefix_weight": 0.5},
     [P("p0", (128, 128, 128), queued=4000), P("p1")], "p1", None, 0),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_prefill_choice(case) -> None:
    _, name, params, prefills, want, want_source, want_blocks = case
    d = decide(name, req(), snap(*prefills, D("d0")), **params)
    assert isinstance(d, Placement), d
    assert (d.prefill, d.reuse_source, d.reused_blocks) == (want, want_source, want_blocks)
    assert d.decode == "d0"


def test_remote_copy_is_predicted_cheaper_than_recompute() -> None:
    s = snap(P("p0"), Instance("s0", "store", prefix_blocks=(0, 128, 128)), D("d0"))
    with_copy = decide("kvcache-centric", req(), s)
    without = decide("kvcache-centric", req(), s, remote_reuse=False)
    assert isinstance(with_copy, Placement) and isinstance(without, Placement)
    assert with_copy.reuse_tier == "dram"
    assert with_copy.predicted_ttft_s < without.predicted_ttft_s / 5


def test_ssd_prefix_is_skipped_when_recompute_is_cheaper() -> None:
    # A tiny model with slow SSD: reading from SSD costs more than computing the tokens.
    cheap = PROFILE.model_copy(update={"effective_flops": 1e18, "ssd_bandwidth": 1e6})
    pol = make_policy("kvcache-centric", {}, cheap)
    d = pol.decide(req(), snap(P("p0", (10, 10, 128)), D("d0")), random.Random(0))
    assert isinstance(d, Placement)
    assert (d.reused_blocks, d.reuse_tier) == (10, "hbm")


# --- decode: least loaded under the TBT SLO ---------------------------------------------

DECODE_CASES = [
    ("least loaded wins", "kvcache-centric", {}, [D("d0", 40, 400_000), D("d1", 2, 10_000)], "d1"),
    ("no room for the request -> skipped", "kvcache-centric", {},
     [D("d0", 0, 0, free=10, total=1000), D("d1", 30, 300_000, free=900, total=1000)], "d1"),
    ("least-loaded: smallest batch", "least-loaded", {}, [D("d0", 5), D("d1", 3)], "d1"),
    ("global-cache-aware: lowest predicted TBT", "global-cache-aware", {}, [D("d0", 5, 900_000), D("d1", 6, 10_000)], "d1"),
    ("dynamo-style: fewest used blocks", "dynamo-style", {},
     [D("d0", free=100, total=1000), D("d1", free=900, total=1000)], "d1"),
    ("llm-d-style: free KV and short batch", "llm-d-style", {},
     [D("d0", 9, free=100, total=1000), D("d1", 1, free=900, total=1000)], "d1"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_choice(case) -> None:
    _, name, params, decodes, want = case
    d = decide(name, req(), snap(P("p0"), *decodes), **params)
    assert isinstance(d, Placement), d
    assert d.decode == want


def test_decode_low_load_band_spreads_near_ties() -> None:
    decodes = [D(f"d{i}", 4, 40_000 + i) for i in range(4)] + [D("busy", 60, 900_000)]
    s = snap(P("p0"), *decodes)
    picked = {decide("kvcache-centric", req(), s, seed=k).decode for k in range(40)}
    assert picked == {"d0", "d1", "d2", "d3"}
    narrow = {decide("kvcache-centric", req(), s, seed=k, decode_low_load_band=0.0).decode for k in range(40)}
    assert narrow == {"d0"}


# --- early rejection ------------------------------------------------------------------

REJECT_CASES = [
    ("a prompt no instance can prefill in time", req(200_000), [P("p0"), D("d0")], "ttft_slo"),
    ("every queue alone is past the TTFT SLO", req(), [P("p0", queued=100_000, nq=1), P("p1", queued=120_000, nq=1), D("d0")],
     "overloaded"),
    ("a tight TBT SLO no decode meets", req(tbt_slo_ms=20), [P("p0"), D("d0", 10, 1_000_000), D("d1", 12, 900_000)],
     "tbt_slo"),
    ("no decode has KV room", req(), [P("p0"), D("d0", free=10, total=1000)], "overloaded"),
    ("no decode instance", req(), [P("p0")], "no_live_instance"),
    ("no prefill instance (a store runs nothing)", req(), [Instance("s0", "store", prefix_blocks=(9, 9, 9)), D("d0")],
     "no_live_instance"),
    ("empty cluster", req(), [], "no_live_instance"),
]


@pytest.mark.parametrize("case", REJECT_CASES, ids=[c[0] for c in REJECT_CASES])
def test_kvcache_centric_rejects_with_reason(case) -> None:
    _, r, instances, reason = case
    d = decide("kvcache-centric", r, snap(*instances))
    assert isinstance(d, Rejection), d
    assert d.reason == reason and d.message


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "kvcache-centric"])
def test_baselines_place_what_kvcache_centric_rejects(name: str) -> None:
    s = snap(P("p0", queued=100_000, nq=1), D("d0", 10, 1_000_000))
    assert isinstance(decide(name, req(200_000, tbt_slo_ms=20), s), Placement)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("instances", [[P("p0")], [D("d0")], []], ids=["no-decode", "no-prefill", "empty"])
def test_every_policy_rejects_without_live_instances(name: str, instances: list[Instance]) -> None:
    d = decide(name, req(), snap(*instances))
    assert isinstance(d, Rejection) and d.reason == "no_live_instance"


def test_early_rejection_can_be_switched_off() -> None:
    d = decide("kvcache-centric", req(200_000), snap(P("p0"), D("d0")), early_rejection=False)
    assert isinstance(d, Placement) and d.predicted_ttft_s > 30


# --- priority: where early rejection draws the line --------------------------------------

def _ttft_of(r: PolicyRequest, s: ClusterSnapshot) -> float:
    d = decide("kvcache-centric", r, s, early_rejection=False)
    assert isinstance(d, Placement)
    return d.predicted_ttft_s


@pytest.mark.parametrize("slo_over_ttft,admitted", [
    # (the TTFT SLO as a multiple of the predicted TTFT, the priorities admitted)
    (3.0, {-100, -50, 0, 50, 100}),   # well within: everyone
    (1.5, {-50, 0, 50, 100}),         # -100 is held to half the SLO: shed first
    (0.9, {50, 100}),                 # late by 10 %: only a raised priority is kept
    (0.5, set()),                     # late by 2x: no priority keeps it (+100 allows 1.5x)
])
def test_priority_shifts_the_early_rejection_threshold(slo_over_ttft: float, admitted: set[int]) -> None:
    s = snap(P("p0"), D("d0"))  # no queue: the prediction is the prompt's compute alone
    slo = _ttft_of(req(16_000), s) * slo_over_ttft
    got = {pr for pr in (-100, -50, 0, 50, 100)
           if isinstance(decide("kvcache-centric", req(16_000, ttft_slo_s=slo, priority=pr), s), Placement)}
    assert got == admitted
    low = decide("kvcache-centric", req(16_000, ttft_slo_s=slo, priority=-100), s)
    if isinstance(low, Rejection):
        assert low.reason == "ttft_slo" and "at priority -100" in low.message


def test_priority_shifts_the_tbt_budget_too_and_a_zero_shift_ignores_it() -> None:
    s = snap(P("p0"), D("d0", 10, 1_000_000))
    tbt = decide("kvcache-centric", req(), s, early_rejection=False).predicted_tbt_ms
    tight = req(tbt_slo_ms=tbt * 0.9, priority=100)
    assert isinstance(decide("kvcache-centric", tight, s), Placement)
    assert decide("kvcache-centric", req(tbt_slo_ms=tbt * 0.9), s).reason == "tbt_slo"
    assert decide("kvcache-centric", tight, s, priority_shift=0.0).reason == "tbt_slo"
    with pytest.raises(ConfigError, match="priority_shift"):
        make_policy("kvcache-centric", {"priority_shift": 1.0}, PROFILE)  # -100 would have no budget at all


def test_both_role_serves_prefill_and_decode() -> None:
    d = decide("kvcache-centric", req(), snap(Instance("b0", "both", prefix_blocks=(64, 64, 64))))
    assert isinstance(d, Placement) and d.prefill == d.decode == "b0" and d.reused_blocks == 64


# --- ties: by the seed, reproducibly ----------------------------------------------------

@pytest.mark.parametrize("name", ["kvcache-centric", "random", "least-loaded", "local-cache-aware",
                                  "global-cache-aware", "sglang-style", "dynamo-style", "llm-d-style"])
def test_ties_follow_the_seed_and_not_the_order(name: str) -> None:
    insts = [P(f"p{i}") for i in range(6)] + [D(f"d{i}") for i in range(6)]
    s = snap(*insts)
    shuffled = list(insts)
    random.Random(99).shuffle(shuffled)
    s2 = snap(*shuffled)
    picks = []
    for seed in range(30):
        a, b, c = decide(name, req(), s, seed), decide(name, req(), s, seed), decide(name, req(), s2, seed)
        assert a == b == c
        picks.append((a.prefill, a.decode))
    assert len({p for p, _ in picks}) > 1 and len({d for _, d in picks}) > 1


def test_dynamo_temperature_samples_by_seed() -> None:
    s = snap(P("p0"), P("p1", queued=256), P("p2", queued=100_000), D("d0"))
    picks = [decide("dynamo-style", req(), s, seed=k, temperature=0.5).prefill for k in range(200)]
    assert picks == [decide("dynamo-style", req(), s, seed=k, temperature=0.5).prefill for k in range(200)]
    assert picks.count("p0") > picks.count("p2") and "p1" in picks


def test_round_robin_turns_by_the_requests_log_position() -> None:
    s = snap(P("p1"), P("p0"), P("p2"), D("d1"), D("d0"))
    got = [decide("round-robin", req(ordinal=k), s) for k in range(6)]
    assert [g.prefill for g in got] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [g.decode for g in got] == ["d0", "d1", "d0", "d1", "d0", "d1"]
    # Pure: the same request gets the same turn from any policy object, in any order.
    pol = make_policy("round-robin", None, PROFILE)
    again = [pol.decide(req(ordinal=k), s, random.Random(0)) for k in (5, 3, 5, 0)]
    assert [g.prefill for g in again] == ["p2", "p0", "p2", "p0"]


# --- registry -------------------------------------------------------------------------

def test_registry_names() -> None:
    assert set(POLICIES) == {
        "kvcache-centric", "random", "round-robin", "least-loaded", "local-cache-aware",
        "global-cache-aware", "sglang-style", "dynamo-style", "llm-d-style",
    }
    listed = {p["name"]: p for p in list_policies()}
    assert listed["kvcache-centric"]["params"]["kvcache_balancing_threshold"]["default"] == 1.0
    assert all(p["summary"] for p in listed.values())


@pytest.mark.parametrize(
    "name,params,match",
    [
        ("nope", {}, "unknown policy 'nope'"),
        ("kvcache-centric", {"slo_margin": -1}, "'slo_margin'"),
        ("kvcache-centric", {"threshold": 1}, "unknown parameter 'threshold'"),
        ("dynamo-style", {"temperature": "hot"}, "'temperature'"),
        ("random", {"anything": 1}, "unknown parameter 'anything'"),
    ],
)
def test_bad_policy_config_names_the_problem(name: str, params: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_policy(name, params, PROFILE)


def test_params_are_recorded_validated() -> None:
    pol = make_policy("kvcache-centric", {"slo_margin": "1.5"}, PROFILE)
    assert pol.params["slo_margin"] == 1.5 and pol.name == "kvcache-centric"


# --- properties over random snapshots ----------------------------------------------------

instances_st = st.lists(
    st.builds(
        lambda i, role, h, dd, ss, q, nq, b, ctx, rack: Instance(
            f"n{i}", role, prefix_blocks=(h, h + dd, h + dd + ss), queued_prefill_tokens=q, queued_requests=nq,
            batch_size=b, decode_context_tokens=ctx, rack=rack),
        st.integers(0, 10_000), st.sampled_from(["prefill", "decode", "both", "store"]),
        st.integers(0, 200), st.integers(0, 50), st.integers(0, 50), st.integers(0, 200_000), st.integers(0, 20),
        st.integers(0, 64), st.integers(0, 2_000_000), st.sampled_from(["r0", "r1", None]),
    ),
    max_size=12,
    unique_by=lambda i: i.node_id,
)


@settings(max_examples=150, deadline=None)
@given(instances_st, st.integers(1, 64_000), st.integers(0, 2**32))
def test_every_policy_returns_a_valid_decision(instances, tokens, seed) -> None:
    s = snap(*instances)
    r = req(tokens)
    by_id = {i.node_id: i for i in instances}
    for name in POLICIES:
        d = decide(name, r, s, seed)
        if isinstance(d, Rejection):
            continue
        assert by_id[d.prefill].role in ("prefill", "both")
        assert by_id[d.decode].role in ("decode", "both")
        assert 0 <= d.reused_blocks <= r.chain_len
        assert d.predicted_ttft_s >= 0 and d.predicted_tbt_ms > 0
        if d.reused_blocks:
            assert d.reuse_source in by_id and d.reuse_tier in ("hbm", "dram", "ssd")


@settings(max_examples=150, deadline=None)
@given(instances_st, st.integers(1, 64_000))
def test_kvcache_centric_never_predicts_worse_ttft_than_cache_aware(instances, tokens) -> None:
    s = snap(*instances)
    ours = decide("kvcache-centric", req(tokens), s, early_rejection=False, stay_margin=0.0)
    base = decide("global-cache-aware", req(tokens), s)
    if isinstance(base, Placement):
        assert isinstance(ours, Placement)
        assert ours.predicted_ttft_s <= base.predicted_ttft_s + 1e-9
        # Staying on the prefix holder costs at most the margin: TTFT - lowest <= TTFT x stay_margin.
        staying = decide("kvcache-centric", req(tokens), s, early_rejection=False)
        assert isinstance(staying, Placement)
        assert staying.predicted_ttft_s * (1 - 0.25) <= base.predicted_ttft_s + 1e-9
