"""The view in Redis (or Valkey): the production store.

Key layout (``ns`` = ``settings.view_namespace``; ``|`` cannot occur in a namespace):

``ns|b<8-byte block key>``  string: a bitmask, bit ``3*slot + tier`` set when the node in
    ``slot`` holds the block in ``tier`` (0 hbm, 1 dram, 2 ssd). Read little-endian, so a
    block held only by low slots is a few bytes; the key is deleted when no bit is left.
``ns|nodes``  hash, one field per node attribute (``<node>\\x1f<attr>``): ``slot`` (its
    current slot), ``hb`` (heartbeat state, JSON), ``kv`` / ``hbs`` (stream state),
    ``b0`` ``b1`` ``b2`` (blocks indexed per tier).
``ns|slots``  hash slot → node id (every slot ever given out).  ``ns|meta``  next slot.
``ns|wm``     hash ``topic:partition`` → highest applied offset (the fence).

The routing read (:meth:`RedisViewStore.snapshot`) is ONE pipelined round trip: ``TIME``,
``MGET`` of the chain's block keys, ``HGETALL`` of the nodes and of the watermark; the
prefix walk runs client-side on integer masks (``state.view.longest_prefixes``).

Writes go through one Lua script per batch: per record, skip it if its offset is at or
below the fence of its ``topic:partition``; refuse it (and the rest of the call) if the
node's stream field no longer holds the state the record was folded from (another writer
got there first: the caller folds again); else apply its operations and raise the fence,
all atomically. Clearing a node (restart, all-blocks-cleared) retires its slot instead of
touching its blocks: O(1), and reads ignore retired slots (``ns|retired``). :meth:`RedisViewStore.compact`
(run periodically by the stream worker) later clears their stale bits in one SCAN pass and
frees the slots (``ns|free``) for new nodes, so masks stay as narrow as the cluster.

Bulk load (synthetic views, benchmarks): ``await store.apply_ops([(None, [AddBlocks(node,
tier, keys), ...]), ...])`` — no fence, chunked so that no single script runs long.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from schemas import Envelope
from schemas.codec import pack_script_args
from schemas.errors import ViewStoreError

from .fold import (
    TIER_NAMES,
    AddBlocks,
    ClearNode,
    NodeStream,
    Op,
    RemoveBlocks,
    SetHeartbeat,
    SetStream,
    UnfoldableRecord,
)
from .memory import FENCED, canonical_dump
from .view import CONFLICT, NodeState, SourcePosition, ViewSnapshot, longest_prefixes
from .write import fold_and_write

SEP = "\x1f"
_CHUNK_KEYS = 20_000  # block keys per script call: keeps each call well under ~20 ms

_APPLY_LUA = r"""
local ns = ARGV[1]
local groups = cmsgpack.unpack(ARGV[2])
local nodes, wmkey, bpre = ns .. '|nodes', ns .. '|wm', ns .. '|b'
local SEP = '\31'
local slots = {}
local function slot_of(node, create)
  local s = slots[node]
  if s then return s end
  s = redis.call('HGET', nodes, node .. SEP .. 'slot')
  if s then
    s = tonumber(s)
  elseif create then
    local free = redis.call('ZPOPMIN', ns .. '|free')
    if free[1] then
      s = tonumber(free[1])
    else
      s = redis.call('HINCRBY', ns .. '|meta', 'next_slot', 1) - 1
    end
    redis.call('HSET', nodes, node .. SEP .. 'slot', s)
    redis.call('HSET', ns .. '|slots', s, node)
  else
    return nil
  end
  slots[node] = s
  return s
