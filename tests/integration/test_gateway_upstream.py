"""The gateway's calls to the engines, on the real broker and Redis: timeouts by phase, what is
routed again and what never is, the SSE relay's bound, SGLang's hand-off closing what it opened,
``/health`` when the reply inbox dies, a client that goes away, and the in-flight work and pending
blocks a request gives back however it ends (as another gateway's followers see them).

The gateway and a router run in this process on the session's broker and Valkey; the engines are
one small HTTP server of the test's own (``FakeEngines``), each engine a path prefix on it, whose
every call the test scripts and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from kvstream import read_all
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conductor import web
from conductor.frontdoor.decide import Colocated, LogDecider
from conductor.gateway import relay
from conductor.gateway.app import run_gateway
from conductor.gateway.auth import key_ring
from conductor.gateway.config import RoutingMode, engine_protocol, gateway_config
from conductor.gateway.service import Gateway
from conductor.routing.router import Router
from conductor.routing.stores import decision_time_stores, redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import Settings
from schemas import Heartbeat, RequestOutcome, RoutingRequest, envelope
from state.shared_log import RedisInflight, RedisPendingBlocks
from streams.kafka import ensure_topics
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = list(range(100, 164))
WARM_UP = "warm-up"
Handler = Callable[[str, dict[str, Any], Request], Awaitable[Response]]


@dataclass
class Call:
    node: str
    kind: str
    """``tokenize``, ``prefill`` (nodes named ``p…``) or ``decode`` (``d…``, ``a…``)."""
    body: dict[str, Any]


@dataclass
class FakeEngines:
    """Every engine of a test behind one HTTP server: ``/<node>/v1/completions`` and ``/<node>/tokenize``.
    By default a prefill answers with ``kv_transfer_params`` and a decode with 3 tokens (JSON or SSE);
    ``on[node]`` replaces a node's behaviour."""

    url: str = ""
    calls: list[Call] = field(default_factory=list)
    on: dict[str, Handler] = field(default_factory=dict)
    gone: list[str] = field(default_factory=list)
    """The nodes whose caller went away while they answered (a stream closed, a request dropped)."""

    def count(self, kind: str, node: str | None = None) -> int:
        return sum(1 for c in self.calls if c.kind == kind and node in (None, c.node))

    async def endpoint(self, request: Request) -> Response:
        node, what = request.path_params["node"], request.path_params["what"]
        body = await request.json()
        if what == "tokenize":
            self.calls.append(Call(node, "tokenize", body))
            return JSONResponse({"count": len(PROMPT), "max_model_len": 4096, "tokens": PROMPT})
        kind = "prefill" if node.startswith("p") else "decode"
        self.calls.append(Call(node, kind, body))
        if node in self.on:
            return await self.on[node](kind, body, request)
        return default_answer(kind, body)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{node}/{what:path}", self.endpoint, methods=["POST"])])


