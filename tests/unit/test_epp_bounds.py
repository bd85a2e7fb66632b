"""The picker's bounds (issue 36, item 9): an overall decision timeout, a decision the proxy never
received released and recorded, a bound on the streams worked on at once, and the headers that
steer an engine taken from the client (a fake decider; the protocol itself: test_epp_picker.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from test_epp_picker import BODY, ENGINES, FakeDecider, WordTokenizer, body_msg, decision, headers_msg, set_headers

from conductor.epp.serve import epp_config, serve
from conductor.epp.service import EppConfig, ExternalProcessor, Picker
from conductor.frontdoor.decide import ReleaseMark
from conductor.frontdoor.directory import EngineDirectory
from conductor.harness.epp_cluster import EnvoySide
from conductor.settings import load_settings
from schemas import Endpoint, RequestOutcome, RoutingDecision, RoutingRequest

IDS_BODY = b'{"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 4}'
"""Token ids: no tokenizer call (the engines here are made-up addresses)."""


class SlowDecider(FakeDecider):
    """Decides after ``gate`` is set; records what is released."""

    def __init__(self, answer: Any = None) -> None:
        super().__init__(answer)
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def decide(self, req: RoutingRequest) -> Any:
        self.started.set()
        await self.gate.wait()
        return await super().decide(req)

    def released(self, d: RoutingDecision, at: str, monotonic_s: float, failed: bool = False) -> ReleaseMark | None:
        super().released(d, at, monotonic_s, failed)
        return ReleaseMark(1234, "epp-test", 7)


def picker(dec: FakeDecider, **config: Any) -> tuple[Picker, list[RequestOutcome]]:
    outcomes: list[RequestOutcome] = []
    p = Picker(EppConfig(epp_id="epp-1", engines=dict(ENGINES), **config), dec, WordTokenizer(),
               EngineDirectory(ENGINES), outcomes=outcomes.append)
    return p, outcomes


async def messages(*msgs: pb.ProcessingRequest, hold: asyncio.Event | None = None
                   ) -> AsyncIterator[pb.ProcessingRequest]:
    for m in msgs:
        yield m
    if hold is not None:  # the proxy keeps the stream open
        await hold.wait()


def code(r: pb.ProcessingResponse) -> tuple[int, str]:
    imm = r.immediate_response
    return imm.status.code, json.loads(imm.body)["error"]["code"]


def removed(r: pb.ProcessingResponse) -> list[str]:
    which = r.WhichOneof("response")
    return list(getattr(r, which).response.header_mutation.remove_headers)


async def test_a_decision_past_the_timeout_is_503_at_once_then_releasesand_recorded() -> None:
    dec = SlowDecider()
    p, outcomes = picker(dec, decision_timeout_s=0.05)
    st = p.stream()
    await p.on_message(st, headers_msg())
    [r] = await asyncio.wait_for(p.on_message(st, body_msg(BODY, True)), 2.0)
    assert code(r) == (503, "decision_timeout")
    assert dec.releases == []  # not decided yet: nothing to release
    dec.gate.set()  # the decision ends later (it was logged): what it reserved is released
    for _ in range(20):
        await asyncio.sleep(0)
    assert dec.releases == [("epp-1-abc", "finished", True)]
    [o] = outcomes
    assert (o.request_id, o.status, o.error, o.finished_view_ms) == ("epp-1-abc", 503, "decision_timeout", 1234)
    assert (o.release_producer, o.finished_event) == ("epp-test", 7)
    assert o.gateway == "epp-1" and o.decode_instance == "d0"


async def test_a_slow_tokenizer_counts_against_the_timeout_too() -> None:
    class Stuck(WordTokenizer):
        async def prompt(self, req: Any) -> Any:
            await asyncio.sleep(10)

    dec = FakeDecider()
    p = Picker(EppConfig(epp_id="epp-1", engines=dict(ENGINES), decision_timeout_s=0.05), dec, Stuck(),
               EngineDirectory(ENGINES))
    st = p.stream()
    await p.on_message(st, headers_msg())
    [r] = await asyncio.wait_for(p.on_message(st, body_msg(BODY, True)), 2.0)
    assert code(r) == (503, "decision_timeout") and dec.asked == []


async def test_a_stream_cancelled_while_deciding_releases_the_decision_when_it_is_made() -> None:
    dec = SlowDecider()
    p, outcomes = picker(dec)
    gen = ExternalProcessor(p).Process(messages(headers_msg(), body_msg(BODY, True)), None)
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.wait_for(dec.started.wait(), 2.0)
    task.cancel()  # Envoy cancels the stream (the client went away)
    await asyncio.gather(task, return_exceptions=True)
    assert p.working == 0 and dec.releases == []
    dec.gate.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert dec.releases == [("epp-1-abc", "finished", True)]
    assert [(o.status, o.error) for o in outcomes] == [(499, "cancelled")]


async def test_a_decision_whose_answer_the_proxy_never_took_is_released() -> None:
    dec = SlowDecider()
    dec.gate.set()
    p, outcomes = picker(dec)
    gen = ExternalProcessor(p).Process(messages(headers_msg(), body_msg(BODY, True)), None)
    head = await gen.__anext__()  # full duplex: the headers' answer, then the body's
    assert head.WhichOneof("response") == "request_headers"
    await gen.aclose()  # the stream ends before the body's answer went out
    assert dec.releases == [("epp-1-abc", "finished", True)] and outcomes[0].error == "cancelled"


async def test_a_delivered_decision_is_not_releaseswhen_the_stream_ends() -> None:
    dec = SlowDecider()
    dec.gate.set()
    p, outcomes = picker(dec)
    out = [r async for r in ExternalProcessor(p).Process(messages(headers_msg(), body_msg(BODY, True)), None)]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert dec.releases == [] and outcomes == [] and p.working == 0


async def test_a_stream_ended_as_soon_as_the_last_answer_is_out_is_delivered() -> None:
    """gRPC closes the servicer at its last ``yield`` when the proxy ends the stream on the answer."""
    p, outcomes = picker(FakeDecider())
    gen = ExternalProcessor(p).Process(messages(headers_msg(), body_msg(BODY, True)), None)
    out = [await gen.__anext__(), await gen.__anext__()]
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    await gen.aclose()
    assert outcomes == [] and p.abandoned == 0 and p.working == 0


async def test_streams_beyond_the_bound_are_429_at_once_and_the_bound_frees_after_the_answer() -> None:
    dec = SlowDecider()
    p, _ = picker(dec, max_streams=1)
    ext = ExternalProcessor(p)
    hold = asyncio.Event()
    first = ext.Process(messages(headers_msg(), body_msg(BODY, True), hold=hold), None)
    task = asyncio.ensure_future(first.__anext__())
    await asyncio.wait_for(dec.started.wait(), 2.0)
    [busy] = [r async for r in ext.Process(messages(headers_msg(), body_msg(BODY, True)), None)]
    assert code(busy) == (429, "picker_busy") and set_headers(busy)["retry-after"] == "1"
    dec.gate.set()
    assert (await task).WhichOneof("response") == "request_headers"
    assert (await first.__anext__()).WhichOneof("response") == "request_body"
    # The first stream stays open (the proxy relays the response) but no longer counts.
    out = [r async for r in ext.Process(messages(headers_msg(), body_msg(BODY, True)), None)]
    assert out[0].WhichOneof("response") == "request_headers"
    hold.set()
    await first.aclose()
    assert p.working == 0


async def test_headers_that_steer_an_engine_are_taken_from_the_client() -> None:
    steer: dict[str, Any] = {"x-data-parallel-rank": "7", "x-prefiller-host-port": "evil:1", "x-prefiller-url": "http://evil:1",
             "x-conductor-decode-instance": "d9"}
    # An aggregated decision without a DP rank sets none of the prefill and rank headers: the client's go.
    p, _ = picker(FakeDecider(lambda r: decision(r.request_id, "d1", "d1", mode="aggregated")))
    st = p.stream()
    await p.on_message(st, headers_msg(**steer))
    head, _ = await p.on_message(st, body_msg(BODY, True))
    assert {"x-data-parallel-rank", "x-prefiller-host-port", "x-prefiller-url"} <= set(removed(head))
    assert set_headers(head)["x-conductor-decode-instance"] == "d1"  # overwritten, not removed
    assert "x-conductor-decode-instance" not in removed(head)
    # The decision's own rank and prefill worker are set (overwriting the client's), not removed.
    p, _ = picker(FakeDecider(lambda r: decision(r.request_id, endpoints={"d0": Endpoint(url=ENGINES["d0"],
                                                                                            dp_rank=2)})))
    st = p.stream()
    await p.on_message(st, headers_msg(**steer))
    head, _ = await p.on_message(st, body_msg(BODY, True))
    hdrs = set_headers(head)
    assert hdrs["x-data-parallel-rank"] == "2" and hdrs["x-prefiller-host-port"] == "10.0.0.1:8000"
    assert removed(head) == ["x-prefiller-url"]
    # Buffered, and a request with no body: the same.
    p, _ = picker(FakeDecider(), body_mode="buffered")
    st = p.stream()
    await p.on_message(st, headers_msg(**steer))
    [b] = await p.on_message(st, body_msg(BODY, True))
    assert "x-data-parallel-rank" in removed(b)
    [r] = await p.on_message(p.stream(), headers_msg("/v1/models", eos=True, **steer))
    assert {"x-data-parallel-rank", "x-prefiller-host-port"} <= set(removed(r))


async def test_over_grpc_a_stream_the_proxy_ends_right_after_the_answer_is_not_released() -> None:
    """Envoy may end the stream as soon as it has the answer, before the servicer runs again."""
    settings = load_settings(kafka_url="k:9092")
    decider = FakeDecider()
    outcomes: list[RequestOutcome] = []
    stop = asyncio.Event()
    ready: list[dict[str, Any]] = []
    task = asyncio.create_task(serve(epp_config(settings, epp_id="epp-g", engines=dict(ENGINES)), settings, port=0,
                                     stop=stop, on_ready=ready.append, decider=decider, outcomes=outcomes.append))
    try:
        while not ready:
            assert not task.done(), task
            await asyncio.sleep(0.05)
        async with EnvoySide(f"127.0.0.1:{ready[0]['port']}") as envoy:  # cancels each stream after the answer
            for _ in range(20):
                assert (await envoy.request(IDS_BODY)).status == 200
        await asyncio.sleep(0.2)
        assert len(decider.asked) == 20 and decider.releases == [] and outcomes == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("depth", [900, 1100, 100_000])
async def test_a_deeply_nested_body_is_400_not_a_500(depth: int) -> None:
    p, _ = picker(FakeDecider())
    body = b'{"model": "m", "max_tokens": 4, "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    st = p.stream()
    await p.on_message(st, headers_msg())
    [r] = await p.on_message(st, body_msg(body, True))
    assert r.immediate_response.status.code == 400
    assert code(r)[1] in ("invalid_json", "invalid_value")  # past the parser's depth, or not a prompt
