"""The gateway's API keys: who sends a request, how much it may send, how loose an SLO it may ask for.

Clients authenticate as with OpenAI: ``Authorization: Bearer <key>`` on every ``/v1/`` route
(``/health`` and ``/metrics`` stay open for probes and scrapers). Keys come from the settings:
``gateway_api_key`` (one key, named ``default``) and ``gateway_api_keys_file`` (a JSON file,
``{"keys": [{"name": ..., "key": ..., limits...}]}``, each key with its own limits). The
gateway is closed by default: with no key configured it refuses to start unless told
``--insecure``, and then every request is ``anonymous`` under the default bounds.

Per key:

- ``max_in_flight``: requests it may have open at once (a stream counts until it ends);
- ``rate_per_s`` and ``burst``: a token bucket of requests;
- ``max_ttft_slo_ms``, ``max_tbt_slo_ms``: the loosest SLO its ``x-conductor-*-slo-ms`` headers
  may ask for (default: the router's ``ttft_slo_s`` / ``tbt_slo_ms``), so no client can switch
  early rejection off with a huge SLO; a header beyond it is clamped, and the routing request
  on the log carries the clamped value;
- ``max_priority``: the highest ``x-conductor-priority`` it may ask for (default 0: a client may
  lower its own priority, only the operator raises it).

An unknown or missing key is answered 401, a key over its limits 429 with ``Retry-After``,
both in OpenAI's error shape. Keys are kept as SHA-256 digests and compared in constant time
(every one, every time); a key is never logged, only its name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from conductor.errors import ConfigError
from conductor.frontdoor.protocol import SloBounds, default_bounds, error_body
from conductor.settings import Settings

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
"""The caller of a gateway started ``--insecure`` with no key configured."""
NO_KEY = ("the gateway has no API key configured: set CONDUCTOR_GATEWAY_API_KEY (one key) or "
          "CONDUCTOR_GATEWAY_API_KEYS_FILE (keys with limits), or pass --insecure to serve without authentication")
GUARDED_PREFIX = "/v1/"


class ApiKey(BaseModel):
    """One client's key and what it may do (an entry of ``gateway_api_keys_file``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._:-]{1,64}$", description="what logs and metrics call the key")
    key: SecretStr = Field(description="the bearer secret, 16 to 512 characters")
    max_in_flight: int | None = Field(default=None, ge=1, description="requests open at once; unset: no limit")
    rate_per_s: float | None = Field(default=None, gt=0, description="requests per second (a token bucket)")
    burst: int | None = Field(default=None, ge=1, description="the bucket's size [default: rate_per_s, at least 1]")
    max_ttft_slo_ms: float | None = Field(default=None, gt=0, description="loosest TTFT SLO [default: ttft_slo_s]")
    max_tbt_slo_ms: float | None = Field(default=None, gt=0, description="loosest TBT SLO [default: tbt_slo_ms]")
    max_priority: int = Field(default=0, ge=-100, le=100, description="highest priority it may ask for")

    @field_validator("key")
    @classmethod
    def _long_enough(cls, v: SecretStr) -> SecretStr:
        if not 16 <= len(v.get_secret_value()) <= 512:
            raise ValueError("a key must be 16 to 512 characters")
        return v

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> ApiKey:
        if self.burst is not None and self.rate_per_s is None:
            raise ValueError("burst needs rate_per_s")
        return self


class KeysFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: list[ApiKey] = Field(min_length=1)


