"""One engine's HTTP connections on aiohttp, under httpx's request and response types.

The gateway's calls to the engines went through httpx's own transport: httpcore's pool, h11's
parser and anyio's sockets, all Python. Measured on a streamed completion of 8 chunks, a call
cost its client ~0.7 ms of CPU that way and ~0.15 ms on aiohttp (its parser and its writes in C),
and a request through the gateway makes one to three such calls. This transport keeps httpx's
types (``Upstream``, the hand-offs and the tests speak ``httpx.Request`` / ``httpx.Response``) and
its failure classes, which the gateway's retry rule reads:

- never reached, safe to send elsewhere: a connection not made (refused, unreachable, DNS,
  TLS: ``httpx.ConnectError``; out of time or of pooled connections: ``httpx.ConnectTimeout``)
  and a request that could not be written whole (``httpx.WriteError``);
- reached, never sent again: the connection closing before or during the answer
  (``httpx.RemoteProtocolError``, ``httpx.ReadError``), a read out of time (``httpx.ReadTimeout``).

A failure that cannot be told apart is counted as reached: the gateway answers 502 rather than
risk running a request twice.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator

import aiohttp
import httpx
import yarl

_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"proxy-connection"})
"""Request headers this transport leaves to aiohttp (it frames the request and keeps the connection)."""
_UNWRITTEN = ("Can not write request body", "Failed to send bytes")
"""The start of aiohttp's message for a request it could not write (the body and the headers
coalesced with it): ``ClientOSError`` says the same for a reset while reading the answer."""


@functools.lru_cache(maxsize=1024)
def _url(url: str) -> yarl.URL:
    """``url`` as aiohttp takes it, parsed once: a gateway calls a few paths of each engine over and
    over (the bound: engines come and go)."""
    return yarl.URL(url, encoded=True)


@functools.lru_cache(maxsize=64)
def _timeout(connect: float | None, pool: float | None, read: float | None) -> aiohttp.ClientTimeout:
    """httpx's timeouts as aiohttp's (its ``connect`` bounds the wait for a pooled connection and the
    connect together); one object per distinct set, not one per call."""
    both = None if connect is None and pool is None else (pool or 0) + (connect or 0)
    return aiohttp.ClientTimeout(total=None, connect=both, sock_connect=connect, sock_read=read)


def _mapped(e: BaseException) -> httpx.TransportError:
    """aiohttp's failure of a call as httpx's (see the module's note: unsure is "reached")."""
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(e, aiohttp.ClientConnectorError):  # refused, unreachable, DNS, TLS handshake
        return httpx.ConnectError(msg)
    if isinstance(e, aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(msg)
    words = (e.strerror if isinstance(e, OSError) else None) or str(e)
    if isinstance(e, aiohttp.ClientConnectionError) and words.startswith(_UNWRITTEN):
        return httpx.WriteError(msg)
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(msg)
    return httpx.ReadError(msg)


class _Body(httpx.AsyncByteStream):
    """An answer's body as it comes; closed whole, its connection goes back to the pool, cut
    short, the connection is closed (what is left of the answer would be the next call's)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, OSError) as e:
            raise _mapped(e) from e

    async def aclose(self) -> None:
        resp = self._resp
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()


class EngineTransport(httpx.AsyncBaseTransport):
    """One engine's connection pool on aiohttp: at most ``limits.max_connections`` open, idle ones
    kept ``limits.keepalive_expiry`` seconds (aiohttp has no cap on how many are kept idle, so
    ``max_keepalive_connections`` does not apply). Made outside a loop, its session opens on first use."""

    def __init__(self, limits: httpx.Limits | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.limits = limits if limits is not None else httpx.Limits()
        self.tls = tls
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        lim = self.limits
        connector = aiohttp.TCPConnector(
            limit=lim.max_connections or 0, limit_per_host=0,
            keepalive_timeout=lim.keepalive_expiry if lim.keepalive_expiry is not None else 15.0,
            ssl=self.tls if self.tls is not None else True)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None), skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        session = self._session or self._open()
        t = request.extensions.get("timeout") or {}
        timeout = _timeout(t.get("connect"), t.get("pool"), t.get("read"))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in _HOP]
        body = await request.aread()
        try:
            resp = await session.request(request.method, _url(str(request.url)), data=body or None,
                                         headers=headers,
                                         allow_redirects=False, timeout=timeout)
        except (aiohttp.ClientError, OSError) as e:
            raise _mapped(e) from e
        return httpx.Response(resp.status, headers=resp.raw_headers, stream=_Body(resp),
                              extensions={"http_version": b"HTTP/1.1",
                                          "reason_phrase": (resp.reason or "").encode("latin-1")})

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
