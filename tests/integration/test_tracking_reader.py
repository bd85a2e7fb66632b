"""The client-side caching reader (``state.tracking``, RESP3 + ``CLIENT TRACKING``) on a real
Valkey: it passes the view contract, and over a sequence of writes between reads (blocks
added, removed, nodes cleared, a write landing while a read is in flight) it answers exactly
what the plain reader answers, while serving repeated prefixes from its cache."""

from __future__ import annotations

import asyncio
import random

import pytest

import tests.contract.test_view_contract as contract
from schemas import BlocksRemoved, BlocksStored, Heartbeat, envelope
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.tracking import TrackingSnapshotReader
from state.view import SourcePosition

pytestmark = pytest.mark.integration


class TestTrackingReaderContract(contract.ViewStoreContract):
    """Every read of the view contract through the tracking reader (each test reads, writes
    and reads again, so cached entries are invalidated under it). The contract reads its own
    writes at once, before their pushes need have arrived, so every read here is a round
    trip; reads answered from a point are tested below."""

    @pytest.fixture
    async def store(self, settings):
        s = TrackingSnapshotReader(settings.redis_url, settings.view_namespace, cache_keys=64,
                                   store=RedisViewStore.connect(settings.redis(), settings.view_namespace), point_max_age_s=0)
        yield s
        await s.view.clear()
        await s.close()


@pytest.fixture
async def readers(settings):
    writer = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    plain = RawSnapshotReader(settings.redis_url, settings.view_namespace)
    # Round trips only: these tests read their own writes at once (point reads: further down).
    tracking = TrackingSnapshotReader(settings.redis_url, settings.view_namespace, cache_keys=500, point_max_age_s=0)
    yield writer, plain, tracking
    await writer.clear()
    await tracking.close()
    await plain.close()
    await writer.close()


async def test_same_snapshots_as_the_plain_reader_over_random_writes(readers):
    writer, plain, tracking = readers
    rng = random.Random(7)
    nodes = [f"p{i}" for i in range(5)]
    seqs = dict.fromkeys(nodes, 0)
    base = [rng.getrandbits(63) for _ in range(40)]
    chains = [base[:k] + [rng.getrandbits(63) for _ in range(6)] for k in (8, 20, 40)] + [base[:30]]
    compared = 0
    for step in range(60):
        node = rng.choice(nodes)
        upto = rng.randint(1, 40)
        keys = rng.sample(base[:upto], rng.randint(1, min(12, upto)))
        rec = (BlocksStored(block_keys=keys, tier=rng.choice(["hbm", "dram", "ssd"])) if rng.random() < 0.7
               else BlocksRemoved(block_keys=keys, tier="hbm"))
        await writer.apply([(envelope(rec, producer_id=node, producer_seq=seqs[node], ts_ms=1_000), None)])
        seqs[node] += 1
        if step % 20 == 19:
            await writer.compact()
        for chain in rng.sample(chains, 2):
            want = await plain.snapshot(chain, now_ms=5)
            got = await tracking.snapshot(chain, now_ms=5)
            assert got == want, f"step {step}"
            compared += 1
    assert compared == 120
    assert tracking.stats["hits"] > 0 and tracking.stats["invalidated"] > 0  # the cache was used and told


async def test_a_write_between_two_reads_of_one_chain_is_seen(readers):
    writer, plain, tracking = readers
    chain = [11, 12, 13, 14]
    await writer.apply([(envelope(BlocksStored(block_keys=chain[:3], tier="hbm"), producer_id="a", producer_seq=0,
                                  ts_ms=1), None)])
    first = await tracking.snapshot(chain, now_ms=5)
    assert first.prefix == {"a": (3, 3, 3)}
    assert (await tracking.snapshot(chain, now_ms=5)) == first and tracking.stats["hits"] >= 3
    await writer.apply([(envelope(BlocksStored(block_keys=[14], tier="hbm"), producer_id="a", producer_seq=1,
                                  ts_ms=1), None),
                        (envelope(BlocksRemoved(block_keys=[11], tier="hbm"), producer_id="b", producer_seq=0,
                                  ts_ms=1), None)])
    await writer.apply([(envelope(BlocksStored(block_keys=chain, tier="dram"), producer_id="b", producer_seq=1,
                                  ts_ms=1), None)])
    got = await tracking.snapshot(chain, now_ms=5)
    assert got == await plain.snapshot(chain, now_ms=5)
    assert got.prefix == {"a": (4, 4, 4), "b": (0, 4, 4)}


