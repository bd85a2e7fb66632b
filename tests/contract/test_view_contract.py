"""One contract, every view store: the same tests run against each implementation.

``ViewStoreContract`` is subclassed once per store; a subclass only provides the
``store`` fixture (an empty view). The router's reader (``state.reader``) runs the same
tests as a read-through view: written through ``RedisViewStore``, read through it.
"""

from __future__ import annotations

import random

import pytest

from schemas import AllBlocksCleared, BlocksMigrated, BlocksRemoved, BlocksStored, Heartbeat, chain_keys, envelope
from schemas.errors import ViewStoreError
from state.fold import AddBlocks, SetHeartbeat, fold
from state.keys import MAX_SLOTS, holder_entries
from state.memory import InMemoryViewStore
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.view import Outcome, SourcePosition

APPLIED, FENCED, CONFLICT = Outcome.APPLIED, Outcome.FENCED, Outcome.CONFLICT

KV = "kv-events"
HB = "heartbeats"


def stored(node, seq, keys, *, tier="hbm", epoch=0, ts=1_000):
    return envelope(BlocksStored(block_keys=keys, tier=tier), producer_id=node, producer_seq=seq, epoch=epoch, ts_ms=ts)


def removed(node, seq, keys, *, tier="hbm", epoch=0):
    return envelope(BlocksRemoved(block_keys=keys, tier=tier), producer_id=node, producer_seq=seq, epoch=epoch, ts_ms=1_000)


def heartbeat(node, seq, ts, *, role="prefill", queue=0, epoch=0, rack=None, **more):
    hb = Heartbeat(role=role, queue_depth=queue, queued_prefill_tokens=queue * 100, rack=rack, tier_capacity={"hbm": 10},
                   **more)
    return envelope(hb, producer_id=node, producer_seq=seq, epoch=epoch, ts_ms=ts)


