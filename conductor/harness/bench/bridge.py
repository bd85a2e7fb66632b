"""``conductor bench bridge``: how fast one bridge turns engine batches into Conductor records,
and what one tracked block costs it in memory."""

from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc
from typing import Any

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.bridge.translate import NodeTranslator
from conductor.bridge.wire import EngineBlockStored
from schemas import BlocksStored, Envelope
from streams.kafka import ensure_topics, producer
from streams.topics import topics


def translator_memory(blocks: int, *, block_size: int = 16, per_event: int = 64) -> dict[str, Any]:
    """Bytes one node's translator holds per tracked block (``tracemalloc``): ``blocks`` blocks stored in
    one chain, ``per_event`` a GPU event, with random 64-bit engine hashes (as vLLM's), bound not reached."""
    rng = random.Random(0)
    t = NodeTranslator(expected_block_size=block_size, max_tracked=blocks)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        parent = None
        for first in range(0, blocks, per_event):
            n = min(per_event, blocks - first)
            hashes = tuple(rng.getrandbits(64) for _ in range(n))
            tokens = tuple((first * block_size + j) % 32_000 for j in range(n * block_size))
            t.translate_event(EngineBlockStored(hashes, parent, tokens, block_size, "hbm"))
            parent = hashes[-1]
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return {"memory_blocks": blocks, "bytes_per_block": round(held / blocks, 1),
            "mib_per_million_blocks": round(held / blocks * 1_000_000 / 2**20, 1)}


async def run_bridge_bench(settings: Any, *, batches: int, blocks: int, kafka: bool,
                           memory_blocks: int = 100_000) -> dict[str, Any]:
    """Publish ``batches`` batches of ``blocks`` chained blocks; time them through the bridge. Then
    measure the translator's memory per block over ``memory_blocks`` blocks (0: not measured)."""
    bs = settings.block_size
    pub = EventPublisher(f"tcp://{settings.bind_host}:0", f"tcp://{settings.bind_host}:0", buffer_steps=batches + 1)
    pub.start()
    got = 0
    done = asyncio.Event()
    prod = None
    if kafka:

        tps = topics(settings.topic_config())
        await ensure_topics(settings.kafka(), (tps.kv_events,))
        prod = producer(settings.kafka())
        await prod.start()
        to_kafka = kafka_sink(prod, tps.kv_events.name)

    async def sink(envs: list[Envelope]) -> None:
        nonlocal got
        if prod is not None:
            await to_kafka(envs)
        got += sum(len(e.body.block_keys or ()) for e in envs if isinstance(e.body, BlocksStored))
        if got >= batches * blocks:
            done.set()

    stop = asyncio.Event()
    bridge = Bridge(BridgeConfig(node_id="bench-0", role="prefill", zmq_endpoint=pub.endpoint,
                                 replay_endpoint=pub.replay_endpoint, block_size=bs, heartbeat_s=None), sink)
    task = asyncio.create_task(bridge.run(stop))
    try:
        await asyncio.wait_for(bridge.ready.wait(), 10)
        await asyncio.sleep(0.2)  # let the subscription settle, so the run measures the live path
        t0 = time.perf_counter()
        parent = None
        for i in range(batches):
            hashes = tuple(range(i * blocks + 1, (i + 1) * blocks + 1))
            tokens = tuple((i * blocks * bs + j) % 32_000 for j in range(blocks * bs))
            await pub.publish(time.time(), [EngineBlockStored(hashes, parent, tokens, bs, "hbm")])
            parent = hashes[-1]
            if i % 64 == 0:
                await asyncio.sleep(0)  # let the bridge run alongside, as it would against an engine
        await asyncio.wait_for(done.wait(), 120)
        if prod is not None:
            await to_kafka.flush()  # acknowledged by the broker, not just queued
        dt = time.perf_counter() - t0
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        if prod is not None:
            await prod.stop()
    return {
        "batches": batches,
        "blocks": batches * blocks,
        "block_size": bs,
        "kafka": kafka,
        "seconds": round(dt, 3),
        "batches_per_s": round(batches / dt, 1),
        "blocks_per_s": round(batches * blocks / dt, 1),
        "gaps": bridge.counts["gaps"],
        "gaps_unfilled": bridge.counts["gaps_unfilled"],
        **(translator_memory(memory_blocks, block_size=bs) if memory_blocks else {}),
    }
