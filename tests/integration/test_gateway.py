"""The gateway end to end: real broker, Redis, stream worker, router, 2 prefill + 2 decode emulated
engines over HTTP, and `conductor gateway`, driven with the official `openai` client."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from kvstream import read_all

from conductor.harness.gateway_cluster import GatewayCluster
from conductor.routing.explain import explain
from conductor.settings import Settings
from schemas import RequestOutcome, RoutingDecision, RoutingRequest
from streams.topics import topics

pytestmark = pytest.mark.timeout(240)




@pytest.fixture(params=["colocated", "log"])
async def cluster(settings: Settings, tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    # A fast model clock: prefill ~ms, 8 output tokens at ~1 ms each. Both ways of deciding:
    # in the gateway's process (the default) and through the log (a router process).
    async with GatewayCluster(settings, tmp_path / "logs", time_scale=20.0, max_output_tokens=8,
                              gateway_args=["--routing", request.param]) as c:
        yield c


def client(c: GatewayCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=30)


async def test_completions_and_chat_streaming_and_not(cluster: GatewayCluster, settings: Settings) -> None:
    cl = client(cluster)
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    r = await cl.completions.create(model="default", prompt=prompt, max_tokens=8)
    assert r.choices[0].text.strip() and r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 72
    chunks = [c async for c in await cl.completions.create(model="default", prompt=prompt, max_tokens=8, stream=True)]
    assert len([c for c in chunks if c.choices and c.choices[0].text]) == 8
    msgs = [{"role": "user", "content": "tell me about prefill and decode " * 5}]
    cr = await cl.chat.completions.create(model="default", messages=msgs, max_tokens=8)
    assert cr.choices[0].message.content and cr.choices[0].message.role == "assistant"
    stream = await cl.chat.completions.create(model="default", messages=msgs, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True})
    got = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text and got[-1].usage is not None and got[-1].usage.completion_tokens == 8

    # Every request is on the log and was decided once: by this gateway (colocated; the router
    # skipped it) or by the router, answering this gateway's reply topic. Each left an outcome.
    tps = topics(settings.topic_config())
    reqs = [b for b in await read_all(settings, tps.requests.name, 4) if isinstance(b, RoutingRequest)]
    decs = [b for b in await read_all(settings, tps.dispatch.name, 4) if isinstance(b, RoutingDecision)]
    assert len(reqs) == 4 and sorted(d.request_id for d in decs) == sorted(r.request_id for r in reqs)
    if "colocated" in cluster.gateway_args:
        assert {r.decided_by for r in reqs} == {cluster.gateway_id} and {r.reply_to for r in reqs} == {None}
        assert {d.decided_by for d in decs} == {cluster.gateway_id}
        assert sorted(d.ordinal or 0 for d in decs) == [0, 1, 2, 3]
    else:
        assert {r.reply_to for r in reqs} == {cluster.gateway_id} and {r.decided_by for r in reqs} == {None}
        assert {d.decided_by for d in decs} == {None}
    # explain re-derives a decision either way, from the log alone.
    ex = await explain(settings, decs[-1].request_id)
    assert ex.matches, ex.differences
    outs = [b for b in await read_all(settings, tps.request_outcomes.name, 4) if isinstance(b, RequestOutcome)]
    assert len(outs) == 4 and all(o.status == 200 and o.error is None for o in outs)
    assert all(o.prefill_instance.startswith("prefill-") and o.decode_instance.startswith("decode-") for o in outs)
    assert all(o.ttft_s is not None and o.ttft_s > 0 and o.output_tokens == 8 for o in outs)
    assert any(o.tbt_p50_ms is not None for o in outs if o.stream)
    # The second identical prompt found its prefix cached on the prefill instance it reused (or not: then 0).
    assert all(0 <= o.cached_tokens <= o.prompt_tokens for o in outs)


async def test_rejection_and_bad_body_reach_the_client(cluster: GatewayCluster) -> None:
    cl = client(cluster)
    with pytest.raises(openai.RateLimitError) as e:
        await cl.completions.create(model="default", prompt="a b c d " * 200, max_tokens=4,
                                    extra_headers={"x-conductor-ttft-slo-ms": "0.001"})
    assert e.value.status_code == 429 and e.value.body["code"] == "ttft_slo"
    assert e.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError) as e2:  # 503: nothing serves this model
        await cl.completions.create(model="no-such-model", prompt="hello there", max_tokens=4)
    assert e2.value.status_code == 503 and e2.value.body["code"] == "no_live_instance"
    with pytest.raises(openai.BadRequestError) as e3:
        await cl.completions.create(model="default", prompt="hi", max_tokens=-3)
    assert e3.value.body["param"] == "max_tokens"
    async with httpx.AsyncClient(headers=cluster.auth_headers) as h:
        r = await h.post(cluster.gateway_url + "/v1/chat/completions", json={"model": "default", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    async with httpx.AsyncClient(headers=cluster.auth_headers) as h:
        bad = await h.post(cluster.gateway_url + "/v1/completions",
                           json={"model": "default", "prompt": "x"}, headers={"x-conductor-tbt-slo-ms": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-conductor-tbt-slo-ms"


async def test_a_dead_prefill_instance_is_routed_around_and_recorded(cluster: GatewayCluster, settings: Settings) -> None:
    cluster.kill("prefill-0")  # the view still shows it live for heartbeat_ttl_s
    cl = client(cluster)
    t0 = time.monotonic()
    for i in range(6):
        r = await cl.completions.create(model="default", prompt=f"request {i} " + "tok " * 40, max_tokens=4)
        assert r.choices[0].text
    assert time.monotonic() - t0 < 30
    tps = topics(settings.topic_config())
    reqs = [b for b in await read_all(settings, tps.requests.name, 6) if isinstance(b, RoutingRequest)]
    outs = [b for b in await read_all(settings, tps.request_outcomes.name, 6) if isinstance(b, RequestOutcome)]
    assert all(o.status == 200 and o.prefill_instance == "prefill-1" for o in outs)
    retried = [o for o in outs if len(o.attempts) > 1]
    # Whenever the router picked the dead instance, a retry excluding it is in the log.
    for o in retried:
        assert o.excluded == ["prefill-0"]
        retry = next(r for r in reqs if r.request_id == o.attempts[1])
        assert retry.exclude == ["prefill-0"] and retry.retry_of == o.request_id


async def test_a_decode_killed_mid_stream_ends_the_stream_with_an_error(tmp_path: Path, settings: Settings) -> None:
    # Slow decode (1 token every ~20 ms model time at scale 1): long enough to kill it mid-stream.
    async with GatewayCluster(settings, tmp_path / "logs", time_scale=1.0, max_output_tokens=400) as c:
        cl = client(c)
        t0 = time.monotonic()
        async with cl.completions.with_streaming_response.create(
            model="default", prompt="stream me " * 10, max_tokens=400, stream=True,
        ) as resp:
            victim = resp.headers["x-conductor-decode-instance"]
            n = 0
            with pytest.raises(openai.APIError) as e:
                async for chunk in await resp.parse():
                    n += 1
                    if n == 3:
                        c.kill(victim)
            assert "engine_failed" in str(e.value.body) or "engine_failed" in str(e.value)
        assert time.monotonic() - t0 < 20
        # The next request goes elsewhere once routed around (or is rerouted by the gateway).
        r = await cl.completions.create(model="default", prompt="after the crash", max_tokens=4)
        assert r.choices[0].text
