"""Chunked pipeline parallelism: the cost model, the policy's choice, the decision record,
the reservations and the simulated pipeline, against hand-computed expectations."""

from __future__ import annotations

import heapq
import random

import pytest

from conductor.costmodel.profiles import DEFAULT_PROFILE, ModelProfile, load_profile
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.engine import Simulation
from conductor.harness.sim.network import Network
from conductor.harness.sim.trace import TraceRecord, TraceRequest, long_context
from conductor.routing.decision import decision_record, decision_reservations
from conductor.routing.policies import Placement, Rejection, make_policy
from conductor.routing.policies.cpp import chunk_boundaries, pipeline_finish, plan_pipeline
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from conductor.topology import Link
from schemas import RoutingDecision, RoutingRequest
from state.reservations import Load

PROFILE = load_profile(DEFAULT_PROFILE)
# prefill_seconds(n, c) = (n - c) / 1000; one layer (one pipeline stage); 1e4 B of KV per token.
EASY = ModelProfile(
    name="easy", l=1, d=1, a=0, b=1, effective_flops=1000.0, kv_bytes_per_token=10_000,
    weight_bytes=1e7, hbm_bandwidth=1e9, dram_bandwidth=1e12, ssd_bandwidth=1e12,
    rack_bandwidth=1e9, cross_rack_bandwidth=1e9,
)
LINK = Link(bandwidth_gbps=8, latency_us=0)  # 1e9 B/s


def test_chunks_have_equal_flops_on_block_boundaries() -> None:
    ends = chunk_boundaries(PROFILE, 0, 131_072, 4, 512)
    assert len(ends) == 4 and ends[-1] == 131_072 and all(e % 512 == 0 for e in ends)
    work = [PROFILE.flops(b) - PROFILE.flops(a) for a, b in zip((0, *ends), ends)]
    assert max(work) / min(work) < 1.03  # equal up to half a block of rounding at each cut
    sizes = [b - a for a, b in zip((0, *ends), ends)]
    assert sizes == sorted(sizes, reverse=True)  # attention makes later tokens dearer
    assert chunk_boundaries(PROFILE, 0, 700, 4, 512) == (700,)  # too short to split


def test_two_stage_free_pipeline_by_hand() -> None:
    # One stage: member 1 waits for member 0's stage, then the hand-off of 1024 tokens
    # (1024 * 1e4 B at 1e9 B/s = 10.24 ms), then computes its 1024 tokens (1.024 s).
    fin = pipeline_finish(EASY, 0, (1024, 2048), (0.0, 0.0), (None, LINK))
    assert fin == pytest.approx((1.024, 1.024 + 0.01024 + 1.024))
    # A member whose queue drains later than its predecessor's output starts on its own time.
    fin = pipeline_finish(EASY, 0, (1024, 2048), (0.0, 5.0), (None, LINK))
    assert fin[1] == pytest.approx(5.0 + 1.024)


def test_layer_wise_pipeline_beats_one_instance_on_a_long_prompt() -> None:
    plan = plan_pipeline(PROFILE, ["a", "b", "c", "d"], [0.0] * 4, [None, LINK, LINK, LINK],
                         start=0, total=131_072, block_size=512)
    single = PROFILE.prefill_seconds(131_072)
    assert single / 4 < plan.finish_s < single / 2  # ~k-fold, less the pipeline's fill
    assert plan.member_finish_s == tuple(sorted(plan.member_finish_s))


def _cluster(n_prefill: int, *, queued: dict[str, int] | None = None) -> ClusterSnapshot:
    queued = queued or {}
    insts = [Instance(f"p{i}", "prefill", queued_prefill_tokens=queued.get(f"p{i}", 0),
                      queued_requests=1 if queued.get(f"p{i}") else 0, rack="r0") for i in range(n_prefill)]
    return ClusterSnapshot(tuple(insts) + (Instance("d0", "decode", rack="r0"),), 512)


