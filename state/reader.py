"""The router's view reader: the one-round-trip snapshot over a dedicated RESP connection.

:class:`RawSnapshotReader` is a :class:`state.view.ViewReader` that sends the same commands
as ``RedisViewStore.snapshot`` (``TIME``, ``MGET`` of the chain's block keys, the node hash,
the watermark) and decodes them with the same code (:mod:`state.keys`), but packs and
parses them with hiredis on a raw asyncio stream: redis-py's asyncio pipeline costs more
client CPU than the read itself, and that CPU is what bounds one router's throughput. The
node hash travels only when the view's version moved since the last read.

It speaks plain ``redis://`` (with ``user:password@`` and a ``/db``); for ``rediss://`` and
the rest, read through ``RedisViewStore`` (``conductor.routing.stores.redis_stores`` picks).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import hiredis
from redis.crc import key_slot

from schemas.errors import ViewStoreError

from .connect import HiredisPackedConnection, cluster_seeds, pack_command
from .keys import NODE_ATTRS, NodeHashDecoder, PrefixWalk, ViewKeys, dump_from_replies, snapshot_from_replies
from .scripts import lua
from .view import NodeState, ViewSnapshot

_NODES_SINCE_LUA = lua("nodes_since")
"""The node hash, or only the nodes changed since the reader's version (state/lua/nodes_since.lua)."""
_NODES_SHA = hashlib.sha1(_NODES_SINCE_LUA.encode()).hexdigest()
DELTA_MAX_NODES = 4096
"""More nodes changed than this since the last read: read the whole node hash instead. High:
with heartbeats from every node once a second, a read of a 1,000-node cluster that came
100 ms after the one before finds ~100 nodes changed, and a delta of them is still far less
to send and parse than the whole hash (a cap of 64 made such reads fall back to it)."""

_IO_ERRORS = (OSError, asyncio.TimeoutError, ConnectionError, hiredis.ProtocolError)
_RECONNECT_ON = ("NOSCRIPT", "MOVED", "ASK", "CLUSTERDOWN", "READONLY")
"""Replies after which the reader connects afresh: the script cache was flushed (restart,
failover), or on a cluster the slot moved or its primary changed."""


def _pairs(reply: Any) -> Any:
    """(field, value) pairs of a hash reply: RESP2's flat list, or a RESP3 map."""
    return reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])


