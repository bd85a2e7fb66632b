"""The gateway's HTTP app (FastAPI) and the task that runs it with its Kafka clients."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.telemetry import TelemetryConfig
from starlette.responses import JSONResponse, PlainTextResponse, Response

from conductor import web
from conductor.frontdoor.decide import make_decider
from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import SloBounds, error_body
from conductor.frontdoor.tokenizer import EngineTokenizer, ModelFilesTokenizer, prompt_tokenizer
from conductor.gateway.admission import InFlightBound
from conductor.gateway.auth import ApiKeyGuard, Caller, KeyRing
from conductor.gateway.config import GatewayConfig
from conductor.gateway.service import Gateway
from conductor.gateway.upstream import EnginePools
from conductor.settings import Settings
from state.connect import open_client
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

KEEPALIVE_EXPIRY_S = 4.0
"""Idle connections to engines are dropped before the engines' own keep-alive (uvicorn's 5 s in
vLLM and SGLang) closes them: a request sent on a connection the engine is closing fails after
it left, and such a failure is not routed again (the engine may have taken the request)."""


NO_FRAMEWORK_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
"""FastAPI's own OpenTelemetry (on by default since 0.163 once a meter provider is installed, as
``conductor.telemetry`` does) is off: per request it attached a context, walked the middleware
stack, wrapped every ``send`` (each SSE chunk of a stream) and recorded an
``http.server.request.duration`` histogram and an active-requests counter that nothing reads; the
gateway's own ``conductor_gateway_*`` metrics say what it serves (``GatewayMetrics``, admission)."""


class BodyTooLarge(Exception):
    """A request body past the gateway's ``max_body_bytes``."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (:class:`BodyTooLarge`) from its ``Content-Length`` before a byte is read,
    or as soon as what arrives (chunked, or more than it said) passes ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    out = bytearray()
    async for chunk in request.stream():
        out += chunk
        if len(out) > limit:
            raise BodyTooLarge
    return bytes(out)


def gateway_app(gw: Gateway, keys: KeyRing, metrics_text: Callable[[], str] = lambda: "", *,
                max_in_flight: int = 0, max_body_bytes: int = GatewayConfig.max_body_bytes_default()) -> FastAPI:
    """The gateway's routes behind its API keys (:class:`~conductor.gateway.auth.ApiKeyGuard`) and its
    bound of requests in flight (``max_in_flight``, 0 = none: :class:`~conductor.gateway.admission.InFlightBound`);
    a body past ``max_body_bytes`` is 413 (:func:`read_body`)."""
    body_limit = max_body_bytes
    app = FastAPI(title="conductor gateway", docs_url=None, redoc_url=None, telemetry=NO_FRAMEWORK_TELEMETRY)
    app.add_middleware(ApiKeyGuard, keys=keys)
    # Outermost: a full gateway answers 429 before it reads anything else of the request.
    app.add_middleware(InFlightBound, limit=max_in_flight)

    def bounds_of(request: Request) -> SloBounds:
        caller: Caller = request.state.caller  # set by the guard on every /v1/ route
        return caller.bounds

    async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
        # A client that goes away cancels its request's engine calls; nobody reads the 499.
        return await web.cancel_on_disconnect(request.receive, work) or Response(status_code=499)

    async def body_of(request: Request) -> Any:
        """The JSON body, or the client's error answer (413 too long, 400 not JSON)."""
        try:
            return web.json_body(await read_body(request, body_limit))
        except BodyTooLarge:
            return JSONResponse(error_body(f"the body is longer than {body_limit} bytes", "body_too_large",
                                           param="body"), status_code=413)
        except (ValueError, RecursionError):
            return JSONResponse(error_body("the body is not JSON", "invalid_json", param="body"), status_code=400)

    async def completions(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        return await until_disconnect(request, gw.handle(body, request.headers, chat=False, bounds=bounds_of(request)))

    async def chat(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, Response):
            return body
        return await until_disconnect(request, gw.handle(body, request.headers, chat=True, bounds=bounds_of(request)))

    async def models() -> Response:
        await gw.directory.refresh()
        for url in gw.directory.urls()[:3]:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await gw.client.get(f"{url}/v1/models", timeout=2.0)
                if r.status_code == 200:
                    return JSONResponse(r.json())
        name = gw.config.base_model or "default"
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                         "owned_by": "conductor"}]})

    async def health() -> Response:
        down = await gw.readiness()  # draining; its decider not started, ended, lost or stalled; its log unacknowledging
        if down is not None:
            return JSONResponse(error_body(down[1], down[0], kind="service_unavailable"), status_code=503)
        return Response(status_code=200)

    async def prom() -> Response:
        return PlainTextResponse(metrics_text(), media_type="text/plain; version=0.0.4")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prom, methods=["GET"])
    return app