class ViewStoreContract:
    """Behaviour every ViewStore must have. Subclasses provide an empty ``store``."""

    @pytest.fixture
    def store(self):  # pragma: no cover - overridden
        raise NotImplementedError

    async def feed(self, store, envs, topic=KV, partition=0, start=0):
        return await store.apply([(e, SourcePosition(topic, partition, start + i)) for i, e in enumerate(envs)])

    async def test_empty_view(self, store):
        snap = await store.snapshot([1, 2, 3], now_ms=5)
        assert snap.nodes == () and snap.prefix == {} and snap.watermark == {}
        assert snap.now_ms == 5

    async def test_stored_blocks_make_a_prefix(self, store):
        await self.feed(store, [stored("a", 0, [1, 2, 3]), stored("b", 0, [1, 2])])
        snap = await store.snapshot([1, 2, 3, 4], now_ms=0)
        assert snap.prefix == {"a": (3, 3, 3), "b": (2, 2, 2)}
        assert snap.watermark == {f"{KV}:0": 1}

    async def test_prefix_is_contiguous(self, store):
        await self.feed(store, [stored("a", 0, [1, 2, 4, 5])])
        snap = await store.snapshot([1, 2, 3, 4, 5], now_ms=0)
        assert snap.prefix == {"a": (2, 2, 2)}
        assert (await store.snapshot([3, 4], now_ms=0)).prefix == {}

    async def test_tiers_are_cumulative(self, store):
        await self.feed(
            store,
            [stored("a", 0, [1, 2]), stored("a", 1, [3], tier="dram"), stored("a", 2, [4, 5], tier="ssd"), stored("a", 3, [6], tier="hbm")],
        )
        snap = await store.snapshot([1, 2, 3, 4, 5, 6, 7], now_ms=0)
        assert snap.prefix == {"a": (2, 3, 6)}

    async def test_keys_from_tokens(self, store):
        tokens = list(range(40))
        env = envelope(BlocksStored(token_ids=tokens, block_size=16), producer_id="a", producer_seq=0, ts_ms=1)
        await self.feed(store, [env])
        chain = chain_keys(tokens + [7] * 8, 16)
        assert (await store.snapshot(chain, now_ms=0)).prefix == {"a": (2, 2, 2)}
        # a child event continues the chain from its parent key
        child = envelope(
            BlocksStored(token_ids=tokens[32:40] + [7] * 8, parent_key=chain[1], block_size=16),
            producer_id="a", producer_seq=1, ts_ms=2,
        )
        await self.feed(store, [child], start=1)
        assert (await store.snapshot(chain, now_ms=0)).prefix == {"a": (3, 3, 3)}

    async def test_removed_blocks_leave(self, store):
        await self.feed(store, [stored("a", 0, [1, 2, 3]), removed("a", 1, [2])])
        snap = await store.snapshot([1, 2, 3], now_ms=0)
        assert snap.prefix == {"a": (1, 1, 1)}
        (a,) = snap.nodes
        assert a.blocks == {"hbm": 2}

    async def test_removing_from_another_tier_keeps_the_block(self, store):
        await self.feed(store, [stored("a", 0, [1]), stored("a", 1, [1], tier="dram"), removed("a", 2, [1])])
        assert (await store.snapshot([1], now_ms=0)).prefix == {"a": (0, 1, 1)}

    async def test_duplicates_are_skipped(self, store):
        out = await self.feed(store, [stored("a", 0, [1]), stored("a", 1, [2]), stored("a", 1, [9]), stored("a", 0, [8])])
        assert out == ["applied", "applied", "duplicate", "duplicate"]
        snap = await store.snapshot([1, 2], now_ms=0)
        assert snap.prefix == {"a": (2, 2, 2)}
        assert (await store.snapshot([9], now_ms=0)).prefix == {}

    async def test_sequence_gap_is_counted_and_applied(self, store):
        out = await self.feed(store, [stored("a", 0, [1]), stored("a", 4, [2]), stored("a", 5, [3])])
        assert out == ["applied"] * 3
        (a,) = await store.nodes()
        assert a.seq_gaps == 1 and a.last_seq == 5
        assert (await store.dump())["nodes"]["a"]["missed"] == 3

    async def test_new_epoch_drops_the_nodes_blocks(self, store):
        await self.feed(store, [stored("a", 0, [1, 2]), stored("b", 0, [1]), stored("a", 0, [7], epoch=1), stored("a", 3, [5], epoch=0)])
        snap = await store.snapshot([1, 2], now_ms=0)
        assert snap.prefix == {"b": (1, 1, 1)}
        assert (await store.snapshot([7], now_ms=0)).prefix == {"a": (1, 1, 1)}
        assert (await store.snapshot([5], now_ms=0)).prefix == {}  # a straggler of epoch 0
        a = {n.node_id: n for n in await store.nodes()}["a"]
        assert a.epoch == 1 and a.blocks == {"hbm": 1}

    async def test_all_blocks_cleared(self, store):
        clear = envelope(AllBlocksCleared(), producer_id="a", producer_seq=2, ts_ms=1)
        await self.feed(store, [stored("a", 0, [1, 2]), stored("b", 0, [1, 2]), clear, stored("a", 3, [1])])
        snap = await store.snapshot([1, 2], now_ms=0)
        assert snap.prefix == {"a": (1, 1, 1), "b": (2, 2, 2)}

    async def test_migrate_and_replicate(self, store):
        mig = envelope(
            BlocksMigrated(mode="migrate", block_keys=[1, 2], from_node="a", from_tier="hbm", to_node="a", to_tier="dram"),
            producer_id="a", producer_seq=1, ts_ms=1,
        )
        rep = envelope(
            BlocksMigrated(mode="replicate", block_keys=[1], from_node="a", from_tier="dram", to_node="s", to_tier="ssd"),
            producer_id="a", producer_seq=2, ts_ms=1,
        )
        await self.feed(store, [stored("a", 0, [1, 2]), mig, rep])
        snap = await store.snapshot([1, 2], now_ms=0)
        assert snap.prefix == {"a": (0, 2, 2), "s": (0, 0, 1)}

    async def test_heartbeat_sets_node_state_and_liveness(self, store):
        await self.feed(store, [heartbeat("a", 0, 10_000, queue=3, rack="r1"), heartbeat("d", 0, 2_000, role="decode")], topic=HB)
        snap = await store.snapshot([], now_ms=12_000)
        by = {n.node_id: n for n in snap.nodes}
        assert by["a"].role == "prefill" and by["a"].queue_depth == 3 and by["a"].queued_prefill_tokens == 300
        assert by["a"].rack == "r1" and by["a"].tier_capacity == {"hbm": 10}
        assert by["d"].role == "decode" and by["a"].last_heartbeat_ms == 10_000
        assert [n.node_id for n in snap.live_nodes(5.0)] == ["a"]  # d is 10 s old
        assert snap.watermark == {f"{HB}:0": 1}

    async def test_older_heartbeat_never_overwrites(self, store):
        await self.feed(store, [heartbeat("a", 5, 9_000, queue=5), heartbeat("a", 4, 8_000, queue=4)], topic=HB)
        (a,) = await store.nodes()
        assert a.queue_depth == 5 and a.last_heartbeat_ms == 9_000

    async def test_a_node_without_kv_events_is_marked_by_its_latest_heartbeat(self, store):
        """``kv_events=False`` (a ``--no-events`` bridge) reaches ``NodeState.kv_events`` with the
        node's capacity; a node that says nothing reads None; each heartbeat says it anew."""
        await self.feed(store, [heartbeat("x", 0, 1_000, kv_events=False, total_kv_blocks=640),
                                heartbeat("e", 0, 1_000), heartbeat("t", 0, 1_000, kv_events=True)], topic=HB)
        by = {n.node_id: n for n in await store.nodes()}
        assert (by["x"].kv_events, by["x"].publishes_kv_events, by["x"].total_kv_blocks) == (False, False, 640)
        assert (by["e"].kv_events, by["e"].publishes_kv_events) == (None, True)
        assert (by["t"].kv_events, by["t"].publishes_kv_events) == (True, True)
        assert {n.node_id: n.kv_events for n in (await store.snapshot([], now_ms=1_000)).nodes} == {
            "x": False, "e": None, "t": True}
        await self.feed(store, [heartbeat("x", 1, 2_000)], topic=HB, start=3)  # its engine now publishes them
        (x,) = [n for n in await store.nodes() if n.node_id == "x"]
        assert x.kv_events is None and x.last_heartbeat_ms == 2_000

    async def test_replay_changes_nothing(self, store):
        envs = [stored("a", 0, [1, 2]), removed("a", 1, [2]), stored("b", 0, [1])]
        await self.feed(store, envs)
        before = await store.dump()
        # the same records again at the same positions (a redelivery) ...
        assert await self.feed(store, envs) == ["fenced"] * 3
        # ... and a mixed batch that straddles the fence
        out = await self.feed(store, envs[1:] + [stored("b", 1, [5])], start=1)
        assert out == ["fenced", "fenced", "applied"]
        after = await store.dump()
        assert after["blocks"] != before["blocks"]
        await self.feed(store, envs)
        assert await store.dump() == after

    async def test_partitions_are_fenced_separately(self, store):
        await self.feed(store, [stored("a", 0, [1])], partition=0, start=10)
        out = await self.feed(store, [stored("b", 0, [2])], partition=1, start=3)
        assert out == ["applied"]
        assert await store.watermark() == {f"{KV}:0": 10, f"{KV}:1": 3}

    async def test_apply_groups_bulk_path(self, store):
        out = await store.apply_groups(
            [
                (None, [AddBlocks("a", 0, tuple(range(100, 200)))]),
                (SourcePosition("bulk", 0, 0), [AddBlocks("b", 1, (100, 101))]),
                (SourcePosition("bulk", 0, 0), [AddBlocks("b", 1, (102,))]),
                (None, [SetHeartbeat("a", {"role": "prefill", "last_heartbeat_ms": 7})]),
            ]
        )
        assert out == [APPLIED, APPLIED, FENCED, APPLIED]
        snap = await store.snapshot(list(range(100, 210)), now_ms=7)
        assert snap.prefix == {"a": (100, 100, 100), "b": (0, 2, 2)}
        assert [x.node_id for x in snap.live_nodes(1.0)] == ["a"]

    async def test_apply_groups_reports_each_group(self, store):
        pos = SourcePosition("bulk", 1, 5)
        flags = await store.apply_groups([(pos, [AddBlocks("a", 0, (1,))]), (pos, [AddBlocks("a", 0, (2,))]), (None, [])])
        assert flags == [APPLIED, FENCED, APPLIED]
        assert (await store.snapshot([1, 2], now_ms=0)).prefix == {"a": (1, 1, 1)}

    async def test_a_write_folded_from_a_moved_stream_is_refused(self, store):
        """Compare-and-set: a record folded from a stream state that another writer has since
        moved changes nothing, nor does anything after it in the call, fence included."""
        def pos(o):
            return SourcePosition(KV, 0, o)

        assert await store.apply_groups([(pos(0), fold(stored("a", 0, [1])).ops)]) == [APPLIED]
        stale = fold(stored("a", 1, [2])).ops  # folded as if "a" had no stream yet
        other = fold(stored("b", 0, [3])).ops
        assert await store.apply_groups([(pos(1), stale), (pos(2), other)]) == [CONFLICT, CONFLICT]
        assert (await store.snapshot([1, 2], now_ms=0)).prefix == {"a": (1, 1, 1)}
        assert (await store.snapshot([3], now_ms=0)).prefix == {}
        assert await store.watermark() == {f"{KV}:0": 0}
        # folded again from the stored state, the same records go in
        st = (await store.streams(["a"]))["a"]
        assert await store.apply_groups([(pos(1), fold(stored("a", 1, [2]), st).ops), (pos(2), other)]) == [APPLIED, APPLIED]
        assert (await store.snapshot([1, 2], now_ms=0)).prefix == {"a": (2, 2, 2)}
        assert (await store.streams(["a"]))["a"].gaps == 0

    async def test_a_write_lands_only_on_the_fence_it_continues_from(self, store):
        """Contiguity: a record naming the offset it continues from (``after``) is refused
        (``HOLE``, with everything after it) unless the partition's fence is exactly that; a
        missing fence is accepted only for the partition's first record (``after=-1``)."""
        def pos(o, after):
            return SourcePosition(KV, 0, o, after)

        a0, a1 = fold(stored("a", 0, [1])), None
        # a fence-less partition (a lost view) refuses a record that continues from offset 4
        assert await store.apply_groups([(pos(5, 4), a0.ops)]) == [Outcome.HOLE]
        assert await store.watermark() == {}
        assert await store.apply_groups([(pos(3, -1), a0.ops)]) == [APPLIED]  # the log starts at 3
        a1 = fold(stored("a", 1, [2]), a0.stream)
        a2 = fold(stored("a", 2, [3]), a1.stream)
        # 5 continues from 4, which the view does not have: refused, and 6 after it too
        assert await store.apply_groups([(pos(5, 4), a1.ops), (pos(6, 5), a2.ops)]) == [Outcome.HOLE, CONFLICT]
        assert await store.watermark() == {f"{KV}:0": 3}
        assert await store.apply_groups([(pos(4, 3), a1.ops), (pos(5, 4), a2.ops)]) == [APPLIED, APPLIED]
        assert await store.apply_groups([(pos(5, 4), a2.ops)]) == [FENCED]  # re-delivered
        assert (await store.snapshot([1, 2, 3], now_ms=0)).prefix == {"a": (3, 3, 3)}

    async def test_clear(self, store):
        await self.feed(store, [stored("a", 0, [1])])
        await store.clear()
        assert await store.dump() == {"nodes": {}, "blocks": {}, "watermark": {}}

    async def test_same_view_as_the_reference_store(self, store):
        """A random stream folded by this store equals the in-memory reference, key by key."""
        rng = random.Random(7)
        ref = InMemoryViewStore()
        envs = []
        seqs = {n: 0 for n in "abcd"}
        epochs = {n: 0 for n in "abcd"}
        for _ in range(300):
            node = rng.choice("abcd")
            r = rng.random()
            keys = rng.sample(range(40), rng.randint(1, 6))
            tier = rng.choice(["hbm", "hbm", "dram", "ssd"])
            if r < 0.5:
                body = BlocksStored(block_keys=keys, tier=tier)
            elif r < 0.8:
                body = BlocksRemoved(block_keys=keys, tier=tier)
            elif r < 0.85:
                body = AllBlocksCleared()
            elif r < 0.9:
                epochs[node] += 1
                seqs[node] = 0
                body = BlocksStored(block_keys=keys)
            else:
                body = BlocksMigrated(mode=rng.choice(["migrate", "replicate"]), block_keys=keys, from_node=node,
                                      from_tier=tier, to_node=rng.choice("abcd"), to_tier=rng.choice(["dram", "ssd"]))
            envs.append(envelope(body, producer_id=node, producer_seq=seqs[node], epoch=epochs[node], ts_ms=1))
            seqs[node] += rng.choice([1, 1, 1, 2])
        envs += envs[50:80]  # late duplicates
        positions = [(e, SourcePosition(KV, 0, i)) for i, e in enumerate(envs)]
        for i in range(0, len(positions), 37):
            await store.apply(positions[i : i + 37])
        await ref.apply(positions)
        assert await store.dump() == await ref.dump()
        for _ in range(20):
            chain = rng.sample(range(40), 10)
            assert (await store.snapshot(chain, now_ms=0)).prefix == (await ref.snapshot(chain, now_ms=0)).prefix


    async def test_long_chains_same_prefixes_as_the_reference_store(self, store):
        """Chains of hundreds of blocks, holder sets that come back after a change (A, B, A),
        the first unheld block at the start, in the middle and past the end of a holder's
        run, prefixes cut in one tier only: the same prefixes as the in-memory reference."""
        ref = InMemoryViewStore()
        envs = [stored("a", 0, list(range(700))), stored("b", 0, list(range(300))),
                stored("c", 0, list(range(256))), stored("b", 1, list(range(400, 520))),
                stored("d", 0, list(range(1000, 1256))), stored("d", 1, list(range(1000, 1100)), tier="dram"),
                removed("a", 1, [150, 151], tier="hbm"), stored("a", 2, [150], tier="ssd")]
        positions = [(e, SourcePosition(KV, 0, i)) for i, e in enumerate(envs)]
        await store.apply(positions)
        await ref.apply(positions)
        chains = [list(range(700)), list(range(900)), list(range(1000, 1300)), list(range(1000, 1256)),
                  list(range(255, 700)), [5000, *range(10)], list(range(149, 160)), [1, 2, 1, 2, 3] * 60]
        for chain in chains:
            got = (await store.snapshot(chain, now_ms=0)).prefix
            assert got == (await ref.snapshot(chain, now_ms=0)).prefix, chain[:3]
        assert (await store.snapshot(list(range(900)), now_ms=0)).prefix["a"] == (150, 150, 151)  # 150 in ssd only, 151 gone

    async def test_many_holders_same_view_as_the_reference_store(self, store):
        """Blocks held by many nodes (slots past 32 and 64: Redis's holder entries then differ in
        both bytes), stored again, in other tiers, removed tier by tier, prefixes stored over
        and over: the same view as the in-memory reference."""
        rng = random.Random(11)
        ref = InMemoryViewStore()
        names = [f"n{i}" for i in range(90)]
        seqs = dict.fromkeys(names, 0)
        envs = [stored(n, 0, [0, 1, 2, 3]) for n in names]  # every node holds the shared prefix
        for n in names:
            seqs[n] = 1
        for _ in range(600):
            node = rng.choice(names)
            tier = rng.choice(["hbm", "hbm", "dram", "ssd"])
            start = rng.choice([0, 0, rng.randrange(12)])
            keys = list(range(start, start + rng.randint(1, 8)))
            body = (BlocksStored(block_keys=keys, tier=tier) if rng.random() < 0.7
                    else BlocksRemoved(block_keys=keys, tier=tier))
            envs.append(envelope(body, producer_id=node, producer_seq=seqs[node], ts_ms=1))
            seqs[node] += 1
        positions = [(e, SourcePosition(KV, 0, i)) for i, e in enumerate(envs)]
        for i in range(0, len(positions), 50):
            await store.apply(positions[i : i + 50])
        await ref.apply(positions)
        assert await store.dump() == await ref.dump()
        for start in range(12):
            chain = list(range(start, 20))
            assert (await store.snapshot(chain, now_ms=0)).prefix == (await ref.snapshot(chain, now_ms=0)).prefix


