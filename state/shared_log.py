"""Decision-time records shared by every process through a Redis stream, read from memory.

The pending blocks (:mod:`state.pending`) and the in-flight ledger (:mod:`state.inflight`) are
folds of time-stamped operations whose result does not depend on the order they arrive in.
So sharing them is only moving operations: each process applies its own at once to its
in-memory copy, appends them in small batches to a stream (``ns|pend-log``, ``ns|infl-log``,
trimmed to the span that can still matter), and follows everyone else's into the same copy.
Reads never wait on Redis; another process sees an operation ``flush_after_s`` plus one round
trip after it was made. A Redis outage only delays what the others see (logged; retried with
the next batch). :class:`SharedLog` is the stream part, written once for both.

**What a reader had seen.** Operations arrive a flush and a round trip after they were made, so
what a decision counted depends on which had arrived, not only on their times. Each producer
numbers what it shares (:class:`EventSeq`: the operations of one call, a placement's blocks and
its charge, share a number; numbers grow across restarts), each entry carries the last number in
it, and a follower knows, per producer, the last number it applied (:meth:`SharedLog.cut`). A
decision records that cut and its own number, an outcome its releases' numbers, so ``explain``
applies exactly the operations the decision's router had (``conductor.routing.explain``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from .connect import follower_read
from .events import Cut, EventSeq
from .inflight import Charged, Finished, FirstToken, InflightOp, InMemoryInflight, InstanceLoad
from .inflight import decode_op as decode_inflight
from .inflight import encode_op as encode_inflight
from .keys import ViewKeys
from .pending import Confirmed, InMemoryPendingBlocks, PendingPrefix, Released, decode_session, encode_session
from .pending import decode_op as decode_pending
from .pending import encode_op as encode_pending
from .reservations import FOLLOW_BLOCK_MS

MAX_BUFFERED = 100_000
KEEPALIVE_MS = 2_000
"""A producer with open charges appends at least this often (an empty entry when it has nothing else)."""
DEAD_AFTER_MS = 10_000
"""A producer silent this long with open charges has died: a follower ends its charges for it."""
StreamEntry = tuple[bytes, dict[bytes, bytes]]
log = logging.getLogger(__name__)


class SharedLog:
    """One Redis stream of operations: ``append`` buffers (flushed after ``flush_after_s``),
    ``start`` catches up on the last ``retain_ms`` and follows; every other producer's
    operation is handed to ``apply`` (a JSON-decoded item; a ValueError skips it). ``events``:
    the producer's numbering, shared with its other logs (else one of this log's own)."""

    def __init__(self, client: aioredis.Redis | RedisCluster, key: str, *, producer_id: str, retain_ms: int,
                 apply: Callable[[Any], None], flush_after_s: float = 0.01, block_ms: int = FOLLOW_BLOCK_MS,
                 events: EventSeq | None = None, follow_client: aioredis.Redis | RedisCluster | None = None,
                 group: LogGroup | None = None, heard: Callable[[str, int], None] | None = None) -> None:
        self.client = client
        self._heard = heard
        """Told (producer, the entry's stream time in ms) of every entry applied here (another
        producer's, or an earlier process's under this id), empty ones too, before its operations."""
        self.group = group if group is not None else LogGroup(client, flush_after_s=flush_after_s, block_ms=block_ms,
                                                              follow_client=follow_client)
        """The logs this one is written and followed with (:class:`LogGroup`; alone, a group of its own)."""
        self.group.join(self)
        self.follow_client, self.block_ms = self.group.follow_client, self.group.block_ms
        """What the follower reads with (its owner closes it), and how long each read blocks: a
        client of its own lets it block longer than ``client``'s read timeout allows (the group's)."""
        self.key = key
        self.producer_id = producer_id
        self.retain_ms = retain_ms
        self._apply_one = apply
        self.events = events if events is not None else EventSeq()
        self._born = self.events.last
        """Event numbers above this are this process's own (applied when made). An entry under this
        producer id numbered at or below it is an earlier process's that ran under the same id (a
        gateway restarted with a fixed ``--gateway-id``): applied like another producer's, since the
        others count it too (:meth:`RedisInflight.leftovers` ends its charges)."""
        self._buffer: list[tuple[int, int, Any]] = []
        self._cut = Cut(producer_id, retain_ms)
        self._follower: asyncio.Task[None] | None = None
        self._last_id = b"0-0"
        self.applied = 0
        """Operations of other producers applied (for tests and metrics)."""

    @property
    def position(self) -> bytes:
        """The id of the last stream entry read (``b"0-0"`` before any)."""
        return self._last_id

    @property
    def buffered(self) -> bool:
        """Whether operations wait for the next flush."""
        return bool(self._buffer)

    def cut(self) -> dict[str, int]:
        """Per producer, the number of the last event whose operations on this stream are applied
        here (this producer's own: the last it appended; a producer not named: none of its)."""
        return self._cut.as_dict()

    def append(self, item: Any, at_ms: int) -> int:
        """Share ``item`` (JSON-able, stamped ``at_ms``) with the next batch; returns its event number."""
        seq = self.events.stamp()
        self._cut.own_last = seq
        self._buffer.append((at_ms, seq, item))
        self.group.schedule()
        return seq

    async def flush(self, *, wake: bool = False) -> None:
        """Append the buffered operations to the stream now, with the group's other logs' in the
        same round trip. ``wake``: append an empty batch when nothing is buffered (every
        follower's read returns; readers apply nothing)."""
        await self.group.flush(wake=self if wake else None)

    def _take(self) -> list[tuple[int, int, Any]]:
        batch, self._buffer = self._buffer, []
        return batch

    def _entry(self, batch: list[tuple[int, int, Any]]) -> tuple[dict[Any, Any], int]:
        """The stream entry of ``batch`` and the oldest id the stream keeps (``MINID``)."""
        newest = max(at for at, _, _ in batch)
        return ({"p": self.producer_id, "s": str(max(seq for _, seq, _ in batch)),
                 "o": json.dumps([item for _, _, item in batch], separators=(",", ":"))},
                max(newest - self.retain_ms, 0))

    def _empty_entry(self) -> dict[Any, Any]:
        return {"p": self.producer_id, "o": "[]"}

    def _restore(self, batch: list[tuple[int, int, Any]], e: BaseException) -> None:
        """``batch`` was not appended: retried with the next one; past MAX_BUFFERED the oldest go
        (long past mattering)."""
        self._buffer = (batch + self._buffer)[-MAX_BUFFERED:]
        log.warning("%d operation(s) not shared on %s yet: %s", len(self._buffer), self.key, e)

    async def start(self, now_ms: int) -> None:
        """Catch up on the stream's last ``retain_ms`` and follow it from there."""
        if self._follower is not None:
            return
        self._last_id = f"{max(now_ms - self.retain_ms, 0)}-0".encode()
        try:
            while True:
                entries = cast(list[StreamEntry],
                               await self.client.xrange(self.key, min=b"(" + self._last_id, count=1000))
                if not entries:
                    break
                self._apply(entries)
        except (RedisError, OSError) as e:
            log.warning("%s not readable yet: %s", self.key, e)
        self._follower = self.group.follow(self)

    def _apply(self, entries: Sequence[StreamEntry]) -> None:
        me = self.producer_id.encode()
        for eid, fields in entries:
            self._last_id = eid
            producer = fields.get(b"p")
            if producer == me and not self._predecessor(fields):
                continue  # applied when made
            if self._heard is not None and producer is not None:
                with contextlib.suppress(ValueError):
                    self._heard(producer.decode(), int(eid.split(b"-", 1)[0]))
            try:
                items = json.loads(fields.get(b"o", b"[]"))
            except ValueError:
                log.warning("skipping a malformed entry %r of %s", eid, self.key)
                continue
            self._cut.saw(eid, fields)
            for item in items if isinstance(items, list) else ():
                try:
                    self._apply_one(item)
                    self.applied += 1
                except ValueError as e:
                    log.warning("skipping an operation of %s: %s", self.key, e)

    def _predecessor(self, fields: dict[bytes, bytes]) -> bool:
        """Whether an entry under this producer id was appended by an earlier process (see ``_born``;
        an empty keep-alive, which has no number, applies nothing either way)."""
        seq = fields.get(b"s")
        try:
            return seq is not None and int(seq) <= self._born
        except ValueError:
            return False

    async def close(self, timeout_s: float = 2.0) -> None:
        """Share what is buffered and stop following; returns within about ``timeout_s`` whatever
        Redis does. The write (an empty batch if nothing is buffered) ends the follower's blocked
        read, so an idle follower's long block is not waited out (state/reservations.py)."""
        follower, self._follower = self._follower, None
        if follower is not None and not self.group.unfollow(self):
            follower = None  # the group's read goes on for its other logs (without this one's key)
        try:
            await asyncio.wait_for(self.flush(wake=follower is not None), timeout_s / 2)
        except TimeoutError:
            log.warning("%d operation(s) not shared on %s at shutdown", len(self._buffer), self.key)
        except (RedisError, OSError) as e:
            log.warning("could not wake the follower of %s at shutdown: %s", self.key, e)
        if follower is not None:
            done, _ = await asyncio.wait({follower}, timeout=timeout_s / 2)
            if not done:
                follower.cancel()
                await asyncio.wait({follower}, timeout=0.2)
                log.warning("the follower of %s did not stop in time; abandoned it", self.key)

    async def clear(self) -> None:
        """Delete the stream (benchmarks and tests)."""
        self._buffer.clear()
        await self.client.delete(self.key)


class LogGroup:
    """Shared logs on one Redis (one namespace: its keys share a hash slot) written in one round
    trip (one MULTI: a blocked read of them returns once, with all of them) and followed with
    one read.

    A decision shares its pending blocks and its in-flight charge on two streams: alone, each
    log flushed on its own timer and followed with its own blocking XREAD, so every decision was
    two appends, and (each append ending every follower's read, the writer's own included) two
    reads more in every process that follows them. In a group, an append starts the group's one
    timer, a flush appends every log's batch in one MULTI (a batch of one stream alone, a first
    token's or an end's, is a plain append: a MULTI costs three commands), and one XREAD follows
    every started log's stream. A log that starts while the group's read is blocked ends that read (an
    empty entry on a stream it reads), so the next one reads its stream too."""

    def __init__(self, client: aioredis.Redis | RedisCluster, *, flush_after_s: float = 0.01,
                 block_ms: int = FOLLOW_BLOCK_MS, follow_client: aioredis.Redis | RedisCluster | None = None) -> None:
        self.client = client
        self.follow_client, self.block_ms = follower_read(client, follow_client, block_ms)
        self.flush_after_s = flush_after_s
        self.members: list[SharedLog] = []
        self.following: list[SharedLog] = []
        """The started logs the group's read follows."""
        self._timer: asyncio.TimerHandle | None = None
        self._flushing = asyncio.Lock()  # one pipeline at a time: each producer's entries stay in order
        self._tasks: set[asyncio.Task[None]] = set()
        self._follower: asyncio.Task[None] | None = None
        self._reading: SharedLog | None = None
        """While the group's read is blocked: a log whose stream it reads (a write there ends it)."""
        self.reads = 0
        """Blocking reads issued (for tests and benchmarks)."""

    def join(self, member: SharedLog) -> None:
        self.members.append(member)

    def schedule(self) -> None:
        """Flush every log ``flush_after_s`` from now (once, whoever appended)."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next flush() sends it
            return
        self._timer = loop.call_later(self.flush_after_s, self._flush_soon)

    def _flush_soon(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self, *, wake: SharedLog | None = None) -> None:
        """Append every log's buffered operations in one round trip; ``wake``: a log that gets an
        empty entry when it has nothing buffered (its followers' reads return)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        async with self._flushing:
            batches = [(m, m._take()) for m in self.members if m._buffer]
            if not batches and wake is None:
                return
            appends: list[tuple[str, dict[Any, Any], int | None]] = []
            for m, batch in batches:
                entry, oldest = m._entry(batch)
                appends.append((m.key, entry, oldest))
            if wake is not None and all(m is not wake for m, _ in batches):
                appends.append((wake.key, wake._empty_entry(), None))
            try:
                if len(appends) == 1:  # one stream (a first token, an end): a plain append
                    key, fields, minid = appends[0]
                    await self.client.xadd(key, fields, minid=minid, approximate=minid is not None)
                else:
                    # One MULTI: a follower's blocked read returns once, with every log's entry
                    # (pipelined without it, the read returns after the first).
                    pipe = self.client.pipeline(transaction=True)
                    for key, fields, minid in appends:
                        pipe.xadd(key, fields, minid=minid, approximate=minid is not None)
                    await pipe.execute()
            except (RedisError, OSError) as e:
                for m, batch in batches:
                    m._restore(batch, e)
                if wake is not None and not batches:
                    raise

    def follow(self, member: SharedLog) -> asyncio.Task[None]:
        """Follow ``member``'s stream (from its position) with the group's read; the read's task."""
        if member not in self.following:
            self.following.append(member)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self._follow())
        elif self._reading is not None:  # a read without this log's key is blocked: end it now
            task = asyncio.ensure_future(self.flush(wake=self._reading))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self._follower

    def unfollow(self, member: SharedLog) -> bool:
        """Stop following ``member``; True when no log is followed any more (the read then ends
        when it returns)."""
        with contextlib.suppress(ValueError):
            self.following.remove(member)
        return not self.following

    async def _follow(self) -> None:
        failing = False
        while self.following:
            by_key = {m.key.encode(): m for m in self.following}
            try:
                self.reads += 1
                self._reading = self.following[0]
                res = cast(list[tuple[bytes, list[StreamEntry]]] | None, await self.follow_client.xread(
                    {m.key: m.position for m in by_key.values()}, block=self.block_ms, count=1000))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                (log.debug if failing else log.warning)("%s unreachable: %s", ", ".join(m.key for m in by_key.values()), e)
                failing = True
                await asyncio.sleep(0.2)
                continue
            finally:
                self._reading = None
            failing = False
            for key, entries in res or ():
                m = by_key.get(key if isinstance(key, bytes) else str(key).encode())
                if m is not None:
                    m._apply(entries)


class RedisPendingBlocks:
    """:class:`~state.pending.InMemoryPendingBlocks` shared by every router, gateway and picker
    (``ns|pend-log``). Call :meth:`start` once and :meth:`close` at the end; writes and reads
    never wait on Redis."""

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str, ttl_ms: int, *, producer_id: str,
                 capacity: Mapping[str, int] | None = None, flush_after_s: float = 0.01,
                 block_ms: int = FOLLOW_BLOCK_MS, events: EventSeq | None = None,
                 follow_client: aioredis.Redis | RedisCluster | None = None, group: LogGroup | None = None) -> None:
        self.local = InMemoryPendingBlocks(ttl_ms, capacity)
        self.on_session: Callable[[str, str, int], None] | None = None
        """Called with (session, node, at_ms) for each session placement another producer shared."""
        self.log = SharedLog(client, ViewKeys(namespace).pending, producer_id=producer_id, retain_ms=2 * ttl_ms,
                             apply=self._apply_item,
                             flush_after_s=flush_after_s, block_ms=block_ms, events=events,
                             follow_client=follow_client, group=group)

    def record(self, request_id: str, placements: Mapping[str, Sequence[int]], at_ms: int) -> None:
        for op in self.local.record(request_id, placements, at_ms):
            self.log.append(encode_pending(op), at_ms)

    def release(self, request_id: str, at_ms: int) -> None:
        self.local.release(request_id, at_ms)
        self.log.append(encode_pending(Released(request_id, at_ms)), at_ms)

    def share_session(self, session: str, node: str, at_ms: int) -> None:
        """Tell every follower that a decision at ``at_ms`` placed ``session`` on ``node``."""
        self.log.append(encode_session(session, node, at_ms), at_ms)

    def _apply_item(self, item: Any) -> None:
        placed = decode_session(item)
        if placed is None:
            self.local.apply(decode_pending(item))
        elif self.on_session is not None:
            self.on_session(*placed)

    def confirm(self, node: str, blocks: Sequence[int], at_ms: int) -> None:
        self.local.confirm(node, blocks, at_ms)
        self.log.append(encode_pending(Confirmed(node, at_ms, tuple(blocks))), at_ms)

    def set_capacity(self, node: str, blocks: int | None) -> None:
        self.local.set_capacity(node, blocks)

    def prefixes(self, chain: Sequence[int], now_ms: int,
                 held: Mapping[str, int] | None = None) -> dict[str, PendingPrefix]:
        return self.local.prefixes(chain, now_ms, held)

    def holds(self, node: str, block: int, now_ms: int) -> bool:
        return self.local.holds(node, block, now_ms)

    async def start(self, now_ms: int) -> None:
        await self.log.start(now_ms)

    async def flush(self) -> None:
        await self.log.flush()

    async def close(self, timeout_s: float = 2.0) -> None:
        await self.log.close(timeout_s)

    async def clear(self) -> None:
        await self.log.clear()


