"""Balance worker on the real broker and Redis: hot requests in → a replicate command out."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from schemas import (
    BlocksStored,
    Heartbeat,
    KvCommand,
    RoutingRequest,
    decode,
    encode,
    envelope,
)
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration


async def test_hot_prefix_on_overloaded_holder_is_replicated(settings):
    now = int(time.time() * 1000)
    store = RedisViewStore.from_settings(settings)
    chain = [101, 102, 103, 104]
    records = [
        (envelope(Heartbeat(role="prefill", queued_prefill_tokens=50_000), producer_id="p-busy", producer_seq=0,
                  ts_ms=now), None),
        (envelope(Heartbeat(role="prefill", queued_prefill_tokens=100), producer_id="p-idle", producer_seq=0,
                  ts_ms=now), None),
        (envelope(Heartbeat(role="decode"), producer_id="d-0", producer_seq=0, ts_ms=now), None),
        (envelope(BlocksStored(block_keys=chain), producer_id="p-busy", producer_seq=0, ts_ms=now), None),
    ]
    await store.apply(records)
    t = topics(settings)
    await kafka.ensure_topics(settings, t.all())
    producer = kafka.producer(settings)
    await producer.start()
    for i in range(12):
        req = RoutingRequest(request_id=f"r{i}", block_keys=chain, prompt_tokens=64)
        await producer.send(t.requests.name, encode(envelope(req, producer_id="gw", producer_seq=i, ts_ms=now + i)))
    await producer.send(t.requests.name, b"\x00not a record")  # carries no heat, breaks nothing
    await producer.stop()

    stop = asyncio.Event()
    balancer = Balancer(settings, BalanceParams(hot_threshold=8, overload_tokens=1000, cooldown_s=60))
    task = asyncio.create_task(balancer.run(interval_s=0.3, stop=stop))
    consumer = kafka.consumer(settings, t.kv_commands.name, group_id=None)
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 20)
    finally:
        stop.set()
        await consumer.stop()
        await asyncio.wait_for(task, 10)
        await store.close()
    cmd = decode(msg.value).body
    assert isinstance(cmd, KvCommand)
    assert (cmd.action, cmd.from_node, cmd.to_node, cmd.block_keys) == ("replicate", "p-busy", "p-idle", chain)
    assert msg.key == b"p-idle"  # keyed by the executor: the target pulls the prefix
    assert cmd.command_id and cmd.deadline_ms is not None
