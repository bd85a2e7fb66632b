"""``conductor gateway`` as one call: a :class:`GatewayConfig` and its listening port → :func:`serve`.

Also :func:`gateway_config`, which checks the command's options and builds the config.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, get_args

from conductor import web
from conductor.errors import ConfigError
from conductor.frontdoor.protocol import ENGINE_PROTOCOLS, EngineProtocol, parse_engine_map
from conductor.gateway.app import run_gateway
from conductor.gateway.auth import KeyRing
from conductor.gateway.service import ROUTING_MODES, GatewayConfig, RoutingMode
from conductor.settings import Settings
from streams.topics import topics

_PROTOCOLS: tuple[EngineProtocol, ...] = get_args(EngineProtocol)


def default_gateway_id() -> str:
    """``gw-HOST-PID``: unique per process, and a valid topic name."""
    return f"gw-{socket.gethostname()}-{os.getpid()}".replace("_", "-")[:120]


def engine_protocol(text: str) -> EngineProtocol:
    """``text`` as an engine protocol; :class:`ConfigError` naming ``--engine-protocol`` otherwise."""
    for protocol in _PROTOCOLS:
        if text == protocol:
            return protocol
    raise ConfigError(f"--engine-protocol must be one of {', '.join(ENGINE_PROTOCOLS)}")


def routing_mode(text: str) -> RoutingMode:
    """``text`` as a routing mode; :class:`ConfigError` naming ``--routing`` otherwise."""
    for mode in ROUTING_MODES:
        if text == mode:
            return mode
    raise ConfigError(f"--routing must be one of {', '.join(ROUTING_MODES)} (got {text!r})")


def engine_map(items: Sequence[str]) -> dict[str, str]:
    """``--engine NODE_ID=URL`` items as {node id: base URL}; :class:`ConfigError` naming a bad one."""
    try:
        return parse_engine_map(items) if items else {}
    except ValueError as e:
        raise ConfigError(str(e)) from None


def gateway_config(settings: Settings, *, gateway_id: str | None, engines: dict[str, str],
                   protocol: EngineProtocol, base_model: str | None = None, decision_timeout_s: float = 5.0,
                   max_attempts: int = 3, bootstrap_port: int | None = None,
                   routing: RoutingMode = "colocated") -> GatewayConfig:
    """The gateway's configuration; ``gateway_id`` must name a valid reply topic (default: :func:`default_gateway_id`);
    colocated routing needs the view (``redis_url``)."""
    gid = gateway_id or default_gateway_id()
    try:
        topics(settings.topic_config()).replies(gid)
    except ValueError as e:
        raise ConfigError(f"--gateway-id: {e}") from None
    if routing == "colocated" and not settings.redis_url:
        raise ConfigError("--routing colocated reads the view: set redis_url (CONDUCTOR_REDIS_URL), or use --routing log")
    return GatewayConfig(gateway_id=gid, engines=engines, protocol=protocol, base_model=base_model,
                         decision_timeout_s=decision_timeout_s, max_attempts=max_attempts,
                         bootstrap_port=bootstrap_port, routing=routing)


async def serve(config: GatewayConfig, settings: Settings, *, port: int, stop: asyncio.Event, keys: KeyRing,
                tokenizer_path: str | None = None, metrics_text: Callable[[], str] = lambda: "",
                on_ready: Callable[[dict[str, Any]], None] = lambda _: None) -> None:
    """Serve the gateway on ``port`` of the settings' bind host (0: a free one) until ``stop``, behind
    ``keys`` (:func:`conductor.gateway.auth.key_ring`). ``on_ready`` gets the ready line (gateway id,
    URL, OpenAI base URL, the API keys' names or ``"auth": "none"``) once it reads its replies."""
    sock = web.bind(settings.bind_host, port)
    url = f"http://{settings.bind_host}:{sock.getsockname()[1]}"
    ready: dict[str, Any] = {"event": "ready", "gateway_id": config.gateway_id, "url": url,
                             "openai_base_url": f"{url}/v1"}
    ready |= {"auth": "none"} if keys.open else {"auth": "api_key", "api_keys": keys.names}
    await run_gateway(settings, config, sock, stop, keys=keys, tokenizer_path=tokenizer_path,
                      metrics_text=metrics_text, on_ready=lambda _: on_ready(ready))
