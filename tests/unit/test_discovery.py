"""Engines found through the view: what a bridge announces and what a gateway reads back."""

from __future__ import annotations

import pytest

from conductor.bridge.runner import BridgeConfig, endpoint_of_metrics, rank_configs
from conductor.bridge.scrape import parse_load
from conductor.frontdoor.directory import EngineDirectory
from schemas import Envelope, Heartbeat, can_hand_off, decode, encode, envelope
from state.fold import fold
from state.view import NodeState


@pytest.mark.parametrize("url, base", [
    ("http://10.0.0.5:8000/metrics", "http://10.0.0.5:8000"),
    ("https://engine:443/metrics/", "https://engine:443"),
    ("http://h:1/prefix/metrics", None),  # a path prefix: say it with --engine-url
    ("tcp://h:1/metrics", None),
    (None, None),
])
def test_the_serving_url_is_the_base_of_the_metrics_url(url, base):
    assert endpoint_of_metrics(url) == base


def test_dp_ranks_announce_one_url_and_their_rank():
    cfgs = rank_configs(node_id="e", dp_size=2, zmq_endpoint="tcp://h:5557", replay_endpoint=None, role="both",
                        metrics_url="http://h:8000/metrics")
    assert [c.announced()["dp_rank"] for c in cfgs] == [0, 1]
    assert {c.announced()["endpoint"] for c in cfgs} == {"http://h:8000"}
    one = BridgeConfig(node_id="p", role="prefill", zmq_endpoint="tcp://h:1", endpoint="http://e:9", kv_transfer=True)
    assert one.announced()["endpoint"] == "http://e:9" and one.announced()["dp_rank"] is None


def test_a_heartbeat_carries_the_endpoint_into_the_view():
    hb = Heartbeat(role="both", endpoint="http://127.0.0.1:8100", dp_rank=1, kv_transfer=False)
    env = decode(encode(envelope(hb, producer_id="a0", producer_seq=1, ts_ms=5)))
    assert isinstance(env, Envelope) and env.body == hb
    op = fold(env).ops[0]
    st = NodeState(node_id="a0", **op.state)  # type: ignore[union-attr]
    assert (st.endpoint, st.dp_rank, st.kv_transfer) == ("http://127.0.0.1:8100", 1, False)


@pytest.mark.parametrize("role, kv, can", [
    ("prefill", None, True), ("decode", None, True), ("both", None, False), ("both", True, True),
    ("prefill", False, False), ("store", None, False),
])
def test_who_takes_part_in_hand_offs(role, kv, can):
    assert can_hand_off(role, kv) is can


@pytest.mark.parametrize("bad", ["ftp://h:1", "http://", "h:8000", "http://h:1?x=1", "http://h :1"])
def test_a_bad_endpoint_is_refused(bad):
    with pytest.raises(ValueError):
        Heartbeat(role="prefill", endpoint=bad)


async def test_the_directory_merges_overrides_and_live_announced_engines():
    import time
    now = time.time_ns() // 1_000_000
    nodes = [NodeState("a", "both", endpoint="http://a:1", last_heartbeat_ms=now),
             NodeState("b", "both", endpoint="http://b:1/", last_heartbeat_ms=now),
             NodeState("old", "both", endpoint="http://old:1", last_heartbeat_ms=now - 60_000),
             NodeState("s", "store", endpoint="http://s:1", last_heartbeat_ms=now),
             NodeState("c", "prefill", last_heartbeat_ms=now)]
    calls = []

    async def read():
        calls.append(1)
        return nodes

    d = EngineDirectory({"b": "http://override:2"}, read, ttl_s=3.0)
    await d.refresh()
    assert d.urls() == ["http://override:2", "http://a:1"]
    await d.refresh()
    assert len(calls) == 1  # within refresh_s: no second read

    async def broken():
        raise ConnectionError("down")

    d2 = EngineDirectory({}, broken)
    await d2.refresh()
    assert d2.urls() == [] and len(d2) == 0


def test_the_prefix_cache_counters_are_read_from_a_vllm_page():
    page = (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        '# TYPE vllm:prefix_cache_queries counter\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0\n'
        '# TYPE vllm:prefix_cache_hits counter\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0'
    )
    load = parse_load(page)
    assert (load.prefix_hit_tokens, load.prefix_query_tokens) == (256.0, 640.0)


def test_the_gateway_sends_where_the_decision_says_and_pins_the_dp_rank():
    from conductor.gateway.handoff import call_of
    from conductor.gateway.upstream import EngineFailed
    from schemas import Endpoint, RoutingDecision

    d = RoutingDecision(request_id="r", prefill_instance="e-dp1", decode_instance="e-dp1", reused_tokens=0,
                        predicted_ttft_s=0.1, predicted_tbt_ms=5, policy="p", mode="aggregated",
                        endpoints={"e-dp1": Endpoint(url="http://h:8000/", dp_rank=1)})
    call = call_of({}, False, d, "r", {"o": "http://override:1"})
    assert call.headers("e-dp1") == {"x-request-id": "r", "X-data-parallel-rank": "1"}
    assert call.headers("other") == {"x-request-id": "r"}
    assert call.url("e-dp1") == call.decode_url == "http://h:8000"
    assert call.url("o") == "http://override:1"
    with pytest.raises(EngineFailed, match="announce no endpoint"):
        call.url("nowhere")
