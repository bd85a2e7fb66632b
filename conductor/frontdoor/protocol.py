"""What both front doors read and answer alike: OpenAI bodies and SLO headers, rejections as HTTP,
the routing request built from a parsed request and its prompt.

No I/O here: everything is a function of its arguments, so it is tested without a server.
"""

from __future__ import annotations

import dataclasses
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError

from conductor.errors import ConfigError
from schemas import MmItem, RoutingDecision, RoutingRequest
from schemas.records import MAX_EXTRA_KEYS, MAX_NAME

TTFT_HEADER = "x-conductor-ttft-slo-ms"
TBT_HEADER = "x-conductor-tbt-slo-ms"
PRIORITY_HEADER = "x-conductor-priority"
SESSION_HEADER = "x-conductor-session"
"""The conversation a request belongs to (else the body's OpenAI ``user`` field): the router keeps
a session on the instance that served it last unless leaving pays (``RoutingRequest.session``)."""
DEFAULT_EXPECTED_OUTPUT = 256
"""Output tokens the router plans for when the client names no max_tokens."""
MAX_TOKENS_CAP = 1_048_576

# Rejection reason → (HTTP status, Retry-After seconds).
# 429: the cluster is up but cannot serve *this* request within its SLOs right now
#      (load-dependent: the same request later, or with a looser SLO, may pass).
# 503: the service cannot place anything (no live instance, the view unreachable, no
#      decision in time): not about this client's rate, retry after the outage.
# 400: the request itself is unplaceable as given.
REJECTION_STATUS: dict[str, tuple[int, int]] = {
    "ttft_slo": (429, 1),
    "tbt_slo": (429, 1),
    "overloaded": (429, 2),
    "no_live_instance": (503, 5),
    "view_unavailable": (503, 5),
    "view_rebuilding": (503, 2),
    "decision_timeout": (503, 2),
    "invalid_request": (400, 0),
}


class BadRequest(ValueError):
    """A client error; ``param`` names the body field or header at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """What the gateway needs from one OpenAI request body (the body itself is forwarded as is)."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    cache_salt: str | None
    lora_name: str | None
    prompt_fields: Mapping[str, Any] = field(default_factory=dict)
    """The body's other fields that shape the prompt the engine prefills (:data:`CHAT_PROMPT_FIELDS`,
    :data:`COMPLETION_PROMPT_FIELDS`), as the client sent them: the gateway tokenizes with them."""
    session: str | None = None
    """The request's session key: the body's ``user`` (:func:`with_session` puts the
    :data:`SESSION_HEADER` over it)."""


@dataclass(frozen=True)
class Prompt:
    """The token ids an engine will prefill, and what else goes into its block keys."""

    token_ids: list[int]
    mm_items: tuple[tuple[str, int, int], ...] = ()
    """(identifier, offset, length) of each multimodal item, in prompt order (from vLLM's render)."""
    unhashed_media: int = 0
    """Multimodal parts tokenized without their hash (``/tokenize``): routed on the text before the first."""


CHAT_PROMPT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "tools": list, "tool_choice": (str, dict), "documents": list, "reasoning_effort": str,
    "chat_template": str, "chat_template_kwargs": dict, "add_generation_prompt": bool,
    "continue_final_message": bool, "add_special_tokens": bool, "mm_processor_kwargs": dict,
    "media_io_kwargs": dict, "response_format": dict, "truncate_prompt_tokens": int, "truncation_side": str,
}
"""Fields of vLLM's (0.32) chat request besides ``model`` and ``messages`` that change the token ids
it prefills: the template's inputs (tools, documents, its kwargs, the generation prompt, a reasoning
effort that turns thinking on), the template itself, special tokens, multimodal processing, truncation."""
COMPLETION_PROMPT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "add_special_tokens": bool, "truncate_prompt_tokens": int, "truncation_side": str,
}


ENGINE_CONTROL_FIELDS = frozenset({
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "priority", "request_id",  # vLLM
    "rid", "data_parallel_rank", "disagg_prefill_dp_rank",  # SGLang (and its bootstrap_* fields)
})
"""Body fields an engine takes as orders from whoever calls it, not as part of the request: where its
KV connector pulls or leaves blocks (``kv_transfer_params``, ``ec_transfer_params``, SGLang's
``bootstrap_*``), the extensions' arguments that reach the connector beside them (``vllm_xargs``), its
scheduling priority, the id it files the request under, the data-parallel rank. Only Conductor sets
them; ``cache_salt`` (the client's own isolation, in the block keys) and ``session_id`` are not orders."""