async def run_gateway(settings: Settings, config: GatewayConfig, sock: socket.socket, stop: asyncio.Event, *,
                      keys: KeyRing, tokenizer_path: str | None = None, metrics_text: Callable[[], str] = lambda: "",
                      on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Run one gateway on ``sock`` until ``stop``: its producer, its decider (the colocated router or the
    reply inbox), its HTTP server (behind ``keys``: :func:`conductor.gateway.auth.key_ring`)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    tps = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (tps.requests, tps.dispatch, tps.request_outcomes))
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    pools = EnginePools(limits)
    # The engines are called straight, never through HTTP(S)_PROXY from the environment: the hand-off
    # calls the pools itself, and /tokenize and /v1/models (through this client) go the same way.
    client = httpx.AsyncClient(timeout=config.timeouts.outside_requests(), transport=pools, trust_env=False)
    view = None
    if settings.redis_url:
        view = RedisViewStore(open_client(settings.redis().connection_url(), decode_responses=False, **settings.redis().tls_options(),
                                          socket_timeout=1.0, socket_connect_timeout=1.0),
                              settings.view_namespace)
    directory = EngineDirectory(config.engines, view.nodes if view is not None else None,
                                ttl_s=settings.heartbeat_ttl_s)
    await directory.refresh(force=True)
    if not len(directory):
        log.warning("no engine known yet: none announces an endpoint in the view and no --engine was given")
    engine_tok = EngineTokenizer(client, directory)
    tok, how = prompt_tokenizer(engine_tok, tokenizer_path, config.base_model)
    log.info("gateway %s: %s; %s", config.gateway_id, how,
             "text completions reach the engines as their token ids" if config.sends_prompt_ids
             else "prompts reach the engines as the clients sent them")
    prod = producer(settings.kafka(), linger_ms=0)
    await prod.start()
    seq = itertools.count(1)  # this gateway's records on the log: its routing requests and its outcomes
    decider = make_decider(settings, config.routing, producer_id=config.gateway_id,
                           timeout_s=config.decision_timeout_s, producer=prod, seq=seq)
    gw = Gateway(settings, config, tok, client, prod, decider, directory=directory, seq=seq, engines=pools)
    # The model's files looked for now, not by the first requests (they would pay for it).
    warming = asyncio.ensure_future(tok.warm()) if isinstance(tok, ModelFilesTokenizer) else None
    try:
        await decider.start()
        if on_ready is not None:
            on_ready(gw)
        await web.serve(gateway_app(gw, keys, metrics_text, max_in_flight=config.max_in_flight,
                                    max_body_bytes=config.max_body_bytes), sock, stop,
                        grace_s=config.drain_s, on_stop=gw.drain)
    finally:
        stop.set()
        if warming is not None:
            warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await warming
        with contextlib.suppress(Exception):
            await decider.close()
        await prod.stop()
        await client.aclose()
        if view is not None:
            with contextlib.suppress(Exception):
                await view.close()
