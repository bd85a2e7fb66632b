"""The admin feed on the real broker: the gateways' outcomes reach /api/stats (observed TTFT was
always null: the feed did not read request-outcomes)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from conductor.admin.api import create_app
from schemas import RequestOutcome, RoutingDecision, encode, envelope
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration

TOKEN = "admin-token-integration-0002"


async def test_observed_ttft_and_its_series_come_from_request_outcomes(settings):
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    now = int(time.time() * 1000)
    prod = kafka.producer(settings.kafka())
    await prod.start()
    try:
        for i, ttft in enumerate((0.30, 0.50, 0.70)):
            rid = f"o{i}"
            await prod.send_and_wait(t.dispatch.name, encode(envelope(
                RoutingDecision(request_id=rid, prefill_instance="p-1", decode_instance="p-1", reused_tokens=32,
                                predicted_ttft_s=0.4, predicted_tbt_ms=10, policy="kvcache-centric"),
                producer_id="router", producer_seq=i, ts_ms=now)), key=b"p-1")
            await prod.send_and_wait(t.request_outcomes.name, encode(envelope(
                RequestOutcome(request_id=rid, gateway="gw", status=200, prefill_instance="p-1", prompt_tokens=1000,
                               cached_tokens=32, predicted_ttft_s=0.4, ttft_s=ttft + 0.02, routing_ms=20.0),
                producer_id="gw", producer_seq=i, ts_ms=now)), key=rid.encode())
        await prod.send_and_wait(t.request_outcomes.name, encode(envelope(
            RequestOutcome(request_id="rejected", gateway="gw", status=429, error="ttft_slo"),
            producer_id="gw", producer_seq=9, ts_ms=now)), key=b"rejected")
    finally:
        await prod.stop()

    s = settings.model_copy(update={"admin_token": SecretStr(TOKEN)})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(s)) as c:
        deadline = time.monotonic() + 20
        while True:
            st = c.get("/api/stats", params={"window_s": 600}, headers=auth).json()
            if st["observed_requests"] == 3 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert st["observed_requests"] == 3, st
    assert st["observed_ttft_p50_s"] == pytest.approx(0.5)
    assert st["predicted_ttft_p50_s"] == pytest.approx(0.4)
    assert st["engine_cache_hit_ratio"] == pytest.approx(0.032)
    assert [p["requests"] for p in st["ttft_series"]] == [3]
    assert st["ttft_series"][0]["observed_ttft_p50_s"] == pytest.approx(0.5)
    assert st["hit_rate_by_instance"] == {"p-1": 1.0}
