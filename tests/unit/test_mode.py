"""Aggregated, disaggregated and conditional placement (conductor/routing/policies/mode.py)."""

from __future__ import annotations

import random

import pytest

from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.routing.policies import POLICIES, Placement, Rejection, make_policy
from conductor.routing.policies.mode import decide_mode
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest

PROFILE = load_profile(DEFAULT_PROFILE)
BS = 16


def snap(*instances: Instance) -> ClusterSnapshot:
    return ClusterSnapshot(instances=tuple(instances), block_size=BS)


def req(tokens: int = 2048, **kw) -> PolicyRequest:
    return PolicyRequest(request_id=kw.pop("rid", "r1"), prompt_tokens=tokens, chain_len=tokens // BS, **kw)


def choose(name: str, r: PolicyRequest, s: ClusterSnapshot, seed: int = 0, **params):
    return decide_mode(make_policy(name, params, PROFILE), r, s, random.Random(seed))


def agg(node: str, **kw) -> Instance:
    """An aggregated engine: role both, no KV connector."""
    return Instance(node, "both", handoff=kw.pop("handoff", None), **kw)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_without_both_instances_the_policy_answers_alone(name: str) -> None:
    s = snap(Instance("p0", "prefill"), Instance("p1", "prefill", queued_prefill_tokens=900, queued_requests=1),
             Instance("d0", "decode"), Instance("d1", "decode", batch_size=3))
    got = choose(name, req(), s, seed=7)
    want = make_policy(name, {}, PROFILE).decide(req(), s, random.Random(7))
    assert got.decision == want and got.options == () and got.mode == "disaggregated"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_aggregated_fleet_is_served_in_one_call(name: str) -> None:
    s = snap(agg("a0", queued_prefill_tokens=4000, queued_requests=2), agg("a1"))
    got = choose(name, req(), s)
    d = got.decision
    assert isinstance(d, Placement), d
    assert d.prefill == d.decode
    assert got.mode == "aggregated"
    assert [o.mode for o in got.options] == ["aggregated"]
    assert got.options[0].prefill == d.prefill


def test_kvcache_centric_serves_an_aggregated_fleet_on_the_lowest_predicted_ttft() -> None:
    s = snap(agg("a0", queued_prefill_tokens=4000, queued_requests=2), agg("a1"))
    assert choose("kvcache-centric", req(), s).decision.prefill == "a1"  # type: ignore[union-attr]


# The aggregated fleet of the live A/B: a0 holds the whole prompt but has 8,000 tokens queued (two
# requests) and half its KV cache in use; a1 is idle and holds nothing. The lowest predicted TTFT is a1's.
HOLDER_BUSY = snap(agg("a0", prefix_blocks=(128, 128, 128), queued_prefill_tokens=8000, queued_requests=2,
                       running_requests=2, free_kv_blocks=500, total_kv_blocks=1000),
                   agg("a1", free_kv_blocks=1000, total_kv_blocks=1000))

AGGREGATED_RULES = [
    # (policy, params, request ordinal, the instance its own rule picks)
    ("sglang-style", {}, 0, "a0"),  # balanced (spread 4 < 64 requests) and a0 matches 100 % > 0.3
    ("sglang-style", {"balance_abs_threshold": 1, "balance_rel_threshold": 1.0}, 0, "a1"),  # imbalanced
    ("sglang-style", {"cache_threshold": 1.0}, 0, "a1"),  # no match good enough: most room (a1: none used)
    ("round-robin", {}, 0, "a0"),
    ("round-robin", {}, 1, "a1"),
    ("round-robin", {}, 2, "a0"),
    ("local-cache-aware", {}, 0, "a0"),  # the longest own prefix, whatever the queue
    ("least-loaded", {}, 0, "a1"),
    ("global-cache-aware", {}, 0, "a1"),  # its rule is the lowest TTFT from own cache
    ("llm-d-style", {"queue_weight": 0.0}, 0, "a0"),  # prefix and KV free only: a0's prefix wins
    ("dynamo-style", {}, 0, "a1"),  # a0's 500 queued blocks + 500 in use > a1's 128 to compute
    ("dynamo-style", {"overlap_score_weight": 10.0}, 0, "a1"),
]


@pytest.mark.parametrize(("name", "params", "ordinal", "want"), AGGREGATED_RULES)
def test_each_policy_s_own_rule_picks_the_aggregated_instance(name: str, params: dict, ordinal: int,
                                                              want: str) -> None:
    """Mode decides aggregated or disaggregated; on an aggregated fleet the instance is the policy's
    pick, not the lowest predicted TTFT (which would be a1 for every policy)."""
    policy = make_policy(name, params, PROFILE)
    r = req(ordinal=ordinal)
    got = decide_mode(policy, r, HOLDER_BUSY, random.Random(3))
    d = got.decision
    assert isinstance(d, Placement) and d.prefill == d.decode and got.mode == "aggregated", got
    assert d.prefill == want
    assert d.predicted_ttft_s == next(o.ttft_s for o in got.options if o.prefill == want)


def test_round_robin_takes_aggregated_instances_in_turn_whatever_their_load() -> None:
    picks = [choose("round-robin", req(ordinal=k), HOLDER_BUSY).decision.prefill for k in range(4)]  # type: ignore[union-attr]
    assert picks == ["a0", "a1", "a0", "a1"]


def test_a_hand_off_never_names_an_engine_without_a_connector() -> None:
    # a0 holds the whole prefix and is idle; as a prefill instance it would win, but it cannot hand off.
    s = snap(agg("a0", prefix_blocks=(128, 128, 128), batch_size=40, decode_context_tokens=400_000),
             Instance("p0", "prefill"), Instance("d0", "decode"))
    for seed in range(20):
        d = choose("kvcache-centric", req(8192), s, seed=seed).decision
        assert isinstance(d, Placement)
        assert (d.prefill, d.decode) in (("a0", "a0"), ("p0", "d0")), d


def test_conditional_disaggregation_keeps_a_short_request_on_its_prefill_instance() -> None:
    # b0 can do both (a connector); d0 decodes less loaded, so a long prompt goes P/D, a short one stays.
    b0 = Instance("b0", "both", handoff=True, batch_size=6, decode_context_tokens=6000)
    s = snap(b0, Instance("d0", "decode"))
    short = choose("kvcache-centric", req(256), s)
    assert short.mode == "aggregated" and short.decision.prefill == "b0"  # type: ignore[union-attr]
    assert {o.mode for o in short.options} == {"aggregated", "disaggregated"}
    long = choose("kvcache-centric", req(4096), s, aggregate_below_tokens=0)
    assert long.mode == "disaggregated"
    assert (long.decision.prefill, long.decision.decode) == ("b0", "d0")  # type: ignore[union-attr]
    # what b0 would compute counts, not the prompt: with the prefix held it stays
    held = snap(Instance("b0", "both", handoff=True, batch_size=6, decode_context_tokens=6000,
                         prefix_blocks=(250, 250, 250)), Instance("d0", "decode"))
    assert choose("kvcache-centric", req(4096), held).mode == "aggregated"


def test_aggregated_engines_that_cannot_meet_the_slo_are_rejected_with_the_reason() -> None:
    full = agg("a0", free_kv_blocks=1, total_kv_blocks=100)
    got = choose("kvcache-centric", req(2048), snap(full))
    assert isinstance(got.decision, Rejection) and got.decision.reason == "overloaded"
    assert got.options and not got.options[0].fits
    slow = agg("a0", queued_prefill_tokens=10_000_000, queued_requests=100)
    got = choose("kvcache-centric", req(2048, ttft_slo_s=1.0), snap(slow))
    assert isinstance(got.decision, Rejection) and got.decision.reason == "ttft_slo"
    # a baseline never rejects for the SLO: it serves on the best aggregated engine anyway
    got = choose("round-robin", req(2048, ttft_slo_s=1.0), snap(slow))
    assert isinstance(got.decision, Placement) and got.decision.prefill == "a0"


def test_the_lower_predicted_ttft_wins_between_modes() -> None:
    # The P/D pair's prefill is busy; an idle aggregated engine predicts a lower TTFT.
    s = snap(Instance("p0", "prefill", queued_prefill_tokens=20_000, queued_requests=4), Instance("d0", "decode"),
             agg("a0"))
    got = choose("kvcache-centric", req(4096), s)
    assert got.mode == "aggregated" and got.decision.prefill == "a0"  # type: ignore[union-attr]
    pd = next(o for o in got.options if o.mode == "disaggregated")
    assert pd.ttft_s > got.decision.predicted_ttft_s  # type: ignore[union-attr]
    # and the other way round
    s = snap(Instance("p0", "prefill"), Instance("d0", "decode"),
             agg("a0", queued_prefill_tokens=20_000, queued_requests=4))
    got = choose("kvcache-centric", req(4096), s)
    assert got.mode == "disaggregated" and got.decision.prefill == "p0"  # type: ignore[union-attr]


def test_the_aggregated_options_are_held_to_the_priority_s_budget() -> None:
    s = snap(agg("a0"))
    ttft = choose("kvcache-centric", req(16_000), s, early_rejection=False).decision.predicted_ttft_s
    late = {pr: choose("kvcache-centric", req(16_000, ttft_slo_s=ttft * 0.9, priority=pr), s) for pr in (0, 100)}
    assert isinstance(late[0].decision, Rejection) and late[0].decision.reason == "ttft_slo"
    assert isinstance(late[100].decision, Placement) and late[100].options[0].fits


def test_kvcache_centric_keeps_a_session_on_its_aggregated_instance_unless_leaving_pays() -> None:
    # a0 served the session last and holds nothing of this prompt; a1 is a little faster (a small
    # queue on a0): within the error, the conversation stays on a0.
    s = snap(agg("a0", queued_prefill_tokens=200, queued_requests=1), agg("a1"))
    alone = choose("kvcache-centric", req(), s).decision
    assert isinstance(alone, Placement) and alone.prefill == "a1"
    stay = choose("kvcache-centric", req(session_instance="a0"), s).decision
    assert isinstance(stay, Placement) and stay.prefill == "a0" and stay.left_holder is None
    # a long queue on a0: leaving pays, and the decision says why
    busy = snap(agg("a0", queued_prefill_tokens=20_000, queued_requests=10), agg("a1"))
    left = choose("kvcache-centric", req(session_instance="a0"), busy).decision
    assert isinstance(left, Placement) and left.prefill == "a1"
    assert left.left_holder is not None and left.left_holder.startswith("session's instance a0")
