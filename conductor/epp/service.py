"""One ext_proc stream, one HTTP request: headers → body (whole or in chunks) → a decision → the answer.

- The request headers are read and held: in full-duplex mode their answer waits for the body's
  end (it carries the destination); buffered, they are answered at once (go on) and the body's
  answer carries the destination.
- At the body's end (``end_of_stream`` on the last of however many body messages, or the
  trailers): the OpenAI body is checked (:func:`conductor.frontdoor.protocol.parse_body`, 400
  naming the field), the prompt tokenized as the gateway does (the engines' render route or
  ``/tokenize``, or a local ``tokenizer.json``), a :class:`~schemas.RoutingRequest` built as the
  gateway builds it (:func:`conductor.frontdoor.protocol.routing_request`), and the decider asked (:mod:`conductor.frontdoor.decide`: the request and the
  decision go to the log before the answer).
- A decision becomes the destination header and metadata (the decode instance), the prefill
  header (disaggregated), the route cache cleared (:func:`conductor.epp.protocol.routed`); a
  rejection an ``ImmediateResponse`` with 429/503 and the reason (:func:`~conductor.epp.protocol.rejected`).
- A request with no body (``GET /v1/models``) goes to a live engine in turn: nothing to decide.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry import metrics

from conductor.epp.protocol import (
    BODY_MODES,
    BUFFERED,
    DESTINATION_HEADER,
    FULL_DUPLEX,
    ROUTING_MS_HEADER,
    BadEndpoint,
    Pick,
    bad_request,
    header_map,
    headers_only,
    host_port,
    immediate,
    is_chat,
    passthrough,
    pick_of,
    rejected,
    routed,
    subset_hint,
    unavailable,
)
from conductor.frontdoor.decide import Decider, InboxClosed, LogUnavailable
from conductor.frontdoor.directory import EngineDirectory, decided_url
from conductor.frontdoor.protocol import (
    TRUSTED_BOUNDS_HEADER,
    BadRequest,
    SloBounds,
    default_bounds,
    error_body,
    outcome_decision_fields,
    outcome_release_fields,
    parse_body,
    parse_slo,
    request_id,
    routing_request,
    trusted_bounds,
    with_session,
)
from conductor.frontdoor.tokenizer import PromptRejected, PromptTokenizer, TokenizeError
from conductor.settings import Settings
from schemas import RequestOutcome, RoutingDecision

log = logging.getLogger(__name__)

Responses = list[pb.ProcessingResponse]
OutcomeSink = Callable[[RequestOutcome], None]
"""Where the picker records a decision it made but did not deliver (the ``request-outcomes`` topic)."""
CANCELLED_STATUS = 499
"""The outcome's status of a decision whose stream the proxy cancelled before the answer (nginx's
"client closed request": no HTTP answer reached anyone)."""


@dataclass(frozen=True)
class EppConfig:
    """``conductor epp``'s configuration (checked by :func:`conductor.epp.serve.epp_config`)."""

    epp_id: str
    """Names the picker as a producer on the log (and its reply topic in ``log`` mode)."""
    engines: dict[str, str] = field(default_factory=dict)
    """Node id → base URL, overriding what the node's heartbeats announce (``--engine``)."""
    base_model: str | None = None
    """The engines' base model; another ``model`` in a request is a LoRA adapter name."""
    routing: str = "colocated"
    """``colocated``: a router in this process (:class:`conductor.routing.local.LocalRouter`); ``log``:
    the routers through the log (:class:`conductor.frontdoor.decide.LogDecider`)."""
    decision_timeout_s: float = 5.0
    """The whole answer, from the body's end (parse, tokenize, decide, the log's acknowledgement): past it
    503 ``decision_timeout``, and a decision that comes later is released (:meth:`Picker.abandon`)."""
    max_streams: int = 256
    """Streams the picker works on at once, each from its first message to its answer (a stream the
    proxy keeps open after the answer does not count); beyond it 429 ``picker_busy`` at once. 0: no bound."""
    body_mode: str = "full-duplex"
    """What the proxy's ext_proc filter is configured with when its first message does not say
    (``protocol_config``, Envoy 1.32+): ``full-duplex`` (FULL_DUPLEX_STREAMED, the Inference
    Extension's) or ``buffered``."""
    max_body_bytes: int = 16 * 1024 * 1024
    """A body longer than this is answered 413 (the picker holds the whole body to decide)."""
    bounds: SloBounds = field(default_factory=lambda: default_bounds(Settings.model_construct()))
    """What a request's SLO and priority headers are clamped to (the settings' ``ttft_slo_s``,
    ``tbt_slo_ms``, priority 0), as the gateway clamps them to an API key's."""
    trust_bounds_header: bool = False
    """Widen ``bounds`` by the proxy's :data:`~conductor.frontdoor.protocol.TRUSTED_BOUNDS_HEADER` (settings
    ``epp_trust_bounds_header``)."""


