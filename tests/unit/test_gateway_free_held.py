"""A vLLM P/D prefill whose decode never took the request holds its KV pinned for a decode to pull
(issue 36 item 6). A retry on the same prefill instance pulls it (tests/integration/
test_gateway_decode_retry.py); a retry routed to another prefill instance frees it with a
one-token decode that pulls those blocks, instead of leaving them pinned until vLLM's abort
timeout. The engines here are httpx's mock transport: what each call carried is what is checked."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from conductor.gateway.config import UpstreamTimeouts
from conductor.gateway.handoff import call_of, vllm
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import EngineFailed, Upstream
from schemas import RoutingDecision

pytestmark = pytest.mark.unit

HELD = {"do_remote_prefill": True, "remote_engine_id": "e-p0", "remote_block_ids": [1, 2, 3],
        "remote_host": "10.0.0.1", "remote_port": 5600}
FRESH = {"do_remote_prefill": True, "remote_engine_id": "e-p1", "remote_block_ids": [7, 8],
         "remote_host": "10.0.0.2", "remote_port": 5600}
ENGINES = {"p0": "http://p0", "p1": "http://p1", "d0": "http://d0"}


def _decision(prefill: str) -> RoutingDecision:
    return RoutingDecision(request_id="r-2", prefill_instance=prefill, decode_instance="d0", reused_tokens=0,
                           predicted_ttft_s=0.1, predicted_tbt_ms=10.0, policy="kvcache-centric")


async def _hand_off(prefill: str, decode_status: int = 200) -> list[tuple[str, dict[str, Any], str]]:
    """One attempt of a request whose earlier attempt's prefill on p0 is held; the calls the
    engines got: (host, body, x-request-id)."""
    calls: list[tuple[str, dict[str, Any], str]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.host, body, request.headers["x-request-id"]))
        if request.url.host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": FRESH})
        return httpx.Response(decode_status, json={"choices": [{"text": "hello"}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        up = Upstream(client, UpstreamTimeouts(), time.monotonic)
        tr = Trace(request_id="r", t0=time.monotonic(), stream=False)
        tr.held_kv = ("p0", dict(HELD), {"choices": [{"text": "x"}]})
        call = call_of({"model": "m", "prompt": "hi there", "max_tokens": 16}, False, _decision(prefill), "r-2",
                       ENGINES)
        resp, _ = await vllm.hand_off(up, call, tr)
        await resp.aread()
        await resp.aclose()
        for _ in range(100):  # the freeing pull runs in the background
            if not vllm._freeing:
                break
            await asyncio.sleep(0.01)
        assert tr.held_kv is None
    return calls


async def test_a_retry_on_another_prefill_frees_the_held_kv_with_a_one_token_pull() -> None:
    calls = await _hand_off("p1")
    decodes = [(body, rid) for host, body, rid in calls if host == "d0"]
    frees = [(body, rid) for body, rid in decodes if body["kv_transfer_params"] == HELD]
    serves = [(body, rid) for body, rid in decodes if body["kv_transfer_params"] == FRESH]
    assert [host for host, _, _ in calls if host.startswith("p")] == ["p1"]  # a new prefill, on p1
    assert len(frees) == 1 and len(serves) == 1
    body, rid = frees[0]
    assert body["max_tokens"] == 1 and body["stream"] is False and rid == "r-2-free"
    assert serves[0][0]["max_tokens"] == 16 and serves[0][1] == "r-2"


async def test_a_retry_on_the_holder_pulls_the_held_kv_itself() -> None:
    calls = await _hand_off("p0")
    assert [host for host, _, _ in calls] == ["d0"]  # no prefill again, no extra pull
    assert calls[0][1]["kv_transfer_params"] == HELD and calls[0][1]["max_tokens"] == 16


async def test_a_pull_that_fails_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="conductor.gateway.handoff.vllm"):
        # d0 answers every decode 400 here: the request's own decode fails to the caller, the
        # freeing pull is logged and leaves the rest to vLLM's timeout.
        with pytest.raises(Exception, match="400"):
            await _hand_off("p1", decode_status=400)
        for _ in range(100):
            if "could not free the KV" in caplog.text:
                break
            await asyncio.sleep(0.01)
    assert "could not free the KV its prefill on p0 holds" in caplog.text


def _engines(calls: list[tuple[str, dict[str, Any], str]], decode: dict[str, int],
             hang: asyncio.Event | None = None) -> httpx.MockTransport:
    """p* prefill (answering FRESH); d* decode with ``decode[host]`` (default 200). With ``hang``,
    a full decode (more than one token) waits until the event is set: the client leaves meanwhile."""

    async def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.host, body, request.headers["x-request-id"]))
        if request.url.host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": FRESH})
        if hang is not None and body.get("max_tokens") != 1:
            await hang.wait()
        return httpx.Response(decode.get(request.url.host, 200), json={"choices": [{"text": "hello"}]})

    return httpx.MockTransport(engine)


async def _settle() -> None:
    for _ in range(200):  # the freeing pulls run in the background
        if not vllm._freeing:
            return
        await asyncio.sleep(0.01)


def _frees(calls: list[tuple[str, dict[str, Any], str]]) -> list[tuple[str, dict[str, Any], str]]:
    return [c for c in calls if c[0].startswith("d") and c[1]["max_tokens"] == 1]


async def test_a_client_that_leaves_before_the_decode_answers_frees_the_prefills_kv() -> None:
    calls: list[tuple[str, dict[str, Any], str]] = []
    async with httpx.AsyncClient(transport=_engines(calls, {}, hang=asyncio.Event())) as client:
        up = Upstream(client, UpstreamTimeouts(), time.monotonic)
        tr = Trace(request_id="r", t0=time.monotonic(), stream=False)
        call = call_of({"model": "m", "prompt": "hi there", "max_tokens": 16}, False, _decision("p1"), "r-2", ENGINES)
        task = asyncio.ensure_future(vllm.hand_off(up, call, tr))
        while not any(host == "d0" for host, _, _ in calls):  # the prefill answered, the decode is on its way
            await asyncio.sleep(0.005)
        task.cancel()  # the client went away (cancel_on_disconnect)
        with pytest.raises(asyncio.CancelledError):
            await task
        await _settle()
    frees = _frees(calls)
    assert len(frees) == 1
    host, body, rid = frees[0]
    assert (host, rid) == ("d0", "r-2-free") and body["kv_transfer_params"] == FRESH and body["stream"] is False


async def test_held_kv_left_when_no_decode_took_it_is_pulled_by_the_next_decode_that_opens() -> None:
    calls: list[tuple[str, dict[str, Any], str]] = []
    decode = {"d0": 503}
    pd = vllm.VllmHandOff()
    async with httpx.AsyncClient(transport=_engines(calls, decode)) as client:
        up = Upstream(client, UpstreamTimeouts(), time.monotonic)
        first = Trace(request_id="r1", t0=time.monotonic(), stream=False)
        with pytest.raises(EngineFailed):  # the last attempt's decode fails: nothing retries it
            await pd(up, call_of({"model": "m", "prompt": "one", "max_tokens": 16}, False, _decision("p1"), "r1",
                                 ENGINES), first)
        assert first.held_kv is not None and pd.orphaned(first) and first.held_kv is None
        assert len(pd.orphans) == 1 and not _frees(calls)
        decode["d0"] = 200  # the decode side is back
        second = Trace(request_id="r2", t0=time.monotonic(), stream=False)
        resp, _ = await pd(up, call_of({"model": "m", "prompt": "two", "max_tokens": 16}, False, _decision("p1"), "r2",
                                       ENGINES), second)
        await resp.aread()
        await resp.aclose()
        await _settle()
    frees = _frees(calls)
    assert [(h, b["prompt"], b["kv_transfer_params"], rid) for h, b, rid in frees] == [("d0", "one", FRESH, "r1-free")]
    assert len(pd.orphans) == 0


async def test_a_failed_pull_waits_for_the_next_decode_and_old_orphans_are_dropped() -> None:
    now = [0.0]
    orphans = vllm.Orphans(clock=lambda: now[0], limit=2)
    for i in range(3):  # bounded: the oldest goes
        call = call_of({"model": "m", "prompt": "hi", "max_tokens": 16}, True, _decision("p0"), f"r{i}", ENGINES)
        orphans.add(call, ("p0", dict(HELD), {}))
    assert len(orphans) == 2
    taken = orphans.take()
    assert [o.request_id for o in taken] == ["r1", "r2"] and len(orphans) == 0
    assert taken[0].path == "/v1/chat/completions" and taken[0].body["max_tokens"] == 1
    assert taken[0].body["kv_transfer_params"] == HELD and taken[0].holder == "p0"
    orphans.requeue(taken[0])  # its pull failed: kept for the next decode
    assert len(orphans) == 1
    now[0] = vllm.ABORT_TIMEOUT_S + 1  # vLLM has freed it by now: not pulled, not kept
    assert orphans.take() == []
    orphans.requeue(taken[1])
    assert len(orphans) == 0
