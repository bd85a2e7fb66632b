"""In-flight reservations: load the routers placed that heartbeats do not show yet.

Every decision reserves, on its prefill instance, the prompt tokens it will
compute and one queued request, and on its decode instance one batch slot, the
prompt as context and the KV blocks of the whole request. A reservation counts
until the node's next heartbeat (one stamped later than the reservation) or until
``ttl``, whichever comes first; nothing has to release it explicitly.

The amounts are kept per node as *cumulative* sums with a time-stamped checkpoint
per reservation, so "reserved since t" is ``cumulative now - cumulative at t``: one
binary search per node however many reservations are pending.

Across router replicas the reservations are an event log: each router appends its
own, in small batches, to a Redis stream (``ns|resv-log``, trimmed to ``2 x ttl``)
and follows everyone else's into its in-memory copy. A decision therefore reads
reservations from memory (no round trip); a replica sees another's reservations a
few milliseconds after they are made (``flush_after_s`` plus one round trip).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from .connect import follower_read
from .events import Cut, EventSeq
from .keys import ViewKeys

FOLLOW_BLOCK_MS = 1_000
"""How long a follower's XREAD blocks when nothing is written (entries end it at once, so this
is not a delay; it is how often an idle follower asks again). :meth:`RedisReservations.close`
does not wait it out: it wakes its own read with a write (the buffered batch, else an empty one).
On a client with a shorter read timeout a follower blocks less (:func:`state.connect.block_ms_within`)."""

FIELDS = 5
MAX_BUFFERED = 100_000
StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""One entry of the reservation log: its id, its fields (``p`` producer, ``r`` reservations)."""
log = logging.getLogger(__name__)
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
        """Record ``reservations`` as made at ``now_ms`` (the view's clock).

        A store may buffer them briefly; its own next :meth:`pending` always sees them.
        """
        ...

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        """Per node of ``since_ms``, what was reserved after ``max(since_ms[node], now_ms - ttl)``.

        Nodes with nothing pending may be absent.
        """
        ...


