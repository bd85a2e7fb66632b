"""One client request, end to end: tokenize → decide (logged) → P/D hand-off → relay.

- A decider decides (:mod:`conductor.frontdoor.decide`, as the picker's): colocated (the default,
  ``GatewayConfig.routing``) in this process, the engines called once the broker acknowledged the
  request (``decided_by`` = this gateway) and its decision, a broker that does not becomes 503
  ``log_unavailable``; or through the log, the answer back on this gateway's reply topic.
- A rejection becomes 429/503/400 with an OpenAI-style error naming the reason and a
  ``Retry-After`` (:data:`conductor.frontdoor.protocol.REJECTION_STATUS`). No decision within
  ``decision_timeout_s`` becomes 503 ``decision_timeout``: a client never hangs on the log.
- A call to an engine is re-routed only when nothing of the request runs there: the engine was
  never reached (connection refused, connect timeout, a request it never fully received) or
  it answered the call whole with a 5xx (503, a decode that could not pull the KV from its
  prefill peer, ...). That instance is excluded and a new routing request is sent
  (``retry_of``, ``exclude``: the retry is in the log); after ``max_attempts`` the client gets
  502 ``engine_failed``. Once an engine has taken the request (its connection breaks while it
  works, or a timeout by phase runs out: :class:`~conductor.gateway.config.UpstreamTimeouts`), the client
  gets 504
  ``upstream_timeout`` or 502 ``engine_failed`` with the reason, and the request is never run
  again: the engine may still be generating it. The calls are :mod:`conductor.gateway.upstream`'s,
  one module per hand-off drives them (:mod:`conductor.gateway.handoff`), and the answer goes
  back through :mod:`conductor.gateway.relay`.
- After each request a ``request_outcome`` record goes to ``request-outcomes``.
- Each attempt's decision is released on the shared decision-time records
  (:meth:`~conductor.frontdoor.decide.Decider.released`): its prefill work at the first token,
  all of it when the answer ends (complete, failed, cancelled, the client gone) or when the
  engine fails it before a retry (failed: its pending blocks end too). The outcome records the
  last attempt's ``first_token_view_ms`` / ``finished_view_ms`` from the same readings.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
from opentelemetry import metrics
from starlette.responses import Response

from conductor.frontdoor.decide import Decider, InboxClosed, LogUnavailable, Release, ReleaseMark
from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import (
    BadRequest,
    ClientRequest,
    Prompt,
    Slo,
    SloBounds,
    error_body,
    parse_body,
    parse_slo,
    rejection_response,
    request_id,
    routing_request,
    with_session,
)
from conductor.frontdoor.tokenizer import PromptRejected, PromptTokenizer, TokenizeError
from conductor.gateway.admission import RETRY_AFTER_S, DecidingBound, EngineBusy, EngineSlots, instruments
from conductor.gateway.config import GatewayConfig
from conductor.gateway.handoff import HandOff, aggregated, call_of, cpp, engine_body, vllm
from conductor.gateway.handoff.sglang import SglangHandOff
from conductor.gateway.health import LogHealth
from conductor.gateway.outcome import Trace, outcome_of
from conductor.gateway.relay import RelayResponse, respond
from conductor.gateway.upstream import EngineFailed, EngineLost, Upstream, UpstreamClientError, cached
from conductor.settings import Settings
from conductor.web import FastJSONResponse
from schemas import RequestOutcome, RoutingDecision, RoutingRejection, encode, envelope, headers
from streams.topics import topics

log = logging.getLogger(__name__)

BROKER_PROBE_S = 2.0
"""How long ``/health`` waits for the broker's metadata while the log health is tripped."""


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
    """Serves OpenAI requests by asking Conductor and driving the chosen prefill/decode pair.

    ``decider``: who decides (:func:`conductor.frontdoor.decide.make_decider`); ``producer``: sends
    the outcomes; ``seq``: this gateway's producer sequence on the log (shared with its decider);
    ``directory``: the engines for ``/tokenize`` and ``/v1/models``; ``engines``: the transport the
    calls to the engines take (the one under ``client``, without the client's layer), default
    through ``client``."""

    def __init__(self, settings: Settings, config: GatewayConfig, tokenizer: PromptTokenizer,
                 client: httpx.AsyncClient, producer: Any, decider: Decider,
                 clock: Callable[[], float] = time.perf_counter, *, directory: EngineDirectory | None = None,
                 seq: Iterator[int] | None = None, engines: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.producer = producer
        self.decider = decider
        self.clock = clock
        self.topics = topics(settings.topic_config())
        self.metrics = GatewayMetrics()
        self.upstream = Upstream(engines if engines is not None else client, config.timeouts, clock)
        self.engine_slots = EngineSlots(config.engine_max_in_flight)
        self.deciding = DecidingBound(config.max_deciding)
        self.log_health = LogHealth(config.log_failures_to_trip)
        """Colocated: unacknowledged decisions in a row; tripped, the gateway is unready (:meth:`problem`)."""
        self.draining = False
        """Stopping (:meth:`drain`): new requests 503 ``draining``, the ones in flight finish."""
        self._open: set[str] = set()
        """The request ids in flight, from arrival to outcome (a second one under the same id is 409)."""
        self._seq = seq if seq is not None else itertools.count(1)
        self._reachable = sorted(config.engines)
        """What the router may name besides the engines that announce an endpoint."""
        self.directory = directory if directory is not None else EngineDirectory(config.engines)
        """The engines for /tokenize and /v1/models (``run_gateway`` gives it the view)."""
        self._pd: HandOff = SglangHandOff(config.bootstrap_port) if config.protocol == "sglang" else vllm.VllmHandOff()
        """The P/D hand-off between two engines (the engines' protocol)."""
        self.outcomes: list[RequestOutcome] = []
        """The last outcomes (bounded), for tests and the bench."""

    # --- the request ------------------------------------------------------------------

    async def handle(self, body: Any, hdrs: Mapping[str, str], *, chat: bool, bounds: SloBounds | None = None,
                     ) -> Response:
        """One client request; its SLO headers clamped to ``bounds`` (its API key's)."""
        t0 = self.clock()
        try:
            creq = with_session(parse_body(body, chat=chat, base_model=self.config.base_model), hdrs)
            slo = parse_slo(hdrs, bounds)
        except BadRequest as e:
            self.metrics.requests.add(1, {"status": 400, "error": "invalid_body"})
            return FastJSONResponse(error_body(str(e), "invalid_value", param=e.param), status_code=400)
        rid = request_id(self.config.gateway_id, hdrs.get("x-request-id"))
        if rid in self._open or self.decider.waiting(rid):
            # Two requests under one id would share it on every topic (their decisions, releases and
            # outcomes mixed up); a new id would hide this one from the client. Said, not recorded:
            # an outcome under that id would be the other request's.
            self.metrics.requests.add(1, {"status": 409, "error": "duplicate_request_id"})
            return FastJSONResponse(error_body(
                "a request with this x-request-id is in flight at this gateway: wait for it to end, or send "
                "another id", "duplicate_request_id", param="x-request-id"), status_code=409)
        tr = Trace(request_id=rid, t0=t0, stream=creq.stream, model=creq.model)
        self._open.add(rid)
        down = self.problem()
        if down is not None and not (down[0] == "log_unavailable" and self.log_health.may_try()):
            # Every decision would be lost: say so now rather than after the decision timeout.
            return self._fail(tr, 503, down[0], down[1], kind="service_unavailable", retry_after=5)
        try:
            return await self._route_and_serve(creq, slo, body, tr)
        except asyncio.CancelledError:
            # The client went away (conductor.web.cancel_on_disconnect): the engine calls are cancelled with it.
            tr.status, tr.error, tr.message = 499, "client_closed", "the client closed the connection before the answer"
            self._outcome(tr)
            raise
        except BaseException:
            self._open.discard(rid)
            raise

    async def _route_and_serve(self, creq: ClientRequest, slo: Slo, body: dict[str, Any], tr: Trace) -> Response:
        """Tokenize, then route and serve, routing again (up to ``max_attempts``) while an engine fails
        before it took the request."""
        prompt = await self._prompt(creq, tr)
        if isinstance(prompt, Response):
            return prompt
        if self.config.sends_prompt_ids:
            body = engine_body(body, creq, prompt)
        for attempt in range(self.config.max_attempts):
            arid = tr.request_id if attempt == 0 else f"{tr.request_id}.r{attempt}"
            tr.attempts.append(arid)
            if attempt:
                self.metrics.retries.add(1)
            answer = await self._decide(arid, creq, slo, prompt, tr)
            if isinstance(answer, Response):
                return answer
            tr.decision = answer
            tr.decided_s = self.clock() - tr.t0
            tr.prefill_s, tr.decode_sent = 0.0, None
            try:
                return await self._serve(creq, body, answer, arid, tr)
            except EngineFailed as e:
                self._release_end(tr, failed=True)  # nothing of it runs: its work and blocks end now
                log.warning("request %s: %s failed (%s); %s", arid, e.node, e,
                            "routing again without it" if attempt + 1 < self.config.max_attempts else "giving up")
                tr.exclude(e.node)
            except EngineBusy as e:
                # Once: another instance (a capacity-group mate the group's work gathered beside, or
                # any other) may take it; if none can, or it is busy too, the client gets the 429.
                if tr.busy is not None or attempt + 1 >= self.config.max_attempts:
                    return self._engine_busy(tr, str(e))
                self._release_end(tr, failed=True)  # nothing of it runs: its work and blocks end now
                tr.busy = str(e)
                tr.exclude(e.node)
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

    async def _prompt(self, creq: ClientRequest, tr: Trace) -> Prompt | Response:
        """The prompt's token ids, or the answer when the tokenizer is down or refuses the prompt."""
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
        return prompt

    def problem(self) -> tuple[str, str] | None:
        """(code, message) when no request can be decided now: the gateway is draining, the colocated
        router is not running, the reply inbox is not reading (not started, its task ended, its
        partition lost, or stalled), or the broker did not acknowledge the last decisions
        (``log_unavailable``: :class:`~conductor.gateway.health.LogHealth`); None when requests can be decided."""
        if self.draining:
            return "draining", "the gateway is shutting down and takes no new request: retry on another replica"
        down = self.decider.down("gateway")
        if down is not None:
            return down.code, down.message
        tripped = self.log_health.problem()
        return None if tripped is None else ("log_unavailable", tripped)

    async def readiness(self) -> tuple[str, str] | None:
        """:meth:`problem` as ``/health`` answers it: while the log health is tripped, the broker is
        asked (at most once a second) whether it answers again; if it does, the gateway is ready
        and the next decision tells whether the log takes records."""
        down = self.problem()
        if down is not None and down[0] == "log_unavailable" and self.log_health.may_try() \
                and await self._broker_answers():
            self.log_health.half_open()
            down = self.problem()
        return down

    async def _broker_answers(self) -> bool:
        client = getattr(self.producer, "client", None)
        if client is None:
            return False
        try:
            await asyncio.wait_for(client.fetch_all_metadata(), BROKER_PROBE_S)
        except Exception:  # noqa: BLE001 - any failure means: not yet
            return False
        return True

    def drain(self, grace_s: float) -> None:
        """Stop taking requests (503 ``draining``, ``/health`` 503) and cut every call to an engine
        still open after ``grace_s`` (:meth:`~conductor.gateway.upstream.Upstream.cut`): a stream
        still running then ends with an SSE error event ``gateway_shutdown``."""
        self.draining = True
        self.upstream.cut(grace_s)
        log.info("gateway %s: draining; calls to engines still open in %gs are cut", self.config.gateway_id, grace_s)

    def _engine_busy(self, tr: Trace, why: str) -> Response:
        """429 ``engine_busy`` (counted as throttled): an engine at its bound, and nothing else took it."""
        instruments().throttled.add(1, {"reason": "engine_busy"})
        return self._fail(tr, 429, "engine_busy", why, kind="requests", retry_after=RETRY_AFTER_S)

    def _fail(self, tr: Trace, status: int, body_or_code: Any, message_or_headers: Any = "", *,
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

    # --- the decision --------------------------------------------------------------------

    async def _decide(self, arid: str, creq: ClientRequest, slo: Slo, prompt: Prompt,
                      tr: Trace) -> RoutingDecision | Response:
        """One attempt's decision within the bound of decisions at once, or the client's answer."""
        t_r = self.clock()
        if not self.deciding.take():
            return self._fail(tr, 429, "gateway_busy", f"the gateway is deciding {self.deciding.deciding} "
                              "requests, its bound (gateway_max_deciding): retry after the Retry-After seconds",
                              kind="requests", retry_after=RETRY_AFTER_S)
        # The decision's slot is held until its work ends, not until this request stops waiting: a
        # colocated decision goes on (shielded) after the decision timeout, until the broker took it or not.
        work = asyncio.ensure_future(self._ask(arid, creq, slo, prompt, tr))
        work.add_done_callback(self._decided)
        try:
            answer = await asyncio.wait_for(asyncio.shield(work), self.config.decision_timeout_s)
        except TimeoutError:
            answer = None
        except BadRequest as e:
            return self._fail(tr, 400, "invalid_value", str(e), param=e.param)
        except InboxClosed as e:
            return self._fail(tr, 503, "reply_inbox_down", f"the gateway cannot read its decisions: {e}",
                              kind="service_unavailable", retry_after=5)
        except LogUnavailable as e:
            return self._fail(tr, 503, "log_unavailable", f"{e}; the request was not served",
                              kind="service_unavailable", retry_after=2)
        tr.routing_ms += (self.clock() - t_r) * 1000.0
        if answer is None:
            return self._fail(tr, *rejection_response(
                "decision_timeout", f"no decision within {self.config.decision_timeout_s:g}s {self.decider.late}"))
        if isinstance(answer, RoutingRejection):
            if tr.busy is not None:  # nothing else could take what a busy engine could not
                return self._engine_busy(tr, tr.busy)
            return self._fail(tr, *rejection_response(answer.reason, answer.message), code=answer.reason)
        return answer

    async def _ask(self, arid: str, creq: ClientRequest, slo: Slo, prompt: Prompt,
                   tr: Trace) -> RoutingDecision | RoutingRejection | None:
        """The decider's answer (on the log when it returns); None when it timed out itself (log mode)."""
        req = routing_request(arid, creq, slo, prompt, base_model=self.config.base_model, reachable=self._reachable,
                              exclude=tr.excluded, retry_of=tr.request_id if arid != tr.request_id else None)
        try:
            return await self.decider.decide(req)
        except TimeoutError:
            return None

    def _decided(self, work: asyncio.Future[Any]) -> None:
        """A decision's work ended (answered, failed, or after its client stopped waiting): its slot
        comes back, and whether the broker took it counts for the log's health."""
        self.deciding.give()
        if work.cancelled():
            return
        e = work.exception()
        if isinstance(e, LogUnavailable):
            self.log_health.failed()
            if self.log_health.tripped:
                log.warning("gateway %s: unready: %s", self.config.gateway_id, self.log_health.problem())
        elif e is None and work.result() is not None:
            if self.log_health.tripped:
                log.warning("gateway %s: the broker acknowledges decisions again: ready", self.config.gateway_id)
            self.log_health.acknowledged()

    # --- the hand-off -------------------------------------------------------------------

    async def _serve(self, creq: ClientRequest, body: dict[str, Any], d: RoutingDecision, arid: str,
                     tr: Trace) -> Response:
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
                        tr: Trace) -> Response:
        call = call_of(body, creq.chat, d, arid, self.config.engines)
        step = self._pd
        if d.aggregated:
            step = aggregated.hand_off
        elif d.prefill_group and d.chunk_boundaries:
            step = cpp.hand_off
        resp, pj = await step(self.upstream, call, tr)
        tr.cached_tokens = cached(pj)
        out_headers = {"x-conductor-request-id": tr.request_id, "x-conductor-prefill-instance": d.prefill_instance,
                       "x-conductor-decode-instance": d.decode_instance,
                       "x-conductor-routing-ms": f"{tr.decided_s * 1000.0:.3f}"}
        return await respond(self.upstream, resp, creq, tr, out_headers, self._outcome, self._first_token)

    # --- decision-time releases -----------------------------------------------------------

    def _first_token(self, tr: Trace) -> None:
        """The (last) decision's first token is in: its prefill's in-flight work ends."""
        if tr.decision is not None:
            tr.first_token_release = self._released(tr.decision, "first_token", False)

    def _release_end(self, tr: Trace, failed: bool) -> None:
        """The (last) decision ended (once per attempt)."""
        d = tr.decision
        if d is not None and tr.finished != d.request_id:
            tr.finished = d.request_id
            tr.finished_release = self._released(d, "finished", failed)

    def _released(self, d: RoutingDecision, at: Release, failed: bool) -> ReleaseMark | None:
        try:
            return self.decider.released(d, at, time.monotonic(), failed)
        except Exception:  # the lease ends what a release could not; the client is answered
            log.exception("request %s: releasing its %s failed", d.request_id, at)
            return None

    # --- the outcome --------------------------------------------------------------------------

    def _outcome(self, tr: Trace) -> None:
        self._open.discard(tr.request_id)
        held = tr.held_kv  # no decode took it and no retry was left to pull it (vLLM's hand-off sets it)
        if held is not None and isinstance(self._pd, vllm.VllmHandOff) and self._pd.orphaned(tr):
            log.warning("request %s: no decode took the KV its prefill on %s holds; the next decode call "
                        "that opens pulls it (else vLLM's abort timeout frees it)", tr.request_id, held[0])
        self._release_end(tr, failed=tr.error is not None)  # failed as explain reads the outcome
        o = outcome_of(tr, self.config.gateway_id, self.clock())
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


def _log_send_error(t: asyncio.Future[Any]) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.warning("request outcome not published: %s", t.exception())
