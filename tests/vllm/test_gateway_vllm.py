"""Conductor end to end in front of real vLLM engines (the ``vllm`` marker; tests/vllm/README.md).

One cluster per test: stream worker, router, a `conductor bridge` per engine and a gateway
started with no ``--engine`` (it finds the engines through the view), in front of the
session's engines: one aggregated (role ``both``, no KV connector) and a P/D pair over NIXL.
Requests go in through the official ``openai`` client. What is checked comes from the
engines themselves (their prefix-cache and NIXL counters) and from the log.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.routing.control_log import publish_control
from conductor.routing.explain import explain
from conductor.settings import Settings
from schemas import ControlCommand, RequestOutcome, RoutingDecision, decode
from state.redis_view import RedisViewStore
from streams.kafka import consumer
from streams.topics import topics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

AGG, PRE, DEC = "vllm-a", "vllm-p", "vllm-d"


def counter(text: str, name: str) -> float:
    """The sum of a counter's samples on a /metrics page (0 when absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.MULTILINE))


async def metrics(http: httpx.AsyncClient, url: str) -> str:
    return (await http.get(url)).text


@pytest.fixture
async def cluster(vllm_settings: Settings, vllm_engines, tmp_path: Path) -> AsyncIterator[VllmGatewayCluster]:  # type: ignore[no-untyped-def]
    for e in vllm_engines.all():
        if not e.running:
            await e.start()
    nodes = [VllmNode(AGG, "both", vllm_engines.aggregated), VllmNode(PRE, "prefill", vllm_engines.prefill),
             VllmNode(DEC, "decode", vllm_engines.decode)]
    # A liveness TTL of 30 s: on two shared cores an idle NIXL engine's /metrics can miss the
    # bridge's 1 s scrape for ten seconds (its progress threads take most of a core), and a busy
    # engine is not a dead one. A killed engine is then routed around by the gateway's retry.
    settings = vllm_settings.model_copy(update={"heartbeat_ttl_s": 30.0})
    async with VllmGatewayCluster(settings, tmp_path / "logs", nodes=nodes,
                                  model=vllm_engines.aggregated.model) as c:
        yield c


