"""One live process per producer id: a short-lived claim in the view's Redis.

A door (a gateway, a picker) writes its decision-time records under its producer id: pending
blocks, in-flight charges and their releases (:mod:`state.shared_log`). It applies its own when
it makes them and skips them when they come back on the stream; entries under its id numbered
below its first are an earlier run's, and it ends that run's charges at start. Two live
processes under one id (one fixed ``--gateway-id`` given to two replicas) would each skip the
other's records and the second to start would end the first one's charges: every router's
count of load and pending blocks would be wrong, and nothing would say so. So a door claims its
id before it writes anything under it:

- **at start** it sets the claim (``ns|claim|<producer>``, :meth:`state.keys.ViewKeys.claim`) to
  a token of its own (host, pid, a random part) with a life of ``ttl_ms``, if nobody holds it;
- **found held**, it watches the claim for ``1.5 x renew_ms``: renewed meanwhile, a live process
  holds the id and start-up fails naming it (:class:`ProducerIdInUse`); not renewed, the holder
  is an earlier run that was killed, and the claim is taken over (a restarted gateway waits a
  second and a half, not the claim's life);
- **held**, it renews the claim every ``renew_ms``; found under another token (a process took the
  id over while this one was stalled or cut off from Redis longer than ``1.5 x renew_ms``),
  :attr:`ProducerClaim.problem` says so and the door stops deciding rather than write beside it;
- **at close** it gives the claim back, so a restart under the same id does not wait.

Redis out of reach at start: the door starts unclaimed (logged) and the renewals take the claim
when Redis answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from typing import Any

from redis.exceptions import RedisError

from schemas.errors import ConfigError

from .keys import ViewKeys
from .scripts import lua

log = logging.getLogger(__name__)

RENEW_MS = 1_000
"""How often a holder renews its claim."""
TTL_MS = 5_000
"""A claim's life without renewal: how long a killed holder's claim outlives it at most."""
_CLAIM_LUA = lua("claim")
_RELEASE_LUA = lua("claim_release")


class ProducerIdInUse(ConfigError):
    """Another live process holds this producer id."""


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class ProducerClaim:
    """The claim on ``producer_id`` in ``namespace`` (see the module): :meth:`take` at start (waits
    ``1.5 x renew_ms`` at most; :class:`ProducerIdInUse`), :meth:`start` the renewals, :meth:`close`
    gives it back."""

    def __init__(self, client: Any, namespace: str, producer_id: str, *, renew_ms: int = RENEW_MS,
                 ttl_ms: int = TTL_MS) -> None:
        if not 0 < renew_ms < ttl_ms:
            raise ValueError(f"a claim's renewal ({renew_ms} ms) must come within its life ({ttl_ms} ms)")
        self.client = client
        self.key = ViewKeys(namespace).claim(producer_id)
        self.producer_id = producer_id
        self.renew_ms, self.ttl_ms = renew_ms, ttl_ms
        self.token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        """What this process writes in the claim: who holds it, for whoever finds it held."""
        self.held = False
        self.problem: str | None = None
        """Why this process must not write under its id now (another one holds it); None when it may."""
        self._claim = client.register_script(_CLAIM_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._task: asyncio.Task[None] | None = None

    async def _call(self, replace: str = "") -> int:
        return int(await self._claim(keys=[self.key], args=[self.token, self.ttl_ms, replace]))

    async def take(self) -> None:
        """Claim the id before anything is written under it (see the module)."""
        try:
            got = await self._call()
            if got:
                self.held = True
                return
            holder, left = await self._holder()
            watch_s = 1.5 * self.renew_ms / 1000
            await asyncio.sleep(watch_s)
            now, left_now = await self._holder()
            if now is None:  # given back or lapsed meanwhile
                got = await self._call()
            elif now == holder and left is not None and left_now is not None \
                    and left_now < left - 1000 * watch_s + self.renew_ms / 2:
                got = await self._call(replace=_text(holder))  # nobody renewed it: a killed earlier run's
                if got == 3:
                    log.warning("producer id %s: the claim of %s was not renewed for %.1fs (an earlier run "
                                "that was killed): taken over", self.producer_id, _text(holder), watch_s)
            if not got:
                raise ProducerIdInUse(
                    f"producer id {self.producer_id!r} is in use by a live process ({_text(now or holder)} renews "
                    "its claim): two processes under one id would skip each other's decision-time records and "
                    "end each other's in-flight charges; give each gateway its own --gateway-id (each picker "
                    "its own --epp-id)")
            self.held = True
        except (RedisError, OSError) as e:
            log.warning("producer id %s: not claimed yet (Redis: %s); the renewals take the claim when Redis "
                        "answers", self.producer_id, e)

    async def _holder(self) -> tuple[bytes | None, int | None]:
        """(the claim's token, its life left in ms), Nones when there is none."""
        holder = await self.client.get(self.key)  # two reads (only when the claim was found held):
        left = await self.client.pttl(self.key)  # the same on a single Redis and a cluster
        return holder, (int(left) if left is not None and int(left) >= 0 else None)

    async def renew(self) -> bool:
        """Renew (or take again) the claim; False, with :attr:`problem` set, when another process holds it."""
        got = await self._call()
        if got:
            if self.problem is not None or (got == 2 and self.held):
                log.warning("producer id %s: claimed again", self.producer_id)
            self.held, self.problem = True, None
            return True
        if self.problem is None:
            holder, _ = await self._holder()
            self.problem = (f"another process ({_text(holder)}) holds the producer id {self.producer_id!r}: this "
                            "one stops deciding rather than write beside it (two processes were given one id, "
                            "or this one was cut off from Redis long enough for a restart to take it over)")
            log.error("producer id %s: %s", self.producer_id, self.problem)
        self.held = False
        return False

    def start(self) -> None:
        """Renew every ``renew_ms`` until :meth:`close`."""
        if self._task is None:
            self._task = asyncio.create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_ms / 1000)
            t0 = time.monotonic()
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:  # the claim lapses after ttl_ms; the next renewal retakes it
                log.debug("producer id %s: claim not renewed (%s, %.0f ms)", self.producer_id, e,
                          1000 * (time.monotonic() - t0))

    async def close(self) -> None:
        """Stop renewing and give the claim back (a restart under the same id takes it at once)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.held:
            self.held = False
            with contextlib.suppress(RedisError, OSError):
                await self._release(keys=[self.key], args=[self.token])

    def abandon(self) -> None:
        """Stop renewing without giving the claim back (what a killed process leaves: tests)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
