"""In-flight reservations: the same contract for the in-memory and the Redis store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from conductor.settings import Settings
from state.reservations import InMemoryReservations, Load, RedisReservations, Reservation

TTL_S = 1.0


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[object]:
    if request.param == "memory":
        yield InMemoryReservations(TTL_S)
        return
    client = aioredis.from_url(redis_url(settings))
    s = RedisReservations(client, settings.view_namespace, TTL_S, producer_id="r1")
    await s.start(10_000)
    try:
        yield s
    finally:
        await s.close()
        await s.clear()
        await client.aclose()


def redis_url(settings: Settings) -> str:
    assert settings.redis_url is not None  # (the test session's Redis)
    return settings.redis_url


def R(node: str, *amounts: int) -> list[Reservation]:
    return [Reservation(node, Load(*amounts))]


pytestmark = pytest.mark.integration


async def test_pending_counts_what_came_after_the_heartbeat(store: RedisReservations | InMemoryReservations) -> None:
    await store.reserve(R("p0", 100, 1), 10_000)
    await store.reserve(R("p0", 50, 1), 10_300)
    await store.reserve(R("d0", 0, 0, 1, 2048, 9), 10_300)
    assert await store.pending({"p0": 9_000, "d0": 9_000}, 10_400) == {
        "p0": Load(150, 2), "d0": Load(0, 0, 1, 2048, 9)}
    assert await store.pending({"p0": 10_000}, 10_400) == {"p0": Load(50, 1)}  # same-ms: already reported
    assert await store.pending({"p0": 10_300, "x": 0}, 10_400) == {}


async def test_ttl_releases_unreported_reservations(store: RedisReservations | InMemoryReservations) -> None:
    await store.reserve(R("p0", 100, 1), 10_000)
    await store.reserve(R("p0", 7, 1), 10_800)
    assert await store.pending({"p0": 0}, 10_900) == {"p0": Load(107, 2)}
    assert await store.pending({"p0": 0}, 11_500) == {"p0": Load(7, 1)}
    assert await store.pending({"p0": 0}, 12_000) == {}


async def test_old_checkpoints_are_pruned_without_losing_the_baseline(store: RedisReservations | InMemoryReservations) -> None:
    for k in range(10):  # 0.5 s apart: all but the last few fall out of 2 x ttl
        await store.reserve(R("p0", 10, 1), 10_000 + 500 * k)
    now = 10_000 + 500 * 9
    assert await store.pending({"p0": now - 600}, now + 1) == {"p0": Load(20, 2)}
    assert await store.pending({"p0": 0}, now + 1) == {"p0": Load(20, 2)}  # ttl floor: 2 within 1 s


async def test_redis_reservations_are_shared_between_replicas(settings: Settings) -> None:
    clients = [aioredis.from_url(redis_url(settings)) for _ in range(3)]
    a = RedisReservations(clients[0], settings.view_namespace, TTL_S, producer_id="a", flush_after_s=0.005)
    b = RedisReservations(clients[1], settings.view_namespace, TTL_S, producer_id="b")
    try:
        await a.start(50_000)
        await b.start(50_000)
        await a.reserve(R("p0", 300, 1), 50_000)
        assert await a.pending({"p0": 0}, 50_001) == {"p0": Load(300, 1)}  # its own: at once
        await _until(lambda: b.applied == 1)
        assert await b.pending({"p0": 0}, 50_001) == {"p0": Load(300, 1)}
        await b.reserve(R("p0", 1, 1), 49_990)  # made earlier, arrives later: still in time order
        await b.flush()
        await _until(lambda: a.applied == 1)
        assert await a.pending({"p0": 49_995}, 50_010) == {"p0": Load(300, 1)}
        assert await a.pending({"p0": 0}, 50_010) == {"p0": Load(301, 2)}
        # A replica started later catches up on the log.
        c = RedisReservations(clients[2], settings.view_namespace, TTL_S, producer_id="c")
        await c.start(50_020)
        assert await c.pending({"p0": 0}, 50_020) == {"p0": Load(301, 2)}
        await c.close()
    finally:
        await a.close()
        await b.close()
        await a.clear()
        for cl in clients:
            await cl.aclose()


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_late_arrivals_keep_the_sums_in_time_order() -> None:
    r = InMemoryReservations(ttl_s=10.0)
    r.add("p0", 1_000, (1, 1, 0, 0, 0))
    r.add("p0", 3_000, (4, 1, 0, 0, 0))
    r.add("p0", 2_000, (2, 1, 0, 0, 0))
    assert r.pending_sync({"p0": 1_500}, 3_001) == {"p0": Load(6, 2)}
    assert r.pending_sync({"p0": 2_500}, 3_001) == {"p0": Load(4, 1)}
    assert r.pending_sync({"p0": 0}, 3_001) == {"p0": Load(7, 3)}


async def test_close_is_bounded_while_following_and_when_redis_is_gone(settings: Settings) -> None:
    """Shutdown never hangs: a follower blocked in XREAD, buffered reservations, or a Redis that
    stopped answering all give way within the close timeout (issue: ``bench route`` hung in close)."""
    loop = asyncio.get_running_loop()
    for i in range(20):
        client = aioredis.from_url(redis_url(settings))
        s = RedisReservations(client, settings.view_namespace, TTL_S, producer_id=f"r{i}", block_ms=100)
        await s.start(10_000)
        await s.reserve(R("p0", 10, 1), 10_000 + i)
        await asyncio.sleep(0.01 * (i % 7))  # close at varying points of the follower's XREAD
        t0 = loop.time()
        await s.close(timeout_s=1.0)
        assert loop.time() - t0 < 1.5
        await client.aclose()
    # A Redis that accepts the connection but never answers: a listening socket nobody serves.
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.from_url(f"redis://127.0.0.1:{port}", socket_timeout=30)
    s = RedisReservations(client, "deaf", TTL_S, producer_id="deaf", block_ms=100)
    s._follower = asyncio.ensure_future(s._follow())  # following a server that never replies
    await s.reserve(R("p0", 1, 1), 10_000)
    await asyncio.sleep(0.05)
    t0 = loop.time()
    await s.close(timeout_s=1.0)
    assert loop.time() - t0 < 2.0
    assert s._follower is None
    server.close()


async def test_an_idle_follower_blocks_long_yet_closes_at_once(settings: Settings,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """An idle follower's XREAD blocks a whole second (one read a second, not ten), and close does
    not wait it out: its own write (an empty batch when nothing is buffered) ends the read. The
    other replicas skip the empty batch without a warning."""
    from state.shared_log import RedisPendingBlocks

    loop = asyncio.get_running_loop()
    client = aioredis.from_url(redis_url(settings))
    ns = f"{settings.view_namespace}-wake"
    try:
        reservations = [RedisReservations(client, ns, TTL_S, producer_id=p) for p in ("a", "b")]
        pending = [RedisPendingBlocks(client, ns, 60_000, producer_id=p) for p in ("a", "b")]
        assert reservations[0].block_ms == 1_000 and pending[0].log.block_ms == 1_000
        for r in reservations:
            await r.start(10_000)
        for p in pending:
            await p.log.start(10_000)
        await asyncio.sleep(0.3)  # both followers blocked in XREAD now
        for s in (reservations[0], pending[0].log):
            t0 = loop.time()
            await s.close(timeout_s=4.0)
            assert loop.time() - t0 < 0.5  # not the block's second, nor the timeout's half
        await asyncio.sleep(0.2)  # the other replicas read the empty batches
        assert reservations[1].applied == 0 and pending[1].log.applied == 0
        assert not [r for r in caplog.records if r.levelname == "WARNING" and "malformed" in r.getMessage()]
        for s in (reservations[1], pending[1].log):
            await s.close()
            await s.clear()
    finally:
        await client.aclose()