def test_policy_splits_only_what_one_instance_cannot_serve() -> None:
    on = make_policy("kvcache-centric", {"cpp": True}, PROFILE)
    snap = _cluster(4)
    short = PolicyRequest("s", 32_768, 64, ttft_slo_s=30)
    d = on.decide(short, snap, random.Random(0))
    assert isinstance(d, Placement) and d.prefill_group == ()  # 6.7 s on one instance
    long = PolicyRequest("l", 131_072, 256, ttft_slo_s=30)
    d = on.decide(long, snap, random.Random(0))
    assert isinstance(d, Placement) and len(d.prefill_group) >= 2 and d.prefill_group[0] == d.prefill
    assert d.chunk_boundaries[-1] == 131_072 and d.predicted_ttft_s <= 30
    off = make_policy("kvcache-centric", {}, PROFILE).decide(long, snap, random.Random(0))
    assert isinstance(off, Rejection) and off.reason == "ttft_slo"  # 60.5 s on one instance


def test_group_members_queues_count() -> None:
    # Three idle instances and one with a 100k-token backlog: the group avoids the busy one.
    on = make_policy("kvcache-centric", {"cpp": True, "cpp_max_group": 4}, PROFILE)
    snap = _cluster(4, queued={"p3": 100_000})
    d = on.decide(PolicyRequest("l", 131_072, 256, ttft_slo_s=30), snap, random.Random(0))
    assert isinstance(d, Placement) and "p3" not in d.prefill_group and len(d.prefill_group) == 3


def test_decision_record_and_reservations_of_a_group() -> None:
    req = RoutingRequest(request_id="r", prompt_tokens=10_000, block_keys=list(range(19)), block_size=512,
                         expected_output_tokens=240)
    place = Placement("p0", "d0", 2, "p0", "dram", 3.0, 20.0, prefill_group=("p0", "p1", "p2"),
                      chunk_boundaries=(5_120, 8_192, 10_000))
    rec = decision_record(req, place, block_size=512, policy="kvcache-centric", params={}, seed=0, watermark={})
    assert isinstance(rec, RoutingDecision)
    assert rec.prefill_group == ["p0", "p1", "p2"] and rec.chunk_boundaries == [5_120, 8_192, 10_000]
    held = {r.node: r.load for r in decision_reservations(req, rec, 512)}
    assert held["p0"] == Load(prefill_tokens=5_120 - 1_024, prefill_requests=1)
    assert held["p1"] == Load(prefill_tokens=3_072, prefill_requests=1)
    assert held["p2"] == Load(prefill_tokens=1_808, prefill_requests=1)
    assert held["d0"] == Load(decode_requests=1, decode_context_tokens=10_000, kv_blocks=20)


@pytest.mark.parametrize(
    "group,bounds,match",
    [
        (["p1", "p0"], [100, 200], "must start with prefill_instance"),
        (["p0", "p1", "p2"], [100, 200], "go together"),
        (["p0", "p0"], [100, 200], "twice"),
        (["p0", "p1"], [200, 100], "increase"),
        (["p0", "p1"], [50, 200], "past reused_tokens"),
    ],
)
def test_bad_groups_are_refused(group, bounds, match) -> None:
    with pytest.raises(ValueError, match=match):
        RoutingDecision(request_id="r", prefill_instance="p0", decode_instance="d0", reused_tokens=64,
                        predicted_ttft_s=1, predicted_tbt_ms=1, policy="x", prefill_group=group,
                        chunk_boundaries=bounds)


# --- the simulator ---------------------------------------------------------------------------


class _Forced:
    """A stand-in policy that places every request on one fixed CPP group."""

    name = "forced"

    def __init__(self, group: tuple[str, ...], bounds: tuple[int, ...]) -> None:
        self.group, self.bounds = group, bounds

    def decide(self, request, snapshot, rng):
        return Placement(self.group[0], "decode-0", 0, None, None, 0.0, 0.0, prefill_group=self.group,
                         chunk_boundaries=self.bounds)


def _sim_cluster(p: int) -> ClusterProfile:
    return ClusterProfile(name="t", prefill_instances=p, decode_instances=1, block_size=512, view_delay_ms=0.0)


