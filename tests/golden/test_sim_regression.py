"""Regression on a slice of the conversation trace: the ordering of the policies is pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

from conductor.harness.sim.cluster import load_cluster
from conductor.harness.sim.report import PolicyRun, common_ttft_means
from conductor.harness.sim.session import Bench

# The first 1,500 requests of the Mooncake conversation trace (FAST'25), shipped with the tests so
# they run on a clean checkout (tests/golden/README.md says where the lines come from).
TRACE = Path(__file__).resolve().parent / "mooncake_conversation_first1500.jsonl"
POLICIES = ("random", "least-loaded", "global-cache-aware", "kvcache-centric", "sglang-style", "dynamo-style", "llm-d-style")


@pytest.fixture(scope="module")
def slice_runs() -> dict[str, tuple[dict, float]]:
    # The first 1500 requests at 1.5x: loaded enough that placement matters, small enough for ~3 s.
    bench = Bench(TRACE, load_cluster(), limit=1500, seed=0)
    runs = [PolicyRun.from_result(*bench.run(p, 1.5)) for p in POLICIES]
    common = common_ttft_means(runs)
    return {r.summary["policy"]: (r.summary, common[r.summary["policy"]]) for r in runs}


def test_paper_ordering_of_average_ttft(slice_runs) -> None:
    t = {p: v[1] for p, v in slice_runs.items()}
    # FAST'25: random > load balancing > cache-aware on own caches > cache-aware with transfers.
    assert t["random"] > t["least-loaded"] > t["global-cache-aware"] > t["kvcache-centric"]


def test_kvcache_centric_beats_peer_styles(slice_runs) -> None:
    best_peer = min(slice_runs[p][1] for p in ("sglang-style", "dynamo-style", "llm-d-style"))
    assert slice_runs["kvcache-centric"][1] <= 0.8 * best_peer
    kc = slice_runs["kvcache-centric"][0]
    assert kc["reuse_ratio"] <= kc["reuse_upper_bound"]
    assert kc["remote_reuse_requests"] > 0


def test_the_slice_is_whole() -> None:
    lines = TRACE.read_text().splitlines()
    assert len(lines) == 1500
    assert lines[0].startswith('{"timestamp": 0, "input_length": 6758,')
    assert lines[-1].startswith('{"timestamp": 509999, "input_length": 13753,')


def test_same_seed_same_numbers() -> None:
    bench = Bench(TRACE, load_cluster(), limit=300, seed=7)
    a, _ = bench.run("kvcache-centric", 2.0)
    b, _ = bench.run("kvcache-centric", 2.0)
    a.pop("sim_wall_s"), b.pop("sim_wall_s")
    assert a == b
