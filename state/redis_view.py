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
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
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
from .view import NodeState, Outcome, ViewSnapshot
from .write import Group, Record, fold_and_write

_CHUNK_KEYS = 20_000  # block keys per script call: keeps each call well under ~20 ms

# Every script declares every key it touches (KEYS), all of one namespace and so of one
# cluster slot (state.keys: the {ns} hash tag).

# KEYS: 1 gen, 2 nodes, 3 wm, 4 slots, 5 meta, 6 free, 7 retired, 8 ver, 9 chg, then the block keys
# the operations name; ARGV: 1 the groups (msgpack), 2 the generation the write was folded on.
# A block operation is {code, node, tier, index of its first block key in KEYS, count}.
_APPLY_LUA = r"""
local groups = cmsgpack.unpack(ARGV[1])
-- generation check: a write folded on another generation of the view (lost, replaced) is refused whole
if ARGV[2] ~= redis.call('GET', KEYS[1]) then
  local lost = {}
  for gi = 1, #groups do lost[gi] = 4 end
  return lost
end
local nodes, wmkey, slotkey, metakey, freekey, retiredkey = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local SEP = '\31'
local slots = {}
local function slot_of(node, create)
  local s = slots[node]
  if s then return s end
  s = redis.call('HGET', nodes, node .. SEP .. 'slot')
  if s then
    s = tonumber(s)
  elseif create then
    local free = redis.call('ZPOPMIN', freekey)
    if free[1] then
      s = tonumber(free[1])
    else
      s = redis.call('HINCRBY', metakey, 'next_slot', 1) - 1
    end
    redis.call('HSET', nodes, node .. SEP .. 'slot', s)
    redis.call('HSET', slotkey, s, node)
  else
    return nil
  end
  slots[node] = s
  return s
end
-- A block key's value: its holders, one 2-byte little-endian entry slot * 8 + tiers per node
-- (bit t of tiers: held in tier t; state.keys). find(v, lim, hi, lo) is the 1-based position
-- of the entry of the slot whose entry bytes are (lo + tiers, hi) among the first lim bytes of
-- v, and its tiers; nil when the slot holds none. It jumps between the slot's high byte
-- (string.find, in C) and checks alignment and the low byte.
local function find(v, lim, hi, lo)
  local c = string.char(hi)
  local p = 2
  while true do
    p = string.find(v, c, p, true)
    if not p or p > lim then return nil end
    if p % 2 == 0 then
      local b = string.byte(v, p - 1)
      if b >= lo and b < lo + 8 then return p - 1, b - lo end
      p = p + 2
    else
      p = p + 1
    end
  end
end
local function has(t, bit) return t % (2 * bit) >= bit end
-- Can every node this group adds blocks for have a slot? (A slot must fit a holder entry.)
local function room(ops)
  local need, seen = 0, {}
  for oi = 1, #ops do
    local node = ops[oi][2]
    if ops[oi][1] == 1 and not seen[node] then
      seen[node] = true
      if not slot_of(node, false) then need = need + 1 end
    end
  end
  if need == 0 then return true end
  local taken = tonumber(redis.call('HGET', metakey, 'next_slot') or '0')
  return need <= MAX_SLOTS - taken + redis.call('ZCARD', freekey)
end
local out, fence, halted, touched = {}, {}, false, {}
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
      -- contiguity check: g[5] is the fence the record continues from (-2: unchecked)
      if ok == 1 and g[5] ~= -2 and g[5] ~= cur then
        ok = 3
        halted = true
      end
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
    -- no slot left for a new node: refuse the group (and the rest of the call) before it writes
    if ok == 1 and not room(ops) then
      ok = 5
      halted = true
    end
    if ok == 1 and fk ~= '' then fence[fk] = off end
  end
  out[gi] = ok
  if ok == 1 then
    for oi = 1, #ops do
      local op = ops[oi]
      local code, node = op[1], op[2]
      touched[node] = true
      if code == 1 or code == 2 then
        local tier, first, last = op[3], op[4], op[4] + op[5] - 1
        local s = slot_of(node, code == 1)
        if s then
          local bit = 2 ^ tier
          local hi, lo = math.floor(s / 32), (s % 32) * 8
          local delta = 0
          if code == 1 then
            -- Most added blocks are new keys: APPEND first (one call; its reply, 2, says the key
            -- was new). A block held already (a shared prefix) is read first from then on, until
            -- a block is new again, and rewritten whole with SET: APPEND grows a string with
            -- room to spare (up to twice its length), SET stores it at its size.
            local entry = string.char(lo + bit, hi)
            local fresh = true
            for i = first, last do
              local k = KEYS[i]
              if fresh then
                local n = redis.call('APPEND', k, entry)
                if n == 2 then
                  delta = delta + 1
                else
                  fresh = false
                  local v = redis.call('GET', k)
                  local at, t = find(v, n - 2, hi, lo)
                  if not at then
                    delta = delta + 1
                  else  -- held already: take the appended entry back, merge the tier
                    v = string.sub(v, 1, n - 2)
                    if not has(t, bit) then
                      v = string.sub(v, 1, at - 1) .. string.char(lo + t + bit, hi) .. string.sub(v, at + 2)
                      delta = delta + 1
                    end
                  end
                  redis.call('SET', k, v)
                end
              else
                local v = redis.call('GET', k)
                if not v then
                  redis.call('SET', k, entry)
                  delta = delta + 1
                  fresh = true
                else
                  local at, t = find(v, #v, hi, lo)
                  if not at then
                    redis.call('SET', k, v .. entry)
                    delta = delta + 1
                  elseif not has(t, bit) then
                    redis.call('SETRANGE', k, at - 1, string.char(lo + t + bit))
                    delta = delta + 1
                  end
                end
              end
            end
          else
            for i = first, last do
              local k = KEYS[i]
              local v = redis.call('GET', k)
              if v then
                local at, t = find(v, #v, hi, lo)
                if at and has(t, bit) then
                  delta = delta - 1
                  if t ~= bit then
                    redis.call('SETRANGE', k, at - 1, string.char(lo + t - bit))
                  elseif #v == 2 then
                    redis.call('DEL', k)
                  else
                    redis.call('SET', k, string.sub(v, 1, at - 1) .. string.sub(v, at + 2))
                  end
                end
              end
            end
          end
          if delta ~= 0 then redis.call('HINCRBY', nodes, node .. SEP .. 'b' .. tier, delta) end
        end
      elseif code == 3 then
        local s = slot_of(node, false)
        if s then
          redis.call('HDEL', nodes, node .. SEP .. 'slot')
          redis.call('SADD', retiredkey, s)
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
-- Readers re-read the node hash only when this moved, and then only the nodes scored above their version.
local ver = redis.call('INCR', KEYS[8])
for node in pairs(touched) do redis.call('ZADD', KEYS[9], ver, node) end
return out
""".replace("MAX_SLOTS", str(MAX_SLOTS))


