"""kvcache-centric evaluates only the prefill instances that can win: over random clusters it
decides exactly as the exhaustive policy (every instance evaluated), seed for seed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.costmodel.costs import Reuse
from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.routing.policies import make_policy
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from conductor.topology import Link, LinkClasses, RackSpec, Topology

PROFILE = load_profile(DEFAULT_PROFILE)

# Few distinct queue lengths and prefixes, so ties (the seeded pick among equals) are common.
prefill = st.builds(
    lambda i, q, nq, pre, rack, role: Instance(f"p{i:03d}", role, prefix_blocks=pre, queued_prefill_tokens=q,
                                               queued_requests=nq if q else 0, rack=rack[0], zone=rack[1]),
    st.integers(0, 999), st.sampled_from([0, 0, 512, 4_000, 4_000, 30_000, 120_000]), st.integers(1, 4),
    st.sampled_from([(0, 0, 0)] * 4 + [(16, 16, 16), (0, 8, 8), (2, 2, 40), (64, 64, 64), (0, 0, 3)]),
    st.sampled_from([("r0", "z0"), ("r1", "z0"), ("r2", "z1"), (None, None), ("r3", None)]),
    st.sampled_from(["prefill", "prefill", "store"]),  # stores hold prefixes and never prefill
)
decode = st.builds(
    lambda i, b, ctx, free, rack: Instance(f"d{i:03d}", "decode", batch_size=b, decode_context_tokens=ctx,
                                           free_kv_blocks=free, total_kv_blocks=80_000, rack=rack),
    st.integers(0, 99), st.integers(0, 64), st.sampled_from([0, 50_000, 400_000]),
    st.sampled_from([10, 20_000, 60_000]), st.sampled_from(["r0", "r1"]),
)
params = st.fixed_dictionaries({
    "early_rejection": st.booleans(),
    "remote_reuse": st.booleans(),
    "kvcache_balancing_threshold": st.sampled_from([0.0, 1.0, 1.5]),
    "queue_wait_safety": st.sampled_from([1.0, 2.0]),
    "prefill_tie_s": st.sampled_from([0.0, 1e-6, 0.05]),
})


@settings(max_examples=300, deadline=None)
@given(
    st.lists(prefill, min_size=1, max_size=40, unique_by=lambda i: i.node_id),
    st.lists(decode, min_size=1, max_size=6, unique_by=lambda i: i.node_id),
    params, st.integers(512, 100_000), st.sampled_from([0.5, 2.0, 30.0]), st.integers(0, 2**31),
)
def test_pruned_policy_decides_as_the_exhaustive_one(prefills, decodes, p, tokens, slo, seed) -> None:
    pruned = make_policy("kvcache-centric", p, PROFILE)
    full = make_policy("kvcache-centric", p, PROFILE)
    full.prune_candidates = False
    full._same_rack_class = lambda: -1  # every copy walked, no same-rack lookup
    snap = ClusterSnapshot(tuple(prefills) + tuple(decodes), 512)
    chain = tokens // 512
    req = PolicyRequest("r", tokens, chain, ttft_slo_s=slo)
    assert pruned.decide(req, snap, random.Random(seed)) == full.decide(req, snap, random.Random(seed))


def test_candidates_are_the_holders_and_each_places_shortest_queues() -> None:
    policy = make_policy("kvcache-centric", {}, PROFILE)
    insts = (
        Instance("a", "prefill", prefix_blocks=(8, 8, 8), queued_prefill_tokens=90_000, queued_requests=3, rack="r0"),
        Instance("b", "prefill", queued_prefill_tokens=4_000, queued_requests=1, rack="r0"),
        Instance("c", "prefill", queued_prefill_tokens=4_000, queued_requests=1, rack="r0"),  # ties b
        Instance("d", "prefill", queued_prefill_tokens=30_000, queued_requests=1, rack="r0"),
        Instance("e", "prefill", queued_prefill_tokens=60_000, queued_requests=2, rack="r1"),
    )
    waits = [policy.costs.queue_wait_s(i) for i in insts]
    assert policy._same_rack_class() == 0  # the default topology: same rack is a link class
    got = [i.node_id for i, _ in policy._candidates(insts, waits, policy.p)]
    assert got == ["a", "b", "c", "e"]


def _cheapest_copy(policy, inst: Instance, holders: list[Instance], req: PolicyRequest) -> Reuse:
    """The reuse plan by its definition: the instance's own cache, or, link class by link
    class, the cheapest usable copy (ties to the first holder) if it is cheaper still."""
    costs = policy.costs
    best = costs.local_reuse(inst, req, 512)
    floor = best.blocks * policy.p.kvcache_balancing_threshold
    if not policy.p.remote_reuse:
        return best
    for li in range(len(costs.links)):
        usable = []
        for h in holders:
            o = costs.remote_plan(h.prefix_blocks, req, 512, li)
            if o is not None and h.node_id != inst.node_id and o[0] > floor and costs.link_index(h, inst) == li:
                usable.append((o[2], h, o))
        if usable:
            cost, h, o = min(usable, key=lambda u: u[0])  # min keeps the first of equals
            if cost < best.cost_s:
                best = Reuse(o[0], h.node_id, o[1], cost)
    return best


@settings(max_examples=500, deadline=None)
@given(st.lists(prefill, min_size=1, max_size=40, unique_by=lambda i: i.node_id), params,
       st.one_of(st.integers(512, 2_048), st.integers(512, 100_000)))  # short chains: shapes cut to equal plans
def test_reuse_planner_finds_the_cheapest_copy(insts, p, tokens) -> None:
    """The planner walks copies as runs of equal cost per prefix shape and looks same-rack
    copies up by rack; it finds what scanning every holder finds."""
    policy = make_policy("kvcache-centric", p, PROFILE)
    req = PolicyRequest("r", tokens, tokens // 512)
    holders = [h for h in insts if h.prefix_blocks[2] > 0]
    best_reuse, _, groups = policy._reuse_planner(req, holders, 512)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(holders)))
    for inst in insts:
        assert best_reuse(inst) == _cheapest_copy(policy, inst, holders, req)


# Twelve racks in three zones (the file's), links that differ by class: a bare instance's
# copies then depend on whether its rack holds any, and else on its zone only.
ZONED = Topology(
    links=LinkClasses(same_rack=Link(bandwidth_gbps=400, latency_us=5), cross_rack=Link(bandwidth_gbps=100, latency_us=20),
                      cross_zone=Link(bandwidth_gbps=10, latency_us=800)),
    racks={f"r{i}": RackSpec(zone=f"z{i % 3}") for i in range(12)},
)
zoned = st.builds(
    lambda i, pre, rack, zone, q: Instance(f"p{i:03d}", "prefill", prefix_blocks=pre, queued_prefill_tokens=q,
                                           queued_requests=1 if q else 0, rack=rack, zone=zone),
    st.integers(0, 999),
    st.sampled_from([(0, 0, 0)] * 6 + [(16, 16, 16), (0, 8, 8), (2, 2, 40), (64, 64, 64)]),
    st.sampled_from([f"r{i}" for i in range(12)] + [None]),
    st.sampled_from([None, None, None, "z0", "z2"]),  # mostly the file's zone of its rack
    st.sampled_from([0, 4_000]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(zoned, min_size=1, max_size=60, unique_by=lambda i: i.node_id), params, st.integers(512, 100_000))
def test_reuse_planner_finds_the_cheapest_copy_across_zones(insts, p, tokens) -> None:
    """Bare instances of racks without holders share their plan per zone (the rack's zone from
    the topology file when the heartbeat has none); still what scanning every holder finds."""
    policy = make_policy("kvcache-centric", p, PROFILE, ZONED)
    assert policy._same_rack_class() == 0
    req = PolicyRequest("r", tokens, tokens // 512)
    holders = [h for h in insts if h.prefix_blocks[2] > 0]
    best_reuse, _, _ = policy._reuse_planner(req, holders, 512)
    for inst in insts:
        assert best_reuse(inst) == _cheapest_copy(policy, inst, holders, req)


@settings(max_examples=200, deadline=None)
@given(st.lists(prefill, min_size=1, max_size=30, unique_by=lambda i: i.node_id), params,
       st.lists(st.integers(512, 100_000), min_size=2, max_size=5))
def test_reuse_plans_remembered_per_holder_groups_follow_the_request(insts, p, lengths) -> None:
    """The copy runs are remembered per holder-groups object (the index hands out one per hot
    chain): requests of other lengths over the same object still get their own plans, even
    with the same number of blocks."""
    policy = make_policy("kvcache-centric", p, PROFILE)
    holders = [h for h in insts if h.prefix_blocks[2] > 0]
    shapes = [h.prefix_blocks for h in holders]
    groups = {}
    for i, s in enumerate(shapes):
        groups.setdefault(s, []).append(i)
    # Then as many blocks as the first with one token more, and the first's tokens with a chain
    # of two blocks (prefixes cut there).
    asks = [(t, t // 512) for t in lengths] + [(lengths[0] + 1, lengths[0] // 512), (lengths[0], 2)]
    for tokens, blocks in asks:
        req = PolicyRequest("r", tokens, blocks)
        best_reuse, _, _ = policy._reuse_planner(req, holders, 512, shapes, None, groups)
        for inst in insts:
            assert best_reuse(inst) == _cheapest_copy(policy, inst, holders, req)
