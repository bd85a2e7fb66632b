"""The admin API on the real broker and Redis: the log feed, the dead-letter queue's re-send,
and policy changes that reach the routers as control records."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from conductor.admin.api import create_app
from conductor.routing.control_log import current_control
from schemas import DeadLetter, Heartbeat, RoutingDecision, decode, encode, envelope
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration

TOKEN = "admin-token-integration-0001"


def wait_for(pred, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


async def test_admin_api_follows_the_log_and_steers_through_control(settings):
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    now = int(time.time() * 1000)
    hb = envelope(Heartbeat(role="prefill"), producer_id="p-9", producer_seq=0, ts_ms=now)
    prod = kafka.producer(settings.kafka())
    await prod.start()
    await prod.send_and_wait(t.dispatch.name, encode(envelope(
        RoutingDecision(request_id="a1", prefill_instance="p-9", decode_instance="d-9", reused_tokens=0,
                        predicted_ttft_s=0.2, predicted_tbt_ms=10, policy="kvcache-centric"),
        producer_id="router", producer_seq=1, ts_ms=now)), key=b"p-9")
    await prod.send_and_wait(t.dead_letter.name, encode(envelope(
        DeadLetter(source_topic=t.heartbeats.name, partition=0, offset=7, reason="validation_error",
                   error="a test letter", original=encode(hb)),
        producer_id="worker", producer_seq=1, ts_ms=now)), key=t.heartbeats.name.encode())
    await prod.stop()

    s = settings.model_copy(update={"admin_token": SecretStr(TOKEN)})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(s)) as c:
        wait_for(lambda: c.get("/health").json()["feed_ready"], "the feed to catch up")
        ds = wait_for(lambda: c.get("/api/decisions", headers=auth).json()["decisions"], "the decision")
        assert ds[0]["request_id"] == "a1" and ds[0]["prefill_instance"] == "p-9"
        dl = wait_for(lambda: c.get("/api/dead-letters", headers=auth).json()["dead_letters"], "the dead letter")
        assert dl[0]["reason"] == "validation_error" and dl[0]["source_offset"] == 7
        one = c.get(f"/api/dead-letters/{dl[0]['partition']}/{dl[0]['offset']}", headers=auth).json()
        assert one["original_base64"]
        sent = c.post(f"/api/dead-letters/{dl[0]['partition']}/{dl[0]['offset']}/resend", headers=auth)
        assert sent.status_code == 200 and sent.json()["topic"] == t.heartbeats.name and sent.json()["key"] == "p-9"

        r = c.put("/api/policy", json={"policy": "least-loaded", "params": {}, "reason": "test"}, headers=auth)
        assert r.status_code == 202, r.text
        assert c.put("/api/policy/params", json={"params": {"nope": 1}}, headers=auth).status_code == 422
        assert c.post("/api/nodes/p-9/drain", headers=auth).status_code == 202
        pol = wait_for(lambda: (p := c.get("/api/policy", headers=auth).json())["control"]["offset"] >= 1 and p,
                       "the control records to come back")
        assert pol["policy"] == "least-loaded" and pol["control"]["draining"] == ["p-9"]

    # The re-sent record is on its source topic, byte for byte; the routers' fold agrees.
    cons = kafka.consumer(settings.kafka(), t.heartbeats.name, group_id=None)
    await cons.start()
    try:
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            for recs in (await cons.getmany(timeout_ms=300)).values():
                got += [r for r in recs if r.key == b"p-9"]
    finally:
        await cons.stop()
    assert got and decode(got[0].value).producer_id == "p-9"
    st = await current_control(settings)
    assert (st.policy, sorted(st.draining)) == ("least-loaded", ["p-9"])
