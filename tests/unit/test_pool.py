"""The shared KV pool's engine side, with a pool of plain dicts in place of Mooncake Store:
what goes in (blocks leaving the last local tier, demotions), what is read back, and the
events that index it in the view. The same paths against a real store: tests/integration/
test_mooncake_pool.py (marker ``mooncake``)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Sequence

from conductor.costmodel.profiles import load_profile
from conductor.harness.dispatch import Assignment
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.executor import EngineCommandExecutor
from conductor.harness.engine.pool import POOL_NODE, PoolIndex, PoolLink, block_bytes, object_key
from schemas import (
    BlocksMigrated,
    BlocksRemoved,
    Envelope,
    Heartbeat,
    KvCommand,
    RoutingDecision,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
)
from state.memory import InMemoryViewStore

BS = 4
A = list(range(100, 116))  # 4 blocks
B = list(range(500, 516))


class DictPool:
    """MooncakePool's calls over a dict (``capacity_blocks`` objects at most: then full)."""

    def __init__(self, capacity_blocks: int = 100, block_size_bytes: int = 64) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size_bytes = block_size_bytes
        self.objects: dict[str, bytes] = {}
        self.puts = 0

    def put_blocks(self, keys: Sequence[int]) -> tuple[list[int], bool]:
        done = []
        for k in keys:
            if len(self.objects) >= self.capacity_blocks:
                return done, True
            self.objects[object_key(k)] = block_bytes(k, self.block_size_bytes)
            self.puts += 1
            done.append(k)
        return done, False

    def read_prefix(self, keys: Sequence[int]) -> int:
        for i, k in enumerate(keys):
            if object_key(k) not in self.objects:
                return i
        return len(keys)

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return [object_key(k) in self.objects for k in keys]

    def remove_blocks(self, keys: Sequence[int]) -> list[int]:
        return [k for k in keys if self.objects.pop(object_key(k), None) is not None]

    def close(self) -> None: ...


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    def start(self) -> None: ...

    async def publish(self, ts: float, events: list[object]) -> None:
        self.batches.append(list(events))


def engine(node: str = "p0", *, kv_blocks: int = 4, pool: DictPool | None = None
           ) -> tuple[EmulatedEngine, list[Envelope], io.StringIO]:
    sent: list[Envelope] = []

    async def sink(envs: list[Envelope]) -> None:
        sent.extend(decode(encode(e)) for e in envs)  # what the topic would carry

    link = PoolLink(pool or DictPool(), PoolIndex(node, epoch=7, capacity_blocks=100), events=sink,  # type: ignore[arg-type]
                    heartbeats=sink, clock_ms=lambda: 1_000)
    report = io.StringIO()
    cfg = EngineConfig(node_id=node, role="prefill", block_size=BS, kv_blocks=kv_blocks, time_scale=1e6)
    eng = EmulatedEngine(cfg, load_profile("llama3-8b-a100x1"), Recorder(), report=report,  # type: ignore[arg-type]
                         clock_ms=lambda: 1_000, pool=link)
    return eng, sent, report


def assignment(rid: str, tokens: list[int], *, reuse_source: str | None = None, reused: int = 0) -> Assignment:
    req = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), expected_output_tokens=1)
    d = RoutingDecision(request_id=rid, prefill_instance="p0", decode_instance="d0", reused_tokens=reused,
                        reuse_source=reuse_source, reuse_tier="dram" if reuse_source else None,
                        predicted_ttft_s=0.0, predicted_tbt_ms=20, policy="test")
    return Assignment(d, req, 0, 0, prefill=True, decode=False)


async def run(eng: EmulatedEngine, report: io.StringIO, *items: Assignment) -> list[dict[str, object]]:
    for a in items:
        eng.submit(a)
    task = asyncio.create_task(eng.run_prefill())
    try:
        async with asyncio.timeout(10):
            while report.getvalue().count("\n") < len(items):
                await asyncio.sleep(0.005)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return [json.loads(line) for line in report.getvalue().splitlines()]


def fold(envs: list[Envelope]) -> InMemoryViewStore:
    view = InMemoryViewStore()
    view.apply_records_sync([(e, None) for e in envs])  # type: ignore[misc]
    return view


async def test_blocks_leaving_hbm_are_put_into_the_pool_and_indexed_on_its_node() -> None:
    pool = DictPool()
    eng, sent, report = engine(pool=pool)
    await run(eng, report, assignment("a", A), assignment("b", B))  # b evicts a's 4 blocks from HBM
    keys = chain_keys(A, BS)
    assert set(pool.objects) == {object_key(k) for k in keys}
    [ev] = sent
    assert ev.producer_id == f"p0@{POOL_NODE}" and ev.epoch == 7  # the writer's own stream
    assert isinstance(ev.body, BlocksMigrated) and ev.body.mode == "replicate"
    assert (ev.body.to_node, ev.body.to_tier, ev.body.block_keys) == (POOL_NODE, "dram", keys)
    view = fold([*sent, eng.pool.index.heartbeat(1_000)])  # type: ignore[union-attr]
    snap = view.snapshot_sync(keys, now_ms=1_000)
    assert snap.prefix[POOL_NODE] == (0, 4, 4)  # nothing in HBM, 4 blocks in the pool's DRAM
    assert {n.node_id: n.role for n in snap.nodes}[POOL_NODE] == "store"