def test_simulated_pipeline_by_hand() -> None:
    # 2048 tokens over two members, one stage: TTFT = 1.024 (chunk 0) + 0.01024 (hand-off of
    # 1024 tokens at 1e9 B/s) + 1.024 (chunk 1); the last member holds all 4 blocks, the
    # first only its 2; then the whole KV (2048 * 1e4 B) reaches decode in 20.48 ms.
    reqs = [TraceRequest(0, 0.0, 2048, 1, (1, 2, 3, 4))]
    sim = Simulation(_sim_cluster(2), EASY, _Forced(("prefill-0", "prefill-1"), (1024, 2048)), reqs)
    (o,) = sim.run().outcomes
    assert o.ttft_s == pytest.approx(2.05824)
    assert o.handoff_s == pytest.approx(0.02048)
    assert sim.prefills[0].cache.prefix_len(o.chain) == 2 and sim.prefills[1].cache.prefix_len(o.chain) == 4


def test_a_member_busy_with_earlier_work_delays_the_pipeline() -> None:
    # prefill-1 first runs a 3000-token request alone (3 s); chunk 1 then starts at 3 s.
    reqs = [TraceRequest(0, 0.0, 3000, 1, (9,)), TraceRequest(1, 0.0, 2048, 1, (1, 2, 3, 4))]

    class Mixed(_Forced):
        def decide(self, request, snapshot, rng):
            if request.ordinal == 0:
                return Placement("prefill-1", "decode-0", 0, None, None, 0.0, 0.0)
            return super().decide(request, snapshot, rng)

    sim = Simulation(_sim_cluster(2), EASY, Mixed(("prefill-0", "prefill-1"), (1024, 2048)), reqs)
    _, o = sim.run().outcomes
    assert o.ttft_s == pytest.approx(3.0 + 1.024)


def test_the_simulator_matches_the_policy_on_an_idle_cluster() -> None:
    pol = make_policy("kvcache-centric", {"cpp": True}, PROFILE)
    reqs = [TraceRequest(0, 0.0, 131_072, 1, tuple(range(256)))]
    c = ClusterProfile(name="t", prefill_instances=4, decode_instances=1, block_size=512, view_delay_ms=0.0)
    (o,) = Simulation(c, PROFILE, pol, reqs).run().outcomes
    assert len(o.group) >= 2
    assert o.ttft_s == pytest.approx(o.predicted_ttft_s, rel=1e-6)


def test_transfers_on_one_path_share_its_bandwidth() -> None:
    heap: list = []
    net = Network(lambda t, key, v: heapq.heappush(heap, (t, key, v)))
    key = ("racks", "a", "b")
    link = Link(bandwidth_gbps=8, latency_us=1000)  # 1e9 B/s, 1 ms
    net.start(0.0, key, link, 1e9, "A")
    done: dict[str, float] = {}

    def drain(until: float) -> None:
        while heap and heap[0][0] <= until:
            t, k, v = heapq.heappop(heap)
            for ready, what in net.wake(t, k, v):
                done[what] = ready

    drain(0.5)
    net.start(0.5, key, link, 0.5e9, "B")  # A has 0.5e9 left; both now move at 0.5e9 B/s
    drain(10.0)
    assert done == pytest.approx({"A": 1.5 + 0.001, "B": 1.5 + 0.001})
    assert net.stats[key].max_concurrent == 2 and net.stats[key].busy_s == pytest.approx(1.5)


def test_long_context_workload_keeps_order_and_sharing() -> None:
    recs = [TraceRecord(i, i * 1000.0, n, 10, ids) for i, (n, ids) in
            enumerate([(1000, (1, 2)), (4000, (1, 2, 3, 4, 5, 6, 7, 8)), (2000, (1, 2, 9, 10))])]
    out = long_context(recs, sample=1, factor=4)
    assert [r.input_length for r in out] == [32_768, 131_072, 65_536]  # rank 0, 1, 0.5 → log-uniform
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in out)
    assert out[1].hash_ids[:8] == out[2].hash_ids[:8] == out[0].hash_ids[:8]  # the 2 shared ids x 4
    assert out[1].hash_ids[8] != out[2].hash_ids[8]
    assert len(long_context(recs, sample=2)) == 2