def achievable(d: RoutingDecision, o: RequestOutcome, bs: int = 32) -> int:
    """The reuse vLLM can realise of a decision's prediction: it always computes the prompt's last
    token, so a prompt's last block is recomputed when the prompt ends on a block boundary."""
    return min(d.reused_tokens, max(0, (o.prompt_tokens - 1) // bs * bs))


def client(c: VllmGatewayCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=120)


async def cordon(settings: Settings, node: str, action: str = "cordon") -> None:
    await publish_control(settings, ControlCommand(action=action, node_id=node, reason="test"))  # type: ignore[arg-type]
    await asyncio.sleep(1.5)  # routers apply control in log order, read within their poll


async def read_by_id(settings: Settings, topic: str, kind: type, ids: list[str], wait_s: float = 20.0) -> list:  # type: ignore[type-arg]
    """The records of ``kind`` with these request ids, in the order of ``ids`` (waits for all of them)."""
    cons = consumer(settings.kafka(), topic, group_id=None, fetch_max_wait_ms=50)
    await cons.start()
    found: dict[str, object] = {}
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not set(ids) <= set(found):
            for recs in (await cons.getmany(timeout_ms=200)).values():
                for r in recs:
                    b = decode(r.value).body
                    if isinstance(b, kind):
                        found[b.request_id] = b  # type: ignore[attr-defined]
    finally:
        await cons.stop()
    missing = [i for i in ids if i not in found]
    assert not missing, f"no {kind.__name__} on {topic} for {missing}"
    return [found[i] for i in ids]


async def ask(c: VllmGatewayCluster, prompt: str, *, stream: bool = False, max_tokens: int = 4) -> str:
    """One completion through the gateway; returns its routing request id (``<gateway>-<x-request-id>``)."""
    rid = uuid.uuid4().hex[:12]
    r = await client(c).completions.create(model=c.model, prompt=prompt, max_tokens=max_tokens, stream=stream,
                                           extra_headers={"x-request-id": rid})
    if stream:
        assert [ch async for ch in r]  # type: ignore[union-attr]
    else:
        assert r.choices  # type: ignore[union-attr]
    return f"{c.gateway_id}-{rid}"


async def outcomes(settings: Settings, ids: list[str]) -> list[RequestOutcome]:
    return await read_by_id(settings, topics(settings.topic_config()).request_outcomes.name, RequestOutcome, ids)


async def decisions(settings: Settings, ids: list[str]) -> list[RoutingDecision]:
    return await read_by_id(settings, topics(settings.topic_config()).dispatch.name, RoutingDecision, ids)


async def test_pd_over_nixl_and_aggregated_through_the_gateway(cluster: VllmGatewayCluster, vllm_settings: Settings,
                                                              vllm_engines, unique_text: str,  # type: ignore[no-untyped-def]
                                                              http: httpx.AsyncClient) -> None:
    s = cluster.settings  # the TTL the cluster runs with: explain re-derives with it
    prompt = unique_text + "the prefill engine computes this and the decode engine pulls it " * 12

    # P/D: the aggregated engine cordoned, every request is a NIXL hand-off from vllm-p to vllm-d.
    await cordon(s, AGG)
    p_before = await metrics(http, vllm_engines.prefill.metrics_url)
    d_before = await metrics(http, vllm_engines.decode.metrics_url)
    ids = [await ask(cluster, prompt), await ask(cluster, prompt, stream=True)]
    p_after = await metrics(http, vllm_engines.prefill.metrics_url)
    d_after = await metrics(http, vllm_engines.decode.metrics_url)
    outs = await outcomes(s, ids)
    assert [(o.status, o.error, o.prefill_instance, o.decode_instance, len(o.attempts)) for o in outs] == \
        [(200, None, PRE, DEC, 1)] * 2
    first, second = await decisions(s, ids)
    assert first.mode == second.mode == "disaggregated"
    assert second.endpoints[PRE].url == vllm_engines.prefill.url  # found through the view: no --engine given
    # The second decision predicted reuse on the prefill holder: its KV events reached the view.
    assert second.reused_tokens >= 64 and second.reuse_source == PRE
    # ...and the engine's own counter confirms it (realised against predicted).
    hits = counter(p_after, "vllm:prefix_cache_hits_total") - counter(p_before, "vllm:prefix_cache_hits_total")
    assert hits >= achievable(second, outs[1]) * 0.9, (hits, second.reused_tokens, outs[1].prompt_tokens)
    print(f"\nP/D: predicted reuse {first.reused_tokens + second.reused_tokens} tokens, the prefill engine's "
          f"prefix-cache hits {hits:.0f} (realised/predicted {hits / max(1, first.reused_tokens + second.reused_tokens):.2f})")
    # The decode engine pulled the KV over NIXL, for both requests.
    pulls = counter(d_after, "vllm:nixl_xfer_time_seconds_count") - counter(d_before, "vllm:nixl_xfer_time_seconds_count")
    assert pulls >= 2, d_after[-2000:]

    # Aggregated: the P/D prefill cordoned, the aggregated engine serves whole requests in one call.
    await cordon(s, AGG, "uncordon")
    await cordon(s, PRE)
    a_before = await metrics(http, vllm_engines.aggregated.metrics_url)
    other = unique_text[::-1] + "an aggregated engine prefills and decodes in one call " * 12
    ids = [await ask(cluster, other, stream=stream) for stream in (False, True, False)]
    a_after = await metrics(http, vllm_engines.aggregated.metrics_url)
    outs = await outcomes(s, ids)
    assert [(o.status, o.error, o.prefill_instance, o.decode_instance, len(o.attempts), o.excluded) for o in outs] == \
        [(200, None, AGG, AGG, 1, [])] * 3, "an aggregated engine answered without failed attempts"
    agg = await decisions(s, ids)
    assert all(d.mode == "aggregated" for d in agg)
    assert agg[-1].reused_tokens >= 64
    done = counter(a_after, "vllm:request_success_total") - counter(a_before, "vllm:request_success_total")
    assert done == 3  # one engine call per request: no prefill half, no retry
    hits = counter(a_after, "vllm:prefix_cache_hits_total") - counter(a_before, "vllm:prefix_cache_hits_total")
    assert hits >= sum(achievable(d, o) for d, o in zip(agg, outs)) * 0.9, (hits, [d.reused_tokens for d in agg])
    print(f"aggregated: predicted reuse {sum(d.reused_tokens for d in agg)} tokens, the engine's prefix-cache hits "
          f"{hits:.0f} (realised/predicted {hits / max(1, sum(d.reused_tokens for d in agg)):.2f}); "
          f"failed attempts {sum(len(o.attempts) - 1 for o in outs)}")

    # explain re-derives a real decision from the log, with the modes costed.
    ex = await explain(s, agg[-1].request_id)
    assert ex.matches, ex.differences
    assert ex.recorded["mode"] == "aggregated"
    await cordon(s, PRE, "uncordon")


async def test_a_killed_engine_is_routed_around_and_a_restarted_one_has_no_phantom_cache(
        cluster: VllmGatewayCluster, vllm_settings: Settings, vllm_engines, unique_text: str,  # type: ignore[no-untyped-def]
        http: httpx.AsyncClient) -> None:
    s = cluster.settings  # the TTL the cluster runs with: explain re-derives with it
    prompt = unique_text + "a prompt the aggregated engine will hold in its cache " * 12
    await cordon(s, PRE)  # so the aggregated engine is the only one that can take a prompt
    ids = [await ask(cluster, prompt, max_tokens=2) for _ in range(2)]
    assert (await decisions(s, ids))[1].reused_tokens >= 64  # the view holds the prompt on vllm-a
    await cordon(s, PRE, "uncordon")

    cluster.kill(AGG)  # SIGKILL: the view shows it live until its heartbeats are missed
    ids = [await ask(cluster, f"{i} " + prompt, max_tokens=2) for i in range(4)]
    outs = await outcomes(s, ids)
    assert all(o.status == 200 and o.prefill_instance == PRE for o in outs), \
        [(o.status, o.error, o.message, o.prefill_instance) for o in outs]

    await cluster.restart(AGG)
    # Back in the view with a new epoch: the blocks of the killed process are gone.
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    try:
        node = None
        for _ in range(120):
            node = next((n for n in await view.nodes() if n.node_id == AGG), None)
            if node is not None and node.epoch > 0 and not node.blocks:
                break
            await asyncio.sleep(0.5)
        assert node is not None and node.epoch > 0 and not node.blocks, node
    finally:
        await view.close()
    await cordon(s, PRE)
    (last,) = await decisions(s, [await ask(cluster, prompt, max_tokens=2)])
    assert last.prefill_instance == AGG and last.reused_tokens < 64, "no reuse predicted from the dead process"
    await cordon(s, PRE, "uncordon")
