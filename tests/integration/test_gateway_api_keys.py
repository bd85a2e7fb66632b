"""API keys on a live gateway (real broker, Redis, worker, router, emulated engines, `conductor gateway`):
an unknown key is 401 in OpenAI's shape, a key over its rate is 429 with Retry-After, and a client's
SLO and priority headers reach the log clamped to its key's bounds, so a huge TTFT SLO cannot turn
early rejection off, and `explain` re-derives the decision with the priority the log holds."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from kvstream import read_all

from conductor.harness.gateway_cluster import GatewayCluster
from conductor.routing.explain import explain
from conductor.settings import Settings
from schemas import RoutingRequest
from streams.topics import topics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # `scripts/test -m slow`

TIGHT, VIP, SLOW = "sk-tight-0123456789abcdef", "sk-vip-0123456789abcdef", "sk-slow-0123456789abcdef"


@pytest.fixture
async def cluster(settings: Settings, tmp_path: Path):  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"name": "tight", "key": TIGHT, "max_ttft_slo_ms": 0.001},  # every request of this key misses its SLO
        {"name": "vip", "key": VIP, "max_priority": 30},
        {"name": "slow", "key": SLOW, "rate_per_s": 0.2, "burst": 1},
    ]}))
    s = settings.model_copy(update={"gateway_api_keys_file": keys})
    async with GatewayCluster(s, tmp_path / "logs", time_scale=20.0, max_output_tokens=4) as c:
        yield c


def client(c: GatewayCluster, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=key, max_retries=0, timeout=30)


async def test_keys_limits_and_slo_bounds_on_a_live_gateway(cluster: GatewayCluster, settings: Settings) -> None:
    prompt = "the quick brown fox " * 20
    huge = {"x-conductor-ttft-slo-ms": "86400000", "x-conductor-tbt-slo-ms": "1e9"}

    with pytest.raises(openai.AuthenticationError) as e:
        await client(cluster, "sk-not-a-key-0123456789").completions.create(model="default", prompt=prompt)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    async with httpx.AsyncClient() as h:
        assert (await h.get(cluster.gateway_url + "/health")).status_code == 200  # probes need no key
        assert (await h.get(cluster.gateway_url + "/v1/models")).status_code == 401

    # The tight key's bound (1 us) wins over its huge header: early rejection still applies.
    with pytest.raises(openai.RateLimitError) as e2:
        await client(cluster, TIGHT).completions.create(model="default", prompt=prompt, max_tokens=4,
                                                        extra_headers=huge | {"x-request-id": "tight-1"})
    assert e2.value.body["code"] == "ttft_slo"

    # The default key is bounded by the router's SLOs; vip may raise its priority up to 30.
    r = await client(cluster, cluster.api_key).completions.create(
        model="default", prompt=prompt, max_tokens=4, extra_headers=huge | {"x-conductor-priority": "90",
                                                                          "x-request-id": "default-1"})
    assert r.choices[0].text
    r = await client(cluster, VIP).completions.create(
        model="default", prompt=prompt, max_tokens=4, extra_headers={"x-conductor-priority": "90",
                                                                     "x-request-id": "vip-1"})
    assert r.choices[0].text

    # One request per 5 s for the slow key: the second is refused before it is routed.
    slow = client(cluster, SLOW)
    await slow.completions.create(model="default", prompt=prompt, max_tokens=4)
    with pytest.raises(openai.RateLimitError) as e3:
        await slow.completions.create(model="default", prompt=prompt, max_tokens=4)
    assert e3.value.body["code"] == "rate_limit_exceeded" and e3.value.response.headers["retry-after"] == "5"

    tps = topics(settings.topic_config())
    reqs = {b.request_id: b for b in await read_all(settings, tps.requests.name, 4) if isinstance(b, RoutingRequest)}
    assert len(reqs) == 4  # the unknown key and the second slow request never reached the log
    gw = cluster.gateway_id
    tight, default, vip = reqs[f"{gw}-tight-1"], reqs[f"{gw}-default-1"], reqs[f"{gw}-vip-1"]
    assert (tight.ttft_slo_s, tight.tbt_slo_ms) == (0.001 / 1000, settings.tbt_slo_ms)
    assert (default.ttft_slo_s, default.tbt_slo_ms, default.priority) == (settings.ttft_slo_s, settings.tbt_slo_ms, 0)
    assert vip.priority == 30 and vip.ttft_slo_s is None

    # The decision is re-derived from the log with the clamped SLO and priority the request holds.
    for rid in (tight.request_id, vip.request_id):
        x = await explain(settings, rid)
        assert x.matches, x.differences