end
local function bitoff(p) return math.floor(p / 8) * 8 + 7 - (p % 8) end
local out, fence, halted = {}, {}, false
for gi = 1, #groups do
  local g = groups[gi]
  local fk, off, ops, conds = g[1], g[2], g[3], g[4]
  local ok = 1
  if halted then
    ok = 2
  else
    if fk ~= '' then
      local cur = fence[fk]
      if cur == nil then cur = tonumber(redis.call('HGET', wmkey, fk) or '-1') end
      if off <= cur then ok = 0 end
    end
    -- compare-and-set on the stream state the record was folded from
    if ok == 1 and conds then
      for ci = 1, #conds do
        local c = conds[ci]
        if (redis.call('HGET', nodes, c[1]) or c[3]) ~= c[2] then
          ok = 2
          halted = true
          break
        end
      end
    end
    if ok == 1 and fk ~= '' then fence[fk] = off end
  end
  out[gi] = ok
  if ok == 1 then
    for oi = 1, #ops do
      local op = ops[oi]
      local code, node = op[1], op[2]
      if code == 1 or code == 2 then
        local tier, keys = op[3], op[4]
        local s = slot_of(node, code == 1)
        if s then
          local o = bitoff(3 * s + tier)
          local delta = 0
          if code == 1 then
            for i = 1, #keys, 8 do
              if redis.call('SETBIT', bpre .. string.sub(keys, i, i + 7), o, 1) == 0 then delta = delta + 1 end
            end
          else
            for i = 1, #keys, 8 do
              local k = bpre .. string.sub(keys, i, i + 7)
              if redis.call('GETBIT', k, o) == 1 then
                redis.call('SETBIT', k, o, 0)
                delta = delta - 1
                if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
              end
            end
          end
          if delta ~= 0 then redis.call('HINCRBY', nodes, node .. SEP .. 'b' .. tier, delta) end
        end
      elseif code == 3 then
        local s = slot_of(node, false)
        if s then
          redis.call('HDEL', nodes, node .. SEP .. 'slot')
          redis.call('SADD', ns .. '|retired', s)
          slots[node] = nil
        end
        redis.call('HDEL', nodes, node .. SEP .. 'b0', node .. SEP .. 'b1', node .. SEP .. 'b2')
      else
        redis.call('HSET', nodes, node .. SEP .. op[3], op[4])
      end
    end
  end
