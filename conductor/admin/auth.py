"""Bearer tokens for the admin API: a read-only scope and an admin scope, from settings; and the
console's signed session cookie.

Tokens are compared in constant time (``hmac.compare_digest``) and never logged. The API is
closed by default: with no token configured it refuses to start (:func:`tokens_for`) unless
told ``--insecure``, and then it is open to whoever reaches ``CONDUCTOR_BIND_HOST`` (loopback
by default). With a token, every endpoint except ``/health`` needs a valid one.

The console signs in once (``POST /login`` with a token) and gets a session cookie that holds
no token: its scope, an expiry and a nonce, signed with an HMAC keyed by that scope's token.
So it works on every admin replica with the same tokens, survives a restart, ends after
:data:`SESSION_TTL_S`, and stops working the moment its token is changed. ``/login`` answers 429
to an address after a few failed sign-ins in a window (:class:`LoginAttempts`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict, deque
from typing import Literal

from pydantic import SecretStr

from conductor.errors import ConfigError
from conductor.settings import Settings

Scope = Literal["read", "admin"]
SESSION_TTL_S = 12 * 3600
"""How long a console sign-in lasts."""
NO_TOKEN = ("the admin API has no token configured: set CONDUCTOR_ADMIN_TOKEN (and CONDUCTOR_READ_TOKEN for "
            "read-only users), or pass --insecure to serve it open")


class Tokens:
    def __init__(self, settings: Settings) -> None:
        self._admin = _bytes(settings.admin_token)
        self._read = _bytes(settings.read_token)

    @property
    def required(self) -> bool:
        return self._admin is not None or self._read is not None

    def scope_of(self, authorization: str | None) -> Scope | None:
        """The scope an ``Authorization`` header grants (``admin`` also reads); ``None``: none."""
        if not self.required:
            return "admin"
        if not authorization:
            return None
        kind, _, token = authorization.partition(" ")
        if kind.lower() != "bearer" or not token:
            return None
        given = token.strip().encode()
        # Both compared every time, so timing says nothing about which one matched.
        is_admin = self._admin is not None and hmac.compare_digest(given, self._admin)
        is_read = self._read is not None and hmac.compare_digest(given, self._read)
        if is_admin:
            return "admin"
        if is_read:
            return "read"
        return None

    # --- the console's session cookie ---------------------------------------------------------

    def session(self, scope: Scope, now_s: float) -> str:
        """A cookie value for ``scope``, valid :data:`SESSION_TTL_S` from ``now_s``: ``scope.expiry.nonce.mac``."""
        payload = f"{scope}.{int(now_s) + SESSION_TTL_S}.{secrets.token_urlsafe(12)}"
        return f"{payload}.{self._mac(scope, payload)}"

    def session_scope(self, cookie: str | None, now_s: float) -> Scope | None:
        """The scope a session cookie grants at ``now_s``; ``None``: absent, forged, expired, or its
        scope's token changed since it was signed."""
        if not self.required:
            return "admin"
        if not cookie:
            return None
        payload, _, mac = cookie.rpartition(".")
        scope, _, rest = payload.partition(".")
        expiry, _, _ = rest.partition(".")
        if scope not in ("read", "admin") or not expiry.isdigit():
            return None
        ok: Scope = "admin" if scope == "admin" else "read"
        want = self._mac(ok, payload)
        if want is None or not hmac.compare_digest(mac.encode(), want.encode()) or int(expiry) < now_s:
            return None
        return ok

    def _mac(self, scope: Scope, payload: str) -> str | None:
        token = self._admin if scope == "admin" else self._read
        if token is None:
            return None
        key = hashlib.sha256(b"conductor admin session\0" + token).digest()  # never the token itself
        return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


class LoginAttempts:
    """Failed sign-ins per client address: past ``max_failures`` within ``window_s`` the address is
    refused until its oldest failure leaves the window. At most ``max_clients`` addresses are kept
    (the least recently failed forgotten first), so a flood of addresses costs bounded memory."""

    def __init__(self, max_failures: int = 5, window_s: float = 300.0, max_clients: int = 10_000) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, client: str, now_s: float) -> float | None:
        """Seconds until ``client`` may try again; None: it may now."""
        times = self._failures.get(client)
        if times is None:
            return None
        while times and times[0] <= now_s - self.window_s:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        if self.max_failures and len(times) >= self.max_failures:
            return times[0] + self.window_s - now_s
        return None

    def failed(self, client: str, now_s: float) -> bool:
        """Count a failure; True when it is the one that locks ``client`` out."""
        times = self._failures.pop(client, None) or deque(maxlen=max(self.max_failures, 1))
        times.append(now_s)
        self._failures[client] = times
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)
        return bool(self.max_failures) and len(times) == self.max_failures

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


def granted(scope: Scope | None, needed: Scope) -> bool | None:
    """True: ``scope`` may do what ``needed`` names; False: it may not; None: no scope at all."""
    if scope is None:
        return None
    return scope == "admin" or needed == "read"


def tokens_for(settings: Settings, *, insecure: bool = False) -> Tokens:
    """The settings' tokens; :class:`ConfigError` (naming the settings) when there is none and
    ``insecure`` was not given: the admin API is closed by default."""
    tokens = Tokens(settings)
    if not tokens.required and not insecure:
        raise ConfigError(NO_TOKEN)
    return tokens


def _bytes(secret: SecretStr | None) -> bytes | None:
    if secret is None:
        return None
    return secret.get_secret_value().encode()


__all__ = ["NO_TOKEN", "SESSION_TTL_S", "LoginAttempts", "Scope", "Tokens", "granted", "tokens_for"]
