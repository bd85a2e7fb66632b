"""Bearer tokens for the admin API: a read-only scope and an admin scope, from settings.

Tokens are compared in constant time (``hmac.compare_digest``) and never logged. With
no token configured the API is open (and, like every Conductor server, bound to
``CONDUCTOR_BIND_HOST``, loopback by default); with one or both configured every
endpoint except ``/health`` needs a valid one.
"""

from __future__ import annotations

import hmac
from typing import Literal

from pydantic import SecretStr

from conductor.settings import Settings

Scope = Literal["read", "admin"]


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

    def allows(self, authorization: str | None, needed: Scope) -> bool | None:
        """True: allowed; False: authenticated but not for this; None: not authenticated."""
        scope = self.scope_of(authorization)
        if scope is None:
            return None
        return scope == "admin" or needed == "read"


def _bytes(secret: SecretStr | None) -> bytes | None:
    if secret is None:
        return None
    return secret.get_secret_value().encode()


__all__ = ["Scope", "Tokens"]