def engine_control_field(body: Mapping[str, Any]) -> str | None:
    """The first field of ``body`` that only Conductor may send an engine (:data:`ENGINE_CONTROL_FIELDS`,
    ``bootstrap_*``), or None.

    Refused (400 naming it) rather than dropped, on both doors alike: the picker forwards the client's
    body byte for byte (rewriting it costs a re-encode of every prompt), and a client whose field would be
    dropped silently learns nothing; priority is asked for with ``x-conductor-priority``."""
    for name in body:
        if name in ENGINE_CONTROL_FIELDS or name.startswith("bootstrap_"):
            return name
    return None


def prompt_fields(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prompt-shaping fields of ``body`` (None = absent), type-checked; :class:`BadRequest` naming a bad one."""
    out: dict[str, Any] = {}
    for name, kind in (CHAT_PROMPT_FIELDS if chat else COMPLETION_PROMPT_FIELDS).items():
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise BadRequest(name, f"{name} has the wrong type: {type(v).__name__}")
        out[name] = v
    if out.get("add_generation_prompt") and out.get("continue_final_message"):
        raise BadRequest("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                         "be true")
    if out.get("truncate_prompt_tokens", -1) < -1:
        raise BadRequest("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's length) or >= 0")
    if out.get("truncation_side", "left") not in ("left", "right"):
        raise BadRequest("truncation_side", "truncation_side must be left or right")
    if any(not isinstance(t, dict) for t in out.get("tools", ())):
        raise BadRequest("tools", "each tool is an object")
    return out


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None
    tbt_ms: float | None
    priority: int


@dataclass(frozen=True, slots=True)
class SloBounds:
    """The loosest SLOs and the highest priority a client may ask for (its API key's bounds):
    a header beyond a bound is clamped to it; ``None``: no bound. A request with no SLO header
    gets the router's defaults, which are the operator's too."""

    max_ttft_s: float | None = None
    max_tbt_ms: float | None = None
    max_priority: int = 0


class _SloDefaults(Protocol):
    ttft_slo_s: float
    tbt_slo_ms: float


def default_bounds(settings: _SloDefaults) -> SloBounds:
    """The bounds of a caller nobody vouched for: the router's default SLOs (``ttft_slo_s``,
    ``tbt_slo_ms``: no header loosens them), priority at most 0 (a client may only lower its own)."""
    return SloBounds(max_ttft_s=settings.ttft_slo_s, max_tbt_ms=settings.tbt_slo_ms, max_priority=0)


def bound_slo(slo: Slo, bounds: SloBounds) -> Slo:
    """``slo`` with each value clamped to ``bounds`` (what goes into the routing request, so the
    log and ``explain`` see what was decided on)."""
    def clamp(v: float | None, hi: float | None) -> float | None:
        return v if v is None or hi is None else min(v, hi)

    return Slo(clamp(slo.ttft_s, bounds.max_ttft_s), clamp(slo.tbt_ms, bounds.max_tbt_ms),
               min(slo.priority, bounds.max_priority))


TRUSTED_BOUNDS_HEADER = "x-conductor-trusted-bounds"
"""Set by the proxy in front of the picker for a caller it authenticated: the bounds that caller's SLO
headers are clamped to instead of the defaults, as ``ttft_ms=60000, tbt_ms=200, priority=50`` (any of
them; one left out keeps the default's). Read only when the picker is told to trust it
(``epp_trust_bounds_header``), where the proxy removes a client's own copy before ext_proc."""


def trusted_bounds(value: str | None, defaults: SloBounds) -> SloBounds:
    """``defaults`` widened by a :data:`TRUSTED_BOUNDS_HEADER` value (None: ``defaults``); :class:`BadRequest`
    naming the header when it does not parse."""
    if value is None:
        return defaults
    ttft_s, tbt_ms, priority = defaults.max_ttft_s, defaults.max_tbt_ms, defaults.max_priority
    for item in value.split(","):
        name, _, raw = item.strip().partition("=")
        try:
            x = float(raw)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or (name != "priority" and x <= 0):
            raise BadRequest(TRUSTED_BOUNDS_HEADER, f"header {TRUSTED_BOUNDS_HEADER}: {item.strip()[:64]!r} is not "
                             "ttft_ms=N, tbt_ms=N or priority=N")
        if name == "ttft_ms":
            ttft_s = x / 1000.0
        elif name == "tbt_ms":
            tbt_ms = x
        elif name == "priority" and x == int(x) and -100 <= x <= 100:
            priority = int(x)
        else:
            raise BadRequest(TRUSTED_BOUNDS_HEADER, f"header {TRUSTED_BOUNDS_HEADER}: {item.strip()[:64]!r} is not "
                             "ttft_ms=N, tbt_ms=N or priority=N (an integer in [-100, 100])")
    return SloBounds(max_ttft_s=ttft_s, max_tbt_ms=tbt_ms, max_priority=priority)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(name, f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def parse_body(body: Any, *, chat: bool, base_model: str | None = None) -> ClientRequest:
    """Validate the fields the gateway acts on; raise :class:`BadRequest` naming the first bad one.

    ``base_model``: the engines' base model; any other ``model`` is taken as a LoRA adapter
    name (as vLLM serves adapters), which enters the block keys.
    """
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    control = engine_control_field(body)
    if control is not None:
        raise BadRequest(control, f"{control[:64]} is an engine control field: only Conductor sets it "
                         f"(ask for a priority with the {PRIORITY_HEADER} header)")
    model = body.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= MAX_NAME:
        raise BadRequest("model", "model is required: a string of 1-256 characters")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("stream", "stream must be a boolean")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("stream_options", "stream_options must be an object")
    _int(body, "n", 1, 1)  # only n=1 is served: one prefill, one decode
    mt = _int(body, "max_completion_tokens", 1, MAX_TOKENS_CAP) if chat else None
    mt = _int(body, "max_tokens", 1, MAX_TOKENS_CAP) or mt
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_NAME):
        raise BadRequest("cache_salt", "cache_salt must be a string of 1-256 characters")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_NAME):
        raise BadRequest("user", "user must be a string of at most 256 characters")
    text = ids = msgs = None
    if chat:
        m = body.get("messages")
        if not isinstance(m, list) or not m:
            raise BadRequest("messages", "messages is required: a non-empty list of {role, content} objects")
        for i, x in enumerate(m):
            if not isinstance(x, dict) or not isinstance(x.get("role"), str):
                raise BadRequest(f"messages[{i}]", "each message is an object with a string role")
        msgs = tuple(m)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            text = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                               for t in p):
            ids = tuple(p)
        else:
            raise BadRequest("prompt", "prompt is required: a string or a non-empty list of token ids "
                             "(one prompt per request)")
    return ClientRequest(
        chat=chat, model=model, stream=bool(stream), include_usage=bool((so or {}).get("include_usage")),
        max_tokens=mt, prompt_text=text, prompt_ids=ids, messages=msgs, cache_salt=salt,
        lora_name=model if base_model is not None and model != base_model else None,
        prompt_fields=prompt_fields(body, chat), session=user or None,
    )


