"""The view in Redis (or Valkey): the production store.

Key layout: :mod:`state.keys` (the one place it is written down, beside these scripts).

The routing read (:meth:`RedisViewStore.snapshot`) is ONE pipelined round trip: ``TIME``,
``MGET`` of the chain's block keys, ``HGETALL`` of the nodes and of the watermark; the
prefix walk runs client-side on the blocks' holder entries (``state.keys.entry_prefixes``). The
router reads the same way with less client CPU through :class:`state.reader.RawSnapshotReader`.

Writes go through one Lua script per batch: per record, skip it if its offset is at or
below the fence of its ``topic:partition``; refuse it (and the rest of the call) if the
node's stream field no longer holds the state the record was folded from (another writer
got there first: the caller folds again); else apply its operations and raise the fence,
all atomically. Clearing a node (restart, all-blocks-cleared) retires its slot instead of
touching its blocks: O(1), and reads ignore retired slots (``ns|retired``). :meth:`RedisViewStore.compact`
(run periodically by the stream worker) later drops their stale holder entries in one SCAN
pass and frees the slots (``ns|free``) for new nodes (a slot must stay below
``state.keys.MAX_SLOTS``: a 2-byte entry names it).

Bulk load (synthetic views, benchmarks): ``await store.apply_groups([(None, [AddBlocks(node,
tier, keys), ...]), ...])`` — no fence, chunked so that no single script runs long.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from hiredis import pack_command
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from schemas.codec import pack_script_args
from schemas.errors import ViewStoreError

from .connect import HiredisPackedConnection, RedisConnection, open_client
from .fold import AddBlocks, ClearNode, NodeStream, Op, RemoveBlocks, SetHeartbeat, SetStream
from .keys import (
    HEARTBEAT_FIELD,
    MAX_SLOTS,
    STREAM_FIELD,
    NodeHashDecoder,
    ViewKeys,
    dump_from_replies,
    node_field,
    parse_stream,
    snapshot_from_replies,
    stream_text,
)
from .scripts import lua
from .view import NodeState, Outcome, ViewSnapshot
from .write import Group, Record, fold_and_write

_CHUNK_KEYS = 20_000  # block keys per script call: keeps each call well under ~20 ms

# The scripts (state/lua/: each file says what it does, its KEYS, ARGV and reply). Every script
# declares every key it touches (KEYS), all of one namespace and so of one cluster slot
# (state.keys: the {ns} hash tag).
_APPLY_LUA = lua("apply").replace("MAX_SLOTS", str(MAX_SLOTS))
_COMPACT_LUA = lua("compact")
_FREE_LUA = lua("free")
_REBUILD_LUA = lua("rebuild")
_TIME_LUA = lua("time")
_GENERATION_LUA = lua("generation")

_FLAGS = (Outcome.FENCED, Outcome.APPLIED, Outcome.CONFLICT, Outcome.HOLE, Outcome.LOST)
"""The apply script's per-group reply (0 to 4) → outcome; 5: no node slot left (:meth:`RedisViewStore._run` raises)."""
_NO_SLOT = 5


_ABSENT = {part: stream_text(NodeStream(), part) for part in STREAM_FIELD}
"""A stream part's text when the node hash has none."""


def _conditions(ops: Sequence[Op]) -> list[list[str]]:
    """The script's compare-and-set checks for a group: ``[field, expected, value if absent]``."""
    return [
        [node_field(op.node, STREAM_FIELD[op.part]), stream_text(op.prev, op.part), _ABSENT[op.part]]
        for op in ops
        if isinstance(op, SetStream) and op.prev is not None
    ]