async def test_a_cached_entry_changed_while_the_read_is_in_flight_is_read_again(readers):
    """A write that lands after the read took its values from the cache but before its EXEC
    ran: its push reaches the reader before the EXEC's reply, so the read is redone."""
    writer, plain, tracking = readers
    chain = [21, 22, 23]
    await writer.apply([(envelope(BlocksStored(block_keys=chain, tier="hbm"), producer_id="a", producer_seq=0,
                                  ts_ms=1), None)])
    await tracking.snapshot(chain, now_ms=5)  # cached and tracked
    send = tracking._exec
    writes = []

    async def write_first(rec, fetched):  # the write runs between the cache lookup and the EXEC
        if not writes:
            writes.append(await writer.apply([(envelope(BlocksRemoved(block_keys=[22], tier="hbm"), producer_id="a",
                                                        producer_seq=1, ts_ms=1), None)]))
        return await send(rec, fetched)

    tracking._exec = write_first
    got = await tracking.snapshot(chain, now_ms=5)
    assert writes and got.prefix == {"a": (1, 1, 1)}
    assert got == await plain.snapshot(chain, now_ms=5)
    assert tracking.stats["retries"] == 1


async def test_a_new_connection_starts_with_an_empty_cache(readers):
    writer, plain, tracking = readers
    chain = [31, 32]
    await writer.apply([(envelope(BlocksStored(block_keys=chain, tier="hbm"), producer_id="a", producer_seq=0,
                                  ts_ms=1), None)])
    await tracking.snapshot(chain, now_ms=5)
    await tracking._drop()  # as after a lost connection: the server forgot what we track
    await writer.apply([(envelope(BlocksRemoved(block_keys=[32], tier="hbm"), producer_id="a", producer_seq=1,
                                  ts_ms=1), None)])
    got = await tracking.snapshot(chain, now_ms=5)
    assert got == await plain.snapshot(chain, now_ms=5) and got.prefix == {"a": (1, 1, 1)}


# --- reads answered from the last read's point, with no round trip ------------------------


@pytest.fixture
async def pointed(settings):
    writer = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    plain = RawSnapshotReader(settings.redis_url, settings.view_namespace)
    tracking = TrackingSnapshotReader(settings.redis_url, settings.view_namespace, cache_keys=500,
                                      point_max_age_s=60.0)
    yield writer, plain, tracking
    await writer.clear()
    await tracking.close()
    await plain.close()
    await writer.close()


async def _told(tracking, before: int) -> None:
    """Wait until a push touching the node picture has been parsed since ``before``."""
    for _ in range(200):
        if tracking.stats["node_pushes"] > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no push for the node picture arrived")


def _fenced(rec, node, seq, offset):
    return (envelope(rec, producer_id=node, producer_seq=seq, ts_ms=1_000), SourcePosition("kv-events", 0, offset))


