"""A worker resumes each partition where the view stopped, whatever the group's committed offset says.

Kafka's committed offset is the consumer's claim; the view's fence (the highest offset it
applied per partition, written with the effects) is the fact. A committed offset past
records the view never applied (seen after a worker was SIGKILLed: Faust had committed
offsets of records it had not finished) must not make the worker skip them.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from conductor.bench_ingest import start_worker_process, stop_worker_process
from conductor.devstack import free_port
from conductor.settings import load_settings
from schemas import BlocksRemoved, BlocksStored, encode, envelope
from state.memory import InMemoryViewStore
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.replay import diff_dumps, replay_into
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_committed_offset_past_the_view_is_not_trusted(stack, tmp_path):
    tag = uuid.uuid4().hex[:8]
    s = load_settings(
        kafka_url=stack.kafka_url, redis_url=stack.redis_url, profile="embedded", topic_prefix=f"r{tag}.",
        view_namespace=f"r{tag}", partitions=2, web_port=free_port(), data_dir=tmp_path / "d",
    )
    t = topics(s)
    await ensure_topics(s, t.all())
    rng = random.Random(5)
    held = {f"n{i}": [] for i in range(4)}
    seq = dict.fromkeys(held, 0)
    prod = producer(s)
    await prod.start()
    sent = 0
    try:
        for _ in range(400):
            node = rng.choice(sorted(held))
            if held[node] and rng.random() < 0.3:
                body = BlocksRemoved(block_keys=[held[node].pop(0) for _ in range(min(len(held[node]), 3))])
            else:
                keys = [rng.getrandbits(63) for _ in range(rng.randint(1, 6))]
                held[node] += keys
                body = BlocksStored(block_keys=keys)
            e = envelope(body, producer_id=node, producer_seq=seq[node], ts_ms=1)
            seq[node] += 1
            await prod.send(t.kv_events.name, encode(e), key=node.encode())
            sent += 1
        await prod.flush()
    finally:
        await prod.stop()

    # The worker's group claims 40 records per partition done; the view has none of them.
    group = f"{s.topic_prefix}stream-worker"
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka_url, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(t.kv_events.name, p) for p in range(2)]
        c.assign(tps)
        await c.commit({tp: 40 for tp in tps})
    finally:
        await c.stop()

    store = RedisViewStore.from_settings(s)
    worker = start_worker_process(s, tmp_path / "w.log")
    try:
        deadline = time.monotonic() + 90
        while True:
            wm = await store.watermark()
            if sum(wm.values()) + len(wm) >= sent:
                break
            assert worker.poll() is None, "the worker died"
            assert time.monotonic() < deadline, f"not caught up: {wm}"
            await asyncio.sleep(0.05)
        ref = InMemoryViewStore()
        await replay_into(s, ref)
        got, want = await store.dump(), ref.dump_sync()
        assert got == want, diff_dumps(got, want)
        assert all(n["seq_gaps"] == 0 for n in got["nodes"].values())
    finally:
        stop_worker_process(worker)
        await store.clear()
        await store.close()
