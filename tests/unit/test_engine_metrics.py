"""Engine /metrics → load → heartbeat; vLLM's extra-key rule; topic-config checks."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from conductor.bridge.scrape import MetricsError, heartbeat_of, parse_load
from conductor.costmodel.profiles import load_profile
from conductor.harness.dispatch import Assignment
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.metrics import engine_registry
from schemas import RoutingDecision, RoutingRequest, vllm_block_extras
from streams.kafka import config_problems
from streams.topics import TopicConfig, topics

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 8000.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 6.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_cpu_blocks="4096",num_gpu_blocks="2000"} 1.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 9.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.1
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 64000.0
"""


def test_vllm_metrics_become_a_heartbeat() -> None:
    load = parse_load(VLLM)
    assert (load.running, load.waiting, load.total_blocks, load.block_size, load.finished) == (4, 2, 2000, 16, 8)
    assert load.start_time_s == 1.7e9
    hb = heartbeat_of(load, role="prefill", model="m", interval_s=1.0)
    # Queued prefill work: waiting + running prefills at the mean prompt (8000 / 8 finished).
    assert hb.queued_prefill_tokens == 6 * 1000
    assert (hb.queue_depth, hb.running_requests, hb.free_kv_blocks, hb.total_kv_blocks) == (2, 4, 1000, 2000)
    assert hb.tier_capacity == {"hbm": 2000, "dram": 4096}
    dec = heartbeat_of(load, role="decode", model="m", interval_s=1.0)
    assert dec.decode_context_tokens == 1000 * 16 and dec.queued_prefill_tokens == 2 * 1000


def test_sglang_metrics_become_a_load() -> None:
    load = parse_load(SGLANG, sglang_page_size=16)
    assert (load.running, load.waiting, load.total_blocks) == (9, 1, 4000)
    assert heartbeat_of(load, role="decode", model="m", interval_s=1.0).free_kv_blocks == 3600


@pytest.mark.parametrize("text", ["", "not prometheus {{{", "# TYPE foo gauge\nfoo 1\n"])
def test_a_page_that_is_not_an_engines_metrics_is_an_error(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_load(text)


def test_the_emulated_engine_serves_what_the_scraper_reads() -> None:
    class NoPublisher:
        def start(self) -> None: ...

    eng = EmulatedEngine(EngineConfig("p0", "prefill", 16, kv_blocks=100), load_profile("llama3-70b-a800x8"),
                         NoPublisher())  # type: ignore[arg-type]
    req = RoutingRequest(request_id="r", block_keys=[1], prompt_tokens=640)
    dec = RoutingDecision(request_id="r", prefill_instance="p0", decode_instance="d0", reused_tokens=0,
                          predicted_ttft_s=1.0, predicted_tbt_ms=10.0, policy="x")
    for _ in range(3):
        eng.state.queue.append((Assignment(decision=dec, request=req, request_ts_ms=0, decision_ts_ms=0, prefill=True, decode=False), 0))
    eng.state.current_prefill_tokens = 640
    eng.state.prompt_tokens_total, eng.state.done = 1280, 2
    eng.cache.insert(range(25))
    load = parse_load(generate_latest(engine_registry(eng)).decode())
    assert (load.running, load.waiting, load.total_blocks, load.kv_usage) == (1, 3, 100, 0.25)
    assert load.start_time_s == eng.started_s
    assert heartbeat_of(load, role="prefill", model="m", interval_s=1).queued_prefill_tokens == 4 * 640


def test_vllm_extra_keys_rule() -> None:
    # One image over tokens 10..29, block size 16, a LoRA adapter and a cache salt.
    extras = vllm_block_extras(48, 16, lora_name="a", mm_items=[("img", 10, 20)], cache_salt="s")
    assert extras == [("a", "img", "s"), ("a", "img"), ("a",)]
    assert vllm_block_extras(32, 16) == [None, None]


def test_unsafe_topic_configs_are_named() -> None:
    kv = topics(TopicConfig("x.", 1, 1, 1000, 1000, 1000)).kv_events
    assert dict(kv.configs) == {"cleanup.policy": "delete", "retention.ms": "1000"}
    assert config_problems(kv, {"cleanup.policy": "delete", "retention.ms": "-1"}) == []
    problems = config_problems(kv, {"cleanup.policy": "compact", "retention.ms": "10"})
    assert len(problems) == 2 and "compact" in problems[0] and "10 ms" in problems[1]


def test_a_topic_whose_message_limit_cannot_take_a_dead_letter_is_named() -> None:
    kv = topics(TopicConfig("m.", 1, 1, 1000, 1000, 1000)).kv_events
    assert config_problems(kv, {"max.message.bytes": "1048588"}) == []
    (problem,) = config_problems(kv, {"max.message.bytes": "65536"})
    assert "65536" in problem and kv.name in problem


def test_the_dispatch_path_leaves_requests_a_gateway_brings_by_http() -> None:
    class NoPublisher:
        def start(self) -> None: ...

    eng = EmulatedEngine(EngineConfig("p0", "prefill", 16, kv_blocks=100), load_profile("llama3-70b-a800x8"),
                         NoPublisher())  # type: ignore[arg-type]
    dec = RoutingDecision(request_id="r", prefill_instance="p0", decode_instance="d0", reused_tokens=0,
                          predicted_ttft_s=1.0, predicted_tbt_ms=10.0, policy="x")

    def assignment(**kw: str) -> Assignment:
        req = RoutingRequest(request_id="r", block_keys=[1], prompt_tokens=640, **kw)  # type: ignore[arg-type]
        return Assignment(decision=dec, request=req, request_ts_ms=0, decision_ts_ms=0, prefill=True, decode=False)

    eng.submit(assignment(reply_to="gw-1"))  # routed through the log for a gateway
    eng.submit(assignment(decided_by="gw-1"))  # decided in a gateway's (or picker's) own process
    assert not eng.state.queue  # both come by HTTP: run from dispatch too, each would be prefilled twice
    eng.submit(assignment())
    assert len(eng.state.queue) == 1