class TestInMemoryViewStore(ViewStoreContract):
    @pytest.fixture
    def store(self):
        return InMemoryViewStore()


class TestRedisViewStore(ViewStoreContract):
    @pytest.fixture
    async def store(self, settings):
        s = RedisViewStore.connect(settings.redis(), settings.view_namespace)
        yield s
        await s.clear()
        await s.close()

    async def test_a_write_folded_on_a_lost_view_is_refused_whole(self, store):
        """Generation: a view flushed (or replaced) under a writer refuses its writes (``LOST``)
        until the writer adopts the new generation; creating one marks the partitions named."""
        await self.feed(store, [stored("a", 0, [1])])
        old = store.generation
        assert old is not None
        await store.client.delete(*[k async for k in store.client.scan_iter(match=store.keys.all_pattern)])  # FLUSH
        assert (await store.view_health())[0] is False
        out = await store.apply_groups([(SourcePosition(KV, 0, 0, -1), fold(stored("a", 0, [1])).ops)])
        assert out == [Outcome.LOST]
        assert await store.watermark() == {}
        gen, created = await store.adopt_generation([f"{KV}:0", f"{KV}:1"])
        assert created and gen != old
        assert await store.rebuild_pending() == {f"{KV}:0": -1, f"{KV}:1": -1}
        assert (await store.view_health())[1].startswith("view_rebuilding")
        await self.feed(store, [stored("a", 0, [1])])
        await store.mark_rebuilding({f"{KV}:0": 1, f"{KV}:1": 0}, gen)
        assert await store.rebuild_pending() == {}
        assert await store.view_health() == (True, "")

    async def test_no_node_beyond_the_last_slot(self, store):
        """A holder entry names at most MAX_SLOTS slots: a new node beyond them is refused with a
        clear error before its record writes anything; nodes with slots keep being written."""
        await self.feed(store, [stored("a", 0, [1])])
        await store.client.hset(store.keys.meta, "next_slot", MAX_SLOTS)
        with pytest.raises(ViewStoreError, match="no node slot left"):
            await self.feed(store, [stored("a", 1, [2]), stored("z", 0, [1, 3])], start=1)
        assert await store.watermark() == {f"{KV}:0": 1}  # a's record went in, z's did not
        assert (await store.snapshot([1, 2, 3], now_ms=0)).prefix == {"a": (2, 2, 2)}
        assert [n.node_id for n in await store.nodes()] == ["a"]

    async def test_compaction_clears_retired_slots_and_reuses_them(self, store):
        ref = InMemoryViewStore()
        envs = [
            stored("a", 0, [1, 2, 3]), stored("b", 0, [1, 2]),
            stored("a", 0, [9], epoch=1),  # a restarts: its old slot is retired
            envelope(AllBlocksCleared(), producer_id="b", producer_seq=1, ts_ms=1),  # b clears
        ]
        await self.feed(store, envs)
        await ref.apply([(e, None) for e in envs])
        raw = await store.client.get(store.block_key(3))
        assert raw and holder_entries(raw)  # the stale entry of a's old slot
        assert await store.compact(batch=1) == {"slots_freed": 2, "bits_cleared": 5, "keys_deleted": 3}
        assert await store.client.get(store.block_key(3)) is None
        assert await store.dump() == {**await ref.dump(), "watermark": await store.watermark()}
        # the freed slots are given to the next nodes to arrive, lowest first
        await self.feed(store, [stored("c", 0, [1, 9])], start=10)
        slots = {int(k): v.decode() for k, v in (await store.client.hgetall(store.keys.slots)).items()}
        assert slots == {0: "c", 1: "b", 2: "a"}
        assert (await store.snapshot([9], now_ms=0)).prefix == {"a": (1, 1, 1), "c": (1, 1, 1)}
        assert await store.compact() == {"slots_freed": 0, "bits_cleared": 0, "keys_deleted": 0}