def with_session(creq: ClientRequest, headers: Mapping[str, str]) -> ClientRequest:
    """``creq`` with its session from the :data:`SESSION_HEADER` when the client sent one
    (:class:`BadRequest` naming the header when it is longer than 256 characters)."""
    key = headers.get(SESSION_HEADER)
    if not key:
        return creq
    if len(key) > MAX_NAME:
        raise BadRequest(SESSION_HEADER, f"header {SESSION_HEADER} must be at most 256 characters")
    return dataclasses.replace(creq, session=key)


def parse_slo(headers: Mapping[str, str], bounds: SloBounds | None = None) -> Slo:
    """The client's SLOs and priority from ``x-conductor-*`` headers (absent = the router's defaults),
    clamped to ``bounds`` (its API key's) when given."""

    def num(name: str) -> float | None:
        v = headers.get(name)
        if v is None:
            return None
        try:
            x = float(v)
        except ValueError:
            raise BadRequest(name, f"header {name} must be a number of milliseconds, got {v!r}") from None
        if not math.isfinite(x) or x <= 0:
            raise BadRequest(name, f"header {name} must be > 0, got {v!r}")
        return x

    ttft = num(TTFT_HEADER)
    tbt = num(TBT_HEADER)
    pr = headers.get(PRIORITY_HEADER)
    try:
        priority = int(pr) if pr is not None else 0
    except ValueError:
        raise BadRequest(PRIORITY_HEADER, f"header {PRIORITY_HEADER} must be an integer, got {pr!r}") from None
    if not -100 <= priority <= 100:
        raise BadRequest(PRIORITY_HEADER, f"header {PRIORITY_HEADER} must be in [-100, 100]")
    slo = Slo(ttft / 1000.0 if ttft is not None else None, tbt, priority)
    return slo if bounds is None else bound_slo(slo, bounds)


