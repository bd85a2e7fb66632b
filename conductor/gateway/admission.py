"""Backpressure: a gateway answers 429 with ``Retry-After`` when it is full, instead of failing requests.

Two bounds (settings; 0 = none):

- ``gateway_max_in_flight``: client requests this gateway process serves at once, counted from
  their arrival until the whole answer is sent (a stream to its end, or the client gone).
  :class:`InFlightBound` is ASGI middleware in front of the generation routes: a request beyond
  the bound is answered ``429 gateway_busy`` at once, before its body is read; nothing queues.
- ``gateway_max_deciding``: requests being decided at once (:class:`DecidingBound`): past it,
  ``429 gateway_busy`` before the view is read or anything is written to the log.
- ``gateway_engine_max_in_flight``: requests this gateway has open on one engine (prefill or
  decode instance, each member of a CPP group). :class:`EngineSlots` is asked once a decision
  names the engines; one at its bound sends the request to be routed once more without it (a
  capacity group's work gathers on one member, whose mate can take it), and makes it ``429
  engine_busy`` when nothing else takes it or that engine is at its bound too, before any engine
  is called.

Why 429 and not a queue or a 503: the client (or its load balancer) can retry after a second or
go to another replica, and a queue inside the gateway would only turn overload into timeouts
(5xx) for every request. Both refusals are counted by ``conductor_gateway_throttled`` (by reason),
apart from errors, and ``conductor_gateway_in_flight`` says how many requests are open.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry import metrics
from starlette.types import ASGIApp, Receive, Scope, Send

from conductor.frontdoor.protocol import error_body
from conductor.web import FastJSONResponse

RETRY_AFTER_S = 1
"""What a throttled client is told to wait: a stream slot frees up within about a generation."""
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _Instruments:
    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.throttled = m.create_counter(
            "conductor_gateway_throttled", description="requests answered 429 because the gateway (gateway_busy) "
            "or an engine it would call (engine_busy) was at its bound of requests in flight")
        self.in_flight = m.create_up_down_counter(
            "conductor_gateway_in_flight", description="client requests this gateway is serving")


@functools.cache
def instruments() -> _Instruments:
    """One set per process, made at first use (after the command set up its meter provider)."""
    return _Instruments()


def busy_response(code: str, message: str) -> FastJSONResponse:
    """429 in OpenAI's error shape with ``Retry-After``."""
    return FastJSONResponse(error_body(message, code, kind="requests"), status_code=429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})


class InFlightBound:
    """ASGI middleware: at most ``limit`` generation requests at once (0: no limit), the rest 429 ``gateway_busy``."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        m = instruments()
        if self.limit and self.in_flight >= self.limit:
            m.throttled.add(1, {"reason": "gateway_busy"})
            await busy_response("gateway_busy", f"the gateway is serving {self.in_flight} requests, its bound "
                                "(gateway_max_in_flight): retry after the Retry-After seconds, or on another "
                                "replica")(scope, receive, send)
            return
        self.in_flight += 1
        m.in_flight.add(1)
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            m.in_flight.add(-1)


@dataclass
class DecidingBound:
    """At most ``limit`` requests being decided at once (0: no limit): the decision's work (the
    view's reads, the log's acknowledgements) is what piles up first when the gateway or its
    broker is starved, and a pile-up past the decision timeout became 503s; beyond the bound a
    request is 429 ``gateway_busy`` at once instead."""

    limit: int
    deciding: int = 0

    def take(self) -> bool:
        if self.limit and self.deciding >= self.limit:
            instruments().throttled.add(1, {"reason": "deciding"})
            return False
        self.deciding += 1
        return True

    def give(self) -> None:
        self.deciding -= 1


class EngineBusy(Exception):
    """The decision names an engine this gateway already has ``gateway_engine_max_in_flight`` requests on."""

    def __init__(self, node: str, open_now: int) -> None:
        super().__init__(f"this gateway has {open_now} requests open on {node}, its bound per engine "
                         "(gateway_engine_max_in_flight): retry after the Retry-After seconds")
        self.node = node


@dataclass(eq=False)
class Held:
    """The slots one request holds on its engines; :meth:`release` gives them back (once, however often called)."""

    slots: EngineSlots
    nodes: tuple[str, ...]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.give(self.nodes)


@dataclass
class EngineSlots:
    """Requests open per engine, bounded by ``limit`` (0: counted, not bounded)."""

    limit: int
    open: dict[str, int] = field(default_factory=dict)

    def take(self, nodes: Iterable[str]) -> Held:
        """A slot on each of ``nodes`` (each once), or :class:`EngineBusy` naming the first at its bound."""
        want = tuple(dict.fromkeys(nodes))
        if self.limit:
            for n in want:
                if self.open.get(n, 0) >= self.limit:
                    raise EngineBusy(n, self.open[n])  # counted when the client is answered 429
        for n in want:
            self.open[n] = self.open.get(n, 0) + 1
        return Held(self, want)

    def give(self, nodes: Iterable[str]) -> None:
        for n in nodes:
            left = self.open.get(n, 0) - 1
            if left > 0:
                self.open[n] = left
            else:
                self.open.pop(n, None)
