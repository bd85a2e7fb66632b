"""The balance scheduler's pure parts: heat, hot/cold prefixes, and the commands it plans."""

from __future__ import annotations

import pytest

from conductor.balance.planner import (
    BalanceParams,
    Cooldown,
    HeatTracker,
    hot_and_cold,
    plan,
    queue_wait_s,
    sliding_heat,
)
from state.view import NodeState, ViewSnapshot

NOW_MS = 1_000_000


def node(nid, queued=0, role="prefill", free=100, total=100):
    return NodeState(node_id=nid, role=role, last_heartbeat_ms=NOW_MS, queued_prefill_tokens=queued,
                     free_kv_blocks=free, total_kv_blocks=total)


def snap(nodes, prefix):
    return ViewSnapshot(now_ms=NOW_MS, nodes=tuple(nodes), prefix=prefix, watermark={})


def test_heat_decays_by_half_life():
    t = HeatTracker(BalanceParams(half_life_s=10))
    t.record([1, 2, 3], 0.0)
    t.record([1, 2, 3], 0.0)
    assert t.heat(1, 0.0) == pytest.approx(2.0)
    assert t.heat(1, 10.0) == pytest.approx(1.0)
    t.record([1, 2, 3], 20.0)  # 2 * 0.25 + 1
    assert t.heat(1, 20.0) == pytest.approx(1.5)


def test_tracked_prefix_is_the_shared_part():
    t = HeatTracker(BalanceParams(hot_threshold=2))
    t.record([1, 2, 3, 4], 0.0)
    t.record([1, 2, 9], 0.0)
    assert t.hot(0.0) == [((1, 2), pytest.approx(2.0))]


def test_cold_means_once_hot_and_cooled():
    t = HeatTracker(BalanceParams(hot_threshold=2, cold_threshold=0.5, half_life_s=1))
    t.record([5], 0.0)
    assert t.cold(100.0) == []  # never hot
    t.record([7], 0.0)
    t.record([7], 0.0)
    assert t.cold(0.5) == []
    assert t.cold(3.0) == [(7,)]


def test_tracker_is_bounded():
    t = HeatTracker(BalanceParams(max_tracked=3))
    for head in range(10):
        t.record([head], float(head))
    assert [t.heat(h, 10.0) > 0 for h in range(10)] == [False] * 7 + [True] * 3


P = BalanceParams(overload_tokens=1000, overload_factor=1.5, cooldown_s=30)


def test_replicates_hot_prefix_when_every_holder_is_overloaded():
    chain = (11, 12, 13)
    s = snap([node("a", 9000), node("b", 100), node("c", 50)], {"a": (3, 3, 3)})
    cmds = plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert len(cmds) == 1
    c = cmds[0]
    assert (c.action, c.from_node, c.from_tier, c.to_node, c.to_tier) == ("replicate", "a", "hbm", "c", "hbm")
    assert c.block_keys == [11, 12, 13]


def test_no_replica_while_a_holder_has_room_or_none_is_live():
    chain = (11, 12)
    s = snap([node("a", 9000), node("b", 10), node("c", 50)], {"a": (2, 2, 2), "b": (2, 2, 2)})
    assert plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown()) == []
    stale = ViewSnapshot(now_ms=NOW_MS + 60_000, nodes=s.nodes, prefix=s.prefix, watermark={})
    assert plan([(chain, 20.0)], [], {chain: stale}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown()) == []


def test_partial_holders_do_not_count_and_decode_nodes_are_not_targets():
    chain = (1, 2, 3, 4)
    s = snap([node("a", 5000), node("b", 0), node("d", 0, role="decode")], {"a": (4, 4, 4), "b": (2, 2, 2)})
    cmds = plan([(chain, 9.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert [(c.from_node, c.to_node) for c in cmds] == [("a", "b")]


def test_cooldown_suppresses_repeats():
    chain = (11,)
    s = snap([node("a", 9000), node("b", 0)], {"a": (1, 1, 1)})
    cd = Cooldown()
    assert len(plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=cd)) == 1
    assert plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=10, params=P, cooldown=cd) == []
    assert len(plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=31, params=P, cooldown=cd)) == 1