async def test_a_prefix_routed_from_the_pool_is_read_back_and_a_missing_block_is_reported() -> None:
    pool = DictPool()
    keys = chain_keys(A, BS)
    pool.put_blocks(keys[:3])  # the master evicted the fourth
    eng, sent, report = engine(pool=pool, kv_blocks=16)
    [row] = await run(eng, report, assignment("a", A, reuse_source=POOL_NODE, reused=len(A)))
    assert row["pool_cached_tokens"] == 3 * BS and row["cached_tokens"] == 3 * BS  # the rest recomputed
    [miss] = sent
    assert isinstance(miss.body, BlocksRemoved)
    assert (miss.body.node, miss.body.tier, miss.body.block_keys) == (POOL_NODE, "dram", keys[3:])
    # In the view: the pool had all four (another writer's put), the miss takes the fourth away.
    put = PoolIndex("p1", epoch=1).stored(keys, "hbm", 900)
    snap = fold([put, miss]).snapshot_sync(keys, now_ms=1_000)
    assert snap.prefix[POOL_NODE][1] == 3


async def test_an_engine_without_host_memory_demotes_into_the_pool() -> None:
    pool = DictPool()
    eng, sent, report = engine(pool=pool, kv_blocks=16)
    await run(eng, report, assignment("a", A))
    keys = chain_keys(A, BS)
    results = []

    async def answers(envs: list[Envelope]) -> None:
        results.extend(e.body for e in envs)

    ex = EngineCommandExecutor(eng, answers, clock_ms=lambda: 1_000)
    cmd = KvCommand(command_id="dem-1", action="demote", block_keys=keys, from_node="p0", to_tier="dram",
                    token_ids=A, block_size=BS, deadline_ms=5_000)
    r = await ex.handle(cmd)
    assert (r.status, r.blocks) == ("done", 4), r  # type: ignore[union-attr]
    assert set(pool.objects) == {object_key(k) for k in keys}
    assert len(eng.cache) == 0  # left HBM
    [moved] = sent
    assert isinstance(moved.body, BlocksMigrated) and moved.body.mode == "migrate"
    assert (moved.body.from_node, moved.body.from_tier, moved.body.to_node) == ("p0", "hbm", POOL_NODE)
    again = await ex.handle(cmd)
    assert again == r and len(sent) == 1  # a repeat changes nothing


async def test_a_full_pool_takes_what_fits_and_the_view_hears_only_that() -> None:
    pool = DictPool(capacity_blocks=2)
    eng, sent, report = engine(pool=pool)
    await run(eng, report, assignment("a", A), assignment("b", B))
    assert len(pool.objects) == 2 and eng.pool.counts["pool_full"] == 1  # type: ignore[union-attr]
    [ev] = sent
    assert ev.body.block_keys == chain_keys(A, BS)[:2]  # type: ignore[union-attr]


def test_the_pool_heartbeats_as_a_store_node_with_its_capacity() -> None:
    idx = PoolIndex("p0", "pool-a", epoch=3, capacity_blocks=512, heartbeat_s=0.5)
    hb = idx.heartbeat(10)
    assert hb.producer_id == "pool-a" and hb.epoch == 3
    assert isinstance(hb.body, Heartbeat) and hb.body.role == "store"
    assert hb.body.tier_capacity == {"dram": 512} and idx.heartbeat(11).producer_seq == 1


def test_block_bytes_are_sized_and_keyed() -> None:
    data = block_bytes(0xABCDEF, 5 * 1024 * 1024 + 3)
    assert len(data) == 5 * 1024 * 1024 + 3 and data[:8] == (0xABCDEF).to_bytes(8, "big")
    assert object_key(1, "m") == "conductor/m/0000000000000001" != object_key(2, "m")


def pool_command(cid: str, keys: list[int], **kw: object) -> KvCommand:
    return KvCommand(command_id=cid, action="replicate", block_keys=keys, from_node="p0", to_node=POOL_NODE,
                     to_tier="dram", by_node="p0", deadline_ms=5_000, **kw)  # type: ignore[arg-type]


