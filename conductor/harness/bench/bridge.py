"""``conductor bench bridge``: how fast one bridge turns engine batches into Conductor records."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.bridge.wire import EngineBlockStored
from schemas import BlocksStored, Envelope
from streams.kafka import ensure_topics, producer
from streams.topics import topics


async def run_bridge_bench(settings: Any, *, batches: int, blocks: int, kafka: bool) -> dict[str, Any]:
    """Publish ``batches`` batches of ``blocks`` chained blocks; time them through the bridge."""
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
    }
