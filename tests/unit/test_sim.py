"""Unit tests of the simulator's pieces, against hand-computed expectations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.costmodel.profiles import ModelProfile
from conductor.harness.sim.cache import LruBlockCache, TieredPool
from conductor.harness.sim.capacity import find_capacity
from conductor.harness.sim.cluster import ClusterProfile, load_cluster
from conductor.harness.sim.decode import DecodeInstance, DecodeJob
from conductor.harness.sim.engine import Simulation
from conductor.harness.sim.errors import SimulationError, TraceError
from conductor.harness.sim.trace import TraceRequest, parse_lines, reuse_upper_bound, schedule
from conductor.harness.sim.view import DelayedView
from conductor.routing.policies import make_policy

# A profile whose costs are easy to compute by hand:
#   prefill_seconds(n, c) = (n - c) / 1000           (l=d=b=1, a=0, 1000 FLOP/s)
#   decode_step_seconds(B, C) = 0.01 + C * 1e-5      (1e7 B of weights, 1e4 B/token, 1e9 B/s)
#   remote transfer of t tokens = t * 1e4 B / 1e9 B/s = t * 1e-5 s
#   local DRAM read of t tokens = t * 1e4 B / 1e12 B/s = t * 1e-8 s
EASY = ModelProfile(
    name="easy", l=1, d=1, a=0, b=1, effective_flops=1000.0, kv_bytes_per_token=10_000,
    weight_bytes=1e7, hbm_bandwidth=1e9, dram_bandwidth=1e12, ssd_bandwidth=1e12,
    rack_bandwidth=1e9, cross_rack_bandwidth=1e9,
)


def cluster(p: int = 1, d: int = 1, **kw) -> ClusterProfile:
    base = {"name": "t", "prefill_instances": p, "decode_instances": d, "block_size": 512, "view_delay_ms": 0.0}
    base.update(kw)
    return ClusterProfile(**base)


def req(i: int, t: float, n: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(i, t, n, out, ids)


# --- LRU caches ------------------------------------------------------------------------


def test_lru_evicts_least_recent_and_cuts_chains_from_the_tail() -> None:
    c = LruBlockCache(3)
    assert c.insert([1, 2]) == ([1, 2], [])
    # Inserting [3, 4] needs one slot: block 2 (the tail of chain [1, 2]) is older than 1.
    assert c.insert([3, 4]) == ([3, 4], [2])
    assert c.prefix_len([1, 2]) == 1 and len(c) == 3
    c.touch([1])  # now 4 is the least recent
    assert c.insert([5]) == ([5], [4])
    assert sorted([k for k in (1, 3, 4, 5) if k in c]) == [1, 3, 5]


def test_lru_keeps_at_most_capacity_leading_blocks_of_a_long_chain() -> None:
    c = LruBlockCache(2)
    assert c.insert([7, 8, 9]) == ([7, 8], [])
    assert c.insert([7, 8, 9]) == ([], [])  # already held, nothing to report
    assert LruBlockCache(0).insert([1]) == ([], [])


def test_pool_demotes_dram_evictions_to_ssd() -> None:
    pool = TieredPool(dram_blocks=2, ssd_blocks=2)
    assert pool.insert([10, 11]) == [("stored", "dram", [10, 11])]
    assert pool.insert([12]) == [("stored", "dram", [12]), ("removed", "dram", [11]), ("stored", "ssd", [11])]
    assert pool.prefix([10, 11]) == (1, 2)
    assert pool.prefix([12]) == (1, 1)


# --- decode: continuous batching ---------------------------------------------------------


def test_decode_steps_join_at_boundaries_and_finish_when_hand_computed() -> None:
    d = DecodeInstance("decode-0", EASY.decode_step_seconds, kv_tokens=10**6, max_batch=8)
    a = DecodeJob(0, prompt_tokens=999, output_tokens=11, ready_s=0.0)  # 10 decode steps
    b = DecodeJob(1, prompt_tokens=999, output_tokens=3, ready_s=0.03)  # 2 decode steps
    assert d.submit(a, 0.0) == []
    # A alone: step j has context 1000 + j -> 0.02 + 1e-5 j. At 0.03 step 1 runs (0.02..0.04001).
    assert d.submit(b, 0.03) == []
    assert b.start_s == pytest.approx(0.04001)
    # Together: contexts 1002 + 1000, then 2004 -> 0.03002 + 0.03004.
    assert d.next_finish_time() == pytest.approx(0.04001 + 0.03002 + 0.03004)
    done = d.advance(1.0)
    assert [j.rid for j in done] == [1, 0]
    assert b.finish_s == pytest.approx(0.10007)
    # A alone again with context 1004 for its last 6 steps: 0.06 + 1e-5 * (6*1004 + 15).
    assert a.finish_s == pytest.approx(0.10007 + 0.06 + 1e-5 * (6 * 1004 + 15))
    assert d.tokens == 12 and d.ctx == 0 and d.used_kv == 0


def test_decode_waits_for_kv_memory() -> None:
    d = DecodeInstance("decode-0", lambda b, c: 0.01, kv_tokens=1500, max_batch=8)
    a = DecodeJob(0, 999, 3, 0.0)  # reserves 1002 tokens
    b = DecodeJob(1, 999, 3, 0.0)
    d.submit(a, 0.0)
    d.submit(b, 0.0)
    assert d.batch == 1 and len(d.waiting) == 1
    done = d.advance(10.0)
    assert a.finish_s == pytest.approx(0.02)
    assert b.start_s == pytest.approx(0.02) and b.finish_s == pytest.approx(0.04)
    assert {j.rid for j in done} == {0, 1}


# --- the whole loop: queueing, transfer, events ------------------------------------------


def run(c: ClusterProfile, reqs: list[TraceRequest], policy: str = "least-loaded"):
    return Simulation(c, EASY, make_policy(policy, {}, EASY), reqs, seed=1).run()


def test_prefill_queue_is_fifo_with_compute_from_the_profile() -> None:
    reqs = [req(0, 0.0, 1000, 1, (1, 2)), req(1, 0.5, 1000, 1, (3, 4))]
    res = run(cluster(), reqs)
    a, b = res.outcomes
    assert a.ttft_s == pytest.approx(1.0)  # 1000 tokens at 1000 tokens/s
    assert b.prefill_start_s == pytest.approx(1.0)
    assert b.ttft_s == pytest.approx(1.5)  # waited 0.5 s, computed 1 s
    assert res.prefill_load["prefill-0"]["busy_s"] == pytest.approx(2.0)


def test_local_prefix_is_reused_and_kv_transfer_precedes_decode() -> None:
    # Same two-block prefix (1024 tokens): the second request computes only 476 tokens.
    reqs = [req(0, 0.0, 1500, 2, (1, 2, 3)), req(1, 10.0, 1500, 2, (1, 2, 9))]
    res = run(cluster(), reqs)
    a, b = res.outcomes
    assert (a.reused_tokens, b.reused_tokens) == (0, 1024)
    assert b.ttft_s == pytest.approx(1024 * 1e-8 + 0.476)
    # One decode step after the KV transfer: 1500 tokens * 1e-5 s + (0.01 + 1501 * 1e-5) s.
    assert a.tbt_ms == pytest.approx(1000 * (0.015 + 0.01 + 0.01501))


def test_eviction_events_reach_the_view() -> None:
    c = cluster(prefill_cache_blocks=2)
    reqs = [req(0, 0.0, 1024, 1, (1, 2)), req(1, 5.0, 1024, 1, (3, 4))]
    sim = Simulation(c, EASY, make_policy("least-loaded", {}, EASY), reqs, seed=0)
    first, second = (o.chain for o in sim.run().outcomes)
    snap = sim.view.snapshot(second, 100.0)
    assert snap.prefix == {"prefill-0": (0, 2, 2)}
    assert sim.view.snapshot(first, 100.0).prefix == {}
    # KV events: stored, then removed + stored; heartbeats (the loads) are counted apart.
    assert sim.view.published == 3
    assert sim.view.heartbeats >= 2 and {n.node_id for n in sim.view.store.nodes_sync()} == {"prefill-0", "decode-0"}


def test_view_lags_by_the_propagation_delay() -> None:
    v = DelayedView(delay_ms=50.0, block_size=512)
    v.heartbeat("prefill-0", "prefill", 0.0, rack="r", total_kv_blocks=4)
    v.stored("prefill-0", "dram", [11, 12], 1.0)
    assert v.snapshot([11, 12], 1.049).prefix == {}
    assert v.snapshot([11, 12], 1.050).prefix == {"prefill-0": (0, 2, 2)}


def test_remote_reuse_pays_the_transfer() -> None:
    # Request 0 leaves blocks (1, 2) on one instance, request 1 (5 s of compute) lands on
    # the same one (seed 1), so request 2 is cheaper on the idle instance copying the prefix
    # (1024 tokens * 1e-5 s) and computing 476 tokens than waiting ~4.5 s.
    c = cluster(p=2)
    reqs = [req(0, 0.0, 1024, 1, (1, 2)), req(1, 2.0, 5000, 1, tuple(range(20, 30))),
            req(2, 2.5, 1500, 1, (1, 2, 3))]
    res = run(c, reqs, policy="kvcache-centric")
    first, busy, o = res.outcomes
    assert busy.prefill == first.prefill != o.prefill
    assert o.remote_reuse and o.reuse_source == first.prefill and o.reused_tokens == 1024
    assert o.ttft_s == pytest.approx(1024 * 1e-5 + 0.476)


# --- the trace ---------------------------------------------------------------------------


def test_trace_spreads_a_coarse_timestamp_and_applies_speed() -> None:
    lines = [json.dumps({"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [i]}) for i in range(4)]
    lines.append(json.dumps({"timestamp": 3000, "input_length": 10, "output_length": 1, "hash_ids": [9]}))
    got = [r.arrival_s for r in schedule(parse_lines(lines), speed=2.0)]
    assert got == pytest.approx([0.0, 0.125, 0.25, 0.375, 1.0])


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "line 2"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_trace_line_is_named(line: str, needle: str) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(TraceError) as e:
        parse_lines([good, line], "t.jsonl")
    assert "t.jsonl:2" in str(e.value) and needle.split()[-1] in str(e.value)


def test_reuse_upper_bound_counts_prefixes_seen_before() -> None:
    reqs = [req(0, 0, 1024, 1, (1, 2)), req(1, 1, 1200, 1, (1, 2, 3)), req(2, 2, 600, 1, (4, 5))]
    # Request 1 reuses 1024 of its 1200 tokens; the others nothing.
    assert reuse_upper_bound(reqs, 512) == pytest.approx(1024 / (1024 + 1200 + 600))


# --- capacity, clusters, statistics -------------------------------------------------------


def test_capacity_bisection_brackets_the_threshold() -> None:
    res = find_capacity(lambda s: {"slo_attainment": 1.0 if s <= 3.3 else 0.5}, rel_tol=0.01)
    assert 3.3 / 1.01 <= res.capacity_speed <= 3.3
    assert find_capacity(lambda s: {"slo_attainment": 0.0}).capacity_speed == 0.0


def test_cluster_spec_and_default_profile() -> None:
    c = load_cluster()
    assert (c.prefill_instances, c.decode_instances, c.ttft_slo_s, c.tbt_slo_ms) == (16, 8, 30.0, 100.0)
    assert c.with_counts("4P2D").prefill_instances == 4
    with pytest.raises(SimulationError, match="16X"):
        c.with_counts("16X")
    with pytest.raises(SimulationError, match="unknown cluster profile"):
        load_cluster("nope")


def test_decode_load_counts_waiting_and_in_flight_requests() -> None:
    d = DecodeInstance("decode-0", lambda b, c: 0.01, kv_tokens=3000, max_batch=1)
    d.submit(DecodeJob(0, 999, 3, 0.0), 0.0)  # running: context 1000, reserves 1002
    d.submit(DecodeJob(1, 499, 3, 0.0), 0.0)  # waits (batch full): context 500, reserves 502
    d.expect(99, 256)  # still in prefill: context 100, reserves 355
    assert d.load() == (3, 1000 + 500 + 100, 3000 - 1002 - 502 - 355)
    d.expect(99, 256, -1)
    assert d.load() == (2, 1500, 3000 - 1002 - 502)


def test_prefix_read_back_from_the_shared_pool() -> None:
    # No local caches: request 0's blocks survive only in the pool (store-0), whose KV
    # events reach the view; request 1 copies 1024 tokens from its DRAM over the link
    # (1024 * 1e4 B / 1e9 B/s) and computes the other 476.
    c = cluster(p=2, prefill_cache_blocks=0, store_dram_blocks=8)
    reqs = [req(0, 0.0, 1024, 1, (1, 2)), req(1, 5.0, 1500, 1, (1, 2, 3))]
    sim = Simulation(c, EASY, make_policy("kvcache-centric", {}, EASY), reqs, seed=0)
    _a, b = sim.run().outcomes
    assert b.reuse_source == "store-0" and b.remote_reuse and b.reused_tokens == 1024
    assert b.ttft_s == pytest.approx(1024 * 1e-5 + 0.476)
    assert sim.view.snapshot(b.chain, 100.0).prefix == {"store-0": (0, 3, 3)}


_req_st = st.tuples(st.floats(0, 20), st.integers(1, 6000), st.integers(1, 40), st.integers(0, 5), st.integers(1, 12))


@settings(max_examples=30, deadline=None)
@given(st.lists(_req_st, min_size=1, max_size=25), st.sampled_from(["kvcache-centric", "random", "llm-d-style"]),
       st.integers(0, 8))
def test_every_request_is_accounted_for_and_causal(raw, policy: str, cache_blocks: int) -> None:
    reqs = []
    for i, (t, n, out, conv, blocks) in enumerate(sorted(raw)):
        ids = tuple([conv * 100 + j for j in range(min(blocks, -(-n // 512)))])
        reqs.append(req(i, t, n, out, ids))
    c = cluster(p=2, d=2, prefill_cache_blocks=cache_blocks, decode_kv_tokens=8000, decode_max_batch=3)
    res = run(c, reqs, policy=policy)
    for o in res.outcomes:
        if o.rejected is not None:
            continue
        assert 0 <= o.reused_tokens <= o.input_length
        assert o.arrival_s <= o.prefill_start_s <= o.first_token_s <= o.finish_s
        # Never faster than computing what was not reused.
        assert o.ttft_s >= EASY.prefill_seconds(o.input_length, o.reused_tokens) - 1e-9
        assert o.tbt_ms >= 0
    served = [o for o in res.outcomes if o.rejected is None]
    assert sum(v["requests"] for v in res.prefill_load.values()) == len(served)
    assert sum(v["requests"] for v in res.decode_load.values()) == len(served)
