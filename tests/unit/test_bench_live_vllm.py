"""``bench live --engines vllm``'s pure parts: sides, cores, rounds and their medians, holders left, evictions."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.harness.bench.live_vllm import (
    HEAVY_KV_CACHE_BYTES,
    SIDES,
    EngineCounters,
    SideStats,
    VllmLiveError,
    VllmLiveOptions,
    evicted_blocks,
    holder_reason,
    left_holder_counts,
    median_over_rounds,
    metric_total,
    parse_cpus,
    parse_peer_args,
    parse_sides,
    pinning,
    round_orders,
    shared_cores_topology,
    summary,
)
from schemas import RoutingDecision


def test_sides_are_checked_and_kept_in_order() -> None:
    assert parse_sides("peer, conductor:sglang-style,conductor") == ("peer", "conductor:sglang-style", "conductor")
    assert parse_sides(",".join(SIDES)) == SIDES
    for bad, why in (("conductor:nonesuch", "no Conductor policy"), ("nginx", "is not conductor"),
                     ("peer,peer", "twice"), (" , ", "no side")):
        with pytest.raises(ValueError, match=why):
            parse_sides(bad)


def test_the_peers_extra_arguments_are_shell_words_that_leave_the_benchs_own_alone() -> None:
    assert parse_peer_args("--cache-threshold 0.3 --balance-abs-threshold=16") == (
        "--cache-threshold", "0.3", "--balance-abs-threshold=16")
    assert parse_peer_args("") == ()
    assert VllmLiveOptions().peer_args == () and VllmLiveOptions().peer_policy == "cache_aware"
    for bad, why in (("--policy random", "--peer-policy"), ("--worker-urls=http://x", "set by the bench"),
                     ("--port 1", "set by the bench"), ("--cache-threshold '0.3", "--peer-args")):
        with pytest.raises(ValueError, match=why):
            parse_peer_args(bad)


def test_cores_as_taskset_writes_them() -> None:
    assert parse_cpus("1") == (1,)
    assert parse_cpus("3,0-1") == (0, 1, 3)
    for bad in ("", "a", "1-", "-1", "1;2"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_pinning_gives_the_rest_of_the_cores_to_everything_else() -> None:
    assert pinning((1,), [0, 1]) == {"engines": [1], "others": [0], "shared": False}
    # One core only: everything shares it, and says so.
    assert pinning((0,), [0]) == {"engines": [0], "others": [0], "shared": True}
    with pytest.raises(VllmLiveError, match=r"core\(s\) \[5\]"):
        pinning((1, 5), [0, 1])
    with pytest.raises(VllmLiveError, match="platform"):
        pinning((0,), None)


def test_each_side_runs_first_once_over_as_many_rounds_as_sides() -> None:
    orders = round_orders(["a", "b", "c"], 4)
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {o[0] for o in orders[:3]} == {"a", "b", "c"}


def test_a_side_over_rounds_keeps_its_fields_as_medians() -> None:
    rows: list[dict[str, Any]] = [
        {"router": "conductor", "served": 160, "ttft_p50_s": 1.2, "engine_prefix_hit_ratio": None,
         "statuses": {"served": 160, "429": 10}, "control_cpu_s_by_process": {"gateway": 4.0, "worker": 2.0}},
        {"router": "conductor", "served": 170, "ttft_p50_s": 0.9, "engine_prefix_hit_ratio": 0.2,
         "statuses": {"served": 170}, "control_cpu_s_by_process": {"gateway": 5.0, "worker": 1.0}},
        {"router": "conductor", "served": 165, "ttft_p50_s": 3.0, "engine_prefix_hit_ratio": 0.3,
         "statuses": {"served": 165}, "control_cpu_s_by_process": {"gateway": 6.0, "worker": 3.0}, "new": "x"},
    ]
    m = median_over_rounds(rows)
    assert list(m) == ["router", "served", "ttft_p50_s", "engine_prefix_hit_ratio", "statuses",
                       "control_cpu_s_by_process", "new"]  # the first round's order, then what later rounds add
    assert m["router"] == "conductor" and m["served"] == 165 and isinstance(m["served"], int)
    assert m["ttft_p50_s"] == 1.2  # the middle one, not the mean
    assert m["engine_prefix_hit_ratio"] == 0.25  # over the rounds that have a value
    assert m["statuses"] == {"served": 165, "429": 0}  # a count missing from a round is 0 there
    assert m["control_cpu_s_by_process"] == {"gateway": 5.0, "worker": 2.0}
    assert m["new"] == "x"
    one = median_over_rounds(rows[:1])
    assert one == rows[0]  # one round: its own values


def test_holders_left_are_counted_by_reason_or_null_until_decisions_say() -> None:
    d = RoutingDecision(request_id="r", prefill_instance="a", decode_instance="a", reused_tokens=0,
                        predicted_ttft_s=0.1, predicted_tbt_ms=1.0, policy="kvcache-centric", mode="aggregated")
    if "left_holder" not in RoutingDecision.model_fields:
        assert left_holder_counts([d, d])["left_holder_by_reason"] is None
        return
    why = "holder vllm-0 predicted {}s, vllm-1 {}s: better by {}s > margin {}s"
    stayed = d.model_copy(update={"left_holder": None})
    left = [d.model_copy(update={"left_holder": w}) for w in (why.format(0.481, 0.285, 0.196, 0.12),
                                                              why.format(1.5, 0.2, 1.3, 0.3), "holder cordoned")]
    assert left_holder_counts([stayed, *left]) == {
        "decisions": 4, "left_holder_decisions": 3,
        "left_holder_by_reason": {"holder cordoned": 1, "holder vllm-N predicted Ns, vllm-N Ns: better by Ns > margin Ns": 2},
        "left_holder_example": left[0].left_holder}
    assert holder_reason("margin 0.120s of 12 nodes") == "margin Ns of N nodes"


def test_evictions_are_the_engines_own_count() -> None:
    metrics = ("# HELP vllm:kv_block_idle_before_evict_seconds ...\n"
               'vllm:kv_block_idle_before_evict_seconds_bucket{le="1.0",model_name="tiny"} 3.0\n'
               'vllm:kv_block_idle_before_evict_seconds_count{model_name="tiny"} 7.0\n'
               'vllm:kv_block_idle_before_evict_seconds_sum{model_name="tiny"} 2.5\n')
    assert evicted_blocks(metrics) == 7.0
    assert metric_total(metrics, "vllm:kv_block_idle_before_evict_seconds_sum") == 2.5
    assert metric_total(metrics, "vllm:kv_block_idle_before_evict_seconds") is None  # a prefix of a name is not it
    assert evicted_blocks("vllm:prefix_cache_hits_total 3\n") is None  # an engine that does not count them


def test_the_heavy_regime_evicts_unless_told_a_size() -> None:
    assert VllmLiveOptions().kv_cache_bytes() is None  # the kit's 1 GiB
    assert VllmLiveOptions(engine_model="heavy").kv_cache_bytes() == HEAVY_KV_CACHE_BYTES
    assert VllmLiveOptions(engine_model="tiny", engine_kv_cache_bytes=2**26).kv_cache_bytes() == 2**26


def test_engines_pinned_to_the_same_cores_are_one_capacity_group(tmp_path: Any) -> None:
    from conductor.topology import load_topology

    path = shared_cores_topology(tmp_path / "t.json", ["vllm-0", "vllm-1"], (1,))
    topo = load_topology(path)
    assert topo.capacity_group("vllm-0") == topo.capacity_group("vllm-1") == ("vllm-0", "vllm-1")
    assert topo.capacity_group("other") == ("other",)


def test_the_engines_own_ttft_and_queue_wait_are_means_over_the_replay() -> None:
    stats = SideStats(sent=4, ttft=[0.1, 0.2, 0.3, 0.4])
    before = EngineCounters(ttft_s=10.0, ttfts=100.0, queue_s=1.0, queues=100.0)
    after = EngineCounters(ttft_s=10.6, ttfts=104.0, queue_s=1.2, queues=104.0)
    out = summary(stats, before, after, 5.0)
    assert out["ttft_mean_s"] == 0.25  # the client's, set beside the engines' own
    assert out["engine_ttft_s_mean"] == 0.15 and out["engine_queue_s_mean"] == 0.05
    # An engine that does not report them: null, not zero.
    blank = summary(stats, EngineCounters(), EngineCounters(), 5.0)
    assert blank["engine_ttft_s_mean"] is None and blank["engine_queue_s_mean"] is None


@pytest.mark.parametrize("args,said", [
    (["--engines", "vllm", "--peer-first"], "--sides says the order"),
    (["--engines", "emulated", "--peer-args", "--cache-threshold 0.3"], "--peer-args is for --engines vllm"),
    (["--engines", "vllm", "--peer-args", "--worker-urls http://x"], "set by the bench"),
])
def test_options_that_would_do_nothing_are_refused_before_anything_starts(args: list[str], said: str) -> None:
    from typer.testing import CliRunner

    from conductor.cli import app

    res = CliRunner().invoke(app, ["bench", "live", *args])
    assert res.exit_code == 2, res.output
    assert said in " ".join(res.output.split())
