"""The emulated engine: its prefix cache (unit), and engine → ZMQ → bridge → Kafka with real decisions on dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time

import pytest

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.costmodel.profiles import load_profile
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig, PrefixCache, engine_hashes
from conductor.harness.engine.serve import EngineServeConfig, engine_node
from conductor.settings import Settings
from schemas import (
    BlocksStored,
    Heartbeat,
    RoutingDecision,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
    envelope,
    headers,
)
from streams.kafka import consumer, ensure_topics, producer
from streams.topics import topics


def test_prefix_cache_is_lru_and_bounded() -> None:
    c = PrefixCache(3)
    assert c.insert([1, 2, 3]) == []
    assert c.cached_prefix([1, 2, 9]) == 2  # touches 1 and 2
    assert c.insert([4]) == [3]  # 3 is the least recently used
    assert c.cached_prefix([3]) == 0
    assert c.insert([5, 6, 7, 8]) == [1, 2, 4]  # only the last 3 of an oversized insert are kept
    assert [h in c for h in (6, 7, 8)] == [True, True, True] and len(c) == 3
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_engine_hashes_are_chained_and_salted() -> None:
    toks = list(range(64))
    a = engine_hashes(toks, 16, b"salt-a")
    assert len(a) == 4 and engine_hashes(toks[:32], 16, b"salt-a") == a[:2]
    assert engine_hashes(toks, 16, b"salt-b") != a  # another instance: other hashes
    assert a != chain_keys(toks, 16)  # and never Conductor's keys by accident


async def _send(prod, topic: str, body, key: str, seq: int) -> None:  # type: ignore[no-untyped-def]
    env = envelope(body, producer_id="test", producer_seq=seq, ts_ms=time.time_ns() // 1_000_000)
    await prod.send_and_wait(topic, encode(env), key=key.encode(), headers=headers(env))


@pytest.mark.integration
async def test_engine_executes_its_decisions_and_the_bridge_publishes_token_derived_keys(settings: Settings) -> None:
    tps = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), tps.all())
    prod = producer(settings.kafka())
    await prod.start()
    report = io.StringIO()
    # The engine as `conductor engine` starts it (its own producer, heartbeats and decisions).
    cfg = EngineServeConfig(node_id="p0", role="prefill", kv_blocks=64, time_scale=1000.0, heartbeat_s=0.2,
                            report=True, kv_commands=False)
    node = contextlib.AsyncExitStack()
    eng = await node.enter_async_context(engine_node(cfg, settings, report_to=report))
    stop = asyncio.Event()
    bridge = Bridge(
        BridgeConfig(node_id="p0", role="prefill", zmq_endpoint=eng.publisher.endpoint,
                     replay_endpoint=eng.publisher.replay_endpoint, block_size=settings.block_size, heartbeat_s=None),
        kafka_sink(prod, tps.kv_events.name),
    )
    tasks = [asyncio.create_task(eng.run(stop)), asyncio.create_task(bridge.run(stop))]
    tokens = list(range(7, 7 + 4 * settings.block_size + 5))  # 4 full blocks and a partial one
    try:
        await asyncio.wait_for(bridge.ready.wait(), 10)
        for i in range(2):
            rid = f"r{i}"
            req = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), expected_output_tokens=4)
            dec = RoutingDecision(request_id=rid, prefill_instance="p0", decode_instance="d0", reused_tokens=0,
                                  predicted_ttft_s=0.1, predicted_tbt_ms=20, policy="test")
            await _send(prod, tps.requests.name, req, rid, i)
            await _send(prod, tps.dispatch.name, dec, "p0", i)
            deadline = time.monotonic() + 20
            while report.getvalue().count("\n") < i + 1:
                assert time.monotonic() < deadline, "the engine did not execute its decision"
                await asyncio.sleep(0.05)
        rows = [json.loads(line) for line in report.getvalue().splitlines()]
        assert [r["request_id"] for r in rows] == ["r0", "r1"]
        assert rows[0]["cached_tokens"] == 0
        assert rows[1]["cached_tokens"] == 4 * settings.block_size  # the second run reuses the first's blocks
        assert rows[0]["ttft_s"] is not None and rows[0]["ttft_s"] >= 0

        # What reached kv-events: Conductor keys derived from the tokens, as a request would hash them.
        cons = consumer(settings.kafka(), tps.kv_events.name, tps.heartbeats.name, group_id=None)
        await cons.start()
        stored: list[int] = []
        beats: list[Heartbeat] = []
        deadline = time.monotonic() + 20
        while (not stored or not beats) and time.monotonic() < deadline:
            for recs in (await cons.getmany(timeout_ms=300)).values():
                for rec in recs:
                    env = decode(rec.value)
                    assert rec.key == b"p0"
                    if isinstance(env.body, BlocksStored):
                        stored.extend(env.body.block_keys or [])
                    elif isinstance(env.body, Heartbeat):
                        beats.append(env.body)
        await cons.stop()
        assert stored == chain_keys(tokens, settings.block_size)
        assert beats and beats[0].role == "prefill" and beats[0].total_kv_blocks == 64
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await node.aclose()
        await prod.stop()


def _assignment(rid: str, tokens: list[int], *, prefill: bool, decode_: bool, out: int = 4, ts_ms: int = 0):  # type: ignore[no-untyped-def]
    from conductor.harness.dispatch import Assignment

    req = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), expected_output_tokens=out)
    dec = RoutingDecision(request_id=rid, prefill_instance="n0", decode_instance="n0", reused_tokens=0,
                          predicted_ttft_s=0.0, predicted_tbt_ms=20, policy="test")
    return Assignment(dec, req, ts_ms, ts_ms, prefill=prefill, decode=decode_)


async def _run_engine(eng: EmulatedEngine, assignments: list, until_rows: int, report: io.StringIO) -> list[dict]:  # type: ignore[type-arg]
    async def feed():  # type: ignore[no-untyped-def]
        for a in assignments:
            yield a
        await asyncio.Event().wait()  # stay subscribed, like the dispatch stream

    task = asyncio.create_task(eng.run(feed()))
    try:
        deadline = time.monotonic() + 10
        while report.getvalue().count("\n") < until_rows:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await eng.publisher.close()
    return [json.loads(line) for line in report.getvalue().splitlines()]


async def test_an_evicting_prefill_engine_reports_stored_then_removed_blocks_in_vllm_form() -> None:
    from conductor.bridge.wire import EngineBlockRemoved, EngineBlockStored, decode_batch

    report = io.StringIO()
    pub = EventPublisher("tcp://127.0.0.1:0", None)
    eng = EmulatedEngine(EngineConfig(node_id="n0", role="prefill", block_size=16, kv_blocks=4, time_scale=1e6),
                         load_profile("llama3-70b-a800x8"), pub, report=report)
    a, b = list(range(64)), list(range(1000, 1064))  # 4 blocks each: the second evicts the first
    rows = await _run_engine(eng, [_assignment("a", a, prefill=True, decode_=False),
                                   _assignment("b", b, prefill=True, decode_=False)], 2, report)
    assert [r["cached_tokens"] for r in rows] == [0, 0]
    batches = [decode_batch(payload).events for _, payload in pub.buffer]
    assert [type(e) for e in batches[0]] == [EngineBlockStored]
    assert [type(e) for e in batches[1]] == [EngineBlockStored, EngineBlockRemoved]
    assert batches[1][1].block_hashes == batches[0][0].block_hashes  # type: ignore[union-attr]
    assert batches[1][0].token_ids == tuple(b) and batches[1][0].parent_block_hash is None  # type: ignore[union-attr]


async def test_a_decode_engine_decodes_in_one_batch_at_the_profiles_step_time() -> None:
    report = io.StringIO()
    profile = load_profile("llama3-70b-a800x8")
    pub = EventPublisher("tcp://127.0.0.1:0", None)
    eng = EmulatedEngine(EngineConfig(node_id="n0", role="decode", block_size=16, time_scale=1000.0),
                         profile, pub, report=report)
    rows = await _run_engine(eng, [_assignment("a", list(range(100)), prefill=False, decode_=True, out=40),
                                   _assignment("b", list(range(100)), prefill=False, decode_=True, out=40)], 2, report)
    assert {r["request_id"] for r in rows} == {"a", "b"} and all(r["output_tokens"] == 40 for r in rows)
    alone, together = profile.decode_step_seconds(1, 100) * 1000, profile.decode_step_seconds(2, 280) * 1000
    for r in rows:
        assert alone * 0.99 <= r["tbt_ms"] <= together * 1.01


async def test_evicted_blocks_move_to_host_memory_and_are_reused_from_there() -> None:
    from conductor.bridge.translate import NodeTranslator
    from conductor.bridge.wire import EngineBlockStored, decode_batch
    from schemas import BlocksRemoved

    report = io.StringIO()
    pub = EventPublisher("tcp://127.0.0.1:0", None)
    eng = EmulatedEngine(EngineConfig(node_id="n0", role="prefill", block_size=16, kv_blocks=4, dram_blocks=8,
                                      time_scale=1e6), load_profile("llama3-70b-a800x8"), pub, report=report)
    a, b = list(range(64)), list(range(1000, 1064))
    rows = await _run_engine(eng, [_assignment("a1", a, prefill=True, decode_=False),
                                   _assignment("b", b, prefill=True, decode_=False),
                                   _assignment("a2", a, prefill=True, decode_=False)], 3, report)
    assert [r["cached_tokens"] for r in rows] == [0, 0, 64]
    assert rows[2]["dram_cached_tokens"] == 64  # loaded from host memory, not recomputed
    # Through the bridge's translation: a's blocks go hbm → dram (same keys), then back to hbm.
    t = NodeTranslator()
    batches = [decode_batch(payload) for _, payload in pub.buffer]
    # The copies to host memory go out as vLLM's CPU-offload placeholders: medium CPU, no
    # tokens, block size 0, the hashes the GPU tier already reported.
    offloads = [ev for batch in batches for ev in batch.events if getattr(ev, "tier", None) == "dram"
                and isinstance(ev, EngineBlockStored)]
    assert offloads and all(ev.placeholder and ev.block_size == 0 and ev.parent_block_hash is None
                            for ev in offloads)
    records = [r for batch in batches for r in t.translate(batch)]
    ka, kb = chain_keys(a, 16), chain_keys(b, 16)
    stored = [(r.tier, tuple(r.block_keys or ())) for r in records if isinstance(r, BlocksStored)]
    assert stored[0] == ("hbm", tuple(ka)) and stored[1] == ("hbm", tuple(kb))
    # Each chain moves in one event: a when b evicts it, then b when a comes back.
    assert [keys for tier, keys in stored if tier == "dram"] == [tuple(ka), tuple(kb)]
    removed = [(r.tier, tuple(r.block_keys)) for r in records if isinstance(r, BlocksRemoved)]
    assert ("hbm", tuple(ka)) in removed
    assert t.counts["orphan_blocks"] == 0 and t.counts["bad_event"] == 0
    assert t.counts["placeholder_blocks"] == len(ka) + len(kb)
    assert {tier for h in eng._blocks for tier, _ in t.holders_of(h)} >= {"hbm", "dram"}