class RawSnapshotReader:
    """A :class:`state.view.ViewReader` of the view in namespace ``namespace`` at ``url``.

    Several reads may be in flight on its one connection (replies come back in order). A
    lost connection is re-opened on the next read; failures raise :class:`ViewStoreError`.
    ``store``, when given, is the writing side (a ``RedisViewStore``): attributes this
    reader lacks (``apply``, ``clear``, ...) are looked up there, and :meth:`close` closes it.
    """

    def __init__(self, url: str, namespace: str, *, timeout_s: float = 0.5, store: Any = None) -> None:
        u = urlparse(url)
        if u.scheme not in ("redis", "", "redis+cluster"):
            raise ViewStoreError(f"the raw snapshot reader speaks plain redis:// (or redis+cluster://) only, not {u.scheme}://")
        self.keys = ViewKeys(namespace)
        self.view = store
        self.seeds: list[tuple[str, int]] = []
        """A cluster's seed nodes (``redis+cluster://``): the reader connects to the primary of
        the namespace's one slot, found from them, and again after a MOVED or a lost connection."""
        if u.scheme == "redis+cluster":
            self.seeds, self.username, self.password = cluster_seeds(url)
            (self.host, self.port), self.db = self.seeds[0], 0
            self._slot = key_slot(self.keys.generation.encode())
        else:
            self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
            self.db = int((u.path or "/0").lstrip("/") or 0)
            self.username = unquote(u.username) if u.username else None
            self.password = unquote(u.password) if u.password else None
        self.timeout_s = timeout_s
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._waiting: collections.deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = collections.deque()
        self._reader_task: asyncio.Future[None] | None = None
        self._decoder = NodeHashDecoder()
        self.walk = PrefixWalk()
        """The prefix walk, remembering hot chains' answers (:class:`state.keys.PrefixWalk`)."""
        self._last_version: bytes | None = None
        self._last_base: bytes = b""
        self.node_reads = {"unchanged": 0, "delta": 0, "whole": 0}
        """How each read's node picture came (for tests and benchmarks)."""
        self._last_nodes: tuple[tuple[NodeState, ...], dict[int, str]] = ((), {})
        self._nodes_args = (self.keys.version, self.keys.changes, self.keys.nodes, self.keys.base)
        self._wm_cmd = pack_command(("HGETALL", self.keys.watermark))

    def __getattr__(self, name: str) -> Any:
        view = self.__dict__.get("view")
        if view is None:
            raise AttributeError(name)
        return getattr(view, name)

    # --- the connection -------------------------------------------------------------

    def setup_commands(self) -> list[tuple[Any, ...]]:
        """What a new connection sends first: AUTH (user and password, or password alone),
        SELECT, and loading the node-hash script."""
        setup: list[tuple[Any, ...]] = self._auth()
        if self.db:
            setup.append(("SELECT", self.db))
        setup.append(("SCRIPT", "LOAD", _NODES_SINCE_LUA))
        return setup

    def _auth(self) -> list[tuple[Any, ...]]:
        if self.password is None:
            return []
        return [("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)]

    async def _slot_primary(self) -> tuple[str, int]:
        """The primary serving the namespace's slot, asked of the last one used, then each seed."""
        last: BaseException | None = None
        for host, port in dict.fromkeys([(self.host, self.port), *self.seeds]):
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(host, port), self.timeout_s)
            except _IO_ERRORS as e:
                last = e
                continue
            try:
                cmds = [*self._auth(), ("CLUSTER", "SLOTS")]
                w.write(b"".join(pack_command(c) for c in cmds))
                parser = hiredis.Reader()
                replies: list[Any] = []
                while len(replies) < len(cmds):
                    data = await asyncio.wait_for(r.read(1 << 16), self.timeout_s)
                    if not data:
                        raise ConnectionError("connection closed by the server")
                    parser.feed(data)
                    while (rep := parser.gets()) is not False:
                        replies.append(rep)
                for lo, hi, primary, *_ in replies[-1] if isinstance(replies[-1], list) else ():
                    if lo <= self._slot <= hi:
                        return (primary[0].decode() or host), int(primary[1])
                last = ViewStoreError(f"{host}:{port} knows no primary of slot {self._slot}: {replies[-1]!r}")
            except _IO_ERRORS as e:
                last = e
            finally:
                w.close()
        raise ViewStoreError(f"view read failed: no cluster seed answered with the slot's primary ({last})")

    async def _connect(self) -> None:
        """Open the connection, start its reply reader, and set it up (called under the lock)."""
        if self.seeds:
            self.host, self.port = await self._slot_primary()
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.timeout_s)
        self._io = (reader, writer)
        self._reader_task = asyncio.ensure_future(self._read_replies(reader, writer))
        setup = self.setup_commands()
        fut = self._send(b"".join(pack_command(c) for c in setup), len(setup))
        try:
            replies = await asyncio.wait_for(fut, self.timeout_s)
        except BaseException:
            await self._drop()
            raise
        for r in replies:
            if isinstance(r, hiredis.ReplyError):
                await self._drop()
                raise ViewStoreError(f"view connection set-up failed: {r}")

    def _send(self, packed: bytes, replies: int) -> asyncio.Future[list[Any]]:
        """Write one request; its replies resolve the returned future. Replies come back in
        the order requests were written, so several reads can be in flight at once."""
        assert self._io is not None
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append((fut, replies, []))
        self._io[1].write(packed)
        return fut

    _push_type: type | None = None
    """The parser's type for out-of-band frames (RESP3 pushes), handed to :meth:`_pushed`;
    None on this RESP2 connection, which has none."""

    def _pushed(self, frame: Any) -> None:
        """An out-of-band frame arrived (in stream order, between replies)."""

    def _replied(self, fut: asyncio.Future[list[Any]], got: list[Any]) -> None:
        """A request's replies are all parsed (before any frame after them is)."""

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        waiting = self._waiting
        push = self._push_type
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("connection closed by the server")
                parser.feed(data)
                while (r := parser.gets()) is not False:
                    if push is not None and type(r) is push:
                        self._pushed(r)
                        continue
                    if not waiting:
                        raise hiredis.ProtocolError(f"a reply nobody asked for: {r!r}")
                    fut, n, got = waiting[0]
                    got.append(r)
                    if len(got) == n:
                        waiting.popleft()
                        self._replied(fut, got)
                        if not fut.done():
                            fut.set_result(got)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every waiter must learn the connection is gone
            if self._io is not None and self._io[1] is writer:
                self._fail_waiting(e)
                self._io = None
                writer.close()

    def _fail_waiting(self, e: BaseException) -> None:
        while self._waiting:
            fut, _, _ = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError(f"{type(e).__name__}: {e}"))

    async def _request(self, packed: bytes, replies: int) -> list[Any]:
        """Send packed commands, await their ``replies`` replies; errors → ViewStoreError."""
        try:
            async with self._lock:  # only connecting and writing are serialised, not the wait
                if self._io is None:
                    await self._connect()
                fut = self._send(packed, replies)
            res = await asyncio.wait_for(fut, self.timeout_s)
        except _IO_ERRORS as e:
            # A reply that never came leaves the stream out of step: start afresh.
            await self._drop()
            raise ViewStoreError(f"view read failed: {type(e).__name__}: {e}") from e
        for r in res:
            if isinstance(r, hiredis.ReplyError):
                if str(r).startswith(_RECONNECT_ON):  # the next connection loads the script / finds the slot's primary
                    await self._drop()
                raise ViewStoreError(f"view read failed: {r}")
        return res

    async def _call(self, *commands: tuple[Any, ...]) -> list[Any]:
        return await self._request(b"".join(pack_command(c) for c in commands), len(commands))

    async def _drop(self) -> None:
        io, self._io = self._io, None
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
        self._fail_waiting(ConnectionError("connection dropped"))
        if io is not None:
            io[1].close()

    async def close(self) -> None:
        await self._drop()
        if self.view is not None:
            await self.view.close()

    # --- ViewReader -----------------------------------------------------------------

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        pack = pack_command
        # One MULTI/EXEC: the blocks, the node hash and the fences are of one instant (no
        # write lands between them), so the watermark a decision records is exactly what it
        # read and `explain` replays to the same view.
        packed = pack(("MULTI",)) + pack(("TIME",))
        if chain:
            packed += pack(("MGET", *self.keys.blocks(chain)))
        # The node hash (~100 KB for a large cluster) travels only when its version moved,
        # and then only the nodes that moved (usually one or two heartbeats).
        packed += pack(("EVALSHA", _NODES_SHA, 4, *self._nodes_args, self._last_version or b"", self._last_base,
                        DELTA_MAX_NODES, *NODE_ATTRS))
        packed += self._wm_cmd + pack(("EXEC",))
        n = 4 if chain else 3
        res = (await self._request(packed, n + 2))[-1]
        if not isinstance(res, list) or len(res) != n:
            raise ViewStoreError(f"view read failed: the transaction answered {res!r}")
        for r in res:
            if isinstance(r, hiredis.ReplyError):
                if str(r).startswith(_RECONNECT_ON):
                    await self._drop()
                raise ViewStoreError(f"view read failed: {r}")
        if chain:
            time_reply, values, flat_nodes, flat_wm = res
        else:
            time_reply, flat_nodes, flat_wm = res
            values = []
        nodes, slot_nodes = self._nodes_from(flat_nodes)
        return snapshot_from_replies(time_reply, values, nodes, slot_nodes, _pairs(flat_wm), now_ms, self.walk)

    def _nodes_from(self, reply: list[Any]) -> tuple[tuple[NodeState, ...], dict[int, str]]:
        """The node picture after the node script's reply: unchanged, a delta, or whole."""
        if len(reply) == 2:  # unchanged since the last read
            self.node_reads["unchanged"] += 1
            return self._last_nodes
        version, base = reply[0], reply[1]
        if len(reply) == 4:
            names, values = reply[2], reply[3]
            w = len(NODE_ATTRS)
            changed = {}
            for i, name in enumerate(names):
                row = values[i * w:(i + 1) * w]
                changed[name.decode()] = {a: v for a, v in zip(NODE_ATTRS, row) if v is not None}
            self._last_nodes = self._decoder.update(changed)
            self.node_reads["delta"] += 1
        else:
            self.node_reads["whole"] += 1
            self._last_nodes = self._decoder.decode(dict(_pairs(reply[2])))
        self._last_version = version  # None for a namespace never written: always re-read
        self._last_base = base
        return self._last_nodes

    async def nodes(self) -> list[NodeState]:
        (flat,) = await self._call(("HGETALL", self.keys.nodes))
        return list(NodeHashDecoder().decode(dict(_pairs(flat)))[0])

    async def watermark(self) -> dict[str, int]:
        (flat,) = await self._call(("HGETALL", self.keys.watermark))
        return {k.decode(): int(v) for k, v in _pairs(flat)}

    async def dump(self) -> dict[str, Any]:
        (flat_nodes,) = await self._call(("HGETALL", self.keys.nodes))
        blocks: list[tuple[bytes, bytes | None]] = []
        cursor = b"0"
        while True:
            ((cursor, found),) = await self._call(("SCAN", cursor, "MATCH", self.keys.block_pattern, "COUNT", 2000))
            found = [k for k in found if self.keys.block_of(k) is not None]
            if found:
                (values,) = await self._call(("MGET", *found))
                blocks += zip(found, values)
            if cursor == b"0":
                break
        (flat_wm,) = await self._call(("HGETALL", self.keys.watermark))
        return dump_from_replies(self.keys, dict(_pairs(flat_nodes)), blocks, _pairs(flat_wm))


__all__ = ["DELTA_MAX_NODES", "HiredisPackedConnection", "RawSnapshotReader"]