async def test_a_replicate_into_the_pool_is_carried_out_by_the_holder_with_real_puts_once() -> None:
    pool = DictPool()
    eng, sent, report = engine(pool=pool, kv_blocks=16)
    await run(eng, report, assignment("a", A))
    keys = chain_keys(A, BS)
    results: list[object] = []

    async def answers(envs: list[Envelope]) -> None:
        results.extend(e.body for e in envs)

    ex = EngineCommandExecutor(eng, answers, clock_ms=lambda: 1_000)
    cmd = pool_command("rep-pool-1", keys)  # no token ids: the pool names blocks by Conductor key
    r = await ex.handle(cmd)
    assert (r.status, r.blocks, r.bytes_moved) == ("done", 4, 4 * 64), r  # type: ignore[union-attr]
    assert set(pool.objects) == {object_key(k) for k in keys} and pool.puts == 4
    assert len(eng.cache) == 4  # a replica: the holder keeps its copy
    [stored] = sent
    assert stored.producer_id == f"p0@{POOL_NODE}" and isinstance(stored.body, BlocksMigrated)
    assert (stored.body.mode, stored.body.from_node, stored.body.to_node, stored.body.block_keys) == (
        "replicate", "p0", POOL_NODE, keys)
    snap = fold([*sent, eng.pool.index.heartbeat(1_000)]).snapshot_sync(keys, now_ms=1_000)  # type: ignore[union-attr]
    assert snap.prefix[POOL_NODE] == (0, 4, 4)
    # Delivered twice: the same answer, nothing put again; a new id finds the blocks there.
    assert await ex.handle(cmd) == r and pool.puts == 4 and len(sent) == 1
    r2 = await ex.handle(pool_command("rep-pool-2", keys))
    assert (r2.status, r2.blocks) == ("done", 0) and pool.puts == 4 and len(sent) == 1  # type: ignore[union-attr]
    assert [x.command_id for x in results] == ["rep-pool-1", "rep-pool-1", "rep-pool-2"]  # type: ignore[attr-defined]


async def test_a_replicate_into_another_pool_or_of_blocks_not_held_fails_with_a_code() -> None:
    eng, sent, _ = engine(pool=DictPool(), kv_blocks=16)
    ex = EngineCommandExecutor(eng, clock_ms=lambda: 1_000)
    other = KvCommand(command_id="x", action="replicate", block_keys=[1, 2], from_node="p0", to_node="pool-b",
                      to_tier="dram", by_node="p0")
    assert (await ex.handle(other)).error == "unsupported"  # type: ignore[union-attr]
    missing = await ex.handle(pool_command("y", chain_keys(B, BS)))
    assert (missing.status, missing.error) == ("failed", "not_held") and sent == []  # type: ignore[union-attr]


async def test_a_full_pool_answers_no_room_or_the_part_it_took() -> None:
    pool = DictPool(capacity_blocks=100)
    eng, _, report = engine(pool=pool, kv_blocks=16)
    await run(eng, report, assignment("a", A))
    pool.put_blocks(list(range(1, 99)))  # other writers filled it meanwhile: room for 2 more
    ex = EngineCommandExecutor(eng, clock_ms=lambda: 1_000)
    r = await ex.handle(pool_command("part", chain_keys(A, BS)))
    assert (r.status, r.blocks) == ("done", 2) and "took 2 of 4" in r.reason  # type: ignore[union-attr]
    pool.objects.clear()
    pool.put_blocks(list(range(1, 101)))  # full
    r = await ex.handle(pool_command("none", chain_keys(A, BS)))
    assert (r.status, r.error) == ("failed", "no_room")  # type: ignore[union-attr]


async def test_an_evict_from_the_pool_is_a_forced_remove_by_a_joined_engine() -> None:
    pool = DictPool()
    keys = chain_keys(A, BS)
    put = PoolIndex("p0", epoch=1).stored(keys, "hbm", 900)  # p0 put them
    pool.put_blocks(keys)
    eng, sent, _ = engine("p1", pool=pool)
    ex = EngineCommandExecutor(eng, clock_ms=lambda: 1_000)
    cmd = KvCommand(command_id="evi-1", action="evict", block_keys=keys, from_node=POOL_NODE, from_tier="dram",
                    by_node="p1", deadline_ms=5_000)
    r = await ex.handle(cmd)
    assert (r.status, r.blocks) == ("done", 4) and pool.objects == {}  # type: ignore[union-attr]
    [removed] = sent
    assert removed.producer_id == f"p1@{POOL_NODE}" and isinstance(removed.body, BlocksRemoved)
    assert (removed.body.node, removed.body.tier, removed.body.block_keys) == (POOL_NODE, "dram", keys)
    snap = fold([put, *sent]).snapshot_sync(keys, now_ms=1_000)
    assert snap.prefix.get(POOL_NODE, (0, 0, 0)) == (0, 0, 0)
    assert await ex.handle(cmd) == r and len(sent) == 1
