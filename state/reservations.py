"""In-flight reservations: load the routers placed that heartbeats do not show yet.

Every decision reserves, on its prefill instance, the prompt tokens it will
compute and one queued request, and on its decode instance one batch slot, the
prompt as context and the KV blocks of the whole request. A reservation counts
until the node's next heartbeat (one stamped later than the reservation) or until
``ttl``, whichever comes first; nothing has to release it explicitly.

Both stores keep, per node, the *cumulative* reserved amounts with a time-stamped
checkpoint per reservation, so "reserved since t" is ``cumulative now - cumulative
at t``: one lookup per node however many reservations are pending. Redis keys (next
to the view, ``ns`` = the view namespace): ``ns|resv`` hash node → cumulative
amounts, ``ns|resv|<node>`` sorted set of checkpoints scored by time (pruned past
``2 x ttl`` and expiring with it).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from conductor.errors import ViewStoreError

FIELDS = 5


@dataclass(frozen=True, slots=True)
class Load:
    """Amounts reserved on one node and not yet reflected by its heartbeats."""

    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_requests: int = 0
    decode_context_tokens: int = 0
    kv_blocks: int = 0

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.prefill_tokens, self.prefill_requests, self.decode_requests, self.decode_context_tokens,
                self.kv_blocks)

    def __bool__(self) -> bool:
        return any(self.as_tuple())


@dataclass(frozen=True, slots=True)
class Reservation:
    """What one decision adds: ``load`` on ``node``."""

    node: str
    load: Load


def placement_reservations(
    prefill: str, decode: str, *, prefill_tokens: int, context_tokens: int, kv_blocks: int
) -> list[Reservation]:
    """The reservations of one placement (one per node, merged when prefill == decode)."""
    pre = Load(prefill_tokens=prefill_tokens, prefill_requests=1)
    dec = Load(decode_requests=1, decode_context_tokens=context_tokens, kv_blocks=kv_blocks)
    if prefill == decode:
        return [Reservation(prefill, Load(*(a + b for a, b in zip(pre.as_tuple(), dec.as_tuple()))))]
    return [Reservation(prefill, pre), Reservation(decode, dec)]


class ReservationStore(Protocol):
    async def reserve(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        """Record ``reservations`` as made at ``now_ms`` (the view's clock)."""
        ...

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        """Per node of ``since_ms``, what was reserved after ``max(since_ms[node], now_ms - ttl)``.

        Nodes with nothing pending may be absent.
        """
        ...


class InMemoryReservations:
    """Reservations of one process (tests, the simulator, a router's degraded mode)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_ms = int(ttl_s * 1000)
        self._ts: dict[str, list[int]] = {}
        self._cum: dict[str, list[tuple[int, ...]]] = {}

    async def reserve(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        self.reserve_sync(reservations, now_ms)

    def reserve_sync(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        for r in reservations:
            ts = self._ts.setdefault(r.node, [])
            cum = self._cum.setdefault(r.node, [])
            last = cum[-1] if cum else (0,) * FIELDS
            if ts and now_ms < ts[-1]:
                now_ms = ts[-1]  # keep checkpoints sorted if the clock steps back
            ts.append(now_ms)
            cum.append(tuple(a + b for a, b in zip(last, r.load.as_tuple())))
            cut = bisect.bisect_left(ts, now_ms - 2 * self.ttl_ms)
            if cut > 1:  # keep one checkpoint before the cut as the baseline
                del ts[: cut - 1]
                del cum[: cut - 1]

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        return self.pending_sync(since_ms, now_ms)

    def pending_sync(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        out = {}
        floor = now_ms - self.ttl_ms
        for node, since in since_ms.items():
            ts = self._ts.get(node)
            if not ts:
                continue
            cum = self._cum[node]
            i = bisect.bisect_right(ts, max(since, floor))
            if i >= len(ts):
                continue
            base = cum[i - 1] if i > 0 else (0,) * FIELDS
            out[node] = Load(*(a - b for a, b in zip(cum[-1], base)))
        return out


_RESERVE_LUA = r"""
local ns, now, keep_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local hkey, skey = ns .. '|resv', ns .. '|resvseq'
local i = 4
while i <= #ARGV do
  local node = ARGV[i]
  local cur = {0, 0, 0, 0, 0}
  local raw = redis.call('HGET', hkey, node)
  if raw then
    local j = 1
    for v in string.gmatch(raw, '[^,]+') do cur[j] = tonumber(v); j = j + 1 end
  end
  local d = {}
  for j = 1, 5 do d[j] = tonumber(ARGV[i + j]); cur[j] = cur[j] + d[j] end
  local c = table.concat(cur, ',')
  redis.call('HSET', hkey, node, c)
  local seq = redis.call('HINCRBY', skey, node, 1)
  local zkey = ns .. '|resv|' .. node
  redis.call('ZADD', zkey, now, seq .. ':' .. c .. ':' .. table.concat(d, ','))
  redis.call('ZREMRANGEBYSCORE', zkey, '-inf', '(' .. (now - keep_ms))
  redis.call('PEXPIRE', zkey, keep_ms)
  i = i + 6
end
return 1
"""

# Per node: cumulative now - cumulative at the newest checkpoint <= since. With no such
# checkpoint left, the oldest remaining one minus its own delta is the baseline.
_PENDING_LUA = r"""
local ns = ARGV[1]
local hkey = ns .. '|resv'
local out = {}
local i = 2
local function nums(s)
  local t, j = {}, 1
  for v in string.gmatch(s, '[^,]+') do t[j] = tonumber(v); j = j + 1 end
  return t
end
while i <= #ARGV do
  local node, since = ARGV[i], ARGV[i + 1]
  local raw = redis.call('HGET', hkey, node)
  if raw then
    local zkey = ns .. '|resv|' .. node
    local cur = nums(raw)
    local base
    local last = redis.call('ZREVRANGEBYSCORE', zkey, since, '-inf', 'LIMIT', 0, 1)
    if last[1] then
      local _, _, c = string.find(last[1], '^%d+:([^:]+):')
      base = nums(c)
    else
      local first = redis.call('ZRANGE', zkey, 0, 0)
      if first[1] then
        local _, _, c, d = string.find(first[1], '^%d+:([^:]+):(.+)$')
        base = nums(c)
        local dd = nums(d)
        for j = 1, 5 do base[j] = base[j] - dd[j] end
      else
        base = cur
      end
    end
    local diff = {}
    local any = false
    for j = 1, 5 do diff[j] = cur[j] - base[j]; if diff[j] ~= 0 then any = true end end
    if any then
      out[#out + 1] = node
      out[#out + 1] = table.concat(diff, ',')
    end
  end
  i = i + 2
end
return out
"""


class RedisReservations:
    """Reservations shared by every router replica through Redis."""

    def __init__(self, client: aioredis.Redis, namespace: str, ttl_s: float) -> None:
        self.client = client
        self.ns = namespace
        self.ttl_ms = int(ttl_s * 1000)
        self._reserve = client.register_script(_RESERVE_LUA)
        self._pending = client.register_script(_PENDING_LUA)

    async def reserve(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        args: list[object] = [self.ns, now_ms, 2 * self.ttl_ms]
        for r in reservations:
            args.append(r.node)
            args.extend(r.load.as_tuple())
        try:
            await self._reserve(args=args)
        except RedisError as e:
            raise ViewStoreError(f"reservation write failed: {e}") from e

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        if not since_ms:
            return {}
        floor = now_ms - self.ttl_ms
        args: list[object] = [self.ns]
        for node, since in since_ms.items():
            args.extend((node, max(since, floor)))
        try:
            raw = await self._pending(args=args)
        except RedisError as e:
            raise ViewStoreError(f"reservation read failed: {e}") from e
        out = {}
        for k in range(0, len(raw), 2):
            node = raw[k].decode() if isinstance(raw[k], bytes) else raw[k]
            vals = raw[k + 1].decode() if isinstance(raw[k + 1], bytes) else raw[k + 1]
            out[node] = Load(*(int(float(v)) for v in vals.split(",")))
        return out

    async def clear(self) -> None:
        keys = [k async for k in self.client.scan_iter(match=f"{self.ns}|resv*", count=1000)]
        if keys:
            await self.client.unlink(*keys)
