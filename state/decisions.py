"""Where each decision sits on the log: request id → its ``dispatch`` record and its request.

The router records one entry per decision once the broker has acknowledged the batch (in
the background: routing never waits on it); ``conductor explain`` and the admin API look a
request id up here instead of scanning ``dispatch``, and read the request's own record
instead of scanning ``requests``. A missing entry (expired, never written, another
namespace) is not an error: explain falls back to a bounded scan.

Redis layout: one string per decision, ``{ns}|2|d|<request id>`` → ``"p offset ts rp roffset"``
(dispatch partition and offset, the decision's ms, the request's partition and offset), with
the index's TTL; in the namespace's slot like every view key. 72 bytes an entry in Valkey
for a 2-character request id, plus the id's length (``MEMORY USAGE``, measured in
``tests/integration/test_explain_live.py``): about 300 MB an hour at 1,000 decisions a second, so
the TTL is an hour by default (``decision_index_ttl_s``), the index may live in a Redis of its own
(``decision_index_url``), and the writer watches that Redis's used memory (``INFO memory``, at most
once a minute): past ``memory_alert_bytes`` it logs a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from schemas.errors import ViewStoreError

from .keys import ViewKeys

log = logging.getLogger(__name__)

MEMORY_CHECK_S = 60.0


@dataclass(frozen=True, slots=True)
class DecisionPosition:
    """One decision's place on the log."""

    request_id: str
    partition: int
    """On ``dispatch``."""
    offset: int
    ts_ms: int
    """The decision record's envelope time."""
    request_partition: int
    """The routed request's record on ``requests``."""
    request_offset: int

    def text(self) -> bytes:
        return b"%d %d %d %d %d" % (self.partition, self.offset, self.ts_ms, self.request_partition,
                                    self.request_offset)

    @classmethod
    def parse(cls, request_id: str, raw: bytes) -> DecisionPosition | None:
        """The entry ``raw`` holds (None if it is not one: written by something else)."""
        try:
            p, off, ts, rp, roff = (int(x) for x in raw.split())
        except ValueError:
            return None
        return cls(request_id, p, off, ts, rp, roff)


class DecisionIndex(Protocol):
    async def record(self, positions: Sequence[DecisionPosition]) -> None: ...

    async def lookup(self, request_ids: Sequence[str]) -> dict[str, DecisionPosition]: ...

    async def close(self) -> None: ...


class RedisDecisionIndex:
    """The index in the view's Redis namespace, each entry kept ``ttl_s``; ``memory_alert_bytes``
    (0: none): the used memory of its Redis past which :meth:`record` logs a warning."""

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str, ttl_s: float, *,
                 memory_alert_bytes: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.prefix = ViewKeys(namespace).prefix + "d|"
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self.memory_alert_bytes = memory_alert_bytes
        self.used_memory: int | None = None
        """The index's Redis's used memory when last read (the largest node's in a cluster)."""
        self._clock = clock
        self._checked: float | None = None

    def key(self, request_id: str) -> str:
        return self.prefix + request_id

    async def record(self, positions: Sequence[DecisionPosition]) -> None:
        """One pipelined round trip for the batch (a later decision of a request id replaces an earlier one)."""
        if not positions:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for p in positions:
                    pipe.set(self.key(p.request_id), p.text(), px=self.ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise ViewStoreError(f"decision index: {len(positions)} entries not written: {e}") from e
        now = self._clock()
        if self._checked is None or now - self._checked >= MEMORY_CHECK_S:
            self._checked = now
            await self.check_memory()

    async def check_memory(self) -> int | None:
        """Read the used memory of the index's Redis (:attr:`used_memory`); warn past the alert."""
        try:
            info = await self.client.info("memory")
        except (RedisError, OSError) as e:
            log.debug("decision index: INFO memory failed: %s", e)
            return None
        # A cluster client answers per node ({node: {...}}), a server with its own fields.
        nodes = [v for v in info.values() if isinstance(v, dict)] or [info]
        used = max((int(n.get("used_memory", 0)) for n in nodes), default=0)
        self.used_memory = used
        if self.memory_alert_bytes and used > self.memory_alert_bytes:
            log.warning("decision index: its Redis uses %d MB, above the %d MB alert (decision_index_"
                        "memory_alert_bytes): lower decision_index_ttl_s or give the index a Redis of its own "
                        "(decision_index_url)", used >> 20, self.memory_alert_bytes >> 20)
        return used

    async def lookup(self, request_ids: Sequence[str]) -> dict[str, DecisionPosition]:
        if not request_ids:
            return {}
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for r in request_ids:
                    pipe.get(self.key(r))
                raws = await pipe.execute()
        except (RedisError, OSError) as e:
            raise ViewStoreError(f"decision index unreachable: {e}") from e
        out: dict[str, DecisionPosition] = {}
        for r, raw in zip(request_ids, raws):
            if isinstance(raw, str):
                raw = raw.encode()
            p = DecisionPosition.parse(r, raw) if raw else None
            if p is not None:
                out[r] = p
        return out

    async def close(self) -> None:
        """Close the client (only an index that opened its own: a router's shares the reservations')."""
        await self.client.aclose()


__all__ = ["DecisionIndex", "DecisionPosition", "RedisDecisionIndex"]
