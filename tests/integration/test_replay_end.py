"""Where a partition ends: a replay must read to the last record, whatever the broker reports.

The embedded broker (Tansu) reports the base offset of a partition's last record batch plus
one as its end; a replay that trusted it stopped after the first record of a large batch
and rebuilt a view missing almost everything (found by the worker crash test).
"""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from schemas import BlocksStored, encode, envelope
from state.memory import InMemoryViewStore
from streams.kafka import consumer, end_offsets, ensure_topics, producer
from streams.replay import replay_into
from streams.topics import topics

pytestmark = pytest.mark.integration


async def test_a_large_last_batch_is_read_to_its_end(settings):
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), t.all())
    prod = producer(settings.kafka(), linger_ms=200)  # everything lands in one batch per partition
    await prod.start()
    try:
        futures = [
            await prod.send(
                t.kv_events.name,
                encode(envelope(BlocksStored(block_keys=[i + 1]), producer_id=f"n{i % 2}", producer_seq=i // 2, ts_ms=1)),
                key=f"n{i % 2}".encode(), partition=i % 2,
            )
            for i in range(400)
        ]
        await prod.flush()
        assert all(f.done() and f.exception() is None for f in futures)
    finally:
        await prod.stop()

    c = consumer(settings.kafka(), group_id=None)
    await c.start()
    try:
        tps = [TopicPartition(t.kv_events.name, p) for p in range(2)]
        c.assign(tps)
        assert await end_offsets(c, tps) == {tps[0]: 200, tps[1]: 200}
    finally:
        await c.stop()

    view = InMemoryViewStore()
    res = await replay_into(settings.kafka(), settings.topic_config(), view, idle_timeout_s=1.0)
    assert res.records == 400 and res.applied == 400
    assert (await view.snapshot(list(range(1, 401)), now_ms=0)).prefix["n0"][0] == 1  # key 1 held, 2 is n1's
    assert sum(n.blocks.get("hbm", 0) for n in await view.nodes()) == 400
