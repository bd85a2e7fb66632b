"""Redis lost under a busy worker loses nothing: every (node, block) pair checked against an
independent truth (``conductor.harness.chaos.TruthEngines``) after Redis is flushed, or killed
and restarted empty, mid-stream, or flushed with no traffic left to bring the partitions back;
or failed over to a replica that lagged its primary (the view's last writes lost, same generation)."""

from __future__ import annotations

import pytest

from conductor.harness.chaos import run_scenario


@pytest.mark.parametrize("scenario", ["redis-flushall", "redis-restart-empty", "redis-flushall-quiet", "worker-sigkill",
                                      "bad-records", "duplicates", "silent-node", "skewed-clock",
                                      "two-workers-one-killed", "failover", "failover-quiet"])
async def test_no_pair_lost_or_extra(stack, tmp_path, scenario):
    res = await run_scenario(scenario, stack.kafka_url, tmp_path, records=2000, seed=7)
    assert (res.pairs_lost, res.pairs_extra) == (0, 0), res
    assert res.converged, res
    if scenario.startswith("redis"):
        assert res.generations >= 1, res  # the worker noticed the lost view (not by luck)
    if scenario.startswith("failover"):  # the promoted replica really lagged: WAIT saw no replica with the last writes
        assert res.detail["wait_acked"] == 0 and res.detail["fence_records_lost"] > 0, res.detail
    if scenario == "failover-quiet":  # no traffic after the failover: only the fences moving back could tell
        assert res.detail["fences_moved_back"] >= 1, res.detail
    if scenario in ("silent-node", "skewed-clock"):  # neither silence nor a clock ahead keeps a node live
        assert res.detail["still_live_after_s"] is not None, res.detail
    if scenario == "bad-records":  # every bad record refused with a dead letter, none changed the view
        assert res.detail["bad_records"] >= 300
        assert res.detail["dead_letters"] >= res.detail["bad_records"] - 20, res.detail