class EppMetrics:
    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.requests = m.create_counter("conductor_epp_requests", description="requests picked for, by status and reason")
        self.decision = m.create_histogram("conductor_epp_decision", unit="ms", description="body end to the "
                                           "picker's answer: parse, tokenize, decide and log")


@dataclass
class _Stream:
    """What one HTTP request's ext_proc stream has shown so far."""

    mode: int
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    decided: bool = False
    headers_answered: bool = False
    t0: float = 0.0
    """When the body ended (the picker's clock)."""
    decision: RoutingDecision | None = None
    """The decision the answers carry, until the proxy has them (then None: delivered)."""


class Picker:
    """The endpoint picker's logic over ext_proc messages (no gRPC here: :class:`ExternalProcessor` serves it)."""

    def __init__(self, config: EppConfig, decider: Decider, tokenizer: PromptTokenizer, directory: EngineDirectory,
                 clock: Callable[[], float] = time.perf_counter, outcomes: OutcomeSink | None = None) -> None:
        """``outcomes``: where a decision made but not delivered is recorded (None: only released)."""
        self.config = config
        self.decider = decider
        self.tokenizer = tokenizer
        self.directory = directory
        self.clock = clock
        self.outcomes = outcomes
        self.metrics = EppMetrics()
        self._turn = itertools.count()
        self._reachable = sorted(config.engines)
        self.working = 0
        """Streams between their first message and their answer (bounded by ``max_streams``)."""
        self.abandoned = 0

    def busy(self) -> pb.ProcessingResponse | None:
        """The answer to a new stream while ``max_streams`` are being worked on (429 ``picker_busy``), or None."""
        limit = self.config.max_streams
        if not limit or self.working < limit:
            return None
        self.metrics.requests.add(1, {"status": 429})
        return immediate(429, error_body(f"the picker is working on {limit} requests (--max-streams); retry",
                                         "picker_busy", kind="rate_limit_error"), {"retry-after": "1"},
                         details="conductor_picker_busy")

    def abandon(self, decision: RoutingDecision, why: str, status: int) -> None:
        """``decision`` was made (and logged) but its request never reached an engine (the proxy
        cancelled the stream, or the answer came past the decision timeout): release what it
        reserved (its pending blocks, its in-flight work) and record why on ``request-outcomes``,
        so the log says the request failed and ``explain`` applies the release where it happened."""
        self.abandoned += 1
        mark = None
        try:
            mark = self.decider.released(decision, "finished", time.monotonic(), failed=True)
        except Exception:  # the pending blocks' TTL ends them anyway
            log.exception("releasing the undelivered decision %s failed", decision.request_id)
        log.info("decision %s not delivered (%s): released", decision.request_id, why)
        if self.outcomes is None:
            return
        self.outcomes(RequestOutcome(
            request_id=decision.request_id, gateway=self.config.epp_id, status=status, error=why,
            message=f"the picker's answer was not delivered: {why}", attempts=[decision.request_id],
            **outcome_decision_fields(decision), **outcome_release_fields(None, mark)))

    def _abandon_when_made(self, task: asyncio.Future[Any], why: str, status: int) -> None:
        """Once ``task`` (a decision no one waits for now) ends, :meth:`abandon` what it decided."""
        def done(t: asyncio.Future[Any]) -> None:
            if t.cancelled() or t.exception() is not None:
                return  # nothing was decided, or nothing logged: nothing to release
            if isinstance(t.result(), RoutingDecision):
                self.abandon(t.result(), why, status)
        task.add_done_callback(done)

    def stream(self) -> _Stream:
        return _Stream(mode=BODY_MODES[self.config.body_mode])

    async def on_message(self, st: _Stream, req: pb.ProcessingRequest) -> Responses:
        """The answers to one message of the stream (none while the body is still coming)."""
        if req.HasField("protocol_config") and req.protocol_config.request_body_mode:
            st.mode = req.protocol_config.request_body_mode
        which = req.WhichOneof("request")
        if which == "request_headers":
            return await self._on_headers(st, req)
        if which == "request_body":
            if st.decided:  # more body after the answer (never in the modes served): pass it on
                return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
            st.body += req.request_body.body
            if len(st.body) > self.config.max_body_bytes:
                st.decided = True
                return [immediate(413, error_body(f"the body is longer than {self.config.max_body_bytes} bytes",
                                                  "body_too_large", param="body"))]
            if req.request_body.end_of_stream or req.request_body.end_of_stream_without_message:
                return await self._decide(st)
            return []
        if which == "request_trailers" and not st.decided:
            out = await self._decide(st)  # the body ended with the trailers
            if out and not out[0].HasField("immediate_response"):
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
            return out
        answer = passthrough(req, st.mode)
        return [answer] if answer is not None else []

    async def _on_headers(self, st: _Stream, req: pb.ProcessingRequest) -> Responses:
        st.headers = header_map(req.request_headers)
        st.subset = subset_hint(req)
        if req.request_headers.end_of_stream:
            st.decided = True
            await self.directory.refresh()
            return [self._any_engine(st)]
        if st.mode not in (FULL_DUPLEX, BUFFERED):
            st.decided = True
            return [immediate(500, error_body(
                "conductor epp decides on the request body: configure the ext_proc filter's request_body_mode as "
                "FULL_DUPLEX_STREAMED or BUFFERED", "epp_misconfigured", kind="server_error"))]
        if st.mode == BUFFERED:
            st.headers_answered = True
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # full duplex: the headers' answer carries the destination, once the body is in

    def _any_engine(self, st: _Stream) -> pb.ProcessingResponse:
        """A request with no body: the next live engine in turn (within the proxy's subset)."""
        urls = self.directory.urls()
        allowed = [u for u in urls if st.subset is None or _hp(u) in st.subset]
        if not allowed:
            return unavailable("no live engine is known (none announces an endpoint, no --engine given)"
                               if not urls else "no known engine is in the proxy's endpoint subset", "no_live_instance")
        dest = host_port(allowed[next(self._turn) % len(allowed)])
        return headers_only(Pick(dest, None, {DESTINATION_HEADER: dest}))

    async def _decide(self, st: _Stream) -> Responses:
        st.decided = True
        t0 = st.t0 = self.clock()
        try:
            out = await self._answer(st)
        except TimeoutError:  # parsing, tokenizing or the engine directory past the decision timeout
            out = [rejected("decision_timeout", f"no answer within {self.config.decision_timeout_s:g}s "
                            f"{self.decider.late}")]
        status = 200
        if out and out[0].HasField("immediate_response"):
            status = out[0].immediate_response.status.code
        self.metrics.requests.add(1, {"status": status})
        self.metrics.decision.record((self.clock() - t0) * 1000.0)
        return out

    def _left(self, st: _Stream) -> float:
        """Seconds left of the decision timeout (counted from the body's end)."""
        return max(st.t0 + self.config.decision_timeout_s - self.clock(), 0.0)

    async def _answer(self, st: _Stream) -> Responses:
        async with asyncio.timeout(self._left(st)):  # no task of its own, unlike wait_for
            await self.directory.refresh()
        body = bytes(st.body)
        chat = is_chat(st.headers.get(":path", ""))
        if chat is None:
            return [immediate(404, error_body(f"conductor epp picks for POST /v1/completions and "
                                              f"/v1/chat/completions, not {st.headers.get(':path', '')!r}",
                                              "unknown_route", param=":path"))]
        try:
            parsed = orjson.loads(body)
        except (ValueError, RecursionError):  # deeply nested (orjson: past 1,024 levels): 400, not a 500
            return [bad_request("the body is not JSON", "invalid_json", param="body")]
        try:
            creq = with_session(parse_body(parsed, chat=chat, base_model=self.config.base_model), st.headers)
            bounds = self.config.bounds
            if self.config.trust_bounds_header:
                bounds = trusted_bounds(st.headers.get(TRUSTED_BOUNDS_HEADER), bounds)
            slo = parse_slo(st.headers, bounds)
        except BadRequest as e:
            return [bad_request(str(e), "invalid_value", param=e.param)]
        exclude: list[str] = []
        if st.subset is not None:
            known = self._known_urls()
            exclude = sorted(n for n, u in known.items() if _hp(u) not in st.subset)
            if len(exclude) == len(known):
                return [unavailable("no engine Conductor knows is in the proxy's endpoint subset "
                                    f"{st.subset[:8]}", "no_live_instance")]
        try:
            async with asyncio.timeout(self._left(st)):
                prompt = await self.tokenizer.prompt(creq)
        except TokenizeError as e:
            return [unavailable(str(e), "tokenizer_unavailable", retry_after=2)]
        except PromptRejected as e:
            return [immediate(e.status, e.body if isinstance(e.body, Mapping) else
                              error_body(str(e.body), "prompt_rejected"))]
        try:
            req = routing_request(request_id(self.config.epp_id, st.headers.get("x-request-id")), creq, slo, prompt,
                                  base_model=self.config.base_model, reachable=self._reachable, exclude=exclude)
        except BadRequest as e:
            return [bad_request(str(e), "invalid_value", param=e.param)]
        # The decision runs in a task of its own: when no one waits for it any more (past the
        # timeout, or the proxy cancelled the stream) it still ends, logged, and is then released.
        task = asyncio.ensure_future(self.decider.decide(req))
        try:
            done, _ = await asyncio.wait((task,), timeout=self._left(st))
        except asyncio.CancelledError:
            self._abandon_when_made(task, "cancelled", CANCELLED_STATUS)
            raise
        if not done:
            self._abandon_when_made(task, "decision_timeout", 503)
            return [rejected("decision_timeout", f"no decision within {self.config.decision_timeout_s:g}s "
                             f"{self.decider.late}")]
        try:
            answer = task.result()
        except TimeoutError:
            return [rejected("decision_timeout", f"no decision within {self.config.decision_timeout_s:g}s "
                             f"{self.decider.late}")]
        except InboxClosed as e:
            return [unavailable(f"the picker cannot read its decisions: {e}", "reply_inbox_down")]
        except LogUnavailable as e:  # decided here but not on the log: not served (the log is the record)
            return [unavailable(str(e), "log_unavailable", retry_after=2)]
        if not isinstance(answer, RoutingDecision):
            return [rejected(answer.reason, answer.message)]
        try:
            pick = pick_of(answer, self._urls(answer))
        except (KeyError, BadEndpoint) as e:
            return [unavailable(f"decision {answer.request_id} names an instance with no usable endpoint: {e}",
                                "no_endpoint")]
        pick = replace(pick, headers={**pick.headers, ROUTING_MS_HEADER: f"{(self.clock() - st.t0) * 1000.0:.3f}"})
        st.decision = answer
        if st.mode == BUFFERED or st.headers_answered:
            return routed(pick, body, BUFFERED)
        return routed(pick, body, FULL_DUPLEX)

    def _known_urls(self) -> dict[str, str]:
        return {**self.directory.found(), **self.config.engines}

    def _urls(self, d: RoutingDecision) -> dict[str, str]:
        """Node → base URL of each instance ``d`` names: ``--engine`` first, else the announced endpoint."""
        out: dict[str, str] = {}
        for node in {d.prefill_instance, d.decode_instance}:
            url = decided_url(node, d, self.config.engines)
            if url is None:
                raise KeyError(f"{node}: its heartbeats announce no endpoint and no --engine {node}=URL was given")
            out[node] = url
        return out


def _hp(url: str) -> str:
    try:
        return host_port(url)
    except BadEndpoint:
        return ""


class ExternalProcessor:
    """``envoy.service.ext_proc.v3.ExternalProcessor/Process`` over :class:`Picker`: one stream per HTTP request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        picker = self.picker
        st = picker.stream()
        working = False
        try:
            async for req in request_iterator:
                if not working and not st.decided:
                    busy = picker.busy()
                    if busy is not None:
                        yield busy
                        return
                    working = True
                    picker.working += 1
                answers = await picker.on_message(st, req)
                if working and answers and st.decided:  # the picker's work for this stream is done
                    working = False
                    picker.working -= 1
                for i, answer in enumerate(answers):
                    if i == len(answers) - 1 and st.decided:
                        # The last answer handed to gRPC: delivered (the proxy may end the stream as
                        # soon as it has it, before this generator runs again).
                        st.decision = None
                    yield answer
                    if answer.HasField("immediate_response"):
                        return  # the proxy answers the client; the stream is over
        finally:
            if working:
                picker.working -= 1
            if st.decision is not None:  # decided and logged, but the proxy never had the answer
                picker.abandon(st.decision, "cancelled", CANCELLED_STATUS)
