"""A gateway stopping (issue 36 item 5): the streams in flight get the drain time (``gateway_drain_s``)
to finish, and one still open at its end is cut with an SSE error event, not a silent close.

Uses the in-process stack of ``test_gateway_upstream`` (fake engines whose every call the test scripts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from test_gateway_upstream import completion, default_answer, stack

from conductor.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def tokens_every(gap_s: float, count: int) -> Any:
    """A decode that streams ``count`` tokens, one each ``gap_s``."""

    async def decode(kind: str, body: dict[str, Any], request: Request) -> Response:
        if kind != "decode" or not body.get("stream"):
            return default_answer(kind, body)

        async def events() -> AsyncIterator[bytes]:
            for i in range(count):
                await asyncio.sleep(gap_s)
                yield b'data: {"choices": [{"index": 0, "text": " t' + str(i).encode() + b'"}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return decode


async def test_a_stream_longer_than_the_drain_ends_with_an_error_event_at_its_deadline(settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_drain_s=1.0) as s:
        s.engines.on["d0"] = tokens_every(0.2, 100)  # 20 s of tokens
        async with s.client() as c, c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
            assert r.status_code == 200
            it = r.aiter_bytes()
            got = await anext(it)
            s.stop.set()
            t0 = time.monotonic()
            async for chunk in it:
                got += chunk
            took = time.monotonic() - t0
        assert got.count(b'"text": " t') >= 3  # tokens kept coming while it drained
        assert b'"code":"gateway_shutdown"' in got, got[-300:]  # said, not a silent close
        assert 0.8 < took < 2.9, took  # at the drain's deadline, before the server's own cancel


async def test_a_stream_that_ends_within_the_drain_is_served_whole(settings: Settings) -> None:
    async with stack(settings, {"p0": "prefill", "d0": "decode"}, gateway_drain_s=8.0) as s:
        s.engines.on["d0"] = tokens_every(0.25, 16)  # 4 s: past uvicorn's old 3 s grace
        async with s.client() as c, c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
            it = r.aiter_bytes()
            got = await anext(it)
            s.stop.set()
            async for chunk in it:
                got += chunk
        assert got.count(b'"text": " t') == 16 and got.endswith(b"data: [DONE]\n\n"), got[-300:]
