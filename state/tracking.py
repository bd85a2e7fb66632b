"""A router's view reader that keeps block entries in process, told of changes by Redis
(server-assisted client-side caching, ``CLIENT TRACKING``), the router's reader with
``CONDUCTOR_VIEW_READER=tracking`` (measured against :class:`state.reader.RawSnapshotReader`
with ``conductor bench route --reader tracking``; the numbers and when it pays are in
state/README.md, "Client-side caching").

The connection speaks RESP3 (``HELLO 3``) with ``CLIENT TRACKING on`` (default mode): the
server remembers every key this connection read and, when another client changes one,
pushes ``["invalidate", [key, ...]]`` on this same connection (once; the key is tracked
again when read again). hiredis hands pushes out in stream order as ``PushNotification``.

Why a read stays one instant. A snapshot is still one MULTI/EXEC (``TIME``, ``MGET`` of the
chain's keys not in the cache, the node delta, the watermark); the cached values stand in
for the rest. Redis runs one command at a time and writes a push to our connection when
the write that causes it runs, so a write that ran before our EXEC has its push *before* the
EXEC's reply in the stream, and one that ran after has it after. Hence: a cached value not
invalidated by the time the EXEC reply is parsed is the key's value at the EXEC instant. A
read whose hit was invalidated while it was in flight is redone (its fetched values are
cached all the same, the node delta kept); after :data:`MAX_RETRIES` it reads every key.
Values read are cached when their reply is *parsed* (in the reply loop, in stream order with
the pushes), never later, so a push that follows a reply always wins over it. A new
connection has no tracking: the cache is emptied and reads in flight are redone.

Reads with no round trip. Every snapshot reply parsed is a *point*: its ``TIME``, its
watermark and its node picture, and every cached entry not invalidated since is the key's
value at that instant (the pushes for writes before it came before it). So while no push
has touched the node picture (``ns|ver``, ``ns|nodes``, ``ns|chg``, ``ns|base``: every
heartbeat and every KV batch moves ``ns|ver``) and every block of a chain up to its first
unheld one is cached, the chain's snapshot at the point is known without asking: the view's
state at the point's watermark, read for these keys, is exactly what the cache holds, so
the decision records that watermark and ``conductor explain`` replays to the same view. Its
clock is the point's ``TIME`` moved on by the local monotonic clock (the decision records
it). Such a read waits for no reply: a decision then costs what the policy costs. A point
is used for at most :data:`CACHED_READ_MAX_AGE_S`, never while a read is in flight, and
never across connections.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import hiredis

from schemas.errors import ViewStoreError

from .connect import pack_command
from .keys import NODE_ATTRS, snapshot_from_replies
from .reader import _IO_ERRORS, _NODES_SHA, _RECONNECT_ON, DELTA_MAX_NODES, RawSnapshotReader, _pairs
from .view import ViewSnapshot

DEFAULT_CACHE_KEYS = 200_000
"""Block entries kept in process by default (least recently used go first)."""
CACHED_READ_MAX_AGE_S = 1.0
"""The longest a point (the last snapshot read's clock, watermark and node picture) answers
reads with no round trip: past it the next read asks Redis, for a fresh ``TIME`` at least."""
MAX_RETRIES = 2
"""Reads redone because a cached entry changed while they were in flight, before one read
that takes nothing from the cache."""

_ABSENT = object()


class _InFlight:
    """One snapshot read on the wire: the chain's keys, what the cache gave for each
    (:data:`_ABSENT` where it had nothing), the keys it fetched."""

    __slots__ = ("fetched", "frame", "got", "keys", "stale")

    def __init__(self, keys: list[bytes], got: list[Any], fetched: list[bytes]) -> None:
        self.keys = keys
        self.got = got
        self.fetched = fetched
        self.stale = False
        self.frame = -1
        """Where its reply stood in the connection's stream of frames (set when parsed)."""

    def hits(self) -> list[bytes]:
        """The keys it took from the cache (built only when a push needs them: pushes are rare)."""
        return [k for k, v in zip(self.keys, self.got) if v is not _ABSENT]


class TrackingSnapshotReader(RawSnapshotReader):
    """:class:`RawSnapshotReader` with a bounded in-process cache of block entries kept
    current by RESP3 invalidation pushes (``cache_keys`` entries, least recently used
    evicted). Same ``snapshot(chain)`` answer, same errors."""

    def __init__(self, url: str, namespace: str, *, cache_keys: int = DEFAULT_CACHE_KEYS, timeout_s: float = 0.5,
                 store: Any = None, point_max_age_s: float = CACHED_READ_MAX_AGE_S) -> None:
        """``point_max_age_s``: how long the last read's point answers reads with no round trip
        (0: never; every read asks Redis, as the plain reader does)."""
        super().__init__(url, namespace, timeout_s=timeout_s, store=store)
        if cache_keys < 1:
            raise ValueError("cache_keys must be at least 1")
        self.cache_keys = cache_keys
        self._cache: dict[bytes, bytes | None] = {}
        """Redis key → its value (None: no such key), oldest first; when it outgrows
        ``cache_keys`` the older half is dropped (one C-speed copy, amortised over
        ``cache_keys / 2`` insertions: cheaper per read than keeping an exact LRU)."""
        self._flying: dict[int, _InFlight] = {}
        """Reads that took values from the cache and have not had their reply parsed, from the
        moment they looked (a push parsed while one waits for the connection counts too)."""
        self._by_reply: dict[asyncio.Future[list[Any]], _InFlight] = {}
        self._frame = 0
        """Snapshot replies and pushes parsed on this connection: their order in the stream."""
        self._point: tuple[int, float, Any, int] | None = None
        """The last snapshot reply parsed: (its TIME in ms, time.monotonic() when parsed, its
        watermark reply, its frame); None after a flush."""
        self._point_wm: dict[str, int] | None = None
        self._nodes_frame = -1
        """The frame of the read whose node reply the node picture was last brought to."""
        self._nodes_pushed = 0
        """The frame of the last push that touched the node picture's keys."""
        self._node_keys = frozenset(k.encode() for k in (self.keys.version, self.keys.nodes, self.keys.changes,
                                                        self.keys.base))
        self._reading = 0
        """Snapshot round trips started and not yet folded in."""
        self._now_floor = 0
        self.point_max_age_s = point_max_age_s
        self.stats = {"reads": 0, "hits": 0, "misses": 0, "retries": 0, "uncached_reads": 0, "invalidated": 0,
                      "flushes": 0, "cached_reads": 0, "node_pushes": 0}
        """Counters for tests and benchmarks: keys served from the cache / fetched, reads
        redone, keys invalidated by pushes, whole-cache flushes (new connection, FLUSHDB),
        reads answered from the cache with no round trip, pushes that touched the node picture."""

    def cache_hit_ratio(self) -> float:
        n = self.stats["hits"] + self.stats["misses"]
        return self.stats["hits"] / n if n else 0.0

    # --- the connection: RESP3, tracking, pushes in the reply loop ---------------------

    def setup_commands(self) -> list[tuple[Any, ...]]:
        setup = super().setup_commands()
        return [*setup, ("HELLO", 3), ("CLIENT", "TRACKING", "on")]

    async def _connect(self) -> None:
        self._flush()  # the old connection's tracking is gone with it
        await super()._connect()

    def _flush(self) -> None:
        self._cache.clear()
        self._point = None
        for rec in self._flying.values():
            if rec.fetched is not rec.keys:  # it took something from the cache
                rec.stale = True
        self.stats["flushes"] += 1

    def _invalidate(self, keys: list[bytes] | None) -> None:
        if keys is None:  # FLUSHDB / FLUSHALL, or the server dropped its tracking table
            self._flush()
            return
        cache = self._cache
        for k in keys:
            cache.pop(k, None)
        self.stats["invalidated"] += len(keys)
        if not self._node_keys.isdisjoint(keys):
            self._nodes_pushed = self._frame
            self.stats["node_pushes"] += 1
        if self._flying:
            gone = set(keys)
            for rec in self._flying.values():
                if not rec.stale and not gone.isdisjoint(rec.hits()):
                    rec.stale = True

    def _filled(self, fut: asyncio.Future[list[Any]], got: list[Any]) -> None:
        """A snapshot's replies were parsed: cache what it fetched, now, before any later push."""
        rec = self._by_reply.pop(fut, None)
        if rec is None:
            return
        self._flying.pop(id(rec), None)
        if not rec.fetched:
            return
        res = got[-1]
        if not isinstance(res, list) or len(res) < 2 or not isinstance(res[1], list):
            return
        cache = self._cache
        cache.update(zip(rec.fetched, res[1]))
        if len(cache) > self.cache_keys:
            keep = self.cache_keys // 2
            self._cache = dict(itertools.islice(cache.items(), len(cache) - keep, None))

    _push_type = hiredis.PushNotification

    def _pushed(self, frame: Any) -> None:
        self._frame += 1
        if len(frame) >= 2 and frame[0] == b"invalidate":
            self._invalidate(frame[1])

    def _replied(self, fut: asyncio.Future[list[Any]], got: list[Any]) -> None:
        rec = self._by_reply.get(fut)
        if rec is None:
            return
        self._frame += 1
        rec.frame = self._frame
        res = got[-1]
        if isinstance(res, list) and len(res) >= 3 and isinstance(res[0], list):
            sec, usec = res[0]
            self._point = (int(sec) * 1000 + int(usec) // 1000, time.monotonic(), res[-1], self._frame)
            self._point_wm = None
        self._filled(fut, got)

    def _fail_waiting(self, e: BaseException) -> None:
        super()._fail_waiting(e)
        self._flush()  # the connection and its tracking are gone

    async def _call(self, *commands: tuple[Any, ...]) -> list[Any]:
        # RESP3 answers HGETALL with a map; the reader's other reads expect RESP2's flat list.
        return [_flat(r) for r in await super()._call(*commands)]

    # --- ViewReader -----------------------------------------------------------------

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        self.stats["reads"] += 1
        keys = self.keys.blocks(chain)
        looked = self._from_cache(keys)
        if not looked[1]:  # the cache has the whole chain
            cached = self._from_point(looked[0], now_ms)
            if cached is not None:
                return cached
        self._reading += 1
        try:
            return await self._read(keys, now_ms, looked)
        finally:
            self._reading -= 1

    def _from_point(self, got: list[Any], now_ms: int | None) -> ViewSnapshot | None:
        """The chain's snapshot at the last point from its cached values ``got``, when the
        point still stands (see the module's docstring); None when it must be read."""
        pt = self._point
        if (pt is None or self._reading or self._io is None or self._nodes_frame != pt[3]
                or self._nodes_pushed > pt[3]):
            return None
        mono = time.monotonic()
        if mono - pt[1] >= self.point_max_age_s:
            return None
        if now_ms is None:
            now_ms = max(pt[0] + int((mono - pt[1]) * 1000.0), self._now_floor)
        wm = self._point_wm
        if wm is None:
            wm = self._point_wm = {k.decode(): int(v) for k, v in _pairs(pt[2])}
        nodes, slot_nodes = self._last_nodes
        self.stats["cached_reads"] += 1
        self.stats["hits"] += len(got)
        self._now_floor = now_ms
        return ViewSnapshot(now_ms=now_ms, nodes=nodes, prefix=self.walk(got, slot_nodes), watermark=dict(wm))

    async def _read(self, keys: list[bytes], now_ms: int | None,
                    looked: tuple[list[Any], list[int]]) -> ViewSnapshot:
        """Read the chain in one transaction (``looked``: what the cache held for it just now,
        taken by the first attempt)."""
        at: Sequence[int]  # the positions of the chain's keys to fetch
        for attempt in range(MAX_RETRIES + 2):
            if attempt <= MAX_RETRIES:
                got, at = looked if attempt == 0 else self._from_cache(keys)
                fetched = keys if len(at) == len(keys) else [keys[i] for i in at]
            else:
                self.stats["uncached_reads"] += 1
                got, at, fetched = [_ABSENT] * len(keys), range(len(keys)), keys
            rec = _InFlight(keys, got, fetched)
            self._flying[id(rec)] = rec  # from now on a push for one of its hits marks it stale
            try:
                res = await self._exec(rec, fetched)
            finally:
                self._flying.pop(id(rec), None)
            if fetched:
                time_reply, values, flat_nodes, wm = res
                if fetched is not keys:
                    values, fresh = got, values
                    for i, v in zip(at, fresh):
                        values[i] = v
            else:
                time_reply, flat_nodes, wm = res
                values = got
            nodes, slot_nodes = self._nodes_from(flat_nodes)  # always: the node picture moves on
            self._nodes_frame = rec.frame
            if rec.stale:
                self.stats["retries"] += 1
                continue
            self.stats["hits"] += len(got) - len(fetched)
            self.stats["misses"] += len(fetched)
            snap = snapshot_from_replies(time_reply, values, nodes, slot_nodes, _pairs(wm), now_ms, self.walk)
            self._now_floor = max(self._now_floor, snap.now_ms)
            return snap
        raise AssertionError("unreachable: the last attempt reads without the cache")

    def _from_cache(self, keys: list[bytes]) -> tuple[list[Any], list[int]]:
        """(what the cache holds for each key, :data:`_ABSENT` where nothing; positions to
        fetch). A cached block no node holds (no such key) ends every prefix, so the chain is
        cut there: nothing after it matters to the prefix walk."""
        get = self._cache.get
        got = [get(k, _ABSENT) for k in keys]
        if None in got:
            del got[got.index(None) + 1:]
        return got, [i for i, v in enumerate(got) if v is _ABSENT]

    async def _exec(self, rec: _InFlight, fetched: list[bytes]) -> list[Any]:
        """Send one snapshot transaction; its fetched values are cached as its reply is parsed."""
        pack = pack_command
        packed = pack(("MULTI",)) + pack(("TIME",))
        if fetched:
            packed += pack(("MGET", *fetched))
        packed += pack(("EVALSHA", _NODES_SHA, 4, *self._nodes_args, self._last_version or b"", self._last_base,
                        DELTA_MAX_NODES, *NODE_ATTRS))
        packed += self._wm_cmd + pack(("EXEC",))
        n = 4 if fetched else 3
        fut: asyncio.Future[list[Any]] | None = None
        try:
            async with self._lock:
                if self._io is None:
                    await self._connect()
                fut = self._send(packed, n + 2)
                self._by_reply[fut] = rec
            got = await asyncio.wait_for(fut, self.timeout_s)
        except _IO_ERRORS as e:
            await self._drop()
            raise ViewStoreError(f"view read failed: {type(e).__name__}: {e}") from e
        finally:
            if fut is not None:
                self._by_reply.pop(fut, None)
        res = got[-1]
        if not isinstance(res, list) or len(res) != n:
            raise ViewStoreError(f"view read failed: the transaction answered {res!r}")
        for r in (*got, *res):
            if isinstance(r, hiredis.ReplyError):
                if str(r).startswith(_RECONNECT_ON):
                    await self._drop()
                raise ViewStoreError(f"view read failed: {r}")
        return res


def _flat(reply: Any) -> Any:
    if isinstance(reply, dict):
        return [x for kv in reply.items() for x in kv]
    return reply


__all__ = ["CACHED_READ_MAX_AGE_S", "DEFAULT_CACHE_KEYS", "MAX_RETRIES", "TrackingSnapshotReader"]
