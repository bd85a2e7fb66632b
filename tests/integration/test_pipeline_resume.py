"""A worker resumes each partition where the view stopped, whatever the group's committed offset says.

Kafka's committed offset is the consumer's claim; the view's fence (the highest offset it
applied per partition, written with the effects) is the fact. A committed offset past
records the view never applied (seen after a worker was SIGKILLed: Faust had committed
offsets of records it had not finished) must not make the worker skip them.
"""

from __future__ import annotations

import uuid
from contextlib import asynccontextmanager

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from kvstream import KvStream, caught_up

from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.settings import load_settings
from schemas import encode
from state.memory import InMemoryViewStore
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.replay import diff_dumps, replay_into
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def fresh_settings(stack, tmp_path):
    tag = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_url=stack.kafka_url, redis_url=stack.redis_url, profile="embedded", topic_prefix=f"r{tag}.",
        view_namespace=f"r{tag}", partitions=2, web_port=free_port(), data_dir=tmp_path / "d",
    )


class Engines:
    """A :class:`KvStream` published onto kv-events, in parts."""

    def __init__(self, s, seed):
        self.s, self.stream, self.sent = s, KvStream(seed, max_store=6, max_remove=3), 0

    async def publish(self, n):
        t = topics(self.s.topic_config())
        prod = producer(self.s.kafka())
        await prod.start()
        try:
            for e in self.stream.take(n):
                await prod.send(t.kv_events.name, encode(e), key=e.producer_id.encode())
                self.sent += 1
            await prod.flush()
        finally:
            await prod.stop()


@asynccontextmanager
async def running_worker(s, tmp_path):
    """A `conductor worker` subprocess over a view of its own, stopped and cleared after."""
    store = RedisViewStore.connect(s.redis(), s.view_namespace)
    worker = start_worker_process(s, tmp_path / "w.log")
    try:
        yield store, worker
    finally:
        stop_worker_process(worker)
        await store.clear()
        await store.close()


async def assert_view_is_the_log(s, store):
    ref = InMemoryViewStore()
    await replay_into(s.kafka(), s.topic_config(), ref)
    got, want = await store.dump(), ref.dump_sync()
    assert got == want, diff_dumps(got, want)
    assert all(n["seq_gaps"] == 0 for n in got["nodes"].values())


async def test_a_committed_offset_past_the_view_is_not_trusted(stack, tmp_path):
    s = fresh_settings(stack, tmp_path)
    t = topics(s.topic_config())
    await ensure_topics(s.kafka(), t.all())
    engines = Engines(s, seed=5)
    await engines.publish(400)

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

    async with running_worker(s, tmp_path) as (store, worker):
        await caught_up(store, worker, engines.sent)
        await assert_view_is_the_log(s, store)


async def test_a_view_lost_under_a_running_worker_is_rebuilt_from_the_log(stack, tmp_path):
    """Redis restarted empty: the worker's next records find no fence, and it reads each
    partition back from offset 0 before applying them."""
    s = fresh_settings(stack, tmp_path)
    await ensure_topics(s.kafka(), topics(s.topic_config()).all())
    engines = Engines(s, seed=6)
    await engines.publish(300)
    async with running_worker(s, tmp_path) as (store, worker):
        await caught_up(store, worker, engines.sent)
        await store.clear()  # the view is gone; the worker goes on
        await engines.publish(100)
        await caught_up(store, worker, engines.sent)
        await assert_view_is_the_log(s, store)