def test_demotes_cold_prefix_only_under_hbm_pressure():
    chain = (7, 8, 9)
    s = snap([node("full", free=5, total=100), node("roomy", free=60, total=100)],
             {"full": (2, 3, 3), "roomy": (3, 3, 3)})
    cmds = plan([], [chain], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert [(c.action, c.from_node, c.block_keys, c.to_tier) for c in cmds] == [("demote", "full", [7, 8], "dram")]


def test_prefixes_under_a_shared_root_are_told_apart():
    t = HeatTracker(BalanceParams(hot_threshold=2))
    for _ in range(2):
        t.record([0, 1, 2], 0.0)
        t.record([0, 5, 6, 7], 0.0)
    t.record([0, 9], 0.0)
    assert sorted(c for c, _ in t.hot(0.0)) == [(0, 1, 2), (0, 5, 6, 7)]


class LinearCosts:
    """Prefill 1 ms per token; remote transfer 0.1 ms per token."""

    def prefill_seconds(self, total_tokens, cached_tokens=0):
        return (total_tokens - cached_tokens) / 1000

    def transfer_seconds(self, tokens, tier, remote, same_rack=True):
        return tokens / 10_000


@pytest.mark.parametrize(
    "holder_queue, target_queue, replicated",
    [
        (5_000, 0, True),     # 5 s avoided > 0.1 s transfer
        (5_000, 4_950, False),  # 0.05 s avoided: below min_avoided_s
        (600, 0, True),
        (400, 0, False),      # 0.4 s avoided < min_avoided_s (0.5 s)
    ],
)
def test_cost_rule_replicates_when_the_transfer_is_cheaper_than_the_queue_it_avoids(holder_queue, target_queue,
                                                                                     replicated):
    chain = tuple(range(10))  # 10 blocks x 100 tokens: transfer 0.1 s, recompute 1 s
    s = snap([node("a", holder_queue), node("b", target_queue)], {"a": (10, 10, 10)})
    cmds = plan([(chain, 9.0)], [], {chain: s}, ttl_s=5, now_s=0, params=BalanceParams(), cooldown=Cooldown(),
                costs=LinearCosts(), block_size=100)
    assert bool(cmds) is replicated
    if cmds:
        assert (cmds[0].from_node, cmds[0].to_node, cmds[0].executor) == ("a", "b", "b")
        assert cmds[0].deadline_ms == 10_000 and cmds[0].command_id.startswith("rep-")


@pytest.mark.parametrize(("current", "previous", "into", "want"), [
    (5, 10, 0.0, 15.0),   # at a window's start the previous window counts whole
    (5, 10, 0.25, 12.5),  # a quarter in, three quarters of it is still inside the span
    (5, 10, 1.0, 5.0),    # at its end only the current window counts
    (0, 0, 0.5, 0.0),
])
def test_sliding_heat_weighs_the_previous_window_by_what_is_left_of_it(current, previous, into, want):
    assert sliding_heat(current, previous, into) == want


def test_hot_and_cold_from_window_heat_name_prefixes_by_their_deepest_block():
    params = BalanceParams(hot_threshold=8, cold_threshold=0.5)
    # 1 ← 2 ← 3 is a hot conversation under a shared root 1; 1 ← 4 ← 5 has cooled off;
    # 7's parent 6 was never hot: its root is not known, so it names no prefix.
    parents = {1: None, 2: 1, 3: 2, 4: 1, 5: 4, 7: 6}
    heat = {1: 30.0, 2: 20.0, 3: 9.0, 4: 0.2, 5: 0.0, 7: 50.0}
    hot, cold = hot_and_cold(heat, parents, params)
    assert hot == [((1, 2, 3), 9.0)]
    assert cold == [(1, 4, 5)]
    # Once 3 cools, the hot prefix is the shorter one, and 3 is a cold tip of its own.
    hot, cold = hot_and_cold({**heat, 3: 0.1}, parents, params)
    assert hot == [((1, 2), 20.0)]
    assert sorted(cold) == [(1, 2, 3), (1, 4, 5)]


# --- the shared pool (a store node) --------------------------------------------------


def pool_node(nid="kv-pool", capacity=100, used=0, heartbeat_ms=NOW_MS):
    return NodeState(node_id=nid, role="store", last_heartbeat_ms=heartbeat_ms, total_kv_blocks=capacity,
                     tier_capacity={"dram": capacity}, blocks={"dram": used})


def test_a_prefix_hot_on_several_instances_is_pushed_into_the_pool_by_its_least_loaded_holder():
    chain = (11, 12, 13)
    s = snap([node("a", 300), node("b", 100), node("c", 0), pool_node()], {"a": (3, 3, 3), "b": (0, 3, 3)})
    [c] = plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert (c.action, c.from_node, c.from_tier, c.to_node, c.to_tier) == ("replicate", "b", "dram", "kv-pool", "dram")
    assert c.executor == "b" and c.by_node == "b" and c.block_keys == [11, 12, 13]
    assert "held by 2 instances" in c.reason


def test_one_overloaded_holder_gets_a_pool_copy_instead_of_an_instance_replica():
    chain = (11, 12, 13)
    nodes = [node("a", 9000), node("b", 100), node("c", 50)]
    with_pool = plan([(chain, 20.0)], [], {chain: snap([*nodes, pool_node()], {"a": (3, 3, 3)})}, ttl_s=5, now_s=0,
                     params=P, cooldown=Cooldown())
    assert [(c.to_node, c.executor) for c in with_pool] == [("kv-pool", "a")]
    calm = plan([(chain, 20.0)], [], {chain: snap([node("a", 10), node("b", 0), pool_node()], {"a": (3, 3, 3)})},
                ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert calm == []  # one holder with room: nothing to copy anywhere


@pytest.mark.parametrize(("pool", "why"), [
    (pool_node(capacity=2), "no room for 3 blocks"),
    (pool_node(capacity=10, used=8), "2 free blocks"),
    (pool_node(capacity=0), "reports no capacity"),
])
def test_a_pool_without_room_leaves_the_instance_replica(pool, why):
    chain = (11, 12, 13)
    s = snap([node("a", 9000), node("b", 100), node("c", 50), pool], {"a": (3, 3, 3)})
    [c] = plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown())
    assert (c.to_node, c.executor, c.by_node) == ("c", "c", None), why


def test_a_prefix_the_pool_holds_whole_is_not_copied_again_and_the_rule_can_be_switched_off():
    chain = (11, 12, 13)
    nodes = [node("a", 9000), node("b", 100), node("c", 50), pool_node(used=3)]
    s = snap(nodes, {"a": (3, 3, 3), "kv-pool": (0, 3, 3)})
    assert [c.to_node for c in plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P,
                                     cooldown=Cooldown())] == ["c"]
    partly = snap(nodes, {"a": (3, 3, 3), "kv-pool": (0, 1, 1)})
    assert [c.to_node for c in plan([(chain, 20.0)], [], {chain: partly}, ttl_s=5, now_s=0, params=P,
                                     cooldown=Cooldown())] == ["kv-pool"]
    off = P.model_copy(update={"pool_copies": False})
    assert [c.to_node for c in plan([(chain, 20.0)], [], {chain: partly}, ttl_s=5, now_s=0, params=off,
                                     cooldown=Cooldown())] == ["c"]