def default_answer(kind: str, body: dict[str, Any]) -> Response:
    if kind == "prefill":
        return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": len(PROMPT)},
                             "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p"}})
    if not body.get("stream"):
        return JSONResponse({"choices": [{"index": 0, "text": " a b c", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 3}})

    async def events() -> AsyncIterator[bytes]:
        for w in ("a", "b", "c"):
            yield b'data: {"choices": [{"index": 0, "text": " ' + w.encode() + b'"}]}\n\n'
        yield b'data: {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 3}}\n\n'
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def until_gone(engines: FakeEngines, node: str, request: Request) -> Response:
    """Hold the call until its caller goes away; record that it did."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.02)
    engines.gone.append(node)
    return Response(status_code=500)


async def working(request: Request, seconds: float) -> None:
    """An engine busy with the request for ``seconds``, or until its caller gives up on it (the test
    then need not wait out the rest: the server's stop waits for its calls)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not await request.is_disconnected():
        await asyncio.sleep(0.05)


@dataclass
class Stack:
    gw: Gateway
    url: str
    engines: FakeEngines
    settings: Settings
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set: the gateway (and the fake engines) stop, the gateway draining first."""

    def client(self, timeout: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout)

    async def routing_requests(self, at_least: int = 1, wait_s: float = 3.0) -> list[RoutingRequest]:
        """The routing requests on the log (waits ``wait_s`` for one more than ``at_least``: none may be missed)."""
        got = await read_all(self.settings, topics(self.settings.topic_config()).requests.name, at_least + 2, wait_s)
        return [b for b in got if isinstance(b, RoutingRequest) and not b.request_id.endswith("-" + WARM_UP)]


@contextlib.asynccontextmanager
async def dropping_server(calls: list[bytes]) -> AsyncIterator[str]:
    """An HTTP server that reads a whole request and closes the connection without a word: an engine
    that died while it generated. Every completion request it read is in ``calls``."""

    async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        if b"/v1/completions" in head:
            calls.append(head)
        writer.transport.abort()

    server = await asyncio.start_server(take, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def refusing_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    sock = web.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def stack(settings: Settings, nodes: dict[str, str], *, protocol: str = "vllm", urls: dict[str, str] | None = None,
                routing: RoutingMode = "colocated", **update: Any) -> AsyncIterator[Stack]:
    """The fake engines, the view showing ``nodes`` (id → role) live, a router and a gateway in this
    process (deciding as ``routing`` says); ``urls`` sends some nodes elsewhere than the fake engines."""
    settings = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "gateway_drain_s": 3.0, **update})
    await ensure_topics(settings.kafka(), topics(settings.topic_config()).all())
    view, resv = redis_stores(settings, producer_id="gw-upstream-test")
    now = int(time.time() * 1000)
    await view.apply([(envelope(Heartbeat(role=role, rack="r0"), producer_id=node, producer_seq=0, ts_ms=now), None)
                      for node, role in nodes.items()])
    engines = FakeEngines()
    stop = asyncio.Event()
    esock = web.bind("127.0.0.1", 0)
    engines.url = f"http://127.0.0.1:{esock.getsockname()[1]}"
    engines_stop = asyncio.Event()  # after the gateway's: a draining gateway still reads its engines
    engines_task = asyncio.create_task(web.serve(engines.app(), esock, engines_stop))
    tasks = [asyncio.create_task(RouterWorker(settings, Router(settings, view, resv), router_id="r-upstream").run(stop))]
    config = gateway_config(settings, gateway_id=f"gw-up-{uuid.uuid4().hex[:8]}",
                            engines={n: f"{engines.url}/{n}" for n in nodes} | (urls or {}),
                            protocol=engine_protocol(protocol), decision_timeout_s=10.0, routing=routing)
    gsock = web.bind("127.0.0.1", 0)
    ready: asyncio.Future[Gateway] = asyncio.get_running_loop().create_future()
    tasks.append(asyncio.create_task(run_gateway(settings, config, gsock, stop, keys=key_ring(settings, insecure=True),
                                                 on_ready=ready.set_result)))
    try:
        gw = await asyncio.wait_for(ready, 60)
        st = Stack(gw, f"http://127.0.0.1:{gsock.getsockname()[1]}", engines, settings, stop)
        await warm_up(st)
        yield st
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        engines_stop.set()
        await asyncio.wait_for(asyncio.gather(engines_task, return_exceptions=True), 30)
        await resv.clear()
        await view.close()


async def warm_up(s: Stack) -> None:
    """One request through the log that the router rejects (no engine call): the router's first
    decision takes seconds on the embedded broker (its consumer joins), the tests' timeouts less."""
    async with s.client() as c:
        r = await c.post("/v1/completions", json={"model": "default", "prompt": PROMPT, "max_tokens": 1},
                         headers={"x-request-id": WARM_UP, "x-conductor-ttft-slo-ms": "0.000001"})
    assert r.status_code == 429, r.text
    s.gw.outcomes.clear()


def completion(stream: bool = False) -> dict[str, Any]:
    return {"model": "default", "prompt": "hello " * 64, "max_tokens": 3, "stream": stream}


async def outcome_of(s: Stack, wait_s: float = 5.0) -> RequestOutcome:
    deadline = time.monotonic() + wait_s
    while not s.gw.outcomes:
        assert time.monotonic() < deadline, "no request_outcome"
        await asyncio.sleep(0.02)
    return s.gw.outcomes[-1]


# --- item 3: what is routed again, and what never is ---------------------------------------------


async def test_an_engine_silent_past_the_first_byte_timeout_is_answered_504_and_never_asked_again(
        settings: Settings) -> None:
    async def slow_headers(kind: str, body: dict[str, Any], request: Request) -> Response:
        await working(request, 10.0)  # the engine took the request and works on it: past the first-byte timeout
        return default_answer(kind, body)

    async with stack(settings, {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
                     gateway_first_byte_timeout_s=0.5) as s:
        s.engines.on.update(d0=slow_headers, d1=slow_headers)
        async with s.client() as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=completion(stream=True))
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout", r.text
        assert "not run again" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 8.0  # the answer did not wait for the engine
        assert s.engines.count("decode") == 1 and s.engines.count("prefill") == 1
        assert len(await s.routing_requests()) == 1  # no retry on the log either
        o = await outcome_of(s)
        assert o.status == 504 and o.error == "upstream_timeout" and o.attempts == [o.request_id] and o.excluded == []


async def test_a_connection_broken_after_the_engine_took_the_request_is_a_502_not_a_rerun(settings: Settings) -> None:
    taken: list[bytes] = []
    async with dropping_server(taken) as dying, \
            stack(settings, {"p0": "prefill", "d0": "decode", "d1": "decode"}, urls={"d0": dying, "d1": dying}) as s:
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 502 and r.json()["error"]["code"] == "engine_failed", r.text
        assert len(taken) == 1  # the old gateway sent it to the other decode instance too
        assert len(await s.routing_requests()) == 1


async def test_a_long_non_streamed_generation_is_waited_for(settings: Settings) -> None:
    async def long_generation(kind: str, body: dict[str, Any], request: Request) -> Response:
        await asyncio.sleep(2.0)  # far past the first-byte and idle timeouts: it has no first byte before its last
        return default_answer(kind, body)

    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_first_byte_timeout_s=0.3,
                     gateway_idle_timeout_s=0.3) as s:
        s.engines.on["d0"] = long_generation
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " a b c", r.text
        assert s.engines.count("decode") == 1


async def test_the_total_timeout_bounds_a_whole_request_when_set(settings: Settings) -> None:
    async def long_generation(kind: str, body: dict[str, Any], request: Request) -> Response:
        await working(request, 5.0)
        return default_answer(kind, body)

    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_total_timeout_s=1.5) as s:
        s.engines.on["d0"] = long_generation
        async with s.client() as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 504 and "1.5s for the whole request" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 4.0 and s.engines.count("decode") == 1


