"""``conductor gateway`` as one call: a :class:`~conductor.gateway.config.GatewayConfig` (built by
:func:`~conductor.gateway.config.gateway_config`) and its listening port → :func:`serve`."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from conductor import web
from conductor.gateway.app import run_gateway
from conductor.gateway.auth import KeyRing
from conductor.gateway.config import GatewayConfig
from conductor.settings import Settings


async def serve(config: GatewayConfig, settings: Settings, *, port: int, stop: asyncio.Event, keys: KeyRing,
                tokenizer_path: str | None = None, metrics_text: Callable[[], str] = lambda: "",
                on_ready: Callable[[dict[str, Any]], None] = lambda _: None, sock: socket.socket | None = None) -> None:
    """Serve the gateway on ``port`` of the settings' bind host (0: a free one) until ``stop``, behind
    ``keys`` (:func:`conductor.gateway.auth.key_ring`). ``on_ready`` gets the ready line (gateway id,
    URL, OpenAI base URL, the API keys' names or ``"auth": "none"``) once it reads its replies.
    ``sock``: a socket bound already (``--workers``: the parent's), instead of binding ``port``."""
    sock = sock if sock is not None else web.bind(settings.bind_host, port)
    url = f"http://{settings.bind_host}:{sock.getsockname()[1]}"
    ready: dict[str, Any] = {"event": "ready", "gateway_id": config.gateway_id, "url": url,
                             "openai_base_url": f"{url}/v1"}
    ready |= {"auth": "none"} if keys.open else {"auth": "api_key", "api_keys": keys.names}
    await run_gateway(settings, config, sock, stop, keys=keys, tokenizer_path=tokenizer_path,
                      metrics_text=metrics_text, on_ready=lambda _: on_ready(ready))
