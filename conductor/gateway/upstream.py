"""The gateway's calls to the engines: each phase bounded, each failure classified.

A failure before the engine had the whole request (:class:`EngineFailed`) is routed again
without that engine; once it had it (:class:`EngineLost`) the client gets 504 / 502 and the
request never runs again; an engine's own 4xx (:class:`UpstreamClientError`) is the client's.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx

from conductor.frontdoor.protocol import error_body
from conductor.gateway.config import UpstreamTimeouts
from conductor.gateway.outcome import Trace
from conductor.gateway.transport import EngineTransport
from conductor.web import json_body, json_bytes
from schemas import RoutingDecision

MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The largest answer read whole from an engine (a prefill half, a non-streamed completion)."""
MAX_ERROR_BYTES = 64 * 1024
"""What is read of an engine's error answer (its message goes to the client and the log)."""
_NOT_REACHED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError, httpx.WriteTimeout,
                httpx.UnsupportedProtocol)
"""Failures before the engine had the whole request: it cannot have started on it, so it is safe
to send the request elsewhere."""
T = TypeVar("T")
_url = functools.lru_cache(maxsize=4096)(httpx.URL)
"""An engine's URL parsed once: a gateway calls a few paths of each engine over and over (the bound:
engines come and go)."""
_JSON = {"content-type": "application/json"}


class _Counted(httpx.AsyncByteStream):
    """A response body that tells its pool when it is closed (the call no longer uses a connection).
    Its chunks come straight from the body it wraps: nothing is added per chunk of a stream."""

    def __init__(self, inner: httpx.AsyncByteStream, done: Callable[[], None]) -> None:
        self._inner: httpx.AsyncByteStream = inner
        self._done: Callable[[], None] | None = done

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._inner.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            done, self._done = self._done, None
            if done is not None:
                done()


class _Pool:
    __slots__ = ("last_used", "open_calls", "transport")

    def __init__(self, transport: httpx.AsyncBaseTransport, now: float) -> None:
        self.transport, self.open_calls, self.last_used = transport, 0, now