class TestRawSnapshotReader(ViewStoreContract):
    """Every read of the contract (snapshot, nodes, watermark, dump) through the router's
    reader; writes (which it lends to its store) through ``RedisViewStore``."""

    @pytest.fixture
    async def store(self, settings):
        s = RawSnapshotReader(settings.redis_url, settings.view_namespace, store=RedisViewStore.connect(settings.redis(), settings.view_namespace))
        yield s
        await s.view.clear()
        await s.close()

    async def test_a_heartbeat_is_read_as_a_delta(self, store, settings):
        hb = [envelope(Heartbeat(role="decode", batch_size=i), producer_id=f"n{i}", producer_seq=0, ts_ms=1)
              for i in range(6)]
        await self.feed(store, hb + [stored("n1", 0, [1, 2])])
        chain = [1, 2, 3]
        await store.snapshot(chain, now_ms=5)
        assert store.node_reads["whole"] == 1
        await store.apply([(envelope(Heartbeat(role="decode", batch_size=40), producer_id="n3", producer_seq=1,
                                     ts_ms=2), None)])
        await store.apply([(stored("n5", 1, [1]), None)])  # a new slot
        got = await store.snapshot(chain, now_ms=5)
        assert store.node_reads == {"unchanged": 0, "delta": 1, "whole": 1}
        assert got == await store.snapshot(chain, now_ms=5)
        assert store.node_reads["unchanged"] == 1
        fresh = RawSnapshotReader(settings.redis_url, settings.view_namespace)
        try:
            assert got == await fresh.snapshot(chain, now_ms=5)
        finally:
            await fresh.close()
        assert {n.node_id: n.batch_size for n in got.nodes}["n3"] == 40 and got.prefix["n5"] == (1, 1, 1)
        await store.view.clear()  # a cleared view is read whole again, not as a delta of the old one
        await self.feed(store, [stored("n9", 0, [1])])
        again = await store.snapshot(chain, now_ms=5)
        assert [n.node_id for n in again.nodes] == ["n9"] and store.node_reads["whole"] == 2

    async def test_many_changed_nodes_are_still_a_delta(self, store, settings):
        # 1,010 nodes x 8 attributes: more than one unpack() may take, so the script fetches them in parts.
        n = 1010
        await self.feed(store, [envelope(Heartbeat(role="prefill", queue_depth=1), producer_id=f"n{i:03d}",
                                         producer_seq=0, ts_ms=1) for i in range(n)] + [stored("n007", 0, [1])])
        await store.snapshot([1], now_ms=5)
        assert store.node_reads["whole"] == 1
        await store.apply([(envelope(Heartbeat(role="prefill", queue_depth=i % 7), producer_id=f"n{i:03d}",
                                     producer_seq=1, ts_ms=2), None) for i in range(n)])
        got = await store.snapshot([1], now_ms=5)
        assert store.node_reads == {"unchanged": 0, "delta": 1, "whole": 1}
        assert {x.node_id: x.queue_depth for x in got.nodes} == {f"n{i:03d}": i % 7 for i in range(n)}
        fresh = RawSnapshotReader(settings.redis_url, settings.view_namespace)
        try:
            assert got == await fresh.snapshot([1], now_ms=5)
        finally:
            await fresh.close()

    async def test_reads_do_not_go_through_the_store(self, store):
        assert type(store).snapshot is RawSnapshotReader.snapshot and type(store).dump is RawSnapshotReader.dump
        assert type(store).nodes is RawSnapshotReader.nodes and type(store).watermark is RawSnapshotReader.watermark