def test_a_dead_pool_is_no_target():
    chain = (11, 12)
    dead = pool_node(heartbeat_ms=NOW_MS - 60_000)
    s = snap([node("a", 1), node("b", 1), dead], {"a": (2, 2, 2), "b": (2, 2, 2)})
    assert plan([(chain, 20.0)], [], {chain: s}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown()) == []


@pytest.mark.parametrize(("holder_queue", "copied"), [
    (5_000, True),   # 5 s avoided > 0.1 s loading from the pool (dram, remote)
    (400, False),    # 0.4 s avoided: below min_avoided_s
])
def test_cost_rule_for_the_pool_weighs_the_queue_against_loading_from_the_pool(holder_queue, copied):
    chain = tuple(range(10))
    s = snap([node("a", holder_queue), node("b", 0), pool_node()], {"a": (10, 10, 10)})
    cmds = plan([(chain, 9.0)], [], {chain: s}, ttl_s=5, now_s=0, params=BalanceParams(), cooldown=Cooldown(),
                costs=LinearCosts(), block_size=100)
    assert [c.to_node for c in cmds] == (["kv-pool"] if copied else [])
    if copied:
        assert "loading from the pool" in cmds[0].reason


def test_a_cold_prefix_is_evicted_from_a_full_pool_by_the_least_loaded_prefill_instance():
    chain = (21, 22)
    cool = Cooldown()
    full = snap([node("a", 500), node("b", 20), node("d", 0, role="decode"), pool_node(used=90)],
                {"kv-pool": (0, 2, 2)})
    [c] = plan([], [chain], {chain: full}, ttl_s=5, now_s=0, params=P, cooldown=cool)
    assert (c.action, c.from_node, c.from_tier, c.executor, c.block_keys) == ("evict", "kv-pool", "dram", "b",
                                                                               [21, 22])
    assert plan([], [chain], {chain: full}, ttl_s=5, now_s=1, params=P, cooldown=cool) == []  # cooldown
    roomy = snap(full.nodes[:3] + (pool_node(used=50),), {"kv-pool": (0, 2, 2)})
    assert plan([], [chain], {chain: roomy}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown()) == []
    elsewhere = snap(full.nodes, {"a": (0, 2, 2)})
    assert plan([], [chain], {chain: elsewhere}, ttl_s=5, now_s=0, params=P, cooldown=Cooldown()) == []