# Drop the holder entries of retired slots from a batch of block keys (a key left with none is
# deleted); returns {tier marks cleared, keys deleted}. Only slots still retired are touched: a
# slot freed (and maybe reused) since the caller listed it is left alone.
# KEYS: 1 retired, then the block keys; ARGV: 1 the listed slots, comma-separated.
_COMPACT_LUA = r"""
local retired, any = {}, false
for s in string.gmatch(ARGV[1], '[^,]+') do
  if redis.call('SISMEMBER', KEYS[1], s) == 1 then retired[tonumber(s)] = true; any = true end
end
if not any then return {0, 0} end
local cleared, deleted = 0, 0
for i = 2, #KEYS do
  local k = KEYS[i]
  local v = redis.call('GET', k)
  if v then
    local keep, dropped = {}, false
    for j = 1, #v, 2 do
      local lo, hi = string.byte(v, j, j + 1)
      if retired[hi * 32 + math.floor(lo / 8)] then
        local t = lo % 8
        cleared = cleared + (t % 2) + (math.floor(t / 2) % 2) + math.floor(t / 4)
        dropped = true
      else
        keep[#keep + 1] = string.sub(v, j, j + 1)
      end
    end
    if dropped then
      if #keep == 0 then
        redis.call('DEL', k)
        deleted = deleted + 1
      else
        redis.call('SET', k, table.concat(keep))
      end
    end
  end
end
return {cleared, deleted}
"""

# After a full pass: the listed slots that are still retired become free for reuse.
# KEYS: 1 retired, 2 free, 3 ver; ARGV: 1 the listed slots.
_FREE_LUA = r"""
local n = 0
for s in string.gmatch(ARGV[1], '[^,]+') do
  if redis.call('SREM', KEYS[1], s) == 1 then
    redis.call('ZADD', KEYS[2], tonumber(s), s)
    n = n + 1
  end
end
if n > 0 then redis.call('INCR', KEYS[3]) end
return n
"""


# Partitions being rebuilt under generation ARGV[1]: pairs (topic:partition, end offset);
# a partition whose fence has reached end - 1 (or end <= 0) is done and leaves the hash.
# KEYS: 1 gen, 2 wm, 3 rebuild.
_REBUILD_LUA = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
for i = 2, #ARGV, 2 do
  local tp, target = ARGV[i], tonumber(ARGV[i + 1])
  local cur = tonumber(redis.call('HGET', KEYS[2], tp) or '-1')
  if cur >= target - 1 then redis.call('HDEL', KEYS[3], tp)
  else redis.call('HSET', KEYS[3], tp, target) end
