"""The demo's client side: what one trace request sends through the openai client, and how its TTFT counts."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from conductor.harness.demo import RunStats, ask_completion

SSE = (b'data: {"id":"c","object":"text_completion","created":0,"model":"m",'
       b'"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\n'
       b"data: [DONE]\n\n")


def test_a_trace_request_sends_its_token_ids_as_the_prompt_and_records_the_first_token() -> None:
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=SSE, headers={
            "content-type": "text/event-stream", "x-conductor-routing-ms": "12.5",
            "x-conductor-request-id": "gw-kvcache-centric-3"})

    tokens = list(range(7, 20_007))
    stats = RunStats("kvcache-centric", speed=10.0)

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(engine)))
        await ask_completion(client, stats, "gw-kvcache-centric-3", "kvcache-centric-3", tokens, 5)
        await client.close()

    asyncio.run(main())
    assert len(seen) == 1
    body = json.loads(seen[0].content)
    assert body["prompt"] == tokens and body["max_tokens"] == 5 and body["stream"] is True
    assert seen[0].headers["x-request-id"] == "kvcache-centric-3"
    wall, routing = stats.client_ttft["gw-kvcache-centric-3"]
    assert routing == pytest.approx(0.0125) and wall >= 0.0
    assert not stats.client_errors


def test_a_rejection_counts_as_a_client_error_by_status() -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "m", "type": "t", "param": None, "code": "ttft_slo"}},
                              headers={"retry-after": "1"})

    stats = RunStats("kvcache-centric", speed=10.0)

    async def main() -> None:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.MockTransport(gateway)))
        await ask_completion(client, stats, "gw-1", "1", [1, 2, 3], 4)
        await client.close()

    asyncio.run(main())
    assert stats.client_errors == {"429": 1} and not stats.client_ttft


def test_client_ttft_counts_what_the_engines_emulated_in_model_time_and_the_rest_as_it_took() -> None:
    s = RunStats("p", speed=10.0)
    s.on_client("a", 0.5, 0.05)
    s.on_report({"event": "prefill_done", "request_id": "a", "node": "prefill-0", "prompt_tokens": 100,
                 "cached_tokens": 0, "engine_s": 2.0})
    s.on_report({"event": "kv_received", "request_id": "a", "node": "decode-0", "transfer_model_s": 1.0})
    # 0.3 s of the 0.5 s wall were emulated (3 model seconds); the other 0.2 s were real.
    assert s.observed["a"] == pytest.approx(0.2 + 3.0)
    # Without engine reports: only the routing time is taken as real.
    s.on_client("b", 0.5, 0.05)
    assert s.observed["b"] == pytest.approx(0.05 + 0.45 * 10.0)
    s.predicted.update(a=3.2, b=4.55)
    assert sorted(s.ttft) == pytest.approx([3.2, 4.55])
    assert s.ttft_error == pytest.approx([0.0, 0.0], abs=1e-9)