@dataclass(eq=False)
class Caller:
    """One key's live state: its bounds, limits, requests open, and its token bucket."""

    name: str
    bounds: SloBounds
    max_in_flight: int | None = None
    rate_per_s: float | None = None
    burst: float = 1.0
    in_flight: int = 0
    tokens: float = 0.0
    stamp: float = field(default=-math.inf)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a known caller is turned away now, and when to come back (``Retry-After``, s)."""

    code: str
    message: str
    retry_after_s: int


class KeyRing:
    """The configured keys (or the anonymous caller) and their limits; one per gateway process."""

    def __init__(self, keys: Sequence[ApiKey], defaults: SloBounds, *, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self._clock = clock
        self._digests: list[tuple[bytes, Caller]] = []
        for k in keys:
            bounds = SloBounds(
                max_ttft_s=k.max_ttft_slo_ms / 1000.0 if k.max_ttft_slo_ms is not None else defaults.max_ttft_s,
                max_tbt_ms=k.max_tbt_slo_ms if k.max_tbt_slo_ms is not None else defaults.max_tbt_ms,
                max_priority=k.max_priority,
            )
            burst = float(k.burst if k.burst is not None else max(1.0, k.rate_per_s or 1.0))
            caller = Caller(k.name, bounds, k.max_in_flight, k.rate_per_s, burst, tokens=burst)
            self._digests.append((_digest(k.key.get_secret_value()), caller))
        self._anonymous = None if keys else Caller(ANONYMOUS, defaults)

    @property
    def open(self) -> bool:
        """No key configured (started ``--insecure``): every request is the anonymous caller."""
        return self._anonymous is not None

    @property
    def names(self) -> list[str]:
        return [c.name for _, c in self._digests]

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller an ``Authorization`` header names; ``None``: missing, malformed or unknown."""
        if self._anonymous is not None:
            return self._anonymous
        if not authorization:
            return None
        kind, _, token = authorization.partition(" ")
        token = token.strip()
        if kind.lower() != "bearer" or not token:
            return None
        given = _digest(token)
        found = None
        for digest, caller in self._digests:  # every digest, every time: the time says nothing of which
            if hmac.compare_digest(given, digest):
                found = caller
        return found

    def admit(self, caller: Caller) -> Refusal | None:
        """Take one request for ``caller`` (``None``), or say why not; admitted requests end with :meth:`release`."""
        if caller.max_in_flight is not None and caller.in_flight >= caller.max_in_flight:
            return Refusal("too_many_requests_in_flight",
                           f"key {caller.name!r} has {caller.in_flight} requests in flight, its limit", 1)
        if caller.rate_per_s is not None:
            now = self._clock()
            caller.tokens = min(caller.burst, caller.tokens + (now - caller.stamp) * caller.rate_per_s)
            caller.stamp = now
            if caller.tokens < 1.0:
                wait = (1.0 - caller.tokens) / caller.rate_per_s
                return Refusal("rate_limit_exceeded",
                               f"key {caller.name!r} is over its rate limit of {caller.rate_per_s:g} requests/s",
                               max(1, math.ceil(wait)))
            caller.tokens -= 1.0
        caller.in_flight += 1
        return None

    @staticmethod
    def release(caller: Caller) -> None:
        caller.in_flight -= 1


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def key_ring(settings: Settings, *, insecure: bool = False) -> KeyRing:
    """The keys the settings configure; :class:`ConfigError` naming the setting when one is bad,
    or when there is none and ``insecure`` was not given (the gateway is closed by default)."""
    keys: list[ApiKey] = []
    if settings.gateway_api_key is not None:
        keys.append(ApiKey(name="default", key=settings.gateway_api_key))
    if settings.gateway_api_keys_file is not None:
        keys += _read_keys_file(settings)
    names = [k.name for k in keys]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"gateway_api_keys_file: key name(s) {', '.join(twice)} given twice "
                          "(gateway_api_key is named default)")
    if len({k.key.get_secret_value() for k in keys}) < len(keys):
        raise ConfigError("gateway_api_keys_file: two entries have the same key")
    if not keys and not insecure:
        raise ConfigError(NO_KEY)
    defaults = default_bounds(settings)
    return KeyRing(keys, defaults)


def _read_keys_file(settings: Settings) -> list[ApiKey]:
    path = settings.gateway_api_keys_file
    where = f"gateway_api_keys_file (CONDUCTOR_GATEWAY_API_KEYS_FILE, {path})"
    try:
        raw: Any = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: not a readable JSON file: {e}") from None
    try:
        return KeysFile.model_validate(raw).keys
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.get("loc", ())).lstrip(".")
            lines.append(f"{loc or 'the file'}: {err.get('msg')}")  # never the input: it may be a key
        raise ConfigError(f"{where}: " + "; ".join(lines)) from None


class ApiKeyGuard:
    """ASGI middleware in front of the gateway's app: every ``/v1/`` request names a known key and
    is within its limits, else it is answered here (401, 429); the caller goes into the request's
    state (``request.state.caller``: its SLO bounds), and it counts as in flight until the app has
    sent the whole answer (a stream to its end, or the client gone)."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys
        self.refused = metrics.get_meter(__name__).create_counter(
            "conductor_gateway_refused", description="requests refused before routing, by key and reason")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        caller = self.keys.identify(Headers(scope=scope).get("authorization"))
        if caller is None:
            self.refused.add(1, {"key": "unknown", "reason": "invalid_api_key"})
            client = scope.get("client")
            # Counted by the metric; at INFO, a flood of bad keys would flood the log too.
            log.debug("refused a request from %s: no valid API key", client[0] if client else "?")
            await JSONResponse(error_body("invalid or missing API key: send Authorization: Bearer <key>",
                                          "invalid_api_key"),
                               status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        refusal = self.keys.admit(caller)
        if refusal is not None:
            self.refused.add(1, {"key": caller.name, "reason": refusal.code})
            await JSONResponse(error_body(refusal.message, refusal.code, kind="requests"), status_code=429,
                               headers={"Retry-After": str(refusal.retry_after_s)})(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        try:
            await self.app(scope, receive, send)
        finally:
            self.keys.release(caller)


__all__ = ["ANONYMOUS", "ApiKey", "ApiKeyGuard", "Caller", "KeyRing", "KeysFile", "Refusal", "key_ring"]
