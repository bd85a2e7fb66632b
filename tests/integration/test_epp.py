"""`conductor epp` end to end: real broker, Redis, stream worker, router, emulated engines over HTTP,
and a client that plays Envoy's side of ext_proc over real gRPC with Envoy's own protos."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvstream import read_all

from conductor.epp.protocol import host_port
from conductor.harness.epp_cluster import EppCluster
from conductor.routing.explain import explain
from conductor.settings import Settings
from schemas import RequestOutcome, RoutingDecision, RoutingRejection, RoutingRequest
from streams.topics import topics

pytestmark = [pytest.mark.epp, pytest.mark.integration, pytest.mark.timeout(240)]

PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def completion(prompt: str = PROMPT, **extra: object) -> bytes:
    return json.dumps({"model": "default", "prompt": prompt, "max_tokens": 8, **extra}).encode()


@pytest.fixture
async def cluster(settings: Settings, tmp_path: Path):  # type: ignore[no-untyped-def]
    async with EppCluster(settings, tmp_path / "logs", time_scale=20.0, max_output_tokens=8) as c:
        yield c


async def test_routed_rejected_and_health_on_one_cluster(cluster: EppCluster, settings: Settings) -> None:
    await routed_in_one_message_in_chunks_and_buffered_each_decision_on_dispatch(cluster, settings)
    await rejections_and_bad_bodies_are_immediate_responses(cluster, settings)
    await health_and_a_request_with_no_body(cluster)
    await a_stream_cancelled_before_its_answer_is_released_and_recorded(cluster, settings)


async def routed_in_one_message_in_chunks_and_buffered_each_decision_on_dispatch(
        cluster: EppCluster, settings: Settings) -> None:
    body = completion()
    async with cluster.envoy() as envoy:
        answers = {
            "one": await envoy.request(body, headers={"x-request-id": "one"}),
            "chunks": await envoy.request(body, headers={"x-request-id": "chunks"}, chunks=7),
            "buffered": await envoy.request(body, headers={"x-request-id": "buffered"}, mode="buffered"),
            "chat": await envoy.request(json.dumps({"model": "default", "max_tokens": 4, "messages": [
                {"role": "user", "content": "tell me about prefill and decode " * 5}]}).encode(),
                path="/v1/chat/completions", headers={"x-request-id": "chat"}, chunks=3),
        }
    by_host = {host_port(u): n for n, u in cluster.engine_urls.items()}
    for name, a in answers.items():
        assert a.status == 200, (name, a.error)
        h = a.headers
        dest = h["x-gateway-destination-endpoint"]
        # The decode instance's host:port, the same in the header and in the envoy.lb metadata.
        assert by_host[dest] == h["x-conductor-decode-instance"] and by_host[dest].startswith("decode-")
        assert a.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": dest}}
        assert by_host[h["x-prefiller-host-port"]] == h["x-conductor-prefill-instance"]
        assert h["x-conductor-prefill-instance"].startswith("prefill-")
        assert a.clears_route_cache
        assert h["x-conductor-request-id"] == f"{cluster.epp_id}-{name}"
    # Full duplex: the headers' answer first, then the body streamed back whole and unchanged.
    one = answers["one"].responses
    assert [r.WhichOneof("response") for r in one] == ["request_headers", "request_body"]
    assert answers["one"].body_back == body and answers["chunks"].body_back == body
    assert answers["one"].headers["content-length"] == str(len(body))
    # Buffered: the headers answered at once (go on), the destination in the body's answer.
    buf = answers["buffered"].responses
    assert [r.WhichOneof("response") for r in buf] == ["request_headers", "request_body"]
    assert not buf[0].request_headers.HasField("response") and buf[1].request_body.response.clear_route_cache

    # Each request and its decision are on the log, like any other; explain re-derives each.
    tps = topics(settings.topic_config())
    reqs = {b.request_id: b for b in await read_all(settings, tps.requests.name, 4) if isinstance(b, RoutingRequest)}
    decisions = {b.request_id: b for b in await read_all(settings, tps.dispatch.name, 4)
                 if isinstance(b, RoutingDecision)}
    for name, a in answers.items():
        rid = f"{cluster.epp_id}-{name}"
        assert rid in reqs and reqs[rid].prompt_tokens > 0 and reqs[rid].decided_by == cluster.epp_id
        d = decisions[rid]
        assert d.decided_by == cluster.epp_id  # decided in the picker's own process (colocated)
        assert (d.prefill_instance, d.decode_instance) == (a.headers["x-conductor-prefill-instance"],
                                                           a.headers["x-conductor-decode-instance"])
        ex = await explain(settings, rid)
        assert ex.matches, ex.differences


async def rejections_and_bad_bodies_are_immediate_responses(cluster: EppCluster, settings: Settings) -> None:
    async with cluster.envoy() as envoy:
        slo = await envoy.request(completion("a b c d " * 200), headers={"x-conductor-ttft-slo-ms": "0.001",
                                                                          "x-request-id": "slo"})
        nothing = await envoy.request(completion(model="no-such-model"), chunks=2, headers={"x-request-id": "nothing"})
        not_json = await envoy.request(b'{"model": "default", "prompt": ', chunks=2, headers={"x-request-id": "b1"})
        bad_field = await envoy.request(completion(max_tokens=-3), headers={"x-request-id": "b2"})
        bad_header = await envoy.request(completion(), headers={"x-conductor-tbt-slo-ms": "soon", "x-request-id": "b3"},
                                         mode="buffered")
        wrong_route = await envoy.request(completion(), path="/v1/embeddings", headers={"x-request-id": "b4"})
    assert slo.status == 429 and slo.error["code"] == "ttft_slo" and "rejected by Conductor" in slo.error["message"]
    assert slo.headers["retry-after"] == "1"
    assert nothing.status == 503 and nothing.error["code"] == "no_live_instance"
    assert not_json.status == 400 and not_json.error["code"] == "invalid_json"
    assert bad_field.status == 400 and bad_field.error["param"] == "max_tokens"
    assert bad_header.status == 400 and bad_header.error["param"] == "x-conductor-tbt-slo-ms"
    assert wrong_route.status == 404 and wrong_route.error["code"] == "unknown_route"
    for a in (slo, nothing, not_json, bad_field, bad_header, wrong_route):
        assert a.headers["content-type"] == "application/json" and "x-gateway-destination-endpoint" not in a.headers
    # The two rejections are on dispatch with their reasons; the bad bodies never reached the log.
    tps = topics(settings.topic_config())
    rejections = {b.request_id: b.reason for b in await read_all(settings, tps.dispatch.name, 6)
                  if isinstance(b, RoutingRejection)}
    assert rejections == {f"{cluster.epp_id}-slo": "ttft_slo", f"{cluster.epp_id}-nothing": "no_live_instance"}
    ids = {b.request_id for b in await read_all(settings, tps.requests.name, 6, wait_s=2) if isinstance(b, RoutingRequest)}
    assert {f"{cluster.epp_id}-{i}" for i in ("slo", "nothing", "b1", "b2", "b3", "b4")} & ids == set(rejections)


async def test_a_dead_engine_is_left_out_then_no_live_instance_is_a_503(cluster: EppCluster, settings: Settings) -> None:
    cluster.kill("decode-0")  # its heartbeats stop; the view drops it after heartbeat_ttl_s
    await asyncio.sleep(settings.heartbeat_ttl_s + 1.0)
    async with cluster.envoy() as envoy:
        for i in range(4):
            a = await envoy.request(completion(f"request {i} " + "tok " * 40))
            assert a.status == 200 and a.headers["x-conductor-decode-instance"] == "decode-1"
            assert a.headers["x-gateway-destination-endpoint"] == host_port(cluster.engine_urls["decode-1"])
        cluster.kill("decode-1")
        await asyncio.sleep(settings.heartbeat_ttl_s + 1.0)
        gone = await envoy.request(completion())
    assert gone.status == 503 and gone.error["code"] == "no_live_instance"
    assert gone.headers["retry-after"] == "5"


async def health_and_a_request_with_no_body(cluster: EppCluster) -> None:
    async with grpc.aio.insecure_channel(cluster.epp_address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 10
        while True:
            got = {s: (await stub.Check(health_pb2.HealthCheckRequest(service=s))).status
                   for s in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")}
            if set(got.values()) == {health_pb2.HealthCheckResponse.SERVING} or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert set(got.values()) == {health_pb2.HealthCheckResponse.SERVING}, got
    async with cluster.envoy() as envoy:
        models = await envoy.request(None, method="GET", path="/v1/models")
    assert models.status == 200 and models.clears_route_cache
    assert models.headers["x-gateway-destination-endpoint"] in {host_port(u) for u in cluster.engine_urls.values()}


async def test_routed_through_the_log_by_the_routers(settings: Settings, tmp_path: Path) -> None:
    async with EppCluster(settings, tmp_path / "logs", time_scale=20.0, max_output_tokens=8,
                          epp_args=["--routing", "log"]) as c, c.envoy() as envoy:
        a = await envoy.request(completion(), headers={"x-request-id": "via-log"}, chunks=3)
        assert a.status == 200 and a.headers["x-conductor-decode-instance"].startswith("decode-")
        tps = topics(settings.topic_config())
        req = next(b for b in await read_all(settings, tps.requests.name, 1) if isinstance(b, RoutingRequest))
        # A router decided it (no decided_by) and answered on the picker's reply topic.
        assert req.request_id == f"{c.epp_id}-via-log" and req.reply_to == c.epp_id and req.decided_by is None
        d = next(b for b in await read_all(settings, tps.dispatch.name, 1) if isinstance(b, RoutingDecision))
        assert d.decided_by is None and d.decode_instance == a.headers["x-conductor-decode-instance"]


async def a_stream_cancelled_before_its_answer_is_released_and_recorded(cluster: EppCluster,
                                                                       settings: Settings) -> None:
    """Envoy cancels the stream (the client went away) while the picker decides: the decision is
    logged (its reservation was taken), then released and its failure recorded on request-outcomes."""
    async with cluster.envoy() as envoy:
        # Token ids (no tokenizer call): the stream ends while the picker decides (a view read, the
        # broker's acknowledgement), not before the picker has the body.
        for i, after_s in enumerate((0.0, 0.001, 0.002, 0.004, 0.008)):
            body = json.dumps({"model": "default", "prompt": [7, i] * 40, "max_tokens": 4}).encode()
            await envoy.request(body, headers={"x-request-id": f"gone{i}"}, cancel_after_s=after_s)
        # A request answered as usual afterwards is not released (its stream ends after the answer).
        kept = await envoy.request(completion(), headers={"x-request-id": "kept"})
    assert kept.status == 200
    tps = topics(settings.topic_config())
    outcomes = [b for b in await read_all(settings, tps.request_outcomes.name, 3, wait_s=10)
                if isinstance(b, RequestOutcome)]
    assert outcomes and {o.error for o in outcomes} == {"cancelled"}
    assert {o.status for o in outcomes} == {499} and all(o.gateway == cluster.epp_id for o in outcomes)
    assert f"{cluster.epp_id}-kept" not in {o.request_id for o in outcomes}
    decided = {b.request_id: b for b in await read_all(settings, tps.dispatch.name, 10_000, wait_s=3)
               if isinstance(b, RoutingDecision)}
    for o in outcomes:  # what was released was decided and logged
        assert o.request_id in decided and o.decode_instance == decided[o.request_id].decode_instance
        assert o.finished_view_ms is not None
