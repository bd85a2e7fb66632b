"""One contract for each decision-time record, run against the in-memory store and the one
shared through Redis (two processes' copies following one stream on the session's Valkey).

A subclass provides ``pair``: ``(writer, reader, sync)``; after ``await sync()`` the reader has
everything the writer did (the same object in memory). Every test also reads the writer's own
writes at once, with no ``sync``: a decision must see the one before it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from conductor.settings import Settings
from state.inflight import InflightLedger, InMemoryInflight, InstanceLoad
from state.pending import InMemoryPendingBlocks, PendingPrefix, PendingStore
from state.shared_log import EventSeq, LogGroup, RedisInflight, RedisPendingBlocks, SharedLog

TTL_MS = 2_000
LEASE_MS = 60_000
CHAIN = [101, 102, 103, 104]
Sync = Callable[[], Awaitable[None]]


async def _caught_up(writer: SharedLog, reader: SharedLog) -> None:
    """Flush ``writer`` and wait until ``reader`` has read the stream's last entry."""
    await writer.flush()
    last = await writer.client.xrevrange(writer.key, count=1)
    want = last[0][0] if last else b"0-0"
    for _ in range(200):
        if reader.position == want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{reader.key}: reader at {reader.position!r}, stream at {want!r}")


class PendingContract:
    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[PendingStore, PendingStore, Sync]]:
        raise NotImplementedError  # pragma: no cover - overridden
        yield

    async def test_reads_its_own_placement_at_once(self, pair: Any) -> None:
        w, _, _ = pair
        w.record("r1", {"p0": CHAIN, "d0": CHAIN}, 1_000)
        assert w.prefixes(CHAIN, 1_000) == {"p0": PendingPrefix(0, 4), "d0": PendingPrefix(0, 4)}

    async def test_another_process_sees_placements_and_their_end(self, pair: Any) -> None:
        w, r, sync = pair
        w.record("r1", {"p0": CHAIN}, 1_000)
        w.record("r2", {"p1": CHAIN[:2]}, 1_001)
        await sync()
        assert r.prefixes(CHAIN, 1_010) == {"p0": PendingPrefix(0, 4), "p1": PendingPrefix(0, 2)}
        w.release("r2", 1_020)
        w.release("r2", 1_020)
        w.release("unknown", 1_020)
        w.confirm("p0", CHAIN[:3], 1_030)
        await sync()
        assert r.prefixes(CHAIN, 1_040, held={"p0": 3}) == {"p0": PendingPrefix(3, 4)}
        assert r.prefixes(CHAIN, 1_040) == {}
        assert not r.holds("p0", CHAIN[3], 1_000 + TTL_MS)

    async def test_an_instance_without_events_keeps_what_was_placed(self, pair: Any) -> None:
        w, r, sync = pair
        for s in {id(w): w, id(r): r}.values():
            s.set_capacity("e0", 2)
        w.record("r1", {"e0": [1, 2, 3]}, 1_000)
        await sync()
        later = 1_000 + TTL_MS
        assert r.prefixes([2, 3], later) == {"e0": PendingPrefix(0, 2)}
        assert not r.holds("e0", 1, later)  # the least recently placed left


class InflightContract:
    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[InflightLedger, InflightLedger, Sync]]:
        raise NotImplementedError  # pragma: no cover - overridden
        yield

    async def test_reads_its_own_charge_at_once(self, pair: Any) -> None:
        w, _, _ = pair
        w.charge("r1", "p0", "d0", 100, 150, 1_000)
        assert w.load("p0", 1_000) == InstanceLoad(1, 1, 100, 0, 0)

    async def test_another_process_sees_charges_and_releases(self, pair: Any) -> None:
        w, r, sync = pair
        w.charge("r1", "p0", "d0", 100, 150, 1_000)
        w.charge("r2", "p0", "p0", 10, 20, 1_001)
        await sync()
        assert r.loads(1_002) == {"p0": InstanceLoad(2, 2, 110, 1, 20), "d0": InstanceLoad(1, 0, 0, 1, 150)}
        w.first_token("r1", 1_100)
        w.finish("r2", 1_200)
        w.finish("r2", 1_200)
        w.finish("unknown", 1_200)
        await sync()
        assert r.loads(1_300) == {"d0": InstanceLoad(1, 0, 0, 1, 150)}
        assert r.load("p0", 1_300) == InstanceLoad()
        assert r.loads(1_100 + LEASE_MS) == {}  # nobody finished r1: its lease ends it


class TestInMemoryPending(PendingContract):
    @pytest.fixture
    async def pair(self) -> AsyncIterator[tuple[PendingStore, PendingStore, Sync]]:
        s = InMemoryPendingBlocks(TTL_MS)

        async def sync() -> None:
            return None

        yield s, s, sync


class TestRedisPending(PendingContract):
    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[PendingStore, PendingStore, Sync]]:
        clients = [aioredis.from_url(str(settings.redis_url)) for _ in range(2)]
        a, b = (RedisPendingBlocks(c, settings.view_namespace, TTL_MS, producer_id=p, block_ms=50)
                for c, p in zip(clients, "ab", strict=True))
        for s in (a, b):
            await s.start(1_000)
        try:
            yield a, b, lambda: _caught_up(a.log, b.log)
        finally:
            for s in (a, b):
                await s.close()
            await a.clear()
            for c in clients:
                await c.aclose()


class TestInMemoryInflight(InflightContract):
    @pytest.fixture
    async def pair(self) -> AsyncIterator[tuple[InflightLedger, InflightLedger, Sync]]:
        s = InMemoryInflight(LEASE_MS)

        async def sync() -> None:
            return None

        yield s, s, sync