async def test_a_warm_chain_is_answered_at_its_points_watermark_with_no_round_trip(pointed):
    """Read once, then again: the second read waits for no reply and is exactly the view at
    the watermark it records (what the plain reader reads there), at a clock that moved on."""
    writer, plain, tracking = pointed
    chain = [41, 42, 43, 44, 45]
    await writer.apply([_fenced(Heartbeat(role="prefill", queue_depth=2), "a", 0, 0),
                        _fenced(BlocksStored(block_keys=chain[:3], tier="hbm"), "a", 0, 1),
                        _fenced(BlocksStored(block_keys=chain[:2], tier="dram"), "b", 0, 2)])
    first = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 0
    second = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 1
    assert second.prefix == first.prefix == {"a": (3, 3, 3), "b": (0, 2, 2)}
    assert second.nodes == first.nodes and second.watermark == first.watermark == {"kv-events:0": 2}
    assert second.now_ms >= first.now_ms
    assert second == await plain.snapshot(chain, now_ms=second.now_ms)


async def test_a_write_anywhere_ends_the_point(pointed):
    """A KV batch on another node, for blocks no read asked about, still moves the node
    picture (its block counts): once its push is in, the next read asks Redis and sees it."""
    writer, plain, tracking = pointed
    chain = [51, 52, 53]
    await writer.apply([_fenced(BlocksStored(block_keys=chain, tier="hbm"), "a", 0, 0)])
    await tracking.snapshot(chain)
    pushes = tracking.stats["node_pushes"]
    await writer.apply([_fenced(BlocksStored(block_keys=[999], tier="hbm"), "c", 0, 1)])
    await _told(tracking, pushes)
    got = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 0 and got.watermark == {"kv-events:0": 1}
    assert got == await plain.snapshot(chain, now_ms=got.now_ms)
    again = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 1 and again.watermark == got.watermark


async def test_a_heartbeat_ends_the_point(pointed):
    writer, _plain, tracking = pointed
    chain = [61, 62]
    await writer.apply([_fenced(Heartbeat(role="decode", batch_size=3), "d", 0, 0),
                        _fenced(BlocksStored(block_keys=chain, tier="hbm"), "d", 0, 1)])
    await tracking.snapshot(chain)
    pushes = tracking.stats["node_pushes"]
    await writer.apply([(envelope(Heartbeat(role="decode", batch_size=9), producer_id="d", producer_seq=1,
                                  ts_ms=2_000), SourcePosition("heartbeats", 0, 0))])
    await _told(tracking, pushes)
    got = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 0
    assert {n.node_id: n.batch_size for n in got.nodes} == {"d": 9}


async def test_a_chain_with_an_uncached_block_is_read_but_one_cut_at_an_unheld_block_is_not(pointed):
    writer, _plain, tracking = pointed
    await writer.apply([_fenced(BlocksStored(block_keys=[71, 72], tier="hbm"), "a", 0, 0)])
    await tracking.snapshot([71, 72, 73])  # 73: no such key, cached as such (and tracked)
    got = await tracking.snapshot([71, 72, 73, 74, 75])  # 74, 75 never read, but past 73: not needed
    assert tracking.stats["cached_reads"] == 1 and got.prefix == {"a": (2, 2, 2)}
    await tracking.snapshot([71, 76])  # 76 never read
    assert tracking.stats["cached_reads"] == 1


async def test_an_old_point_is_not_used(pointed):
    writer, _plain, tracking = pointed
    tracking.point_max_age_s = 0.05
    await writer.apply([_fenced(BlocksStored(block_keys=[81], tier="hbm"), "a", 0, 0)])
    await tracking.snapshot([81])
    await asyncio.sleep(0.1)
    await tracking.snapshot([81])
    assert tracking.stats["cached_reads"] == 0


async def test_a_cleared_view_and_a_new_connection_end_the_point(pointed):
    writer, _plain, tracking = pointed
    chain = [91, 92]
    await writer.apply([_fenced(BlocksStored(block_keys=chain, tier="hbm"), "a", 0, 0)])
    await tracking.snapshot(chain)
    pushes = tracking.stats["node_pushes"]
    await writer.clear()
    await _told(tracking, pushes)
    got = await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 0 and got.prefix == {} and got.nodes == ()
    await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 1
    await tracking._drop()  # a lost connection: the server forgot what we track
    await tracking.snapshot(chain)
    assert tracking.stats["cached_reads"] == 1
