"""One client request, end to end: tokenize → decide (logged) → P/D hand-off → relay.

- Colocated routing (the default, ``GatewayConfig.routing``): the gateway decides in its own
  process (:class:`conductor.routing.local.LocalRouter`: the routers' code, their shared
  reservations and control topic) and calls the engines once the broker acknowledged the
  request (``decided_by`` = this gateway) and its decision; a broker that does not becomes
  503 ``log_unavailable``. Through the log (``routing="log"``): the routing request goes onto
  ``requests`` with ``reply_to`` = this gateway; the answer comes back on this gateway's reply
  topic (:mod:`conductor.gateway.replies`).
- A rejection becomes 429/503/400 with an OpenAI-style error naming the reason and a
  ``Retry-After`` (:data:`conductor.frontdoor.protocol.REJECTION_STATUS`). No decision within
  ``decision_timeout_s`` becomes 503 ``decision_timeout``: a client never hangs on the log.
- A call to an engine is re-routed only when nothing of the request runs there: the engine was
  never reached (connection refused, connect timeout, a request it never fully received) or
  it answered the call whole with a 5xx (503, a decode that could not pull the KV from its
  prefill peer, ...). That instance is excluded and a new routing request is sent
  (``retry_of``, ``exclude``: the retry is in the log); after ``max_attempts`` the client gets
  502 ``engine_failed``. Once an engine has taken the request (its connection breaks while it
  works, or a timeout by phase runs out: :class:`UpstreamTimeouts`), the client gets 504
  ``upstream_timeout`` or 502 ``engine_failed`` with the reason, and the request is never run
  again: the engine may still be generating it. Once tokens have been relayed, a broken stream
  ends with an SSE error event (the ``openai`` client raises it as ``APIError``), never a
  silent hang.
- After each request a ``request_outcome`` record goes to ``request-outcomes``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlparse

import httpx
from opentelemetry import metrics
from pydantic import ValidationError
from starlette.responses import Response, StreamingResponse

from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import (
    DEFAULT_EXPECTED_OUTPUT,
    BadRequest,
    ClientRequest,
    EngineProtocol,
    Slo,
    SloBounds,
    aggregated_body,
    cpp_chunk_body,
    error_body,
    parse_body,
    parse_slo,
    rejection_response,
    sglang_bodies,
    vllm_decode_body,
    vllm_prefill_body,
)
from conductor.frontdoor.tokenizer import Prompt, PromptRejected, PromptTokenizer, TokenizeError
from conductor.gateway.admission import RETRY_AFTER_S, DecidingBound, EngineBusy, EngineSlots
from conductor.gateway.replies import InboxClosed, ReplyInbox
from conductor.gateway.sse import EventTooLong, SseScan
from conductor.routing.local import LocalRouter, LogUnavailable
from conductor.settings import Settings
from conductor.stats import percentile
from conductor.web import FastJSONResponse, json_body, json_bytes
from schemas import MmItem, RequestOutcome, RoutingDecision, RoutingRejection, RoutingRequest, encode, envelope, headers
from schemas.records import MAX_EXTRA_KEYS, MAX_NAME
from streams.kafka import acknowledged
from streams.topics import topics

log = logging.getLogger(__name__)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")
"""A client's ``x-request-id`` the gateway keeps in its routing request id (as the log's key)."""
MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024
"""The longest SSE event the relay holds while it waits for the event's end. The largest real
one is a first chunk carrying a long prompt's ``prompt_token_ids`` (vLLM's ``return_token_ids``:
~8 bytes a token, 8 MiB at 1M tokens); a stream whose event never ends is cut with an error."""
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The largest answer read whole from an engine (a prefill half, a non-streamed completion)."""
MAX_ERROR_BYTES = 64 * 1024
"""What is read of an engine's error answer (its message goes to the client and the log)."""
_NOT_REACHED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError, httpx.WriteTimeout,
                httpx.UnsupportedProtocol)
