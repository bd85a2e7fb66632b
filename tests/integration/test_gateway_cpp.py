"""Chunked pipeline parallelism live: a long prompt runs as a CPP group of emulated engines behind the
gateway, each member computing its chunk after pulling the KV before it, and the decode instance
receives the whole prompt's KV from the last member."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest
from kvstream import read_all

from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings
from schemas import RequestOutcome, RoutingDecision
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]  # `scripts/test -m slow`

PROMPT_TOKENS = 16_384
"""The default profile prefills 16k tokens in ~2.6 s on one instance, ~1.4 s on a group of two."""




async def test_a_long_prompt_runs_as_a_cpp_group_and_the_decode_gets_the_whole_kv(
        settings: Settings, tmp_path: Path) -> None:
    s = settings.model_copy(update={"policy": "kvcache-centric",
                                    "policy_params": {"cpp": True, "cpp_min_tokens": 4096}})
    async with GatewayCluster(s, tmp_path / "logs", time_scale=20.0, max_output_tokens=8, report=True) as c:
        cl = openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=60)
        prompt = [100 + (i * 7919) % 30_000 for i in range(PROMPT_TOKENS)]
        # 2 s: one instance (~2.6 s) misses it, a group of two (~1.4 s) meets it.
        r = await cl.completions.with_raw_response.create(
            model="default", prompt=prompt, max_tokens=8, extra_headers={"x-conductor-ttft-slo-ms": "2000"})
        done = r.parse()
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == PROMPT_TOKENS
        rid = r.headers["x-conductor-request-id"]
        decode_node = r.headers["x-conductor-decode-instance"]

        tps = topics(s.topic_config())
        ds = [b for b in await read_all(s, tps.dispatch.name, 1) if isinstance(b, RoutingDecision)]
        d = next(x for x in ds if x.request_id == rid)
        assert d.prefill_group is not None and sorted(d.prefill_group) == ["prefill-0", "prefill-1"]
        assert d.chunk_boundaries is not None and d.chunk_boundaries[-1] == PROMPT_TOKENS
        assert d.reused_tokens < d.chunk_boundaries[0] < PROMPT_TOKENS

        # Each member computed its own chunk after receiving the KV before it from its predecessor...
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(x.get("event") == "kv_received" for x in c.reports):
            await asyncio.sleep(0.05)
        chunks = {x["node"]: x for x in c.reports if x.get("event") == "cpp_chunk" and x["request_id"] == rid}
        head, tail = d.prefill_group
        assert chunks[head]["received_tokens"] == 0 and chunks[head]["chunk_end"] == d.chunk_boundaries[0]
        assert chunks[tail]["received_from"] == head
        assert chunks[tail]["received_tokens"] == d.chunk_boundaries[0]
        assert chunks[tail]["chunk_end"] == PROMPT_TOKENS
        # ...and the decode instance received the whole prompt's KV from the last member.
        got = [x for x in c.reports if x.get("event") == "kv_received" and x["request_id"] == rid]
        assert len(got) == 1 and got[0]["node"] == decode_node == d.decode_instance
        assert got[0]["received_from"] == tail and got[0]["received_tokens"] == PROMPT_TOKENS

        outs = [b for b in await read_all(s, tps.request_outcomes.name, 1) if isinstance(b, RequestOutcome)]
        o = next(x for x in outs if x.request_id == rid)
        assert o.status == 200 and o.prefill_instance == head and o.ttft_s is not None
