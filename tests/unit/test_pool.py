"""The shared KV pool's engine side, with a pool of plain dicts in place of Mooncake Store:
what goes in (blocks leaving the last local tier, demotions), what is read back, and the
events that index it in the view. The same paths against a real store: tests/integration/
test_mooncake_pool.py (marker ``mooncake``)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Sequence

from conductor.engine.emulated import EmulatedEngine, EngineConfig
from conductor.engine.executor import EngineCommandExecutor
from conductor.engine.pool import POOL_NODE, PoolIndex, PoolLink, block_bytes, object_key
from conductor.profiles import load_profile
from conductor.routing.dispatch import Assignment
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

    def put_blocks(self, keys: Sequence[int]) -> tuple[list[int], bool]:
        done = []
        for k in keys:
            if len(self.objects) >= self.capacity_blocks:
                return done, True
            self.objects[object_key(k)] = block_bytes(k, self.block_size_bytes)
            done.append(k)
        return done, False

    def read_prefix(self, keys: Sequence[int]) -> int:
        for i, k in enumerate(keys):
            if object_key(k) not in self.objects:
                return i
        return len(keys)

    def holds(self, keys: Sequence[int]) -> list[bool]:
        return [object_key(k) in self.objects for k in keys]

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