class RedisInflight:
    """:class:`~state.inflight.InMemoryInflight` shared by every gateway, router and picker
    (``ns|infl-log``). Call :meth:`start` once and :meth:`close` at the end; writes and reads
    never wait on Redis.

    **Lost producers.** A producer with open charges says it is alive: an empty entry when it has
    appended nothing for ``keepalive_ms`` (:meth:`keep_alive`, on a timer from :meth:`start`). Every
    follower remembers, per producer, when its last entry reached the stream and which open charges
    are its (:meth:`lost`): a producer silent for ``dead_after_ms`` with charges still open has died
    (a gateway killed, its machine gone), and one follower, the first to take its Redis lock
    (:meth:`claim`), ends those charges for it as its own releases (``conductor.routing.local``), so
    its work stops counting seconds after it went, not a lease later."""

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str, lease_ms: int, *, producer_id: str,
                 flush_after_s: float = 0.01, block_ms: int = FOLLOW_BLOCK_MS, events: EventSeq | None = None,
                 follow_client: aioredis.Redis | RedisCluster | None = None, group: LogGroup | None = None,
                 keepalive_ms: int = KEEPALIVE_MS, dead_after_ms: int = DEAD_AFTER_MS) -> None:
        self.local = InMemoryInflight(lease_ms)
        self.client = client
        self.key = ViewKeys(namespace).inflight
        self.producer_id = producer_id
        self.keepalive_ms = keepalive_ms
        self.dead_after_ms = dead_after_ms
        self._from = producer_id
        """The producer of the entry being applied."""
        self.owner: dict[str, str] = {}
        """request id -> the producer that charged it (followed from the stream; this one's own are not here)."""
        self.heard: dict[str, int] = {}
        """producer -> stream time (ms) of its last entry read here."""
        self.inherited: set[str] = set()
        """Request ids charged by an earlier process under this producer id (read at :meth:`start`):
        nothing of this process's, so none is in flight here (:meth:`leftovers`)."""
        self._keepalive: asyncio.Task[None] | None = None
        self._appended_ms = 0
        self.log = SharedLog(client, self.key, producer_id=producer_id, retain_ms=2 * lease_ms,
                             apply=self._apply, flush_after_s=flush_after_s, block_ms=block_ms, events=events,
                             follow_client=follow_client, group=group, heard=self._heard)

    def _heard(self, producer: str, at_ms: int) -> None:
        self._from = producer
        if at_ms > self.heard.get(producer, 0):
            self.heard[producer] = at_ms

    def _apply(self, item: Any) -> None:
        op = decode_inflight(item)
        self.local.apply(op)
        if isinstance(op, Charged):
            if self._from == self.producer_id:
                self.inherited.add(op.request_id)
            else:
                self.owner[op.request_id] = self._from

    def _append(self, op: InflightOp, now_ms: int) -> None:
        self.log.append(encode_inflight(op), now_ms)
        self._appended_ms = int(time.time() * 1000)

    def charge(self, request_id: str, prefill_node: str, decode_node: str, uncached_tokens: int,
               context_tokens: int, now_ms: int) -> None:
        op = self.local.charge(request_id, prefill_node, decode_node, uncached_tokens, context_tokens, now_ms)
        self.owner.pop(request_id, None)  # this producer's own from here on
        self._append(op, now_ms)

    def first_token(self, request_id: str, now_ms: int) -> None:
        self.local.first_token(request_id, now_ms)
        self._append(FirstToken(request_id, now_ms), now_ms)

    def finish(self, request_id: str, now_ms: int) -> None:
        self.local.finish(request_id, now_ms)
        self._append(Finished(request_id, now_ms), now_ms)

    def load(self, node: str, now_ms: int) -> InstanceLoad:
        return self.local.load(node, now_ms)

    def loads(self, now_ms: int) -> dict[str, InstanceLoad]:
        return self.local.loads(now_ms)

    # --- lost producers -------------------------------------------------------------------------

    async def keep_alive(self) -> bool:
        """An empty entry when this producer has open charges of its own and appended nothing for
        ``keepalive_ms``: the others hear it is alive (a long stream sends nothing for minutes).
        Whether one was written."""
        now = int(time.time() * 1000)
        if now - self._appended_ms < self.keepalive_ms or self.log.buffered:
            return False
        if all(r in self.owner for r in self.local.in_flight()):
            return False  # nothing of its own in flight: nothing anyone could take for lost
        await self.log.flush(wake=True)
        self._appended_ms = now
        return True

    def lost(self, now_ms: int) -> dict[str, list[str]]:
        """Producers silent for ``dead_after_ms`` (``now_ms`` on the stream's clock: Redis time,
        :meth:`now_ms`) with charges still open here, each with those charges' request ids
        (sorted). Forgets the owners of charges that ended."""
        open_ = self.local.in_flight()
        for rid in [r for r in self.owner if r not in open_]:
            del self.owner[rid]
        out: dict[str, list[str]] = {}
        for rid, producer in self.owner.items():
            if now_ms - self.heard.get(producer, 0) > self.dead_after_ms:
                out.setdefault(producer, []).append(rid)
        return {p: sorted(rids) for p, rids in sorted(out.items())}

    def leftovers(self) -> list[str]:
        """The charges still open that an earlier process under this producer id made (sorted): it
        died or was restarted with requests in flight, and a fresh process has none, so they are
        ended at start (``conductor.routing.local``) rather than a lease later (the others hear this
        id alive again, so nobody would take them for lost). Forgets those that ended."""
        self.inherited &= self.local.in_flight()
        return sorted(self.inherited)

    async def claim(self, producer: str) -> bool:
        """Whether this process takes on ending ``producer``'s lost charges: a Redis lock, whoever
        takes it first, held for two leases (the others' next look finds the charges ended)."""
        try:
            return bool(await self.client.set(f"{self.key}|reap|{producer}", self.producer_id, nx=True,
                                              px=2 * self.local.lease_ms))
        except (RedisError, OSError) as e:
            log.warning("could not claim the lost producer %s's charges: %s", producer, e)
            return False

    async def now_ms(self) -> int:
        """The stream's clock (Redis ``TIME``) in ms: what its entry ids are stamped with."""
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def _keep_alive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_ms / 2000)
            try:
                await self.keep_alive()
            except (RedisError, OSError) as e:
                log.debug("keep-alive on %s not written: %s", self.key, e)

    async def start(self, now_ms: int) -> None:
        await self.log.start(now_ms)
        if self._keepalive is None and self.keepalive_ms > 0:
            self._keepalive = asyncio.create_task(self._keep_alive_loop())

    async def flush(self) -> None:
        await self.log.flush()

    async def close(self, timeout_s: float = 2.0) -> None:
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.log.close(timeout_s)

    async def clear(self) -> None:
        await self.log.clear()


__all__ = ["EventSeq", "LogGroup", "RedisInflight", "RedisPendingBlocks", "SharedLog"]