class TestRedisInflight(InflightContract):
    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[InflightLedger, InflightLedger, Sync]]:
        clients = [aioredis.from_url(str(settings.redis_url)) for _ in range(2)]
        a, b = (RedisInflight(c, settings.view_namespace, LEASE_MS, producer_id=p, block_ms=50)
                for c, p in zip(clients, "ab", strict=True))
        for s in (a, b):
            await s.start(1_000)
        try:
            yield a, b, lambda: _caught_up(a.log, b.log)
        finally:
            for s in (a, b):
                await s.close()
            await a.clear()
            for c in clients:
                await c.aclose()


async def test_a_follower_knows_each_producers_last_event_it_applied(settings: Settings) -> None:
    """The cut a decision records (``SharedLog.cut``): per producer, the last event applied; the
    operations of one event share its number; a producer's own appends count at once, another's
    only once its entry arrived."""
    clients = [aioredis.from_url(str(settings.redis_url)) for _ in range(2)]
    events = EventSeq(start=100)
    a_pend, a_infl = (RedisPendingBlocks(clients[0], settings.view_namespace + "-cut", TTL_MS, producer_id="a",
                                         block_ms=50, events=events),
                      RedisInflight(clients[0], settings.view_namespace + "-cut", LEASE_MS, producer_id="a",
                                    block_ms=50, events=events))
    b = RedisInflight(clients[1], settings.view_namespace + "-cut", LEASE_MS, producer_id="b", block_ms=50)
    for s in (a_pend, a_infl, b):
        await s.start(1_000)
    try:
        with events.event() as e:  # one decision: its blocks and its charge
            a_pend.record("r1", {"n": CHAIN}, 1_000)
            a_infl.charge("r1", "n", "n", 64, 64, 1_000)
        assert e == 101 and a_pend.log.cut() == {"a": 101} and a_infl.log.cut() == {"a": 101}
        assert b.log.cut() == {}  # nothing of a's arrived yet
        a_infl.first_token("r1", 1_005)  # outside an event: a number of its own
        assert a_infl.log.cut() == {"a": 102}
        await _caught_up(a_infl.log, b.log)
        assert b.log.cut() == {"a": 102}
        b.finish("r1", 1_010)
        assert b.log.cut()["b"] == b.log.events.last and b.load("n", 1_010) == InstanceLoad()
    finally:
        for s in (a_pend, a_infl, b):
            await s.close()
        await a_infl.clear()
        await a_pend.clear()
        for c in clients:
            await c.aclose()


class TestRedisPendingInAGroup(PendingContract):
    """The same, each process's pending blocks in a :class:`LogGroup` with its in-flight ledger."""

    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[PendingStore, PendingStore, Sync]]:
        async with _grouped(settings) as ((a, _), (b, _)):
            yield a, b, lambda: _caught_up(a.log, b.log)


class TestRedisInflightInAGroup(InflightContract):
    @pytest.fixture
    async def pair(self, settings: Settings) -> AsyncIterator[tuple[InflightLedger, InflightLedger, Sync]]:
        async with _grouped(settings) as ((_, a), (_, b)):
            yield a, b, lambda: _caught_up(a.log, b.log)


@contextlib.asynccontextmanager
async def _grouped(settings: Settings, namespace: str | None = None, block_ms: int = 50,
                   ) -> AsyncIterator[list[tuple[RedisPendingBlocks, RedisInflight]]]:
    """Two processes' pending blocks and in-flight ledgers, each process's pair in one group."""
    ns = namespace or settings.view_namespace
    clients = [aioredis.from_url(str(settings.redis_url)) for _ in range(2)]
    pairs = []
    for c, p in zip(clients, "ab", strict=True):
        group, events = LogGroup(c, block_ms=block_ms), EventSeq()
        pairs.append((RedisPendingBlocks(c, ns, TTL_MS, producer_id=p, events=events, group=group),
                      RedisInflight(c, ns, LEASE_MS, producer_id=p, events=events, group=group)))
    for pend, infl in pairs:
        await pend.start(1_000)
        await infl.start(1_000)
    try:
        yield pairs
    finally:
        for pend, infl in pairs:
            await pend.close()
            await infl.close()
        await pairs[0][0].clear()
        await pairs[0][1].clear()
        for c in clients:
            await c.aclose()


async def test_a_group_appends_a_decisions_two_records_at_once_and_follows_them_with_one_read(settings: Settings) -> None:
    """A decision's pending blocks and its charge go in one append (one MULTI over both streams),
    and a group that follows both reads them with one blocking read, not one per stream."""
    async with _grouped(settings, settings.view_namespace + "-grp", block_ms=5_000) as ((a_pend, a_infl), (b_pend, b_infl)):
        group = b_pend.log.group
        assert group is not None and group is b_infl.log.group
        await asyncio.sleep(0.2)  # both logs joined the group's first read
        before = group.reads
        decisions = 20
        for i in range(decisions):
            with a_pend.log.events.event():
                a_pend.record(f"r{i}", {"p0": CHAIN}, 1_000 + i)
                a_infl.charge(f"r{i}", "p0", "p0", 64, 64, 1_000 + i)
            await a_pend.log.flush()
            await _caught_up(a_infl.log, b_infl.log)
            await _caught_up(a_pend.log, b_pend.log)
        assert b_infl.load("p0", 1_100).requests == decisions
        assert set(b_pend.prefixes(CHAIN, 1_100)) == {"p0"}
        reads = group.reads - before
        assert decisions <= reads <= decisions + 2, reads  # alone, each stream's follower reads once a decision