"""Failures before the engine had the whole request: it cannot have started on it, so it is safe
to send the request elsewhere."""
T = TypeVar("T")
_JSON = {"content-type": "application/json"}
RoutingMode = Literal["colocated", "log"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("colocated", "log")


@dataclass(frozen=True)
class GatewayConfig:
    gateway_id: str
    engines: dict[str, str]
    """Node id → base URL, overriding what the node's heartbeats announce (``--engine``); the
    others are found through the view (the decision carries their endpoints)."""
    protocol: EngineProtocol = "vllm"
    base_model: str | None = None
    """The engines' base model; another ``model`` in a request is a LoRA adapter name."""
    decision_timeout_s: float = 5.0
    max_attempts: int = 3
    bootstrap_port: int | None = None
    """SGLang: the prefill instances' bootstrap port (default: the port of their URL)."""
    routing: RoutingMode = "colocated"
    """``colocated``: decide in this process (:class:`~conductor.routing.local.LocalRouter`) and
    write the request and decision to the log before calling the engines; ``log``: send the
    routing request onto ``requests`` and wait for a router's decision on the reply topic."""


@dataclass(frozen=True)
class UpstreamTimeouts:
    """How long the gateway waits on an engine, by phase (settings ``gateway_*_timeout_s``; 0 = no limit).

    A non-streamed generation sends nothing before its last token, so only ``total_s`` bounds
    it, and that is off by default: a long generation is never cut."""

    connect_s: float = 2.0
    """Open a connection (or wait for a pooled one). Running out: the engine never had the request."""
    first_byte_s: float = 120.0
    """A streamed call's response headers (sent when the engine takes the request); a prefill
    half's answer (its queue and prefill)."""
    idle_s: float = 300.0
    """Between two reads of an answer once it started (a stream's chunks; its first chunk after
    the headers); also what writing a request may take."""
    total_s: float = 0.0
    """A whole request, from its arrival at the gateway to its last byte."""

    @classmethod
    def of(cls, settings: Settings) -> UpstreamTimeouts:
        return cls(connect_s=settings.gateway_connect_timeout_s, first_byte_s=settings.gateway_first_byte_timeout_s,
                   idle_s=settings.gateway_idle_timeout_s, total_s=settings.gateway_total_timeout_s)

    def for_httpx(self) -> httpx.Timeout:
        """What httpx bounds itself: connecting, waiting for a pooled connection, writing the request.
        Reads are bounded by phase around the calls (``Gateway._phase``), not per socket read."""
        return httpx.Timeout(connect=self.connect_s, pool=self.connect_s, write=self.idle_s or None, read=None)

    def outside_requests(self) -> httpx.Timeout:
        """The calls beside a request's hand-off (``/tokenize``, ``/v1/models``): every read within ``first_byte_s``."""
        return httpx.Timeout(connect=self.connect_s, pool=self.connect_s, write=self.idle_s or None,
                             read=self.first_byte_s or None)


class EngineFailed(Exception):
    """Nothing of the request runs on ``node`` (never reached, or it answered the call whole with
    a 5xx): the request is routed again without it."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(message)
        self.node = node


class EngineLost(Exception):
    """``node`` had taken the request when the call failed (a timeout by phase, a connection that
    broke while it worked): answered to the client (504 / 502), never run again."""

    def __init__(self, node: str, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.node = node
        self.status, self.code = (504, "upstream_timeout") if timeout else (502, "engine_failed")


class UpstreamClientError(Exception):
    """An engine refused the request itself (4xx): the client's, passed through."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"engine answered {status}")
        self.status, self.body = status, body


@dataclass
class _Trace:
    """What one client request went through (becomes its ``request_outcome``)."""

    request_id: str
    t0: float
    stream: bool
    attempts: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    decision: RoutingDecision | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    gaps_ms: list[float] = field(default_factory=list)
    routing_ms: float = 0.0
    decided_s: float = 0.0
    """From the request's arrival to its (last) decision: parse, tokenize, route through the log."""
    model: str | None = None
    prefill_s: float = 0.0
    """Wall time of the prefill call(s) of a hand-off (the last attempt's)."""
    decode_sent: float | None = None
    """When the decode (or aggregated) call was sent (the clock's time)."""
    status: int = 200
    error: str | None = None
    message: str = ""


class GatewayMetrics:
    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.requests = m.create_counter("conductor_gateway_requests", description="client requests, by status and error")
        self.ttft = m.create_histogram("conductor_gateway_ttft", unit="s", description="observed TTFT")
        self.routing = m.create_histogram("conductor_gateway_routing", unit="ms",
                                          description="tokenize + routing through the log, per request")
        self.retries = m.create_counter("conductor_gateway_retries", description="re-routes after an engine failed")
        self.unhashed_media = m.create_counter(
            "conductor_gateway_unhashed_media", description="chats with images or audio tokenized without the "
            "items' hashes (the engine's render route off or absent): routed on the text before the first item")


class Gateway:
    """Serves OpenAI requests by asking Conductor and driving the chosen prefill/decode pair."""

    def __init__(self, settings: Settings, config: GatewayConfig, tokenizer: PromptTokenizer,
                 client: httpx.AsyncClient, producer: Any, inbox: ReplyInbox | None,
                 clock: Callable[[], float] = time.perf_counter, *, local: LocalRouter | None = None) -> None:
        """``local``: decide in this process (``config.routing`` colocated); else ``inbox`` reads
        the routers' decisions (one of the two is needed)."""
        if local is None and inbox is None:
            raise ValueError("a gateway needs a colocated router or a reply inbox")
        self.settings = settings
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.producer = producer
        self.inbox = inbox
        self.local = local
        self.clock = clock
        self.topics = topics(settings.topic_config())
        self.metrics = GatewayMetrics()
        self.timeouts = UpstreamTimeouts.of(settings)
        self.engine_slots = EngineSlots(settings.gateway_engine_max_in_flight)
        self.deciding = DecidingBound(settings.gateway_max_deciding)
        self._seq = itertools.count(1)
        self._rng = random.Random()
        self._reachable = sorted(config.engines)
        self.directory = EngineDirectory(config.engines)
        """The engines for /tokenize and /v1/models (``run_gateway`` gives it the view)."""
        """What the router may name besides the engines that announce an endpoint."""
        self.outcomes: list[RequestOutcome] = []
        """The last outcomes (bounded), for tests and the bench."""

    # --- the request ------------------------------------------------------------------

    async def handle(self, body: Any, hdrs: Mapping[str, str], *, chat: bool, bounds: SloBounds | None = None,
                     ) -> Response:
        """One client request; its SLO headers clamped to ``bounds`` (its API key's)."""
        t0 = self.clock()
        try:
            creq = parse_body(body, chat=chat, base_model=self.config.base_model)
            slo = parse_slo(hdrs, bounds)
        except BadRequest as e:
            self.metrics.requests.add(1, {"status": 400, "error": "invalid_body"})
            return FastJSONResponse(error_body(str(e), "invalid_value", param=e.param), status_code=400)
        tr = _Trace(request_id=self._request_id(hdrs.get("x-request-id")), t0=t0, stream=creq.stream,
                    model=creq.model)
        down = self.problem()
        if down is not None:
            # Every decision would be lost: say so now rather than after the decision timeout.
            return self._fail(tr, 503, down[0], down[1], kind="service_unavailable", retry_after=5)
        try:
            return await self._route_and_serve(creq, slo, body, tr)
        except asyncio.CancelledError:
            # The client went away (conductor.web.cancel_on_disconnect): the engine calls are cancelled with it.
            tr.status, tr.error, tr.message = 499, "client_closed", "the client closed the connection before the answer"
            self._outcome(tr)
            raise

    async def _route_and_serve(self, creq: ClientRequest, slo: Slo, body: dict[str, Any], tr: _Trace) -> Response:
        """Tokenize, then route and serve, routing again (up to ``max_attempts``) while an engine fails
        before it took the request."""
        try:
            prompt = await self.tokenizer.prompt(creq)
        except TokenizeError as e:
            return self._fail(tr, 503, "tokenizer_unavailable", str(e), kind="service_unavailable",
                              retry_after=2)
        except PromptRejected as e:
            tr.status, tr.error = e.status, "prompt_rejected"
            self._outcome(tr)
            return FastJSONResponse(e.body, status_code=e.status)
        tr.prompt_tokens = len(prompt.token_ids)
        if prompt.unhashed_media:
            self.metrics.unhashed_media.add(1)
            log.debug("request %s: %d multimodal item(s) without their hash (the engine's render route is off or absent): "
                      "routed on the text before the first", tr.request_id, prompt.unhashed_media)
        for attempt in range(self.config.max_attempts):
            arid = tr.request_id if attempt == 0 else f"{tr.request_id}.r{attempt}"
            tr.attempts.append(arid)
            if attempt:
                self.metrics.retries.add(1)
            t_r = self.clock()
            if not self.deciding.take():
                return self._fail(tr, 429, "gateway_busy", f"the gateway is deciding {self.deciding.deciding} "
                                  "requests, its bound (gateway_max_deciding): retry after the Retry-After seconds",
                                  kind="requests", retry_after=RETRY_AFTER_S)
            try:
                answer = await self._decide(arid, creq, slo, prompt, tr)
            except ValidationError as e:
                first = e.errors()[0]
                return self._fail(tr, 400, "invalid_value", f"{first.get('loc')}: {first.get('msg')}",
                                  param="prompt")
            except InboxClosed as e:
                return self._fail(tr, 503, "reply_inbox_down", f"the gateway cannot read its decisions: {e}",
                                  kind="service_unavailable", retry_after=5)
            except LogUnavailable as e:
                return self._fail(tr, 503, "log_unavailable", f"{e}; the request was not served",
                                  kind="service_unavailable", retry_after=2)
            finally:
                self.deciding.give()
            tr.routing_ms += (self.clock() - t_r) * 1000.0
            if answer is None:
                return self._fail(tr, *rejection_response(
                    "decision_timeout", f"no decision within {self.config.decision_timeout_s:g}s " + (
                        "(is the broker taking records?)" if self.local else "(are the routers running?)")))
            if isinstance(answer, RoutingRejection):
                return self._fail(tr, *rejection_response(answer.reason, answer.message), code=answer.reason)
            tr.decision = answer
            tr.decided_s = self.clock() - tr.t0
            tr.prefill_s, tr.decode_sent = 0.0, None
            try:
                return await self._serve(creq, body, answer, arid, tr)
            except EngineFailed as e:
                log.warning("request %s: %s failed (%s); %s", arid, e.node, e,
                            "routing again without it" if attempt + 1 < self.config.max_attempts else "giving up")
                if e.node not in tr.excluded:
                    tr.excluded.append(e.node)
            except EngineBusy as e:
                return self._fail(tr, 429, "engine_busy", str(e), kind="requests", retry_after=RETRY_AFTER_S)
            except EngineLost as e:
                log.warning("request %s: %s failed after taking the request (%s); not run again", arid, e.node, e)
                return self._fail(tr, e.status, e.code, f"{e} (instance {e.node}; it had taken the request, so "
                                  "the request is not run again)", kind="server_error")
            except UpstreamClientError as e:
                tr.status, tr.error = e.status, "engine_rejected"
                self._outcome(tr)
                return FastJSONResponse(e.body, status_code=e.status)
        return self._fail(tr, 502, "engine_failed",
                          f"every attempt failed; instances that failed: {', '.join(tr.excluded)}",
                          kind="server_error")

    def problem(self) -> tuple[str, str] | None:
        """(code, message) when no request can be decided now: the colocated router is not
        running, or the reply inbox is not reading (not started, its task ended, its partition
        lost, or stalled); None when requests can be decided."""
        if self.local is not None:
            down = self.local.problem()
            if down is None:
                return None
            return ("starting" if not self.local.ready else "router_down"), down
        assert self.inbox is not None
        down = self.inbox.problem()
        if down is None:
            return None
        return ("starting" if not self.inbox.ready else "reply_inbox_down",
                f"the gateway cannot read its decisions: {down}")

    def _waiting(self, request_id: str) -> bool:
        deciding = self.local if self.local is not None else self.inbox
        assert deciding is not None
        return deciding.waiting(request_id)

    def _request_id(self, client_id: str | None) -> str:
        """``<gateway id>-<the client's x-request-id>`` when it is a usable, not in-flight id, else a random one."""
        if client_id and _CLIENT_ID.fullmatch(client_id):
            rid = f"{self.config.gateway_id}-{client_id}"
            if not self._waiting(rid):
                return rid
        return f"{self.config.gateway_id}-{uuid.uuid4().hex[:16]}"

    def _fail(self, tr: _Trace, status: int, body_or_code: Any, message_or_headers: Any = "", *,
              code: str | None = None, kind: str = "invalid_request_error", param: str | None = None,
              retry_after: int | None = None) -> Response:
        """An error response and its outcome (takes either (status, code, message) or rejection_response())."""
        if isinstance(body_or_code, dict):
            body, hdrs = body_or_code, dict(message_or_headers)
            code = code or body["error"]["code"]
            message = body["error"]["message"]
        else:
            code, message = body_or_code, str(message_or_headers)
            body, hdrs = error_body(message, code, param=param, kind=kind), {}
        if retry_after:
            hdrs["Retry-After"] = str(retry_after)
        tr.status, tr.error, tr.message = status, code, message
        self._outcome(tr)
        return FastJSONResponse(body, status_code=status, headers=hdrs)

    async def _decide(self, arid: str, creq: ClientRequest, slo: Slo, prompt: Prompt,
                      tr: _Trace) -> RoutingDecision | RoutingRejection | None:
        # Items past the schema's bounds are left out: the blocks from the first of them on match nothing.
        mm = [MmItem(identifier=i, offset=o, length=n) for i, o, n in prompt.mm_items[:MAX_EXTRA_KEYS]
              if 0 < len(i) <= MAX_NAME]
        local = self.local
        gid = self.config.gateway_id
        req = RoutingRequest(
            request_id=arid, model=creq.model if creq.lora_name is None else (self.config.base_model or creq.model),
            token_ids=prompt.token_ids, prompt_tokens=len(prompt.token_ids), mm_items=mm,
            expected_output_tokens=creq.max_tokens or DEFAULT_EXPECTED_OUTPUT,
            ttft_slo_s=slo.ttft_s, tbt_slo_ms=slo.tbt_ms, priority=slo.priority, lora_name=creq.lora_name,
            cache_salt=creq.cache_salt, reply_to=None if local else gid, decided_by=gid if local else None,
            exclude=list(tr.excluded), retry_of=tr.request_id if arid != tr.request_id else None,
            reachable=self._reachable,
        )
        if local is not None:
            try:  # the decision and its request are on the log (acknowledged) when it returns
                return await asyncio.wait_for(local.decide(req), self.config.decision_timeout_s)
            except TimeoutError:
                return None
        assert self.inbox is not None
        fut = self.inbox.expect(arid)
        env = envelope(req, producer_id=self.config.gateway_id, producer_seq=next(self._seq),
                       ts_ms=time.time_ns() // 1_000_000)
        async def ask() -> RoutingDecision | RoutingRejection:
            delivery = await self.producer.send(self.topics.requests.name, encode(env), key=arid.encode(),
                                                headers=headers(env))
            asyncio.ensure_future(self._watch_delivery(delivery, arid))
            return await fut

        try:
            # The send is inside the timeout too: a producer that cannot take the record never hangs a client.
            return await asyncio.wait_for(ask(), self.config.decision_timeout_s)
        except TimeoutError:
            return None
        finally:
            self.inbox.forget(arid)

    async def _watch_delivery(self, delivery: asyncio.Future[Any], arid: str) -> None:
        """The routing request's acknowledgement (``streams.kafka.acknowledged``, warning after 1 s);
        a send that failed is logged: the decision timeout answers the client."""
        try:
            await acknowledged(self.producer, [delivery], warn_after_s=1.0, what=f"routing request {arid}")
        except Exception as e:  # noqa: BLE001 - the decision timeout answers the client
            log.warning("routing request %s not published: %s", arid, e)

    # --- the hand-off -------------------------------------------------------------------

    def _url(self, node: str, d: RoutingDecision) -> str:
        """``--engine``'s URL for ``node``, else the endpoint its heartbeats announce (in the decision)."""
        url = self.config.engines.get(node)
        if url is None:
            ep = d.endpoints.get(node)
            if ep is None:
                raise EngineFailed(node, f"the gateway knows no URL for {node}: its heartbeats announce no "
                                   f"endpoint (conductor bridge --engine-url) and no --engine {node}=URL was given")
            url = ep.url
        return url.rstrip("/")

    @staticmethod
    def _headers(arid: str, d: RoutingDecision, node: str) -> dict[str, str]:
        """The request id, and the DP rank the node is (vLLM routes a request carrying it to that rank)."""
        ep = d.endpoints.get(node)
        if ep is not None and ep.dp_rank is not None:
            return {"x-request-id": arid, "X-data-parallel-rank": str(ep.dp_rank)}
        return {"x-request-id": arid}

    async def _serve(self, creq: ClientRequest, body: dict[str, Any], d: RoutingDecision, arid: str,
                     tr: _Trace) -> Response:
        """The hand-off, holding a slot on each engine the decision names (:class:`EngineSlots`; one at
        its bound: :class:`EngineBusy`, before any call) until the answer is sent whole."""
        held = self.engine_slots.take((d.prefill_instance, *(d.prefill_group or ()), d.decode_instance))
        try:
            resp = await self._hand_off(creq, body, d, arid, tr)
        except BaseException:
            held.release()
            raise
        if isinstance(resp, RelayResponse):
            resp.on_close = held.release
        else:
            held.release()
        return resp

    async def _hand_off(self, creq: ClientRequest, body: dict[str, Any], d: RoutingDecision, arid: str,
                        tr: _Trace) -> Response:
        p_url, d_url = self._url(d.prefill_instance, d), self._url(d.decode_instance, d)
        path = "/v1/chat/completions" if creq.chat else "/v1/completions"
        hdrs = self._headers(arid, d, d.prefill_instance)
        d_hdrs = self._headers(arid, d, d.decode_instance)
        pj: dict[str, Any] = {}
        if d.aggregated:
            # One engine prefills and decodes: no hand-off, one call.
            resp = await self._open_decode(d_url + path, aggregated_body(body), d_hdrs, d, tr)
        elif d.prefill_group and d.chunk_boundaries:
            # CPP: member j pulls the KV before its chunk from member j-1, computes its chunk and
            # holds the KV up to its boundary; the decode instance pulls the whole KV from the last.
            params: dict[str, Any] | None = None
            prev: str | None = None
            for node, end in zip(d.prefill_group, d.chunk_boundaries):
                pj_j = await self._prefill(self._url(node, d) + path, cpp_chunk_body(body, creq.chat, end, params),
                                           self._headers(arid, d, node), node, tr, peer=prev)
                pj = pj or pj_j  # the head's answer: its cached tokens are the request's reuse
                params, prev = pj_j.get("kv_transfer_params"), node
                if not isinstance(params, dict):
                    raise EngineFailed(node, "the CPP member's answer has no kv_transfer_params")
            assert params is not None  # the group has members, so the loop set it
            resp = await self._open_decode(d_url + path, vllm_decode_body(body, params), d_hdrs, d, tr,
                                           kv_from=prev)
        elif self.config.protocol == "sglang":
            resp, pj = await self._sglang(p_url + path, d_url + path, body, hdrs, d_hdrs, d, tr)
        else:
            pj = await self._prefill(p_url + path, vllm_prefill_body(body, creq.chat), hdrs, d.prefill_instance, tr)
            params = pj.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise EngineFailed(d.prefill_instance, "the prefill answer has no kv_transfer_params "
                                   "(is the engine started with a KV connector?)")
            resp = await self._open_decode(d_url + path, vllm_decode_body(body, params), d_hdrs, d, tr)
        tr.cached_tokens = _cached(pj)
        out_headers = {"x-conductor-request-id": tr.request_id, "x-conductor-prefill-instance": d.prefill_instance,
                       "x-conductor-decode-instance": d.decode_instance,
                       "x-conductor-routing-ms": f"{tr.decided_s * 1000.0:.3f}"}
        if not creq.stream:
            content = await self._read(resp, tr, d.decode_instance, "the decode answer", MAX_ANSWER_BYTES)
            try:
                data = json_body(content)
            except ValueError:
                raise EngineLost(d.decode_instance, "the decode answer is not JSON") from None
            tr.ttft_s = self.clock() - tr.t0
            if isinstance(data, dict):
                data.pop("kv_transfer_params", None)
                usage = data.get("usage") or {}
                tr.output_tokens = int(usage.get("completion_tokens") or 0)
                if d.aggregated:
                    tr.cached_tokens = _cached(data)
            self._outcome(tr)
            return FastJSONResponse(data, headers=out_headers)
        it = resp.aiter_raw()
        try:
            first = await self._phase(anext(it), tr, d.decode_instance, "the stream's first chunk",
                                      self.timeouts.idle_s)
        except BaseException as e:
            await resp.aclose()
            if isinstance(e, (httpx.HTTPError, StopAsyncIteration)):
                raise EngineLost(d.decode_instance, f"the stream ended before its first byte: {type(e).__name__}") from None
            raise
        return RelayResponse(self._relay(resp, it, first, creq, tr), media_type="text/event-stream",
                             headers=out_headers)

    async def _sglang(self, p_url: str, d_url: str, body: dict[str, Any], hdrs: dict[str, str],
                      d_hdrs: dict[str, str], d: RoutingDecision, tr: _Trace) -> tuple[httpx.Response, dict[str, Any]]:
        """SGLang's hand-off: prefill and decode at once, meeting at the prefill's bootstrap room.
        Whatever fails, nothing is left open: the other call is cancelled, or its response closed."""
        u = urlparse(p_url)
        ep = d.endpoints.get(d.prefill_instance)
        prefill_body, decode_body = sglang_bodies(body, u.hostname or "127.0.0.1",
                                                  self.config.bootstrap_port or (ep and ep.bootstrap_port)
                                                  or u.port or 80,
                                                  self._rng.getrandbits(63))
        prefill = asyncio.ensure_future(self._prefill(p_url, prefill_body, hdrs, d.prefill_instance, tr))
        try:
            resp = await self._open_decode(d_url, decode_body, d_hdrs, d, tr, prefill)
            try:
                return resp, await prefill
            except BaseException:
                await resp.aclose()  # the decode opened (a stream's headers are in) but its prefill failed
                raise
        except BaseException:
            await _discard(prefill)
            raise

    async def _phase(self, aw: Awaitable[T], tr: _Trace, node: str, what: str, limit_s: float) -> T:
        """``aw`` within ``limit_s`` (0: no limit) and what is left of the request's total timeout;
        running out is :class:`EngineLost` (504): the engine had the request."""
        limit: float | None = limit_s or None
        which = f"{limit_s:g}s"
        if self.timeouts.total_s:
            left = self.timeouts.total_s - (self.clock() - tr.t0)
            if limit is None or left < limit:
                limit, which = max(0.0, left), f"{self.timeouts.total_s:g}s for the whole request"
        try:
            async with asyncio.timeout(limit):
                return await aw
        except TimeoutError:
            raise EngineLost(node, f"no {what} within {which}", timeout=True) from None

    async def _send(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: _Trace, *,
                    what: str, first_byte: bool) -> httpx.Response:
        """POST ``body``; the response once its headers are in (the body not read yet). Headers wait
        ``first_byte_s`` when ``first_byte``, else only the total. Never reached: :class:`EngineFailed`;
        broken or timed out once the engine had the request: :class:`EngineLost`."""
        req = self.client.build_request("POST", url, content=json_bytes(body), headers={**hdrs, **_JSON},
                                        timeout=self.timeouts.for_httpx())
        limit = self.timeouts.first_byte_s if first_byte else 0.0
        try:
            return await self._phase(self.client.send(req, stream=True), tr, node, f"answer to the {what}", limit)
        except _NOT_REACHED as e:
            raise EngineFailed(node, f"{what} not sent: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise EngineLost(node, f"{what}: the connection broke before the answer: {type(e).__name__}: {e}") from None

    async def _read(self, resp: httpx.Response, tr: _Trace, node: str, what: str, limit: int) -> bytes:
        """``resp``'s body (the response closed after): each read within ``idle_s``, at most ``limit`` bytes."""
        out = bytearray()
        it = resp.aiter_bytes()
        try:
            while True:
                try:
                    out += await self._phase(anext(it), tr, node, f"byte of {what}", self.timeouts.idle_s)
                except StopAsyncIteration:
                    return bytes(out)
                if len(out) > limit:
                    raise EngineLost(node, f"{what} is longer than {limit} bytes")
        except httpx.HTTPError as e:
            raise EngineLost(node, f"{what} broke off: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()

    async def _refusal(self, resp: httpx.Response, tr: _Trace, node: str, what: str) -> bytes:
        """The start of an error answer (what names the error); an answer that breaks off gives what came."""
        try:
            return await self._read(resp, tr, node, what, MAX_ERROR_BYTES)
        except EngineLost:
            return b""

    async def _prefill(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: _Trace,
                       peer: str | None = None) -> dict[str, Any]:
        t_p = self.clock()
        try:
            return await self._prefill_call(url, body, hdrs, node, tr, peer)
        finally:
            tr.prefill_s += self.clock() - t_p

    async def _prefill_call(self, url: str, body: dict[str, Any], hdrs: dict[str, str], node: str, tr: _Trace,
                            peer: str | None) -> dict[str, Any]:
        r = await self._send(url, body, hdrs, node, tr, what="prefill", first_byte=True)
        if r.status_code >= 400:
            content = await self._refusal(r, tr, node, "the prefill's error answer")
            if peer is not None and r.status_code >= 500 and _error_code(content) == "kv_transfer_failed":
                raise EngineFailed(peer, f"{node} could not pull the KV before its chunk: {content[:200]!r}")
            if r.status_code >= 500:
                raise EngineFailed(node, f"prefill answered {r.status_code}: {content[:200]!r}")
            raise UpstreamClientError(r.status_code, _json_or_text(content))
        content = await self._read(r, tr, node, "the prefill answer", MAX_ANSWER_BYTES)
        try:
            out = json_body(content)
        except ValueError:
            # Answered whole (the prefill is done, its KV waits for a decode that will not come): routed again.
            raise EngineFailed(node, "prefill answered with a body that is not JSON") from None
        return out if isinstance(out, dict) else {}

    async def _open_decode(self, url: str, body: dict[str, Any], hdrs: dict[str, str], d: RoutingDecision,
                           tr: _Trace, prefill: asyncio.Future[dict[str, Any]] | None = None,
                           kv_from: str | None = None) -> httpx.Response:
        """The decode (or aggregated) call, open: its headers in, its body left to read. A streamed
        call's headers wait ``first_byte_s``; a non-streamed one's come with its last token (total only)."""
        node = d.decode_instance
        tr.decode_sent = self.clock()
        send = asyncio.ensure_future(self._send(url, body, hdrs, node, tr, what="decode",
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
            await _discard(send)
            raise
        if resp.status_code < 400:
            return resp
        content = await self._refusal(resp, tr, node, "the decode's error answer")
        err = _json_or_text(content)
        if _error_code(content) == "kv_transfer_failed":  # the decode is fine; its prefill peer is not
            raise EngineFailed(kv_from or d.prefill_instance,
                               f"the decode instance could not pull the KV: {content[:200]!r}")
        if resp.status_code >= 500:
            raise EngineFailed(node, f"decode answered {resp.status_code}: {content[:200]!r}")
        raise UpstreamClientError(resp.status_code, err)

    async def _relay(self, resp: httpx.Response, it: AsyncIterator[bytes], first: bytes, creq: ClientRequest,
                     tr: _Trace) -> AsyncIterator[bytes]:
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
                        raw = await self._phase(anext(it), tr, node, "stream chunk", self.timeouts.idle_s)
                    except StopAsyncIteration:
                        break
                now = self.clock()
                try:
                    out, tokens = scan.feed(raw)
                except EventTooLong as e:
                    raise EngineLost(node, str(e)) from None
                raw = None
                if scan.usage is not None:
                    usage = scan.usage.get("usage") or {}
                    tr.output_tokens = int(usage.get("completion_tokens") or tr.output_tokens)
                    if tr.decision is not None and tr.decision.aggregated:
                        tr.cached_tokens = _cached(scan.usage) or tr.cached_tokens
                    scan.usage = None
                if tokens:
                    if tr.ttft_s is None:
                        tr.ttft_s = now - tr.t0
                        tokens -= 1
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
            self._outcome(tr)

    # --- the outcome --------------------------------------------------------------------------

    def _outcome(self, tr: _Trace) -> None:
        d = tr.decision
        o = RequestOutcome(
            request_id=tr.request_id, gateway=self.config.gateway_id, status=tr.status, error=tr.error,
            message=tr.message[:4096], attempts=tr.attempts[:16],
            prefill_instance=d.prefill_instance if d else None, decode_instance=d.decode_instance if d else None,
            excluded=tr.excluded[:64], prompt_tokens=tr.prompt_tokens, cached_tokens=min(tr.cached_tokens, tr.prompt_tokens),
            output_tokens=tr.output_tokens, predicted_ttft_s=d.predicted_ttft_s if d else None,
            predicted_tbt_ms=d.predicted_tbt_ms if d else None, ttft_s=tr.ttft_s,
            tbt_p50_ms=percentile(tr.gaps_ms, 50), tbt_p99_ms=percentile(tr.gaps_ms, 99),
            routing_ms=tr.routing_ms or None, total_s=max(0.0, self.clock() - tr.t0), stream=tr.stream,
            model=tr.model, decided_s=tr.decided_s if d else None,
            prefill_s=tr.prefill_s if d and not d.aggregated and tr.prefill_s else None,
            decode_ttft_s=(tr.t0 + tr.ttft_s - tr.decode_sent
                           if tr.ttft_s is not None and tr.decode_sent is not None else None),
            reused_tokens=d.reused_tokens if d else None, mode=d.mode if d else None,
            control_offset=d.control_offset if d else None,
        )
        self.outcomes.append(o)
        del self.outcomes[:-1000]
        self.metrics.requests.add(1, {"status": tr.status, "error": tr.error or ""})
        if tr.ttft_s is not None:
            self.metrics.ttft.record(tr.ttft_s)
        if tr.routing_ms:
            self.metrics.routing.record(tr.routing_ms)
        env = envelope(o, producer_id=self.config.gateway_id, producer_seq=next(self._seq),
                       ts_ms=time.time_ns() // 1_000_000)
        task = asyncio.ensure_future(self.producer.send(self.topics.request_outcomes.name, encode(env),
                                                        key=tr.request_id.encode(), headers=headers(env)))
        task.add_done_callback(_log_send_error)


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


async def _discard(task: asyncio.Future[Any]) -> None:
    """Cancel a call to an engine and wait for it to end; a response it opened meanwhile is closed."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), httpx.Response):
        await task.result().aclose()


def _log_send_error(t: asyncio.Future[Any]) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.warning("request outcome not published: %s", t.exception())


def _json_or_text(content: bytes) -> Any:
    try:
        return json_body(content)
    except ValueError:
        return error_body(content[:500].decode(errors="replace"), "engine_error", kind="server_error")


def _error_code(content: bytes) -> str | None:
    err = _json_or_text(content)
    inner = err.get("error") if isinstance(err, dict) else None
    return inner.get("code") if isinstance(inner, dict) else None


def _cached(j: dict[str, Any]) -> int:
    usage = j.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    try:
        return int(details.get("cached_tokens") or 0)
    except (TypeError, ValueError):
        return 0

