"""``conductor bench gateway``'s load generator (``_Client``), on both of its HTTP clients, against
a small aiohttp server: a streamed answer's time to its first token, a 429 with its Retry-After,
a failure, a stream with no token, and the JSON of a plain POST."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from conductor.harness.bench.gateway import Throttled, _Client

pytestmark = pytest.mark.unit


@asynccontextmanager
async def engine() -> AsyncIterator[str]:
    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("answer") == "busy":
            return web.Response(status=429, headers={"retry-after": "2.5"}, text="busy")
        if body.get("answer") == "boom":
            return web.Response(status=500, text="engine failed")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "role": "assistant"}]}\n\n')
        await asyncio.sleep(0.05)  # the first token comes later than the first chunk
        if body.get("answer") != "empty":
            await resp.write(b'data: {"choices": [{"index": 0, "text": " a"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def plain(request: web.Request) -> web.Response:
        return web.json_response({"echo": await request.json(), "auth": request.headers.get("authorization")})

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/plain", plain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["aiohttp", "httpx"])
async def test_the_bench_client_times_the_first_token_and_says_how_a_call_failed(kind: str) -> None:
    async with engine() as url, _Client(kind, {"authorization": "Bearer k"}) as client:
        ttft = await client.stream_ttft(url + "/stream", {"answer": "tokens"})
        assert 0.04 < ttft < 5.0  # the token's chunk, not the first chunk
        with pytest.raises(Throttled) as busy:
            await client.stream_ttft(url + "/stream", {"answer": "busy"})
        assert busy.value.retry_after_s == 2.5
        with pytest.raises(RuntimeError, match="500: engine failed"):
            await client.stream_ttft(url + "/stream", {"answer": "boom"})
        with pytest.raises(RuntimeError, match="no token"):
            await client.stream_ttft(url + "/stream", {"answer": "empty"})
        assert await client.post_json(url + "/plain", {"x": 1}) == {"echo": {"x": 1}, "auth": "Bearer k"}


def test_the_bench_client_names_its_kinds() -> None:
    with pytest.raises(ValueError, match="aiohttp or httpx"):
        _Client("requests", {})
