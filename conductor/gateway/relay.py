"""The decode's answer to the client: read whole (non-streamed) or relayed event by event (SSE).

Once tokens have been relayed, a broken stream ends with an SSE error event (the ``openai``
client raises it as ``APIError``), never a silent hang; the relay is closed however the response
ends (:class:`RelayResponse`), and the request's outcome recorded then. The first token
(a non-streamed answer read whole, a stream's first event with tokens) is reported at once
(``first_token``: the decision's prefill work is released then, ``Decider.released``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from conductor.frontdoor.protocol import ClientRequest, error_body
from conductor.gateway.outcome import Trace
from conductor.gateway.sse import EventTooLong, SseScan
from conductor.gateway.upstream import MAX_ANSWER_BYTES, EngineLost, Upstream, cached
from conductor.web import FastJSONResponse, json_body, json_bytes

MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024
"""The longest SSE event the relay holds while it waits for the event's end. The largest real
one is a first chunk carrying a long prompt's ``prompt_token_ids`` (vLLM's ``return_token_ids``:
~8 bytes a token, 8 MiB at 1M tokens); a stream whose event never ends is cut with an error."""


def _nothing(_: Trace) -> None:
    """No one to tell."""


class RelayResponse(StreamingResponse):
    """A streamed answer whose relay is always closed when the response ends, however it ends
    (Starlette leaves an unfinished body iterator to the garbage collector): the relay's
    ``finally`` closes the engine's stream and records the outcome at once."""

    on_close: Callable[[], None] | None = None
    """Called once the response has ended (the engine slots it held given back)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


async def respond(up: Upstream, resp: httpx.Response, creq: ClientRequest, tr: Trace, headers: Mapping[str, str],
                  finish: Callable[[Trace], None], first_token: Callable[[Trace], None] = _nothing) -> Response:
    """The client's answer from the decode's open ``resp``: read whole, or a :class:`RelayResponse`
    once the stream's first chunk is in; ``first_token`` is told when the first token is in,
    ``finish`` records the outcome when the answer is done."""
    assert tr.decision is not None
    d = tr.decision
    if not creq.stream:
        content = await up.read(resp, tr, d.decode_instance, "the decode answer", MAX_ANSWER_BYTES)
        try:
            data = json_body(content)
        except ValueError:
            raise EngineLost(d.decode_instance, "the decode answer is not JSON") from None
        tr.ttft_s = up.clock() - tr.t0
        first_token(tr)
        if isinstance(data, dict):
            data.pop("kv_transfer_params", None)
            usage = data.get("usage") or {}
            tr.output_tokens = int(usage.get("completion_tokens") or 0)
            if d.aggregated:
                tr.cached_tokens = cached(data)
        finish(tr)
        return FastJSONResponse(data, headers=dict(headers))
    it = resp.aiter_raw()
    try:
        first = await up.phase(anext(it), tr, d.decode_instance, "the stream's first chunk", up.timeouts.idle_s)
    except BaseException as e:
        await resp.aclose()
        if isinstance(e, (httpx.HTTPError, StopAsyncIteration)):
            raise EngineLost(d.decode_instance, f"the stream ended before its first byte: {type(e).__name__}") from None
        raise
    return RelayResponse(relay(up, resp, it, first, creq, tr, finish, first_token), media_type="text/event-stream",
                         headers=dict(headers))


async def relay(up: Upstream, resp: httpx.Response, it: AsyncIterator[bytes], first: bytes, creq: ClientRequest,
                tr: Trace, finish: Callable[[Trace], None],
                first_token: Callable[[Trace], None] = _nothing) -> AsyncIterator[bytes]:
    """Pass the decode's SSE events through, timing tokens; drop the usage chunk the client did not ask for.

    Each chunk waits at most ``idle_s``; an event longer than :data:`MAX_SSE_EVENT_BYTES` ends
    the stream with an error event instead of growing the buffer."""
    scan = SseScan(drop_usage=not creq.include_usage, max_event_bytes=MAX_SSE_EVENT_BYTES)
    last = None
    raw: bytes | None = first
    node = tr.decision.decode_instance if tr.decision else "?"
    try:
        while True:
            if raw is None:
                try:
                    raw = await up.phase(anext(it), tr, node, "stream chunk", up.timeouts.idle_s)
                except StopAsyncIteration:
                    break
            now = up.clock()
            try:
                out, tokens = scan.feed(raw)
            except EventTooLong as e:
                raise EngineLost(node, str(e)) from None
            raw = None
            if scan.usage is not None:
                _usage(scan.usage, tr)
                scan.usage = None
            if tokens:
                if tr.ttft_s is None:
                    tr.ttft_s = now - tr.t0
                    tokens -= 1
                    first_token(tr)
                if tokens and last is not None:
                    tr.gaps_ms.extend([(now - last) * 1000.0 / tokens] * tokens)
                last = now
            if out:
                yield out
    except (httpx.HTTPError, EngineLost) as e:
        code = e.code if isinstance(e, EngineLost) else "engine_failed"
        tr.error, tr.message = code, f"the decode stream broke: {type(e).__name__}: {e}"
        err = error_body(f"{tr.message} (instance {node})", code, kind="server_error")
        yield b"data: " + json_bytes(err) + b"\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        tr.error, tr.message = "client_closed", "the client closed the stream"
        raise
    finally:
        await resp.aclose()
        finish(tr)


def _usage(chunk: dict[str, Any], tr: Trace) -> None:
    """The token counts of a stream's usage chunk into ``tr``."""
    usage = chunk.get("usage") or {}
    tr.output_tokens = int(usage.get("completion_tokens") or tr.output_tokens)
    if tr.decision is not None and tr.decision.aggregated:
        tr.cached_tokens = cached(chunk) or tr.cached_tokens
