"""The gateway's one configuration: :class:`GatewayConfig`, built by :func:`gateway_config` from the
settings (``gateway_*``: timeouts by phase, backpressure bounds) and the command's options."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

import httpx

from conductor.errors import ConfigError
from conductor.frontdoor.decide import ROUTINGS, Routing, parse_routing
from conductor.settings import Settings
from streams.topics import topics

EngineProtocol = Literal["vllm", "sglang"]
ENGINE_PROTOCOLS: tuple[EngineProtocol, ...] = get_args(EngineProtocol)
RoutingMode = Routing
ROUTING_MODES = ROUTINGS
EnginePrompt = Literal["ids", "text"]
ENGINE_PROMPTS: tuple[EnginePrompt, ...] = get_args(EnginePrompt)
C = TypeVar("C", bound=str)


def _setting(name: str) -> int:
    """A setting's default, so a config built without settings bounds as the settings do."""
    value = Settings.model_fields[name].default
    assert isinstance(value, int)
    return value


def _float_setting(name: str) -> float:
    value = Settings.model_fields[name].default
    assert isinstance(value, float)
    return value


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
        Reads are bounded by phase around the calls (``Upstream.phase``), not per socket read."""
        return httpx.Timeout(connect=self.connect_s, pool=self.connect_s, write=self.idle_s or None, read=None)

    def outside_requests(self) -> httpx.Timeout:
        """The calls beside a request's hand-off (``/tokenize``, ``/v1/models``): every read within ``first_byte_s``."""
        return httpx.Timeout(connect=self.connect_s, pool=self.connect_s, write=self.idle_s or None,
                             read=self.first_byte_s or None)


@dataclass(frozen=True)
class GatewayConfig:
    """Everything one gateway process is configured with (the API keys apart: :mod:`conductor.gateway.auth`)."""

    gateway_id: str
    engines: dict[str, str]
    """Node id → base URL, overriding what the node's heartbeats announce (``--engine``); the
    others are found through the view (the decision carries their endpoints)."""
    protocol: EngineProtocol = "vllm"
    """The P/D hand-off between two engines: ``vllm`` (kv_transfer_params) or ``sglang`` (bootstrap room)."""
    base_model: str | None = None
    """The engines' base model; another ``model`` in a request is a LoRA adapter name."""
    decision_timeout_s: float = 5.0
    max_attempts: int = 3
    bootstrap_port: int | None = None
    """SGLang: the prefill instances' bootstrap port (default: the port of their URL)."""
    routing: RoutingMode = "colocated"
    """``colocated``: decide in this process (:class:`~conductor.frontdoor.decide.Colocated`) and
    write the request and decision to the log before calling the engines; ``log``: send the
    routing request onto ``requests`` and wait for a router's decision on the reply topic."""
    engine_prompt: EnginePrompt = "ids"
    """How a text completion's prompt reaches a vLLM engine: ``ids``, the token ids the gateway
    tokenized it to for the decision (the engine's own, :mod:`conductor.frontdoor.tokenizer`), so the
    engine does not tokenize it again; ``text``, the client's text as it came
    (:func:`~conductor.gateway.handoff.engine_body` says which requests keep their text either way)."""
    timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    """The calls to the engines, by phase (settings ``gateway_*_timeout_s``)."""
    max_in_flight: int = field(default_factory=lambda: _setting("gateway_max_in_flight"))
    """Client requests served at once (settings ``gateway_max_in_flight``; 0 = no bound)."""
    max_deciding: int = field(default_factory=lambda: _setting("gateway_max_deciding"))
    """Requests decided at once (settings ``gateway_max_deciding``; 0 = no bound)."""
    engine_max_in_flight: int = field(default_factory=lambda: _setting("gateway_engine_max_in_flight"))
    """Requests open on one engine at once (settings ``gateway_engine_max_in_flight``; 0 = no bound)."""
    max_body_bytes: int = field(default_factory=lambda: _setting("gateway_max_body_bytes"))
    """The longest request body read; longer is 413 (settings ``gateway_max_body_bytes``)."""
    drain_s: float = field(default_factory=lambda: _float_setting("gateway_drain_s"))
    """On stop, how long the requests in flight may finish before their calls are cut (settings
    ``gateway_drain_s``, ``--drain-s``)."""
    log_failures_to_trip: int = field(default_factory=lambda: _setting("gateway_log_failures_to_trip"))
    """Unacknowledged decisions in a row that make the gateway unready (settings ``gateway_log_failures_to_trip``)."""

    @property
    def sends_prompt_ids(self) -> bool:
        """Whether text completions reach the engines as their token ids (``engine_prompt`` ids, to vLLM)."""
        return self.engine_prompt == "ids" and self.protocol == "vllm"

    @staticmethod
    def max_body_bytes_default() -> int:
        return _setting("gateway_max_body_bytes")