class InMemoryReservations:
    """Reservations of one process (tests, the simulator, and each router's copy)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_ms = int(ttl_s * 1000)
        self._ts: dict[str, list[int]] = {}
        self._cum: dict[str, list[tuple[int, ...]]] = {}
        self.touched: set[str] = set()
        """Nodes reserved on since the last :meth:`take_touched`."""

    async def reserve(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        self.reserve_sync(reservations, now_ms)

    def reserve_sync(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        for r in reservations:
            self.add(r.node, now_ms, r.load.as_tuple())

    def add(self, node: str, ts_ms: int, amounts: tuple[int, ...]) -> None:
        """Record one reservation made at ``ts_ms`` (late arrivals are put in time order)."""
        self.touched.add(node)
        ts = self._ts.setdefault(node, [])
        cum = self._cum.setdefault(node, [])
        i = len(ts)
        if i and ts_ms < ts[-1]:
            i = bisect.bisect_right(ts, ts_ms)
        prev = cum[i - 1] if i else (0,) * FIELDS
        ts.insert(i, ts_ms)
        cum.insert(i, tuple(a + b for a, b in zip(prev, amounts)))
        for j in range(i + 1, len(cum)):  # a late arrival shifts the sums after it
            cum[j] = tuple(a + b for a, b in zip(cum[j], amounts))
        cut = bisect.bisect_left(ts, ts[-1] - 2 * self.ttl_ms)
        if cut > 1:  # keep one checkpoint before the cut as the baseline
            del ts[: cut - 1]
            del cum[: cut - 1]

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        return self.pending_sync(since_ms, now_ms)

    def take_touched(self) -> set[str]:
        """The nodes that got a reservation since the last call (for callers that keep their
        own per-node picture up to date, ``conductor.routing.index``)."""
        out, self.touched = self.touched, set()
        return out

    def pending_one(self, node: str, since_ms: int, now_ms: int) -> tuple[Load | None, int | None]:
        """What :meth:`pending_sync` gives ``node``, and the time at which that changes next
        without a new reservation (its oldest counted one expiring), or None."""
        ts = self._ts.get(node)
        if not ts:
            return None, None
        floor = now_ms - self.ttl_ms
        i = bisect.bisect_right(ts, max(floor, since_ms))
        if i >= len(ts):
            return None, None
        cum = self._cum[node]
        last = cum[-1]
        changes_at = ts[i] + self.ttl_ms
        if i:
            base = cum[i - 1]
            return Load(last[0] - base[0], last[1] - base[1], last[2] - base[2], last[3] - base[3],
                        last[4] - base[4]), changes_at
        return Load(*last), changes_at

    def pending_sync(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        out = {}
        for node, since in since_ms.items():
            load = self.pending_one(node, since, now_ms)[0]
            if load is not None:
                out[node] = load
        return out


class RedisReservations:
    """Reservations shared by every router replica through a Redis stream.

    Call :meth:`start` once (it catches up on the last ``2 x ttl`` of the log and
    starts following it) and :meth:`close` at the end (it flushes). ``reserve`` and
    ``pending`` never wait on Redis; a Redis outage only delays what the other
    replicas see (logged, retried with the next batch).
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str, ttl_s: float, *, producer_id: str,
                 flush_after_s: float = 0.01, block_ms: int = FOLLOW_BLOCK_MS,
                 follow_client: aioredis.Redis | RedisCluster | None = None) -> None:
        self.events = EventSeq()
        """This replica's numbers: one per :meth:`reserve` call (``state.events``)."""
        self._cut = Cut(producer_id, 2 * int(ttl_s * 1000))
        self.client = client
        self.follow_client, self.block_ms = follower_read(client, follow_client, block_ms)
        """What the follower reads with, and how long each read blocks: a client of its own
        (``follow_client``, closed by :meth:`close`) lets it block longer than ``client``'s read
        timeout allows."""
        self._own_follow_client = follow_client is not None
        self.key = ViewKeys(namespace).reservations
        self.ttl_ms = int(ttl_s * 1000)
        self.producer_id = producer_id
        self.flush_after_s = flush_after_s
        self.local = InMemoryReservations(ttl_s)
        self._buffer: list[str] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._follower: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_id = b"0-0"
        self.applied = 0  # entries of other replicas applied (for tests and metrics)
        self._flushing = asyncio.Lock()
        self._last_seq = 0
        """The number of the last reservation buffered (a batch's entry carries the last of it)."""

    # --- writing ----------------------------------------------------------------------

    def cut(self) -> dict[str, int]:
        """Per replica, the number of its last :meth:`reserve` applied here (``state.events.Cut``)."""
        return self._cut.as_dict()

    async def reserve(self, reservations: Sequence[Reservation], now_ms: int) -> None:
        """Reserve at once (numbered, before any wait: the number is ``events.last`` after the call)."""
        seq = self.events.stamp()
        self._cut.own_last = seq
        for r in reservations:
            a = r.load.as_tuple()
            self.local.add(r.node, now_ms, a)
            self._buffer.append(f"{now_ms},{r.node},{a[0]},{a[1]},{a[2]},{a[3]},{a[4]}")
        self._last_seq = seq
        if self._timer is None and self._buffer:
            self._timer = asyncio.get_running_loop().call_later(self.flush_after_s, self._flush_soon)

    def _flush_soon(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self, *, wake: bool = False) -> None:
        """Append the buffered reservations to the log now. ``wake``: append an empty batch when
        nothing is buffered (every follower's read returns; readers skip it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        async with self._flushing:  # one batch at a time: this replica's entries stay in its order
            await self._flush(wake)

    async def _flush(self, wake: bool) -> None:
        if not self._buffer:
            if wake:
                await self.client.xadd(self.key, {"p": self.producer_id, "r": ""})
            return
        batch, self._buffer = self._buffer, []
        newest = max(int(line.split(",", 1)[0]) for line in batch)
        try:
            await self.client.xadd(
                self.key, {"p": self.producer_id, "s": str(self._last_seq), "r": "\n".join(batch)},
                minid=max(newest - 2 * self.ttl_ms, 0), approximate=True,
            )
        except (RedisError, OSError) as e:
            # Retried with the next batch; past MAX_BUFFERED the oldest are dropped (they
            # would be past their ttl long before Redis is back anyway).
            self._buffer = (batch + self._buffer)[-MAX_BUFFERED:]
            log.warning("%d reservation(s) not shared yet: %s", len(self._buffer), e)

    # --- following --------------------------------------------------------------------

    async def start(self, now_ms: int) -> None:
        """Catch up on the log's last ``2 x ttl`` and follow it from there."""
        if self._follower is not None:
            return
        self._last_id = f"{max(now_ms - 2 * self.ttl_ms, 0)}-0".encode()
        try:
            while True:
                entries = cast(list[StreamEntry], await self.client.xrange(self.key, min=b"(" + self._last_id, count=1000))
                if not entries:
                    break
                self._apply(entries)
        except (RedisError, OSError) as e:
            log.warning("reservation log not readable yet: %s", e)
        self._follower = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        failing = False
        # Stopped by a flag, not by cancelling: a task cancelled inside XREAD BLOCK was seen
        # hanging for minutes in the driver's clean-up. Each read blocks at most ``block_ms``
        # (close's own write ends it sooner).
        while not self._stopping:
            try:
                res = cast(list[tuple[bytes, list[StreamEntry]]] | None,  # bytes: the client decodes nothing
                           await self.follow_client.xread({self.key: self._last_id}, block=self.block_ms, count=1000))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                (log.debug if failing else log.warning)("reservation log unreachable: %s", e)
                failing = True
                await asyncio.sleep(0.2)
                continue
            failing = False
            for _, entries in res or ():
                self._apply(entries)

    def _apply(self, entries: Sequence[StreamEntry]) -> None:
        me = self.producer_id.encode()
        for eid, fields in entries:
            self._last_id = eid
            if fields.get(b"p") == me:
                continue
            self._cut.saw(eid, fields)
            for line in fields.get(b"r", b"").decode().split("\n"):
                if not line:
                    continue  # an empty batch: a replica waking its own follower to stop (close)
                try:
                    ts, node, *amounts = line.split(",")
                    self.local.add(node, int(ts), tuple(int(x) for x in amounts))
                    self.applied += 1
                except ValueError:
                    log.warning("skipping a malformed reservation %r", line[:200])

    async def pending(self, since_ms: Mapping[str, int], now_ms: int) -> dict[str, Load]:
        return self.local.pending_sync(since_ms, now_ms)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Share what is buffered and stop following; returns within about ``timeout_s``, whatever
        Redis does (a reservation not shared by then is dropped: the others' copies would expire
        it within ``ttl`` anyway). The write (an empty batch if nothing is buffered) ends the
        follower's blocked read, so an idle follower's long block is not waited out."""
        self._stopping = True
        follower, self._follower = self._follower, None
        try:
            await asyncio.wait_for(self.flush(wake=follower is not None), timeout_s / 2)
        except TimeoutError:
            log.warning("%d reservation(s) not shared at shutdown (Redis too slow)", len(self._buffer))
        except (RedisError, OSError) as e:
            log.warning("could not wake the reservation follower at shutdown: %s", e)
        if follower is not None:
            done, _ = await asyncio.wait({follower}, timeout=timeout_s / 2)
            if not done:
                follower.cancel()
                await asyncio.wait({follower}, timeout=0.2)  # never wait on a read stuck in the driver
                log.warning("the reservation follower did not stop in time; abandoned it")
        if self._own_follow_client:
            with contextlib.suppress(RedisError, OSError):
                await self.follow_client.aclose()

    async def clear(self) -> None:
        """Delete the log (benchmarks and tests)."""
        self._buffer.clear()
        await self.client.delete(self.key)
