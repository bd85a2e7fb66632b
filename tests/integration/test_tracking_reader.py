"""The client-side caching reader (``state.tracking``, RESP3 + ``CLIENT TRACKING``) on a real
Valkey: it passes the view contract, and over a sequence of writes between reads (blocks
added, removed, nodes cleared, a write landing while a read is in flight) it answers exactly
what the plain reader answers, while serving repeated prefixes from its cache."""

from __future__ import annotations

import random

import pytest

import tests.contract.test_view_contract as contract
from schemas import BlocksRemoved, BlocksStored, envelope
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.tracking import TrackingSnapshotReader

pytestmark = pytest.mark.integration


class TestTrackingReaderContract(contract.ViewStoreContract):
    """Every read of the view contract through the tracking reader (each test reads, writes
    and reads again, so cached entries are invalidated under it)."""

    @pytest.fixture
    async def store(self, settings):
        s = TrackingSnapshotReader(settings.redis_url, settings.view_namespace, cache_keys=64,
                                   store=RedisViewStore.from_settings(settings))
        yield s
        await s.view.clear()
        await s.close()


@pytest.fixture
async def readers(settings):
    writer = RedisViewStore.from_settings(settings)
    plain = RawSnapshotReader(settings.redis_url, settings.view_namespace)
    tracking = TrackingSnapshotReader(settings.redis_url, settings.view_namespace, cache_keys=500)
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