def encode_ops(ops: Sequence[Op]) -> list[list[Any]]:
    """Operations in the script's compact form; a block operation still carries its block keys
    (``[code, node, tier, keys]``), which :func:`script_call` moves into the script's KEYS."""
    out: list[list[Any]] = []
    for op in ops:
        if isinstance(op, (AddBlocks, RemoveBlocks)):
            if op.keys:
                out.append([1 if isinstance(op, AddBlocks) else 2, op.node, op.tier, op.keys])
        elif isinstance(op, ClearNode):
            out.append([3, op.node])
        elif isinstance(op, SetHeartbeat):
            out.append([4, op.node, HEARTBEAT_FIELD, json.dumps(op.state, separators=(",", ":"), sort_keys=True)])
        elif isinstance(op, SetStream):
            out.append([4, op.node, STREAM_FIELD[op.part], stream_text(op.stream, op.part)])
        else:
            raise TypeError(f"unknown view operation {op!r}")
    return out


class ScriptKeys:
    """The keys an apply call declares, in order: the namespace's fixed keys, then every block key
    its operations name (held as the block keys' numbers, sent as one RESP run: :meth:`resp`)."""

    __slots__ = ("blocks", "fixed", "keys")

    def __init__(self, keys: ViewKeys, fixed: list[Any]) -> None:
        self.keys = keys
        self.fixed = fixed
        self.blocks: list[int] = []

    def __len__(self) -> int:
        return len(self.fixed) + len(self.blocks)

    def names(self) -> list[Any]:
        """Every key's name (``KEYS`` as the script sees it)."""
        return [*self.fixed, *self.keys.blocks(self.blocks)]

    def resp(self) -> _Bulks:
        """The block keys' names as one pre-encoded run of arguments (:class:`_ViewConnection`)."""
        return _Bulks(len(self.blocks), self.keys.blocks_resp(self.blocks))


def script_call(keys: ViewKeys, groups: list[list[Any]]) -> tuple[ScriptKeys, list[list[Any]]]:
    """The apply script's KEYS (the namespace's fixed keys, then every block key an operation
    names, in order) and its groups with each block operation's keys replaced by
    ``first index in KEYS, count``: the script touches no key it was not given."""
    declared = ScriptKeys(keys, [keys.generation, keys.nodes, keys.watermark, keys.slots, keys.meta, keys.free,
                                 keys.retired, keys.version, keys.changes])
    blocks = declared.blocks
    base = len(declared.fixed) + 1
    out = []
    for fk, off, ops, conds, after in groups:
        enc = []
        for o in ops:
            if o[0] in (1, 2):
                enc.append([o[0], o[1], o[2], base + len(blocks), len(o[3])])
                blocks.extend(o[3])
            else:
                enc.append(o)
        out.append([fk, off, enc, conds, after])
    return declared, out


class _Bulks:
    """Arguments already in RESP (``count`` bulk strings, back to back in ``resp``): what
    :class:`_ViewConnection` splices into a command in place of ``count`` arguments."""

    __slots__ = ("count", "resp")

    def __init__(self, count: int, resp: bytes) -> None:
        self.count, self.resp = count, resp