def error_body(message: str, code: str, *, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An OpenAI-style error object (what the ``openai`` client puts in ``APIError.body``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def rejection_response(reason: str, message: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) telling a client that Conductor rejected its request, and why."""
    status, retry = REJECTION_STATUS.get(reason, (503, 5))
    kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(status, "service_unavailable")
    headers = {"Retry-After": str(retry)} if retry else {}
    return status, error_body(f"rejected by Conductor ({reason}): {message}", reason, kind=kind), headers


def parse_engine_map(items: Sequence[str]) -> dict[str, str]:
    """``ID=URL`` items → {node id: base URL}; raise ValueError naming the bad item."""
    out: dict[str, str] = {}
    for it in items:
        node, sep, url = it.partition("=")
        if not sep or not node or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine {it!r}: expected NODE_ID=http://HOST:PORT")
        if node in out:
            raise ValueError(f"--engine {node}: named twice")
        out[node] = url.rstrip("/")
    return out


def engine_map(items: Sequence[str]) -> dict[str, str]:
    """``--engine NODE_ID=URL`` items as {node id: base URL}; :class:`ConfigError` naming a bad one."""
    try:
        return parse_engine_map(items) if items else {}
    except ValueError as e:
        raise ConfigError(str(e)) from None


_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")
"""A client's ``x-request-id`` a front door keeps in its routing request id (as the log's key)."""


def request_id(door_id: str, client_id: str | None, in_use: Callable[[str], bool] = lambda _: False) -> str:
    """``<door id>-<the client's x-request-id>`` when that is a usable id not ``in_use``, else
    ``<door id>-<16 random hex digits>``."""
    if client_id and _CLIENT_ID.fullmatch(client_id):
        rid = f"{door_id}-{client_id}"
        if not in_use(rid):
            return rid
    return f"{door_id}-{uuid.uuid4().hex[:16]}"


def routing_request(request_id: str, creq: ClientRequest, slo: Slo, prompt: Prompt, *, base_model: str | None,
                    reachable: Sequence[str], exclude: Sequence[str] = (), retry_of: str | None = None,
                    ) -> RoutingRequest:
    """What a front door asks the routers for one parsed request and its prompt (the decider sets
    ``reply_to`` or ``decided_by``); :class:`BadRequest` on ``prompt`` when the schema refuses it."""
    # Items past the schema's bounds are left out: the blocks from the first of them on match nothing.
    mm = [MmItem(identifier=i, offset=o, length=n) for i, o, n in prompt.mm_items[:MAX_EXTRA_KEYS]
          if 0 < len(i) <= MAX_NAME]
    try:
        return RoutingRequest(
            request_id=request_id, model=creq.model if creq.lora_name is None else (base_model or creq.model),
            token_ids=prompt.token_ids, prompt_tokens=len(prompt.token_ids), mm_items=mm,
            expected_output_tokens=creq.max_tokens or DEFAULT_EXPECTED_OUTPUT,
            ttft_slo_s=slo.ttft_s, tbt_slo_ms=slo.tbt_ms, priority=slo.priority, lora_name=creq.lora_name,
            cache_salt=creq.cache_salt, exclude=list(exclude[:64]), retry_of=retry_of, reachable=list(reachable),
            session=creq.session,
        )
    except ValidationError as e:
        first = e.errors()[0]
        raise BadRequest("prompt", f"{first.get('loc')}: {first.get('msg')}") from None


def outcome_decision_fields(d: RoutingDecision | None) -> dict[str, Any]:
    """What a ``request_outcome`` repeats of the request's decision (each None without one): the
    gateway's outcomes and the picker's for a decision it did not deliver."""
    return {
        "prefill_instance": d.prefill_instance if d else None, "decode_instance": d.decode_instance if d else None,
        "predicted_ttft_s": d.predicted_ttft_s if d else None, "predicted_tbt_ms": d.predicted_tbt_ms if d else None,
        "reused_tokens": d.reused_tokens if d else None, "mode": d.mode if d else None,
        "control_offset": d.control_offset if d else None,
    }


class ReleaseMark(NamedTuple):
    """A release as the shared records got it (``Decider.released``): what the request's outcome says of it."""

    view_ms: int
    """When, on the view's clock (``first_token_view_ms`` / ``finished_view_ms``)."""
    producer: str | None = None
    """Who shared it (``release_producer``); None: not shared."""
    event: int | None = None
    """Its number under ``producer`` (``first_token_event`` / ``finished_event``)."""


def outcome_release_fields(first: ReleaseMark | None, finished: ReleaseMark | None) -> dict[str, Any]:
    """What a ``request_outcome`` says of its decision's releases: their times on the view's clock,
    who shared them and their numbers (each None when not released or not shared)."""
    by = next((m.producer for m in (finished, first) if m is not None and m.producer is not None), None)
    return {
        "first_token_view_ms": first.view_ms if first else None, "first_token_event": first.event if first else None,
        "finished_view_ms": finished.view_ms if finished else None,
        "finished_event": finished.event if finished else None, "release_producer": by,
    }
