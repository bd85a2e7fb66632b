"""The engine calls' transport (aiohttp under httpx's types): what a call returns, how its
connections are kept, and each failure in the class the gateway's retry rule reads."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import httpx
import pytest

from conductor.gateway.config import UpstreamTimeouts
from conductor.gateway.outcome import Trace
from conductor.gateway.transport import EngineTransport, _mapped
from conductor.gateway.upstream import EngineFailed, EngineLost, EnginePools, Upstream

pytestmark = pytest.mark.unit

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handle: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A local HTTP/1.1 server written by hand (each test says what it answers); yields its URL and
    the count of connections it accepted."""
    conns = [0]

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            await handle(r, w)
        finally:
            if not w.is_closing():
                w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", conns
    finally:
        srv.close()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One request's head and body (Content-Length framed); None at the connection's end."""
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await r.readexactly(length)


def sse(chunks: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for c in chunks:
        out += b"%x\r\n%s\r\n" % (len(c), c)
    return out + b"0\r\n\r\n"


def client(limits: httpx.Limits | None = None, **timeouts: float) -> httpx.AsyncClient:
    t = httpx.Timeout(**{"connect": 2.0, "pool": 2.0, "write": 2.0, "read": None, **timeouts})
    return httpx.AsyncClient(transport=EnginePools(limits), timeout=t)


async def test_a_streamed_answer_arrives_as_sent_and_its_connection_is_kept() -> None:
    seen: list[bytes] = []
    events = [b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n', b"data: [DONE]\n\n"]

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while (req := await read_request(r)) is not None:
            seen.append(req[1])
            w.write(sse(events))
            await w.drain()

    async with server(handle) as (url, conns), client() as c:
        for i in range(3):
            async with c.stream("POST", f"{url}/v1/completions", json={"prompt": [1, 2, i]}) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
                assert b"".join([b async for b in resp.aiter_bytes()]) == b"".join(events)
        assert seen == [b'{"prompt":[1,2,0]}', b'{"prompt":[1,2,1]}', b'{"prompt":[1,2,2]}']
        assert conns[0] == 1  # one connection, kept between the calls


async def test_an_engines_refusal_comes_back_with_its_status_and_body() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        body = b'{"error": {"message": "too long", "code": "context_length"}}'
        w.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body))
        await w.drain()

    async with server(handle) as (url, _), client() as c:
        resp = await c.post(f"{url}/v1/completions", json={})
        assert resp.status_code == 400 and resp.reason_phrase == "Bad Request"
        assert resp.json()["error"]["code"] == "context_length"


async def test_an_answer_cut_short_by_the_caller_closes_its_connection() -> None:
    # What is left of an answer read in part would be the next call's: that connection must go.
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"4\r\nlast\r\n0\r\n\r\n")
            await w.drain()

    async with server(handle) as (url, conns), client() as c:
        async with c.stream("POST", f"{url}/v1/completions", json={}) as resp:
            async for chunk in resp.aiter_bytes():
                assert chunk == b"first"
                break
        async with c.stream("POST", f"{url}/v1/completions", json={}) as resp:
            assert b"".join([b async for b in resp.aiter_bytes()]) == b"firstlast"
        assert conns[0] == 2


async def test_idle_connections_close_after_the_keepalive() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    async with server(handle) as (url, conns), client(httpx.Limits(keepalive_expiry=0.2)) as c:
        assert (await c.post(f"{url}/x", json={})).text == "ok"
        assert (await c.post(f"{url}/x", json={})).text == "ok"
        assert conns[0] == 1
        await asyncio.sleep(0.6)
        assert (await c.post(f"{url}/x", json={})).text == "ok"
        assert conns[0] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_connection_is_never_reached() -> None:
    async with client() as c:
        with pytest.raises(httpx.ConnectError):
            await c.post(f"http://127.0.0.1:{_free_port()}/v1/completions", json={})


async def test_a_connection_closed_before_the_answer_is_reached() -> None:
    # The engine read the whole request, then its connection closed: it may have run it.
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    async with server(handle) as (url, _), client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(f"{url}/v1/completions", json={})


async def test_a_connection_reset_inside_the_answer_is_a_read_error() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        w.transport.abort()

    async with server(handle) as (url, _), client() as c, c.stream("POST", f"{url}/v1/completions", json={}) as resp:
        got = b""
        with pytest.raises(httpx.ReadError):
            async for chunk in resp.aiter_bytes():
                got += chunk
        assert got == b"first"


async def test_a_read_out_of_time_is_a_read_timeout() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # nothing answered; until the caller gives up and closes

    async with server(handle) as (url, _), client(read=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await c.post(f"{url}/tokenize", json={})
        assert time.monotonic() - t0 < 2.0


async def test_the_gateways_retry_rule_reads_the_classes_as_before() -> None:
    # Upstream.send: never reached is EngineFailed (routed again), reached is EngineLost (never again).
    # The gateway hands Upstream its pools, not a client around them: the path tested here.
    async def closes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await read_request(r)
        if req is not None and b"/ok" in req[0]:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    pools = EnginePools()
    async with server(closes) as (url, _):
        up = Upstream(pools, UpstreamTimeouts(), time.monotonic)
        tr = Trace(request_id="r1", t0=time.monotonic(), stream=False)
        resp = await up.send(f"{url}/ok", {"prompt": [1]}, {"x-request-id": "r1"}, "p0", tr, what="prefill",
                             first_byte=True)
        assert resp.status_code == 200 and resp.request.url.path == "/ok" and await resp.aread() == b"ok"
        with pytest.raises(EngineFailed):
            await up.send(f"http://127.0.0.1:{_free_port()}/v1/completions", {}, {}, "p0", tr,
                          what="prefill", first_byte=True)
        with pytest.raises(EngineLost):
            await up.send(f"{url}/v1/completions", {}, {}, "p1", tr, what="prefill", first_byte=True)
        await pools.aclose()


def test_failures_map_to_httpxs_classes() -> None:
    conn_key = type("K", (), {"ssl": False, "host": "e0", "port": 8000})()
    assert isinstance(_mapped(aiohttp.ClientConnectorError(conn_key, OSError(111, "refused"))), httpx.ConnectError)
    assert isinstance(_mapped(aiohttp.ConnectionTimeoutError("pool")), httpx.ConnectTimeout)
    assert isinstance(_mapped(aiohttp.SocketTimeoutError("read")), httpx.ReadTimeout)
    # aiohttp's own words for a request it could not write whole: never reached.
    assert isinstance(_mapped(aiohttp.ClientOSError(32, "Can not write request body for http://e0/x")),
                      httpx.WriteError)
    assert isinstance(_mapped(aiohttp.ClientConnectionError("Failed to send bytes into the underlying "
                                                            "connection")), httpx.WriteError)
    # A reset while reading, the same class as a failed write: reached (never sent twice).
    assert isinstance(_mapped(aiohttp.ClientOSError(104, "Connection reset by peer")), httpx.ReadError)
    assert isinstance(_mapped(aiohttp.ServerDisconnectedError()), httpx.RemoteProtocolError)
    assert isinstance(_mapped(aiohttp.ClientPayloadError("cut")), httpx.ReadError)


async def test_a_transport_closed_and_used_again_opens_a_new_session() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await w.drain()

    t = EngineTransport()
    async with server(handle) as (url, conns):
        req = httpx.Request("GET", f"{url}/v1/models")
        resp = await t.handle_async_request(req)
        assert await resp.aread() == b"ok"
        await t.aclose()
        resp = await t.handle_async_request(req)
        assert await resp.aread() == b"ok"
        await t.aclose()
        assert conns[0] == 2