class _ViewConnection(HiredisPackedConnection):
    """The store's connection: packs as :class:`HiredisPackedConnection` does, and splices a
    :class:`_Bulks` argument's bytes in as they are (the apply script's block keys: packing
    them one by one was a third of the writer's CPU)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if args[0] != "EVALSHA" or not any(type(a) is _Bulks for a in args):
            return super().pack_command(*args)
        parts: list[bytes] = []
        count = 0
        run: list[Any] = []
        for a in (*args, None):
            if a is None or type(a) is _Bulks:
                if run:
                    packed = pack_command(tuple(run))
                    parts.append(packed[packed.index(b"\n") + 1:])  # without its "*<n>" header
                    count += len(run)
                    run = []
                if a is not None:
                    parts.append(a.resp)
                    count += a.count
            else:
                run.append(a)
        return [b"*%d\r\n" % count, *parts]


class RedisViewStore:
    """A :class:`state.view.ViewStore` in Redis; see the module docstring and :mod:`state.keys`."""

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str) -> None:
        self.keys = ViewKeys(namespace)  # refuses a namespace with '|', '{' or '}'
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        """A Redis Cluster client: the namespace's keys all live in one slot (``state.keys``)."""
        self.ns = namespace
        self._script = client.register_script(_APPLY_LUA)
        self._compact = client.register_script(_COMPACT_LUA)
        self._free = client.register_script(_FREE_LUA)
        self._gen_script = client.register_script(_GENERATION_LUA)
        self._rebuild_script = client.register_script(_REBUILD_LUA)
        self._decoder = NodeHashDecoder()
        self.generation: str | None = None
        """The generation this store's writes are folded on (adopted by :meth:`adopt_generation`)."""

    @classmethod
    def connect(cls, redis: RedisConnection, namespace: str) -> RedisViewStore:
        """A store of the view ``namespace`` on ``redis`` (:class:`ViewStoreError` when no URL is set)."""
        client = open_client(redis.connection_url(), decode_responses=False, socket_timeout=5.0,
                             connection_class=_ViewConnection, **redis.tls_options())
        return cls(client, namespace)

    async def close(self) -> None:
        await self.client.aclose()

    async def _target(self) -> dict[str, Any]:
        """On a cluster, the primary serving the namespace's slot (keyless and per-node
        commands, and scripts, are sent there); nothing on a single server. The client's slot
        map is (re)loaded first when it is new or an error marked it stale (a failover)."""
        if not isinstance(self.client, RedisCluster):
            return {}
        await self.client.initialize()
        return {"target_nodes": self.client.get_node_from_key(self.keys.generation)}

    async def _eval(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run ``script`` with every key it touches declared. On a cluster it goes straight to the
        slot's primary (redis-py would hash every one of up to ~20k block keys to find it;
        they all share the namespace's slot)."""
        if not isinstance(self.client, RedisCluster):
            return await script(keys=keys, args=args)
        return await self._evalsha(script, len(keys), [*keys, *args], await self._target())

    async def _evalsha(self, script: AsyncScript, nkeys: int, keys_and_args: Sequence[Any],
                       target: dict[str, Any]) -> Any:
        """``EVALSHA`` of ``script``, loading it first where the server does not have it yet."""
        try:
            return await self.client.execute_command("EVALSHA", script.sha, nkeys, *keys_and_args, **target)
        except NoScriptError:
            await self.client.execute_command("SCRIPT LOAD", script.script, **target)
            return await self.client.execute_command("EVALSHA", script.sha, nkeys, *keys_and_args, **target)

    async def _apply_script(self, declared: ScriptKeys, args: Sequence[Any]) -> Any:
        """The apply script over ``declared``: on one server through :class:`_ViewConnection`
        (the block keys sent as one pre-encoded run), else through :meth:`_eval`."""
        pool = getattr(self.client, "connection_pool", None)
        if self.cluster or pool is None or not issubclass(pool.connection_class, _ViewConnection):
            return await self._eval(self._script, declared.names(), args)
        return await self._evalsha(self._script, len(declared), [*declared.fixed, declared.resp(), *args], {})

    async def _scan(self, pattern: str, count: int = 2000) -> AsyncIterator[list[bytes]]:
        async for keys in _scan_batches(self.client, pattern, count, **await self._target()):
            yield keys

    def block_key(self, key: int) -> bytes:
        return self.keys.block(key)

    # --- writing ------------------------------------------------------------

    async def apply(self, records: Sequence[Record]) -> list[Outcome]:
        """Fold each record with the stream state stored in Redis, then write the batch, each
        record atomically with its position (``state.write.fold_and_write``). A record whose
        position the view has applied already is reported ``FENCED``."""
        return (await fold_and_write(self, records)).outcomes()

    async def apply_groups(self, batch: Sequence[Group]) -> list[Outcome]:
        """Run the script over ``batch`` in chunks; an outcome per group (``APPLIED``,
        ``FENCED``, ``CONFLICT``). After a conflict no further chunk is sent.

        A fenced group always goes whole into one script call (its effect and its fence are
        one atomic step); an unfenced bulk group may be split to keep each call short.
        """
        flags: list[Outcome] = []
        chunk: list[list[Any]] = []
        owners: list[int] = []  # chunk entry -> group index, -1 for continuation pieces
        weight = 0

        async def flush() -> bool:
            nonlocal chunk, owners, weight
            res = await self._run(chunk)
            for owner, ok in zip(owners, res):
                if owner >= 0:
                    flags.append(ok)
            chunk, owners, weight = [], [], 0
            return any(r in (Outcome.CONFLICT, Outcome.HOLE, Outcome.LOST) for r in res)

        for gi, (pos, ops) in enumerate(batch):
            enc = encode_ops(ops)
            conds = _conditions(ops)
            pieces = [enc] if pos is not None else (_split(enc) or [[]])
            for i, piece in enumerate(pieces):
                fk, off = (pos.key, pos.offset) if pos is not None else ("", 0)
                after = -2 if pos is None or pos.after is None else pos.after
                chunk.append([fk, off, piece, conds if i == 0 else [], after])
                owners.append(gi if i == 0 else -1)
                weight += sum(len(o[3]) if o[0] in (1, 2) else 1 for o in piece) + 1
                if weight >= _CHUNK_KEYS and await flush():
                    return flags + [Outcome.CONFLICT] * (len(batch) - len(flags))
        if chunk:
            await flush()
        return flags

    async def adopt_generation(self, partitions: Sequence[str] = ()) -> tuple[str, bool]:
        """The view's generation, which this store's writes are then folded on; created when
        absent (a new or lost view), and then ``partitions`` (``topic:partition``) are marked
        as being rebuilt (``ns|rebuild``) in the same step. Returns (generation, created)."""
        try:
            g, created = await self._eval(self._gen_script, [self.keys.generation, self.keys.rebuild],
                                          [secrets.token_hex(8), *partitions])
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        self.generation = g.decode() if isinstance(g, bytes) else str(g)
        return self.generation, bool(created)

    async def fences(self) -> tuple[str | None, dict[str, int]]:
        """(the view's generation or None, its fences), read in one atomic step."""
        try:
            async with self.client.pipeline(transaction=True) as p:
                p.get(self.keys.generation)
                p.hgetall(self.keys.watermark)
                g, raw = await p.execute()
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return (g.decode() if g is not None else None), {k.decode(): int(v) for k, v in raw.items()}

    async def rebuild_pending(self) -> dict[str, int]:
        """Partitions still being rebuilt after a new generation → the offset each must reach (-1: not yet known)."""
        return await self._offsets(self.keys.rebuild)

    async def _offsets(self, key: str) -> dict[str, int]:
        """A hash of ``name → offset`` (the watermark, the partitions being rebuilt)."""
        try:
            raw = _bytes_hash(await self.client.hgetall(key))
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return {k.decode(): int(v) for k, v in raw.items()}

    async def mark_rebuilding(self, targets: dict[str, int], generation: str) -> None:
        """Record the end offset each partition must reach after a new generation (only under
        ``generation``); one whose fence has reached it leaves ``ns|rebuild``."""
        if not targets:
            return
        try:
            await self._eval(self._rebuild_script, [self.keys.generation, self.keys.watermark, self.keys.rebuild],
                             [generation, *[x for kv in targets.items() for x in (kv[0], kv[1])]])
        except RedisError as e:
            raise ViewStoreError(f"view write failed: {e}") from e

    async def view_health(self) -> tuple[bool, str]:
        """(healthy, reason): not healthy while the view has no generation (lost, nobody
        rebuilding it yet) or partitions are still being read back from the log."""
        try:
            async with self.client.pipeline(transaction=True) as p:
                p.exists(self.keys.generation)
                p.hlen(self.keys.rebuild)
                has_gen, pending = await p.execute()
        except RedisError as e:
            return False, f"view unreachable: {e}"
        if not has_gen:
            return False, "view_lost: the view has no generation (Redis lost or flushed; no worker has started rebuilding it)"
        if pending:
            return False, f"view_rebuilding: {pending} partitions are being read back from the log"
        return True, ""

    async def _run(self, groups: list[list[Any]]) -> list[Outcome]:
        if self.generation is None:
            await self.adopt_generation()
        try:
            declared, groups = script_call(self.keys, groups)
            res = await self._apply_script(declared, [pack_script_args(groups), self.generation])
        except RedisError as e:
            raise ViewStoreError(f"view write failed: {e}") from e
        if any(int(x) == _NO_SLOT for x in res):
            # The groups before it were applied with their fences (re-delivery finds them fenced).
            raise ViewStoreError(
                f"view write refused: no node slot left for a new node (a holder entry names at most {MAX_SLOTS} "
                "slots; a cleared or restarted node's slot is reused after compaction, `RedisViewStore.compact`)"
            )
        return [_FLAGS[int(x)] for x in res]

    async def streams(self, node_ids: Sequence[str]) -> dict[str, NodeStream]:
        if not node_ids:
            return {}
        kv, hbs = STREAM_FIELD["kv"], STREAM_FIELD["hb"]
        fields = [node_field(n, p) for n in node_ids for p in (kv, hbs)]
        try:
            vals = cast(list[bytes | None], await self.client.hmget(self.keys.nodes, fields))  # (see _bytes_hash)
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        out = {}
        for i, n in enumerate(node_ids):
            kv_v, hbs_v = vals[2 * i], vals[2 * i + 1]
            if kv_v is not None or hbs_v is not None:
                out[n] = parse_stream(kv_v, hbs_v)
        return out

    async def clear(self) -> None:
        try:
            async for batch in self._scan(self.keys.all_pattern):
                await self.client.unlink(*batch)
            # A fresh random version and base, so no reader mistakes the new node hash for one it cached.
            await self.client.set(self.keys.version, secrets.randbits(48))  # exact as a sorted-set score
            await self.client.set(self.keys.base, secrets.token_hex(8))
            # A new generation: writers folded on the old view are refused from now on.
            gen = secrets.token_hex(8)
            await self.client.set(self.keys.generation, gen)
            self.generation = gen
        except RedisError as e:
            raise ViewStoreError(f"view clear failed: {e}") from e
        self._decoder.clear()

    async def compact(self, batch: int = 1000) -> dict[str, int]:
        """Drop the holder entries of retired slots (nodes cleared or restarted) from every block key,
        then free those slots for reuse. Safe to run beside live writes and other compactions
        (the script skips any slot no longer retired); one SCAN pass over the block keys."""
        try:
            retired = sorted(int(x) for x in await self.client.smembers(self.keys.retired))
            if not retired:
                return {"slots_freed": 0, "bits_cleared": 0, "keys_deleted": 0}
            listed = ",".join(map(str, retired))
            cleared = deleted = 0
            async for keys in self._scan(self.keys.block_pattern, count=batch):
                keys = [k for k in keys if self.keys.block_of(k) is not None]
                if keys:
                    c, d = await self._eval(self._compact, [self.keys.retired, *keys], [listed])
                    cleared += int(c)
                    deleted += int(d)
            freed = int(await self._eval(self._free, [self.keys.retired, self.keys.free, self.keys.version], [listed]))
        except RedisError as e:
            raise ViewStoreError(f"view compaction failed: {e}") from e
        return {"slots_freed": freed, "bits_cleared": cleared, "keys_deleted": deleted}

    # --- reading ------------------------------------------------------------

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        """Every node's state and its longest prefix of ``chain``: one round trip."""
        try:
            async with self.client.pipeline(transaction=True) as p:  # one instant: blocks, nodes, fences
                if self.cluster:  # ~10 us of Lua on the server, so on a cluster only
                    p.eval(_TIME_LUA, 1, self.keys.generation)
                else:
                    p.time()
                if chain:
                    p.execute_command("MGET", *self.keys.blocks(chain))  # (a cluster pipeline refuses p.mget)
                p.hgetall(self.keys.nodes)
                p.hgetall(self.keys.watermark)
                res = await p.execute()
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        if chain:
            (sec, usec), values, raw_nodes, raw_wm = res
        else:
            (sec, usec), raw_nodes, raw_wm = res
            values = []
        nodes, slot_nodes = self._decoder.decode(raw_nodes)
        return snapshot_from_replies((sec, usec), values, nodes, slot_nodes, raw_wm.items(), now_ms)

    async def nodes(self) -> list[NodeState]:
        try:
            raw = _bytes_hash(await self.client.hgetall(self.keys.nodes))
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return list(self._decoder.decode(raw)[0])

    async def watermark(self) -> dict[str, int]:
        return await self._offsets(self.keys.watermark)

    async def block_count(self) -> int:
        """Block keys stored (a scan: for tools and benchmarks, not for the hot path)."""
        n = 0
        async for batch in self._scan(self.keys.block_pattern):
            n += sum(1 for k in batch if self.keys.block_of(k) is not None)
        return n

    async def dump(self) -> dict[str, Any]:
        try:
            raw_nodes = _bytes_hash(await self.client.hgetall(self.keys.nodes))
            blocks: list[tuple[bytes, bytes | None]] = []
            async for batch in self._scan(self.keys.block_pattern):
                batch = [k for k in batch if self.keys.block_of(k) is not None]
                if batch:
                    blocks += zip(batch, cast(list[bytes | None], await self.client.mget(batch)))
            raw_wm = _bytes_hash(await self.client.hgetall(self.keys.watermark))
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return dump_from_replies(self.keys, raw_nodes, blocks, raw_wm.items())

    async def server_info(self, section: str) -> dict[str, Any]:
        """``INFO section`` of the server holding the view (on a cluster: the slot's primary)."""
        info = await self.client.info(section, **await self._target())
        if self.cluster and isinstance(info, dict) and len(info) == 1 and isinstance(next(iter(info.values())), dict):
            (info,) = info.values()  # a cluster client may answer {node: info}
        return info

    async def memory_bytes(self) -> int:
        """Redis ``used_memory`` (the whole server; for benchmarks on a dedicated instance)."""
        return int((await self.server_info("memory"))["used_memory"])


def _bytes_hash(reply: Mapping[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    """A hash as the store's client returns it: it decodes nothing (``decode_responses=False``),
    so names and values are bytes (redis-py's types allow str too)."""
    return cast(dict[bytes, bytes], reply)


def _split(enc: list[list[Any]]) -> list[list[list[Any]]]:
    """Split one record's operations so that no piece carries more than ``_CHUNK_KEYS`` keys."""
    pieces: list[list[list[Any]]] = []
    cur: list[list[Any]] = []
    weight = 0
    for o in enc:
        if o[0] in (1, 2) and len(o[3]) > _CHUNK_KEYS:
            step = _CHUNK_KEYS
            parts = [[o[0], o[1], o[2], o[3][i : i + step]] for i in range(0, len(o[3]), step)]
        else:
            parts = [o]
        for part in parts:
            w = len(part[3]) if part[0] in (1, 2) else 1
            if cur and weight + w > _CHUNK_KEYS:
                pieces.append(cur)
                cur, weight = [], 0
            cur.append(part)
            weight += w
    if cur:
        pieces.append(cur)
    return pieces


async def _scan_batches(client: Any, pattern: str, count: int = 2000, **target: Any) -> AsyncIterator[list[bytes]]:
    cursor = 0
    while True:
        cursor, keys = await client.execute_command("SCAN", cursor, "MATCH", pattern, "COUNT", count, **target)
        if isinstance(cursor, dict):  # a cluster client answers {node: cursor}
            (cursor,) = cursor.values()
        cursor = int(cursor)
        if keys:
            yield keys
        if cursor == 0:
            break
