"""The endpoint picker without a server: ext_proc messages in, answers out (a fake decider and tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from conductor.epp.protocol import BadEndpoint, host_port, is_chat, pick_of, subset_hint
from conductor.epp.service import EppConfig, Picker
from conductor.frontdoor.decide import Down, ReleaseMark
from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import ClientRequest, Prompt
from schemas import Endpoint, RoutingDecision, RoutingRejection, RoutingRequest

ENGINES = {"p0": "http://10.0.0.1:8000", "d0": "http://10.0.0.2:8001", "d1": "http://[fd00::3]:8002"}
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 4}).encode()


def decision(rid: str, p: str = "p0", d: str = "d0", **kw: Any) -> RoutingDecision:
    return RoutingDecision(request_id=rid, prefill_instance=p, decode_instance=d, reused_tokens=0,
                           predicted_ttft_s=0.1, predicted_tbt_ms=10.0, policy="kvcache_centric", **kw)


class FakeDecider:
    late = "(are the routers running?)"

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.asked: list[RoutingRequest] = []
        self.releases: list[tuple[str, str, bool]] = []

    async def start(self) -> None: ...

    async def decide(self, req: RoutingRequest) -> RoutingDecision | RoutingRejection:
        self.asked.append(req)
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer is None:
            return decision(req.request_id)
        return self.answer(req) if callable(self.answer) else self.answer

    def problem(self) -> str | None:
        return None

    def down(self, door: str) -> Down | None:
        return None

    def waiting(self, request_id: str) -> bool:
        return False

    def released(self, decision: RoutingDecision, at: str, monotonic_s: float, failed: bool = False) -> ReleaseMark | None:
        self.releases.append((decision.request_id, at, failed))
        return None

    async def close(self) -> None: ...


class WordTokenizer:
    async def prompt(self, req: ClientRequest) -> Prompt:
        return Prompt([len(w) for w in (req.prompt_text or "").split()])


def picker(answer: Any = None, **config: Any) -> tuple[Picker, FakeDecider]:
    dec = FakeDecider(answer)
    return Picker(EppConfig(epp_id="epp-1", engines=dict(ENGINES), **config), dec, WordTokenizer(),
                  EngineDirectory(ENGINES)), dec


def headers_msg(path: str = "/v1/completions", *, eos: bool = False, mode: int | None = None,
                **extra: str) -> pb.ProcessingRequest:
    hdrs = {":method": "POST", ":path": path, "x-request-id": "abc", **extra}
    m = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=eos, headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs.items()])))
    if mode is not None:
        m.protocol_config.request_body_mode = mode
    return m


def body_msg(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def set_headers(r: pb.ProcessingResponse) -> dict[str, str]:
    which = r.WhichOneof("response")
    m = getattr(r, which)
    mutation = m.headers if which == "immediate_response" else m.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def run(p: Picker, *msgs: pb.ProcessingRequest) -> list[list[pb.ProcessingResponse]]:
    st = p.stream()
    return [await p.on_message(st, m) for m in msgs]


@pytest.mark.parametrize("url,want", [
    ("http://10.0.0.5:8000", "10.0.0.5:8000"), ("http://10.0.0.5:8000/", "10.0.0.5:8000"),
    ("http://engine.ns.svc", "engine.ns.svc:80"), ("https://engine", "engine:443"),
    ("http://[fd00::1]:9000", "[fd00::1]:9000"), ("10.1.2.3:7000", "10.1.2.3:7000"),
])
def test_host_port(url: str, want: str) -> None:
    assert host_port(url) == want


@pytest.mark.parametrize("url", ["http://", "http://host:99999"])
def test_host_port_refuses_what_names_no_endpoint(url: str) -> None:
    with pytest.raises(BadEndpoint):
        host_port(url)


@pytest.mark.parametrize("path,want", [("/v1/completions", False), ("/v1/chat/completions", True),
                                       ("/v1/chat/completions?x=1", True), ("/v1/embeddings", None), ("", None)])
def test_is_chat(path: str, want: bool | None) -> None:
    assert is_chat(path) is want


def test_pick_of_a_disaggregated_an_aggregated_and_a_dp_ranked_decision() -> None:
    pd = pick_of(decision("r1"), ENGINES)
    assert pd.destination == "10.0.0.2:8001" and pd.prefill == "10.0.0.1:8000"
    assert pd.headers["x-gateway-destination-endpoint"] == "10.0.0.2:8001"
    assert pd.headers["x-prefiller-host-port"] == "10.0.0.1:8000" and "x-data-parallel-rank" not in pd.headers
    agg = pick_of(decision("r2", "d1", "d1", mode="aggregated",
                           endpoints={"d1": Endpoint(url="http://[fd00::3]:8002", dp_rank=3)}), ENGINES)
    assert agg.destination == "[fd00::3]:8002" and agg.prefill is None and "x-prefiller-host-port" not in agg.headers
    assert agg.headers["x-data-parallel-rank"] == "3"


def test_subset_hint_as_a_list_or_a_comma_separated_string() -> None:
    m = pb.ProcessingRequest()
    assert subset_hint(m) is None
    s = struct_pb2.Struct()
    s.update({"x-gateway-destination-endpoint-subset": ["10.0.0.2:8001", "10.0.0.1:8000"]})
    m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    assert subset_hint(m) == ["10.0.0.2:8001", "10.0.0.1:8000"]
    s.update({"x-gateway-destination-endpoint-subset": "10.0.0.2:8001, 10.0.0.1:8000"})
    m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    assert subset_hint(m) == ["10.0.0.2:8001", "10.0.0.1:8000"]


async def test_full_duplex_holds_the_headers_until_the_last_chunk_then_answers_headers_then_body() -> None:
    p, dec = picker()
    chunks = [BODY[i:i + 5] for i in range(0, len(BODY), 5)]
    out = await run(p, headers_msg(), *[body_msg(c, i == len(chunks) - 1) for i, c in enumerate(chunks)])
    assert all(o == [] for o in out[:-1])  # nothing before the body's end
    head, rest = out[-1]
    assert head.WhichOneof("response") == "request_headers" and head.request_headers.response.clear_route_cache
    hdrs = set_headers(head)
    assert hdrs["x-gateway-destination-endpoint"] == "10.0.0.2:8001"
    assert hdrs["x-prefiller-host-port"] == "10.0.0.1:8000" and hdrs["content-length"] == str(len(BODY))
    assert float(hdrs["x-conductor-routing-ms"]) >= 0  # the picker's own time, as the gateway's header
    assert json_format.MessageToDict(head.dynamic_metadata) == {
        "envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.2:8001"}}
    sb = rest.request_body.response.body_mutation.streamed_response
    assert sb.body == BODY and sb.end_of_stream
    req = dec.asked[0]
    assert req.request_id == "epp-1-abc" and req.token_ids == [5, 5] and req.expected_output_tokens == 4
    assert req.reachable == sorted(ENGINES)


async def test_buffered_answers_the_headers_at_once_and_routes_on_the_body() -> None:
    p, _ = picker(body_mode="buffered")
    [h], [b] = await run(p, headers_msg(), body_msg(BODY, True))
    assert h.WhichOneof("response") == "request_headers" and not h.request_headers.HasField("response")
    assert b.WhichOneof("response") == "request_body" and b.request_body.response.clear_route_cache
    assert set_headers(b)["x-gateway-destination-endpoint"] == "10.0.0.2:8001"
    assert not b.request_body.response.HasField("body_mutation")  # buffered: the body goes on unchanged


async def test_the_proxy_s_protocol_config_wins_over_the_configured_mode() -> None:
    p, _ = picker(body_mode="buffered")
    held, [head, rest] = await run(p, headers_msg(mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED),
                                   body_msg(BODY, True))
    assert held == []
    assert head.WhichOneof("response") == "request_headers" and rest.WhichOneof("response") == "request_body"


@pytest.mark.parametrize("mode", [processing_mode_pb2.ProcessingMode.STREAMED,  # the headers leave first
                                  processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL])
async def test_a_body_mode_it_cannot_decide_in_is_a_clear_500(mode: int) -> None:
    p, dec = picker()
    [[r]] = await run(p, headers_msg(mode=mode))
    assert r.immediate_response.status.code == 500
    assert "FULL_DUPLEX_STREAMED or BUFFERED" in json.loads(r.immediate_response.body)["error"]["message"]
    assert dec.asked == []


async def test_rejections_timeouts_and_bad_bodies() -> None:
    def status_and_code(r: pb.ProcessingResponse) -> tuple[int, str, dict[str, str]]:
        imm = r.immediate_response
        return imm.status.code, json.loads(imm.body)["error"]["code"], set_headers(r)

    p, _ = picker(RoutingRejection(request_id="x", reason="tbt_slo", message="too slow"))
    [_, [r]] = await run(p, headers_msg(), body_msg(BODY, True))
    assert status_and_code(r)[:2] == (429, "tbt_slo") and status_and_code(r)[2]["retry-after"] == "1"
    p, _ = picker(RoutingRejection(request_id="x", reason="view_unavailable"))
    [_, [r]] = await run(p, headers_msg(), body_msg(BODY, True))
    assert status_and_code(r)[:2] == (503, "view_unavailable")
    p, _ = picker(TimeoutError())
    [_, [r]] = await run(p, headers_msg(), body_msg(BODY, True))
    assert status_and_code(r)[:2] == (503, "decision_timeout")
    p, dec = picker()
    for bad, code in ((b"not json", "invalid_json"), (b'{"model": "m"}', "invalid_value"),
                      (json.dumps({"model": "m", "prompt": "x", "n": 2}).encode(), "invalid_value")):
        [_, [r]] = await run(p, headers_msg(), body_msg(bad, True))
        assert status_and_code(r)[:2] == (400, code)
    [_, [r]] = await run(p, headers_msg(**{"x-conductor-priority": "high"}), body_msg(BODY, True))
    assert json.loads(r.immediate_response.body)["error"]["param"] == "x-conductor-priority"
    assert dec.asked == []  # nothing bad reached the decider


async def test_a_body_past_the_limit_is_413_without_waiting_for_its_end() -> None:
    p, dec = picker(max_body_bytes=1024)
    out = await run(p, headers_msg(), body_msg(b"x" * 600, False), body_msg(b"x" * 600, False))
    assert out[1] == [] and out[2][0].immediate_response.status.code == 413 and dec.asked == []


async def test_the_body_ending_with_trailers_and_a_request_with_no_body() -> None:
    p, _ = picker()
    st = p.stream()
    await p.on_message(st, headers_msg())
    assert await p.on_message(st, body_msg(BODY, False)) == []
    out = await p.on_message(st, pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    [[r1], [r2]] = [await p.on_message(p.stream(), headers_msg("/v1/models", eos=True)) for _ in range(2)]
    dests = {set_headers(r)["x-gateway-destination-endpoint"] for r in (r1, r2)}
    assert len(dests) == 2 and r1.request_headers.response.clear_route_cache  # in turn over the engines


async def test_the_proxy_s_subset_excludes_the_others_and_an_empty_overlap_is_503() -> None:
    p, dec = picker()
    m = headers_msg()
    s = struct_pb2.Struct()
    s.update({"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "[fd00::3]:8002"]})
    m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    await run(p, m, body_msg(BODY, True))
    assert dec.asked[0].exclude == ["d0"]
    s.update({"x-gateway-destination-endpoint-subset": ["192.168.9.9:1"]})
    m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    [_, [r]] = await run(p, m, body_msg(BODY, True))
    assert r.immediate_response.status.code == 503 and len(dec.asked) == 1


async def test_a_decision_naming_an_instance_with_no_url_is_503_not_a_guess() -> None:
    p, _ = picker(lambda req: decision(req.request_id, "p9", "d0"))
    [_, [r]] = await run(p, headers_msg(), body_msg(BODY, True))
    assert r.immediate_response.status.code == 503
    assert json.loads(r.immediate_response.body)["error"]["code"] == "no_endpoint"