def default_gateway_id(started_s: float | None = None) -> str:
    """``gw-HOST-PID-INCARNATION``: unique per process, and a valid topic name. The incarnation is the
    start time (seconds, base 36, its last 6 digits: they repeat after ~69 years): a container's
    gateway is PID 1 under a stable host name at every restart, and a restarted producer must not
    reuse its predecessor's id (its sequence numbers start again at 1)."""
    at = int(time.time() if started_s is None else started_s)
    return f"gw-{socket.gethostname()}-{os.getpid()}-{_base36(at)[-6:]}".replace("_", "-")[:120]


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def _one_of(option: str, text: str, choices: tuple[C, ...]) -> C:
    """``text`` as one of ``choices``; :class:`ConfigError` naming ``option`` otherwise."""
    for choice in choices:
        if text == choice:
            return choice
    raise ConfigError(f"{option} must be one of {', '.join(choices)} (got {text!r})")


def engine_protocol(text: str) -> EngineProtocol:
    """``text`` as an engine protocol; :class:`ConfigError` naming ``--engine-protocol`` otherwise."""
    return _one_of("--engine-protocol", text, ENGINE_PROTOCOLS)


def engine_prompt(text: str) -> EnginePrompt:
    """``text`` as an engine prompt form; :class:`ConfigError` naming ``--engine-prompt`` otherwise."""
    return _one_of("--engine-prompt", text, ENGINE_PROMPTS)


def routing_mode(text: str) -> RoutingMode:
    """``text`` as a routing mode; :class:`ConfigError` naming ``--routing`` otherwise."""
    mode = parse_routing(text)
    if mode is None:
        raise ConfigError(f"--routing must be one of {', '.join(ROUTING_MODES)} (got {text!r})")
    return mode


def check_gateway_id(settings: Settings, gateway_id: str) -> None:
    """:class:`ConfigError` naming ``--gateway-id`` when ``gateway_id`` cannot name a reply topic."""
    try:
        topics(settings.topic_config()).replies(gateway_id)
    except ValueError as e:
        raise ConfigError(f"--gateway-id: {e}") from None


def gateway_config(settings: Settings, *, gateway_id: str | None, engines: dict[str, str],
                   protocol: EngineProtocol, base_model: str | None = None, decision_timeout_s: float = 5.0,
                   max_attempts: int = 3, bootstrap_port: int | None = None,
                   routing: RoutingMode = "colocated", drain_s: float | None = None,
                   prompt_form: EnginePrompt = "ids") -> GatewayConfig:
    """The gateway's configuration: the settings' ``gateway_*`` timeouts and bounds, the command's
    options over them. ``gateway_id`` must name a valid reply topic (default: :func:`default_gateway_id`);
    colocated routing needs the view (``redis_url``)."""
    gid = gateway_id or default_gateway_id()
    check_gateway_id(settings, gid)
    if routing == "colocated" and not settings.redis_url:
        raise ConfigError("--routing colocated reads the view: set redis_url (CONDUCTOR_REDIS_URL), or use --routing log")
    return GatewayConfig(gateway_id=gid, engines=engines, protocol=protocol, base_model=base_model,
                         decision_timeout_s=decision_timeout_s, max_attempts=max_attempts,
                         bootstrap_port=bootstrap_port, routing=routing, engine_prompt=prompt_form,
                         timeouts=UpstreamTimeouts.of(settings),
                         max_in_flight=settings.gateway_max_in_flight, max_deciding=settings.gateway_max_deciding,
                         engine_max_in_flight=settings.gateway_engine_max_in_flight,
                         max_body_bytes=settings.gateway_max_body_bytes,
                         drain_s=settings.gateway_drain_s if drain_s is None else drain_s,
                         log_failures_to_trip=settings.gateway_log_failures_to_trip)