end
return redis.call('HLEN', KEYS[3])
"""

# The server's clock inside the snapshot's MULTI/EXEC: a keyless TIME cannot be routed in a
# cluster transaction, a script declaring a key of the namespace can. KEYS: 1 gen (unused).
_TIME_LUA = "return redis.call('TIME')"

_FLAGS = (Outcome.FENCED, Outcome.APPLIED, Outcome.CONFLICT, Outcome.HOLE, Outcome.LOST)
"""The apply script's per-group reply (0 to 4) → outcome; 5: no node slot left (:meth:`RedisViewStore._run` raises)."""
_NO_SLOT = 5

# Adopt the view's generation, creating it when absent (a new view, or one lost): the
# partitions named (ARGV[2..]) are then marked as being rebuilt from the log, with the
# creation, atomically. Returns {generation, 1 if created here else 0}.
# KEYS: 1 gen, 2 rebuild; ARGV: 1 the new generation, 2.. the partitions.
_GENERATION_LUA = r"""
local g = redis.call('GET', KEYS[1])
if g then return {g, 0} end
g = ARGV[1]
redis.call('SET', KEYS[1], g)
for i = 2, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], -1) end
return {g, 1}
"""


def _conditions(ops: Sequence[Op]) -> list[list[str]]:
    """The script's compare-and-set checks for a group: ``[field, expected, value if absent]``."""
    return [
        [node_field(op.node, STREAM_FIELD[op.part]), stream_text(op.prev, op.part), stream_text(NodeStream(), op.part)]
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


def script_call(keys: ViewKeys, groups: list[list[Any]]) -> tuple[list[Any], list[list[Any]]]:
    """The apply script's KEYS (the namespace's fixed keys, then every block key an operation
    names, in order) and its groups with each block operation's keys replaced by
    ``first index in KEYS, count``: the script touches no key it was not given."""
    declared: list[Any] = [keys.generation, keys.nodes, keys.watermark, keys.slots, keys.meta, keys.free,
                           keys.retired, keys.version, keys.changes]
    pre = keys.block_prefix
    out = []
    for fk, off, ops, conds, after in groups:
        enc = []
        for o in ops:
            if o[0] in (1, 2):
                first = len(declared) + 1
                declared += [pre + k.to_bytes(8, "big") for k in o[3]]  # 8 = BLOCK_KEY_BYTES (hot loop)
                enc.append([o[0], o[1], o[2], first, len(o[3])])
            else:
                enc.append(o)
        out.append([fk, off, enc, conds, after])
    return declared, out


class RedisViewStore:
    """A :class:`state.view.ViewStore` in Redis; see the module docstring and :mod:`state.keys`."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
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
                             connection_class=HiredisPackedConnection, **redis.tls_options())
        return cls(client, namespace)

    async def close(self) -> None:
        await self.client.aclose()

    async def _target(self) -> dict[str, Any]:
        """On a cluster, the primary serving the namespace's slot (keyless and per-node
        commands, and scripts, are sent there); nothing on a single server. The client's slot
        map is (re)loaded first when it is new or an error marked it stale (a failover)."""
        if not self.cluster:
            return {}
        await self.client.initialize()
        return {"target_nodes": self.client.get_node_from_key(self.keys.generation)}

    async def _eval(self, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run ``script`` with every key it touches declared. On a cluster it goes straight to the
        slot's primary (redis-py would hash every one of up to ~20k block keys to find it;
        they all share the namespace's slot)."""
        if not self.cluster:
            return await script(keys=keys, args=args)
        target = await self._target()
        try:
            return await self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **target)
        except NoScriptError:
            await self.client.execute_command("SCRIPT LOAD", script.script, **target)
            return await self.client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **target)

    async def _scan(self, pattern: str, count: int = 2000):
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
            raw = await self.client.hgetall(key)
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
            res = await self._eval(self._script, declared, [pack_script_args(groups), self.generation])
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
            vals = await self.client.hmget(self.keys.nodes, fields)
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
            raw = await self.client.hgetall(self.keys.nodes)
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
            raw_nodes = await self.client.hgetall(self.keys.nodes)
            blocks: list[tuple[bytes, bytes | None]] = []
            async for batch in self._scan(self.keys.block_pattern):
                batch = [k for k in batch if self.keys.block_of(k) is not None]
                if batch:
                    blocks += zip(batch, await self.client.mget(batch))
            raw_wm = await self.client.hgetall(self.keys.watermark)
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


async def _scan_batches(client: Any, pattern: str, count: int = 2000, **target: Any):
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