end
for fk, off in pairs(fence) do redis.call('HSET', wmkey, fk, off) end
redis.call('INCR', ns .. '|ver')  -- readers re-read the node hash only when this moved
return out
"""


# Clear the bits of retired slots in a batch of block keys. Only slots still retired are
# touched: a slot freed (and maybe reused) since the caller listed it is left alone.
_COMPACT_LUA = r"""
local ns = ARGV[1]
local slots = {}
for s in string.gmatch(ARGV[2], '[^,]+') do
  if redis.call('SISMEMBER', ns .. '|retired', s) == 1 then slots[#slots + 1] = tonumber(s) end
end
local cleared, deleted = 0, 0
if #slots == 0 then return {0, 0} end
for i = 3, #ARGV do
  local k = ARGV[i]
  local touched = false
  for _, s in ipairs(slots) do
    for tier = 0, 2 do
      local p = 3 * s + tier
      local o = math.floor(p / 8) * 8 + 7 - (p % 8)
      if redis.call('GETBIT', k, o) == 1 then
        redis.call('SETBIT', k, o, 0)
        cleared = cleared + 1
        touched = true
      end
    end
  end
  if touched and redis.call('BITCOUNT', k) == 0 then
    redis.call('DEL', k)
    deleted = deleted + 1
  end
end
return {cleared, deleted}
"""

# After a full pass: the listed slots that are still retired become free for reuse.
_FREE_LUA = r"""
local ns = ARGV[1]
local n = 0
for s in string.gmatch(ARGV[2], '[^,]+') do
  if redis.call('SREM', ns .. '|retired', s) == 1 then
    redis.call('ZADD', ns .. '|free', tonumber(s), s)
    n = n + 1
  end
end
if n > 0 then redis.call('INCR', ns .. '|ver') end
return n
"""


_FIELD = {"kv": "kv", "hb": "hbs"}
"""Stream part → its field in the node hash."""


def _stream_field(s: NodeStream, part: str) -> str:
    return ",".join(map(str, s.part(part)))


def _parse_stream(kv: bytes | None, hbs: bytes | None) -> NodeStream:
    e, q, g, m = map(int, kv.split(b",")) if kv else (-1, -1, 0, 0)
    he, hq = map(int, hbs.split(b",")) if hbs else (-1, -1)
    return NodeStream(epoch=e, seq=q, gaps=g, missed=m, hb_epoch=he, hb_seq=hq)


def _conditions(ops: Sequence[Op]) -> list[list[str]]:
    """The script's compare-and-set checks for a group: ``[field, expected, value if absent]``."""
    return [
        [f"{op.node}{SEP}{_FIELD[op.part]}", _stream_field(op.prev, op.part), _stream_field(NodeStream(), op.part)]
        for op in ops
        if isinstance(op, SetStream) and op.prev is not None
    ]


def encode_ops(ops: Sequence[Op]) -> list[list[Any]]:
    """Operations in the script's compact form (block keys packed as 8-byte big-endian)."""
    out: list[list[Any]] = []
    for op in ops:
        if isinstance(op, (AddBlocks, RemoveBlocks)):
            if op.keys:
                packed = b"".join(k.to_bytes(8, "big") for k in op.keys)
                out.append([1 if isinstance(op, AddBlocks) else 2, op.node, op.tier, packed])
        elif isinstance(op, ClearNode):
            out.append([3, op.node])
        elif isinstance(op, SetHeartbeat):
            out.append([4, op.node, "hb", json.dumps(op.state, separators=(",", ":"), sort_keys=True)])
        elif isinstance(op, SetStream):
            out.append([4, op.node, _FIELD[op.part], _stream_field(op.stream, op.part)])
        else:
            raise TypeError(f"unknown view operation {op!r}")
    return out


def connection_url(settings: Any) -> str:
    """The URL to connect with: the settings' (with any separately set ACL user and password)."""
    return getattr(settings, "redis_connection_url", None) or settings.redis_url


def tls_options(settings: Any) -> dict[str, Any]:
    """redis-py options for a ``rediss://`` server verified against ``redis_ssl_ca_certs``."""
    ca = getattr(settings, "redis_ssl_ca_certs", None)
    if ca is None or not str(settings.redis_url).startswith("rediss://"):
        return {}
    return {"ssl_ca_certs": str(ca)}


class RedisViewStore:
    """A :class:`state.view.ViewStore` in Redis; see the module docstring for the layout."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        if "|" in namespace:
            raise ValueError("a view namespace cannot contain '|'")
        self.client = client
        self.ns = namespace
        self._bpre = f"{namespace}|b".encode()
        self._nodes_key = f"{namespace}|nodes"
        self.version_key = f"{namespace}|ver"
        """Moves on every write to the node hash (apply, slot freeing, clear)."""
        self._wm_key = f"{namespace}|wm"
        self._script = client.register_script(_APPLY_LUA)
        self._compact = client.register_script(_COMPACT_LUA)
        self._free = client.register_script(_FREE_LUA)
        self._state_cache: dict[str, tuple[tuple[Any, ...], NodeState]] = {}

    @classmethod
    def from_settings(cls, settings: Any) -> "RedisViewStore":
        if not settings.redis_url:
            raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
        client = aioredis.from_url(connection_url(settings), decode_responses=False, socket_timeout=5.0,
                                   **tls_options(settings))
        return cls(client, settings.view_namespace)

    async def close(self) -> None:
        await self.client.aclose()

    def block_key(self, key: int) -> bytes:
        return self._bpre + key.to_bytes(8, "big")

    # --- writing ------------------------------------------------------------

    async def apply_ops(self, batch: Sequence[tuple[SourcePosition | None, Sequence[Op]]]) -> int:
        results = await self.apply_groups(batch)
        return sum(results)

    async def apply_groups(self, batch: Sequence[tuple[SourcePosition | None, Sequence[Op]]]) -> list[int]:
        """Run the script over ``batch`` in chunks; return a flag per group (``state.view``:
        1 applied, 0 fenced, 2 conflict). After a conflict no further chunk is sent.

        A fenced group always goes whole into one script call (its effect and its fence are
        one atomic step); an unfenced bulk group may be split to keep each call short.
        """
        flags: list[int] = []
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
            return CONFLICT in res

        for gi, (pos, ops) in enumerate(batch):
            enc = encode_ops(ops)
            conds = _conditions(ops)
            pieces = [enc] if pos is not None else (_split(enc) or [[]])
            for i, piece in enumerate(pieces):
                fk, off = (pos.key, pos.offset) if pos is not None else ("", 0)
                chunk.append([fk, off, piece, conds if i == 0 else []])
                owners.append(gi if i == 0 else -1)
                weight += sum(len(o[3]) // 8 if o[0] in (1, 2) else 1 for o in piece) + 1
                if weight >= _CHUNK_KEYS and await flush():
                    return flags + [CONFLICT] * (len(batch) - len(flags))
        if chunk:
            await flush()
        return flags

    async def _run(self, groups: list[list[Any]]) -> list[int]:
        try:
            res = await self._script(args=[self.ns, pack_script_args(groups)])
        except RedisError as e:
            raise ViewStoreError(f"view write failed: {e}") from e
        return [int(x) for x in res]

    async def apply(self, records: Sequence[tuple[Envelope, SourcePosition | None]]) -> list[str]:
        """Fold each record with the stream state stored in Redis, then apply the batch atomically
        per record (``state.write.fold_and_write``). A record whose position the view has
        applied already is reported ``fenced``."""
        w = await fold_and_write(self, records)
        outcomes = []
        for ok, f in zip(w.flags, w.folds):
            if isinstance(f, UnfoldableRecord):
                raise f
            outcomes.append(f.outcome if ok and f is not None else FENCED)
        return outcomes

    async def streams(self, node_ids: Sequence[str]) -> dict[str, NodeStream]:
        if not node_ids:
            return {}
        fields = [f"{n}{SEP}{p}" for n in node_ids for p in ("kv", "hbs")]
        try:
            vals = await self.client.hmget(self._nodes_key, fields)
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        out = {}
        for i, n in enumerate(node_ids):
            kv, hbs = vals[2 * i], vals[2 * i + 1]
            if kv is not None or hbs is not None:
                out[n] = _parse_stream(kv, hbs)
        return out

    async def clear(self) -> None:
        try:
            async for batch in _scan_batches(self.client, f"{self.ns}|*"):
                await self.client.unlink(*batch)
            # A fresh random version, so no reader mistakes the new node hash for one it cached.
            await self.client.set(self.version_key, secrets.randbits(62))
        except RedisError as e:
            raise ViewStoreError(f"view clear failed: {e}") from e
        self._state_cache.clear()

    async def compact(self, batch: int = 1000) -> dict[str, int]:
        """Clear the bits of retired slots (nodes cleared or restarted) from every block key,
        then free those slots for reuse. Safe to run beside live writes and other compactions
        (the script skips any slot no longer retired); one SCAN pass over the block keys."""
        try:
            retired = sorted(int(x) for x in await self.client.smembers(f"{self.ns}|retired"))
            if not retired:
                return {"slots_freed": 0, "bits_cleared": 0, "keys_deleted": 0}
            listed = ",".join(map(str, retired))
            n_pre = len(self._bpre)
            cleared = deleted = 0
            async for keys in _scan_batches(self.client, self._bpre.decode() + "*", count=batch):
                keys = [k for k in keys if len(k) == n_pre + 8]
                if keys:
                    c, d = await self._compact(args=[self.ns, listed, *keys])
                    cleared += int(c)
                    deleted += int(d)
            freed = int(await self._free(args=[self.ns, listed]))
        except RedisError as e:
            raise ViewStoreError(f"view compaction failed: {e}") from e
        return {"slots_freed": freed, "bits_cleared": cleared, "keys_deleted": deleted}

    # --- reading ------------------------------------------------------------

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        """Every node's state and its longest prefix of ``chain``: one round trip."""
        pre = self._bpre
        try:
            async with self.client.pipeline(transaction=False) as p:
                p.time()
                if chain:
                    p.mget([pre + k.to_bytes(8, "big") for k in chain])
                p.hgetall(self._nodes_key)
                p.hgetall(self._wm_key)
                res = await p.execute()
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        if chain:
            (sec, usec), values, raw_nodes, raw_wm = res
        else:
            (sec, usec), raw_nodes, raw_wm = res
            values = []
        nodes, slot_nodes = self._parse_nodes(raw_nodes)
        return assemble_snapshot((sec, usec), values, nodes, slot_nodes, raw_wm.items(), now_ms)

    def _parse_nodes(self, raw: dict[bytes, bytes]) -> tuple[tuple[NodeState, ...], dict[int, str]]:
        per: dict[str, dict[str, bytes]] = {}
        for f, v in raw.items():
            node, _, attr = f.decode().rpartition(SEP)
            per.setdefault(node, {})[attr] = v
        states = []
        slot_nodes: dict[int, str] = {}
        for node in sorted(per):
            a = per[node]
            if "slot" in a:
                slot_nodes[int(a["slot"])] = node
            sig = (a.get("hb"), a.get("kv"), a.get("b0"), a.get("b1"), a.get("b2"))
            hit = self._state_cache.get(node)
            if hit is not None and hit[0] == sig:
                states.append(hit[1])
                continue
            st = _parse_stream(a.get("kv"), a.get("hbs"))
            hb = json.loads(a["hb"]) if "hb" in a else {}
            blocks = {t: int(a[f"b{i}"]) for i, t in enumerate(TIER_NAMES) if int(a.get(f"b{i}", 0) or 0) > 0}
            state = NodeState(
                node_id=node,
                role=hb.pop("role", "prefill"),
                epoch=max(st.epoch, 0),
                last_seq=st.seq,
                seq_gaps=st.gaps,
                blocks=blocks,
                **hb,
            )
            self._state_cache[node] = (sig, state)
            states.append(state)
        return tuple(states), slot_nodes

    async def nodes(self) -> list[NodeState]:
        try:
            raw = await self.client.hgetall(self._nodes_key)
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return list(self._parse_nodes(raw)[0])

    async def watermark(self) -> dict[str, int]:
        try:
            raw = await self.client.hgetall(self._wm_key)
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return {k.decode(): int(v) for k, v in raw.items()}

    async def block_count(self) -> int:
        """Block keys stored (a scan: for tools and benchmarks, not for the hot path)."""
        n = 0
        async for batch in _scan_batches(self.client, self._bpre.decode() + "*"):
            n += sum(1 for k in batch if len(k) == len(self._bpre) + 8)
        return n

    async def dump(self) -> dict[str, Any]:
        try:
            raw_nodes = await self.client.hgetall(self._nodes_key)
            nodes, slot_nodes = self._parse_nodes(raw_nodes)
            streams = {}
            for f, v in raw_nodes.items():
                node, _, attr = f.decode().rpartition(SEP)
                streams.setdefault(node, [None, None])
                if attr == "kv":
                    streams[node][0] = v
                elif attr == "hbs":
                    streams[node][1] = v
            blocks = []
            n_pre = len(self._bpre)
            async for batch in _scan_batches(self.client, self._bpre.decode() + "*"):
                batch = [k for k in batch if len(k) == n_pre + 8]
                if not batch:
                    continue
                values = await self.client.mget(batch)
                for k, v in zip(batch, values):
                    if not v:
                        continue
                    m = int.from_bytes(v, "little")
                    holders = {}
                    for slot, node in slot_nodes.items():
                        tiers = tuple(TIER_NAMES[t] for t in range(3) if m >> (3 * slot + t) & 1)
                        if tiers:
                            holders[node] = tiers
                    blocks.append((int.from_bytes(k[n_pre:], "big"), holders))
            wm = await self.watermark()
        except RedisError as e:
            raise ViewStoreError(f"view read failed: {e}") from e
        return canonical_dump(nodes, {n: _parse_stream(*v) for n, v in streams.items()}, blocks, wm)

    async def memory_bytes(self) -> int:
        """Redis ``used_memory`` (the whole server; for benchmarks on a dedicated instance)."""
        info = await self.client.info("memory")
        return int(info["used_memory"])


def _split(enc: list[list[Any]]) -> list[list[list[Any]]]:
    """Split one record's operations so that no piece carries more than ``_CHUNK_KEYS`` keys."""
    pieces: list[list[list[Any]]] = []
    cur: list[list[Any]] = []
    weight = 0
    for o in enc:
        if o[0] in (1, 2) and len(o[3]) // 8 > _CHUNK_KEYS:
            step = _CHUNK_KEYS * 8
            parts = [[o[0], o[1], o[2], o[3][i : i + step]] for i in range(0, len(o[3]), step)]
        else:
            parts = [o]
        for part in parts:
            w = len(part[3]) // 8 if part[0] in (1, 2) else 1
            if cur and weight + w > _CHUNK_KEYS:
                pieces.append(cur)
                cur, weight = [], 0
            cur.append(part)
            weight += w
    if cur:
        pieces.append(cur)
    return pieces


async def _scan_batches(client: aioredis.Redis, pattern: str, count: int = 2000):
    cursor = 0
    while True:
        cursor, keys = await client.scan(cursor=cursor, match=pattern, count=count)
        if keys:
            yield keys
        if cursor == 0:
            break


def assemble_snapshot(
    time_reply: Sequence[Any],
    values: Sequence[bytes | None],
    nodes: tuple[NodeState, ...],
    slot_nodes: dict[int, str],
    watermark: Iterable[tuple[bytes, bytes]],
    now_ms: int | None = None,
) -> ViewSnapshot:
    """A :class:`ViewSnapshot` from the replies of the one-round-trip read (``TIME``, the
    ``MGET`` of the chain's block keys, parsed nodes, watermark pairs); shared by this store
    and the router's raw reader so both read the layout the same way."""
    if now_ms is None:
        sec, usec = time_reply
        now_ms = int(sec) * 1000 + int(usec) // 1000
    frm = int.from_bytes
    prefix = longest_prefixes((frm(v, "little") if v else 0 for v in values), slot_nodes) if values else {}
    return ViewSnapshot(now_ms=now_ms, nodes=nodes, prefix=prefix,
                        watermark={k.decode(): int(v) for k, v in watermark})


def now_ms() -> int:
    return int(time.time() * 1000)