# --- standing down under overload ------------------------------------------------------


@pytest.mark.parametrize(
    "holder_queue, target_queue, replicated",
    [
        (100_000, 40_000, False),  # every instance saturated: the target's own wait (40 s) > 20 s
        (100_000, 20_000, True),   # the target's 20 s is not above the bound: 80 s avoided
        (100_000, 0, True),        # an idle target
    ],
)
def test_a_saturated_cluster_stands_down(holder_queue, target_queue, replicated):
    chain = tuple(range(10))
    s = snap([node("a", holder_queue), node("b", target_queue), node("c", target_queue + 5_000)],
             {"a": (10, 10, 10)})
    params = BalanceParams(stand_down_wait_s=20)
    cmds = plan([(chain, 9.0)], [], {chain: s}, ttl_s=5, now_s=0, params=params, cooldown=Cooldown(),
                costs=LinearCosts(), block_size=100)
    assert [(c.from_node, c.to_node) for c in cmds] == ([("a", "b")] if replicated else [])
    # The same holds for a copy into a shared pool that only the holders' overload would justify.
    s = snap([*s.nodes, pool_node()], {"a": (10, 10, 10)})
    cmds = plan([(chain, 9.0)], [], {chain: s}, ttl_s=5, now_s=0, params=params, cooldown=Cooldown(),
                costs=LinearCosts(), block_size=100)
    assert [c.to_node for c in cmds] == (["kv-pool"] if replicated else [])
    # None switches the rule off: the saturated cluster gets its replica.
    cmds = plan([(chain, 9.0)], [], {chain: snap(s.nodes[:3], {"a": (10, 10, 10)})}, ttl_s=5, now_s=0,
                params=BalanceParams(stand_down_wait_s=None), cooldown=Cooldown(), costs=LinearCosts(),
                block_size=100)
    assert [c.to_node for c in cmds] == ["b"]


def test_the_queue_wait_counts_the_backlog_as_equal_prompts():
    class Quadratic:
        def prefill_seconds(self, total_tokens, cached_tokens=0):
            return (total_tokens ** 2 - cached_tokens ** 2) / 1e6

    assert queue_wait_s(Quadratic(), 0, 3) == 0.0
    assert queue_wait_s(Quadratic(), 1000, 0) == pytest.approx(1.0)   # one prompt of 1,000 tokens
    assert queue_wait_s(Quadratic(), 1000, 4) == pytest.approx(0.25)  # four of 250: 4 x 0.0625 s