class EnginePools(httpx.AsyncBaseTransport):
    """One connection pool per engine (origin): an :class:`EngineTransport` each, by default.

    A pool of its own per engine keeps ``limits`` per engine and keeps each pool's bookkeeping to
    one engine's connections (httpcore's pool, used before, walked all of its connections on every
    call: at 50 clients that walk had been the gateway's largest cost after the routing itself).
    ``make`` builds one engine's transport.

    Engines come and go (a rollout gives every pod a new address): past ``keep`` pools, a new one
    closes those with no call open that were last used ``idle_s`` or more ago, so a long-lived
    gateway keeps the pools of the engines it still talks to, not of every engine it ever met."""

    def __init__(self, limits: httpx.Limits | None = None,
                 make: Callable[[], httpx.AsyncBaseTransport] | None = None, *, keep: int = 64,
                 idle_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if make is None:
            # One TLS context for every engine's pool, not one each (the
            # CA bundle loaded each time, tens of ms of CPU for each engine a gateway first meets).
            tls = httpx.create_ssl_context()
            make = lambda: EngineTransport(limits, tls)
        self._make = make
        self.keep, self.idle_s, self.clock = keep, idle_s, clock
        self.pools: dict[tuple[bytes, bytes, int | None], _Pool] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        now = self.clock()
        pool = self.pools.get(key)
        if pool is None:
            if len(self.pools) >= self.keep:
                await self._close_idle(now)
            pool = self.pools[key] = _Pool(self._make(), now)
        pool.last_used = now
        pool.open_calls += 1
        try:
            resp = await pool.transport.handle_async_request(request)
        except BaseException:
            pool.open_calls -= 1
            raise
        assert isinstance(resp.stream, httpx.AsyncByteStream)

        def closed() -> None:
            pool.open_calls -= 1
        resp.stream = _Counted(resp.stream, closed)
        return resp

    async def _close_idle(self, now: float) -> None:
        idle = [k for k, p in self.pools.items() if p.open_calls == 0 and now - p.last_used >= self.idle_s]
        for k in idle:
            await self.pools.pop(k).transport.aclose()

    async def aclose(self) -> None:
        pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            await pool.transport.aclose()


class EngineFailed(Exception):
    """Nothing of the request runs on ``node`` (never reached, or it answered the call whole with
    a 5xx): the request is routed again without it."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(message)
        self.node = node


class EngineLost(Exception):
    """``node`` had taken the request when the call failed (a timeout by phase, a connection that
    broke while it worked): answered to the client (504 / 502), never run again."""

    def __init__(self, node: str, message: str, *, timeout: bool = False, code: str | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.status, self.code = (504, "upstream_timeout") if timeout else (502, "engine_failed")
        if code is not None:
            self.status, self.code = 503, code


class UpstreamClientError(Exception):
    """An engine refused the request itself (4xx): the client's, passed through."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status, self.body = status, body


class Through(httpx.AsyncBaseTransport):
    """Calls sent through an httpx client (its transport, hooks and auth): for an :class:`Upstream`
    handed a client rather than the engines' transport (the tests' mock engines)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.client.send(request, stream=True)


class Upstream:
    """Calls to the engines on one transport, each phase within :class:`UpstreamTimeouts`.

    ``engines`` is the transport itself (the gateway's :class:`EnginePools`), not a client around
    it: httpx's client adds nothing a call to an engine uses (redirects, cookies, auth, default
    headers), and measured on the gateway that layer cost more CPU than the transport under it."""

    def __init__(self, engines: httpx.AsyncBaseTransport | httpx.AsyncClient, timeouts: UpstreamTimeouts,
                 clock: Callable[[], float]) -> None:
        self.engines = Through(engines) if isinstance(engines, httpx.AsyncClient) else engines
        self.timeouts = timeouts
        self.clock = clock
        self._timeouts = timeouts.for_httpx().as_dict()
        self.cut_at: float | None = None
        """The loop time (``loop.time()``) at which every call still waiting is cut (:meth:`cut`)."""
        self._waiting: set[asyncio.Timeout] = set()

    def cut(self, after_s: float) -> None:
        """Cut every call to the engines still waiting ``after_s`` seconds from now, and every later
        one by then: :class:`EngineLost` ``gateway_shutdown`` (a stream ends with it as its SSE error
        event). The gateway's drain deadline: its streams end in words, not a silent close."""
        at = asyncio.get_running_loop().time() + max(after_s, 0.0)
        self.cut_at = at if self.cut_at is None else min(self.cut_at, at)
        for t in self._waiting:
            when = t.when()
            if when is None or when > self.cut_at:
                t.reschedule(self.cut_at)

    async def phase(self, aw: Awaitable[T], tr: Trace, node: str, what: str, limit_s: float) -> T:
        """``aw`` within ``limit_s`` (0: no limit) and what is left of the request's total timeout;
        running out is :class:`EngineLost` (504): the engine had the request."""
        limit: float | None = limit_s or None
        which = f"{limit_s:g}s"
        if self.timeouts.total_s:
            left = self.timeouts.total_s - (self.clock() - tr.t0)
            if limit is None or left < limit:
                limit, which = max(0.0, left), f"{self.timeouts.total_s:g}s for the whole request"
        loop = asyncio.get_running_loop()
        when = None if limit is None else loop.time() + limit
        if self.cut_at is not None and (when is None or self.cut_at < when):
            when = self.cut_at
        try:
            async with asyncio.timeout_at(when) as t:
                self._waiting.add(t)
                try:
                    return await aw
                finally:
                    self._waiting.discard(t)
        except TimeoutError:
            if self.cut_at is not None and loop.time() >= self.cut_at:
                raise EngineLost(node, f"the gateway is shutting down and its drain time ran out while waiting "
                                 f"for the {what}", code="gateway_shutdown") from None
            raise EngineLost(node, f"no {what} within {which}", timeout=True) from None

    async def send(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: Trace, *,
                   what: str, first_byte: bool) -> httpx.Response:
        """POST ``body``; the response once its headers are in (the body not read yet). Headers wait
        ``first_byte_s`` when ``first_byte``, else only the total. Never reached: :class:`EngineFailed`;
        broken or timed out once the engine had the request: :class:`EngineLost`."""
        req = httpx.Request("POST", _url(url), content=json_bytes(body), headers={**hdrs, **_JSON},
                            extensions={"timeout": self._timeouts})
        limit = self.timeouts.first_byte_s if first_byte else 0.0
        try:
            resp = await self.phase(self.engines.handle_async_request(req), tr, node, f"answer to the {what}", limit)
        except _NOT_REACHED as e:
            raise EngineFailed(node, f"{what} not sent: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise EngineLost(node, f"{what}: the connection broke before the answer: {type(e).__name__}: {e}") from None
        resp.request = req
        return resp

    async def read(self, resp: httpx.Response, tr: Trace, node: str, what: str, limit: int) -> bytes:
        """``resp``'s body (the response closed after): each read within ``idle_s``, at most ``limit`` bytes."""
        out = bytearray()
        it = resp.aiter_bytes()
        try:
            while True:
                try:
                    out += await self.phase(anext(it), tr, node, f"byte of {what}", self.timeouts.idle_s)
                except StopAsyncIteration:
                    return bytes(out)
                if len(out) > limit:
                    raise EngineLost(node, f"{what} is longer than {limit} bytes")
        except httpx.HTTPError as e:
            raise EngineLost(node, f"{what} broke off: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()

    async def refusal(self, resp: httpx.Response, tr: Trace, node: str, what: str) -> bytes:
        """The start of an error answer (what names the error); an answer that breaks off gives what came."""
        try:
            return await self.read(resp, tr, node, what, MAX_ERROR_BYTES)
        except EngineLost:
            return b""

    async def prefill(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: Trace,
                      peer: str | None = None) -> dict[str, Any]:
        """A prefill half, read whole (its wall time added to ``tr.prefill_s``); ``peer``: the CPP
        member it pulls the KV before its chunk from (a failed pull is that member's)."""
        t_p = self.clock()
        try:
            return await self._prefill(url, body, hdrs, node, tr, peer)
        finally:
            tr.prefill_s += self.clock() - t_p

    async def _prefill(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: Trace,
                       peer: str | None) -> dict[str, Any]:
        r = await self.send(url, body, hdrs, node, tr, what="prefill", first_byte=True)
        if r.status_code >= 400:
            content = await self.refusal(r, tr, node, "the prefill's error answer")
            if peer is not None and r.status_code >= 500 and error_code(content) == "kv_transfer_failed":
                raise EngineFailed(peer, f"{node} could not pull the KV before its chunk: {content[:200]!r}")
            if r.status_code >= 500:
                raise EngineFailed(node, f"prefill answered {r.status_code}: {content[:200]!r}")
            raise UpstreamClientError(r.status_code, json_or_text(content))
        content = await self.read(r, tr, node, "the prefill answer", MAX_ANSWER_BYTES)
        try:
            out = json_body(content)
        except ValueError:
            # Answered whole (the prefill is done, its KV waits for a decode that will not come): routed again.
            raise EngineFailed(node, "prefill answered with a body that is not JSON") from None
        return out if isinstance(out, dict) else {}

    async def open_decode(self, url: str, body: dict[str, Any], hdrs: dict[str, str], d: RoutingDecision,
                          tr: Trace, prefill: asyncio.Future[dict[str, Any]] | None = None,
                          kv_from: str | None = None) -> httpx.Response:
        """The decode (or aggregated) call, open: its headers in, its body left to read. A streamed
        call's headers wait ``first_byte_s``; a non-streamed one's come with its last token (total only).
        ``prefill``: a prefill running beside it (its failure ends the wait); ``kv_from``: the
        instance the decode pulls the KV from (default: the decision's prefill instance)."""
        node = d.decode_instance
        tr.decode_sent = self.clock()
        send = asyncio.ensure_future(self.send(url, body, hdrs, node, tr, what="decode",
                                               first_byte=bool(body.get("stream"))))
        try:
            if prefill is not None:
                # SGLang: both run at once; a prefill that fails must not leave the decode waiting on its room.
                both: set[asyncio.Future[Any]] = {send, prefill}
                await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and not prefill.cancelled() and (failed := prefill.exception()) is not None:
                    raise failed
            resp = await send
        except BaseException:
            await discard(send)
            raise
        if resp.status_code < 400:
            return resp
        content = await self.refusal(resp, tr, node, "the decode's error answer")
        err = json_or_text(content)
        if error_code(content) == "kv_transfer_failed":  # the decode is fine; its prefill peer is not
            raise EngineFailed(kv_from or d.prefill_instance,
                               f"the decode instance could not pull the KV: {content[:200]!r}")
        if resp.status_code >= 500:
            raise EngineFailed(node, f"decode answered {resp.status_code}: {content[:200]!r}")
        raise UpstreamClientError(resp.status_code, err)


async def discard(task: asyncio.Future[Any]) -> None:
    """Cancel a call to an engine and wait for it to end; a response it opened meanwhile is closed."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), httpx.Response):
        await task.result().aclose()


def json_or_text(content: bytes) -> Any:
    """An engine's answer as JSON, else as an OpenAI error carrying its start."""
    try:
        return json_body(content)
    except ValueError:
        return error_body(content[:500].decode(errors="replace"), "engine_error", kind="server_error")


def error_code(content: bytes) -> str | None:
    """The OpenAI error code of an engine's error answer, if it has one."""
    err = json_or_text(content)
    inner = err.get("error") if isinstance(err, dict) else None
    return inner.get("code") if isinstance(inner, dict) else None


def cached(j: dict[str, Any]) -> int:
    """The cached prompt tokens an engine's answer reports (``usage.prompt_tokens_details``)."""
    usage = j.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    try:
        return int(details.get("cached_tokens") or 0)
    except (TypeError, ValueError):
        return 0
