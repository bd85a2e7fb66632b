"""Serving Conductor's HTTP apps (gateway, emulated engine) with uvicorn inside a running loop.

One place that knows how: a socket bound up front (so port 0 gives a free port we can
print before serving), no uvicorn signal handling (the command's own handlers stop
everything in order), and a stop event instead of a signal. Also the hot path's fast parts:
uvloop as the event loop where it is installed (:func:`loop_factory`), orjson for JSON bodies
(:func:`json_body`, :class:`FastJSONResponse`); uvicorn picks httptools to parse HTTP/1.1 by itself
when it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import orjson
import uvicorn
from starlette.responses import JSONResponse

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when uvloop is installed (a dependency on Linux and macOS), else None (asyncio's).

    Measured on the gateway (``conductor bench gateway``, docs/benchmarks.md): socket writes and
    the loop's own turns were a fifth of its CPU per request on asyncio's selector loop."""
    if importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop

    return uvloop.new_event_loop


def json_body(raw: bytes) -> Any:
    """A request or answer body as JSON (orjson: strict UTF-8, no NaN); ValueError when it is not."""
    return orjson.loads(raw)


def json_bytes(obj: Any) -> bytes:
    """``obj`` as compact JSON (orjson; non-str dict keys as strings)."""
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


class FastJSONResponse(JSONResponse):
    """Starlette's JSON response, rendered by orjson (compact, UTF-8, as Starlette's own)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


TICK_S = 1.0
"""How often a server's main loop wakes with nothing to do: it refreshes the ``Date`` header
(uvicorn's own loop does that once a second too, but wakes every 0.1 s to look at
``should_exit``); a stop wakes it at once."""


class _Server(uvicorn.Server):
    """uvicorn's server, its main loop woken by a stop instead of looking for one ten times a
    second (the gateway's and each emulated engine's idle wake-ups, ``conductor bench idle``)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    async def main_loop(self) -> None:
        # on_tick(0): counter 0 is the tick on which uvicorn refreshes the Date header.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), TICK_S)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the command owns SIGINT/SIGTERM
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 = a free port: read it from ``getsockname()``).

    Created with ``IPPROTO_TCP`` named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    accepted sockets whose ``proto`` says TCP, and a socket made with proto 0 passes that on. With
    Nagle on, uvicorn's two writes per answer (headers, then body) made every JSON answer wait for
    the client's delayed ACK: ~40 ms per call (gateway → engine /tokenize and prefill, client →
    gateway), the bulk of the gateway's measured overhead."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


CUT_MARGIN_S = 2.0
"""With ``on_stop``: how much longer than ``grace_s`` the server waits before it cancels what is left
(the app's own cut at ``grace_s`` writes its last words to the client meanwhile)."""


async def serve(app: Any, sock: socket.socket, stop: asyncio.Event, *, grace_s: float = 3.0,
                on_stop: Callable[[float], None] | None = None) -> None:
    """Serve ``app`` on ``sock`` until ``stop`` is set. Then the socket stops accepting, idle
    connections close, and the requests in flight get ``grace_s`` to finish before they are
    cancelled. ``on_stop(grace_s)`` is told first (the gateway drains: it refuses new requests on
    open connections and cuts its own calls at ``grace_s``, ending a stream with an error event
    rather than the silent close of a cancel; the cancel then comes :data:`CUT_MARGIN_S` later)."""
    wait_s = grace_s + CUT_MARGIN_S if on_stop is not None else grace_s
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(math.ceil(wait_s), 1),
                            timeout_keep_alive=30)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if on_stop is not None and stop.is_set():
            on_stop(grace_s)
        server.should_exit = True
        stopper.cancel()
        await task


async def cancel_on_disconnect(receive: Callable[[], Awaitable[Any]], work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the client disconnects first: ``work`` is then cancelled.

    Starlette goes on running a handler whose client went away (only a streamed body notices, and
    only while it streams), so a gateway request would keep its engines generating for nobody.
    ``receive`` is the request's ASGI ``receive``, called once its body has been read: the server
    answers it only with ``http.disconnect``."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive()).get("type") != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its own clean-up runs (engine calls closed, outcome recorded)
    return None if task.cancelled() else task.result()