async def test_a_stream_idle_past_its_timeout_ends_with_an_error_event(settings: Settings) -> None:
    async def stall(kind: str, body: dict[str, Any], request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
            await asyncio.sleep(30)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_idle_timeout_s=0.5) as s:
        s.engines.on["d0"] = stall
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion(stream=True))
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith('data: {"choices"')
        err = json.loads(events[-1][len("data: "):])
        assert err["error"]["code"] == "upstream_timeout", r.text
        assert s.engines.count("decode") == 1


async def test_failures_before_the_engine_took_the_request_are_routed_elsewhere(settings: Settings) -> None:
    async def busy(kind: str, body: dict[str, Any], request: Request) -> Response:
        return JSONResponse({"error": {"message": "overloaded", "code": "overloaded"}}, status_code=503)

    # p0 answers 503 before any byte; p1 refuses connections; p2 serves. Whichever the router picks
    # first, the request ends on p2 with the others excluded, every retry in the log.
    async with stack(settings, {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode"},
                     urls={"p1": refusing_url()}) as s:
        s.engines.on["p0"] = busy
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 200, r.text
        o = await outcome_of(s)
        assert set(o.excluded) <= {"p0", "p1"} and o.prefill_instance == "p2"
        reqs = await s.routing_requests(at_least=1 + len(o.excluded))
        assert len(reqs) == 1 + len(o.excluded) == len(o.attempts)
        # (the requests topic has partitions: the retries come back in any order)
        assert sorted((r.exclude for r in reqs), key=len) == [o.excluded[:i] for i in range(len(reqs))]
        assert s.engines.count("decode") == 1


# --- item 4: bounded relay, SGLang's hand-off, health, a client that leaves -----------------------


async def test_an_sse_event_that_never_ends_is_cut_with_an_error(settings: Settings,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "MAX_SSE_EVENT_BYTES", 1 << 20, raising=False)
    sent = [0]

    async def endless(kind: str, body: dict[str, Any], request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
            yield b'data: {"choices": [{"index": 0, "text": "'
            for _ in range(256):  # 64 MiB, no end of event
                sent[0] += 1
                yield b"z" * (256 * 1024)
                await asyncio.sleep(0.002)  # lets the server see its client go

        return StreamingResponse(events(), media_type="text/event-stream")

    async with stack(settings, {"p0": "prefill", "d0": "decode"}) as s:
        s.engines.on["d0"] = endless
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion(stream=True))
        err = json.loads([e for e in r.text.split("\n\n") if e][-1][len("data: "):])
        assert err["error"]["code"] == "engine_failed" and "longer than" in err["error"]["message"], r.text[:300]
        assert len(r.content) < 64 * 1024  # the unfinished event never reached the client
        await asyncio.sleep(0.5)
        assert sent[0] < 64, sent  # the engine's stream was closed soon after the bound, not read to its end


async def test_sglang_decode_is_closed_when_its_prefill_fails(settings: Settings) -> None:
    async def failing_prefill(kind: str, body: dict[str, Any], request: Request) -> Response:
        await asyncio.sleep(0.3)  # the decode's stream is open by then
        return JSONResponse({"error": {"message": "prefill crashed", "code": "internal"}}, status_code=500)

    async def waiting_decode(kind: str, body: dict[str, Any], request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            try:
                await asyncio.sleep(60)  # waits on the bootstrap room its prefill never fills
                yield b"data: [DONE]\n\n"
            finally:
                s.engines.gone.append("d0")

        return StreamingResponse(events(), media_type="text/event-stream")

    async with stack(settings, {"p0": "prefill", "d0": "decode"}, protocol="sglang") as s:
        s.engines.on.update(p0=failing_prefill, d0=waiting_decode)
        async with s.client() as c:
            r = await c.post("/v1/completions", json=completion(stream=True))
        assert r.status_code in (502, 503), r.text  # p0 excluded, nothing else to prefill
        assert s.engines.count("decode") == 1
        deadline = time.monotonic() + 5
        while not s.engines.gone and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert s.engines.gone == ["d0"]  # the decode's connection was closed, not left to leak


async def test_health_is_503_with_the_reason_once_the_reply_inbox_is_dead(settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode"}, routing="log") as s, s.client() as c:
        assert (await c.get("/health")).status_code == 200
        inbox = s.gw.decider.inbox if isinstance(s.gw.decider, LogDecider) else None
        assert inbox is not None and inbox.task is not None
        inbox.task.cancel()
        await asyncio.wait({inbox.task})
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "reply_inbox_down"
        assert "cancelled" in h.json()["error"]["message"]
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "reply_inbox_down"
        assert time.monotonic() - t0 < 2.0  # not a decision timeout


async def test_health_is_503_once_the_colocated_router_stops_following_control(settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode"}) as s, s.client() as c:
        assert (await c.get("/health")).status_code == 200
        assert isinstance(s.gw.decider, Colocated)
        local = s.gw.decider.router
        assert local._control_task is not None
        local._control_task.cancel()
        await asyncio.wait({local._control_task})
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == "router_down"
        assert "control topic" in h.json()["error"]["message"]
        r = await c.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "router_down"


async def test_a_client_that_goes_away_cancels_the_engine_calls(settings: Settings) -> None:
    async def hold(kind: str, body: dict[str, Any], request: Request) -> Response:
        return await until_gone(s.engines, "d0", request)

    async with stack(settings, {"p0": "prefill", "d0": "decode"}) as s:
        s.engines.on["d0"] = hold
        async with s.client(timeout=1.0) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json=completion())
        deadline = time.monotonic() + 5
        while not s.engines.gone and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert s.engines.gone == ["d0"]  # the gateway dropped its call to the decode when its client left
        o = await outcome_of(s)
        assert o.status == 499 and o.error == "client_closed"

        # A stream the client stops reading: the decode's stream is closed too.
        async def slow_stream(kind: str, body: dict[str, Any], request: Request) -> Response:
            async def events() -> AsyncIterator[bytes]:
                try:
                    for _ in range(600):
                        yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
                        await asyncio.sleep(0.05)
                finally:
                    s.engines.gone.append("d0-stream")

            return StreamingResponse(events(), media_type="text/event-stream")

        s.engines.on["d0"] = slow_stream
        async with s.client() as c, c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
            async for _ in r.aiter_bytes():
                break
        deadline = time.monotonic() + 5
        while "d0-stream" not in s.engines.gone and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "d0-stream" in s.engines.gone


# --- decision-time state ends with the request, however it ends ----------------------------------


@contextlib.asynccontextmanager
async def shared_state(settings: Settings) -> AsyncIterator[tuple[RedisPendingBlocks, RedisInflight]]:
    """The pending blocks and in-flight ledger as another gateway sees them: its own followers of
    the shared logs on a connection of its own (nothing read from the gateway under test)."""
    _, resv = redis_stores(settings, producer_id="watcher")
    pending, inflight = decision_time_stores(settings, resv.client, "watcher")
    now = int(time.time() * 1000)
    await pending.start(now)
    await inflight.start(now)
    try:
        yield pending, inflight
    finally:
        await pending.close()
        await inflight.close()
        await resv.close()


async def settled(s: Stack, pending: RedisPendingBlocks, inflight: RedisInflight, request_id: str,
                  wait_s: float = 5.0) -> tuple[bool, dict[str, int]]:
    """Whether ``request_id`` still counts in flight, and the blocks of its prompt still pending per
    instance, as the watcher sees them: once both ended, or after ``wait_s``."""
    reqs = [r for r in await s.routing_requests(wait_s=0.5) if r.request_id == request_id]
    assert reqs, f"{request_id} is not on the log"
    chain = s.gw.decider.router.router.chain_of(reqs[0])  # type: ignore[attr-defined]
    assert chain, "a prompt of no full block places nothing"
    deadline = time.monotonic() + wait_s
    while True:
        now = int(time.time() * 1000)
        charged = request_id in inflight.local.in_flight()
        placed = {node: p.pending for node, p in pending.prefixes(chain, now).items() if p.pending}
        if (not charged and not placed and inflight.log.applied >= 2) or time.monotonic() > deadline:
            return charged, placed
        await asyncio.sleep(0.05)


async def test_a_request_that_ends_badly_gives_back_its_load_and_its_pending_blocks_at_once(
        settings: Settings) -> None:
    """Conductor's own load and pending blocks end when the request ends, not after the lease or the
    TTL (both far longer here): a client that leaves before the first token, an engine that fails,
    an engine that drops the connection inside the stream, a client that stops reading."""
    async def hold(kind: str, body: dict[str, Any], request: Request) -> Response:
        return await until_gone(s.engines, "d0", request)

    async def fails(kind: str, body: dict[str, Any], request: Request) -> Response:
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    async def cut_inside(kind: str, body: dict[str, Any], request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
            await asyncio.sleep(0.05)
            raise ConnectionResetError("engine died inside the stream")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def slow_stream(kind: str, body: dict[str, Any], request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            for _ in range(600):
                yield b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
                await asyncio.sleep(0.05)

        return StreamingResponse(events(), media_type="text/event-stream")

    async with (stack(settings, {"p0": "prefill", "d0": "decode"}, pending_ttl_s=600.0, inflight_lease_s=600.0) as s,
                shared_state(s.settings) as (pend, infl)):
        async def ended(case: str, blocks_end: bool = True) -> RequestOutcome:
            """``blocks_end``: the request ended before its prefill did, so no engine holds its blocks
            (after the first token they are in the engine's prefix cache: its KV events say so)."""
            o = await outcome_of(s)
            assert o.decode_instance == "d0", (case, o)  # decided, so charged and placed
            charged, placed = await settled(s, pend, infl, o.request_id)
            assert not charged, f"{case}: {o.request_id} still counted in flight ({o.status} {o.error})"
            if blocks_end:
                assert not placed, f"{case}: {o.request_id} still pending on {placed} ({o.status} {o.error})"
            s.gw.outcomes.clear()
            return o

        s.engines.on["d0"] = hold
        async with s.client(timeout=1.0) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json=completion())
        assert (await ended("client gone before the first token")).status == 499

        s.engines.on["d0"] = fails
        async with s.client() as c:
            assert (await c.post("/v1/completions", json=completion())).status_code >= 500
        assert (await ended("engine answered 500")).status >= 500

        s.engines.on["d0"] = cut_inside
        async with s.client() as c:
            with contextlib.suppress(httpx.HTTPError):
                async with c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                    async for _ in r.aiter_bytes():
                        pass
        assert (await ended("engine dropped the stream", blocks_end=False)).error is not None

        s.engines.on["d0"] = slow_stream
        async with s.client() as c, c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
            async for _ in r.aiter_bytes():
                break
        stopped = await ended("client stopped reading mid-stream", blocks_end=False)
        assert stopped.error == "client_closed", stopped.error  # the 200 was sent; the outcome says who ended it
