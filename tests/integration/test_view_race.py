"""Two writers on one Redis view at once: the view still ends exactly as one writer would leave it.

This is what a Kafka rebalance can do: a consumer that lost its partition finishes the
records it had fetched while the new owner starts again from the last committed offset.
The offset fence drops what one writer applied before the other, and the stream state
each write compares-and-sets keeps the nodes' sequence state exact.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from kvstream import KvStream

from schemas import decode, encode
from state.memory import InMemoryViewStore
from state.redis_view import RedisViewStore
from state.view import SourcePosition
from streams.ingest import Ingestor, RawRecord
from streams.topics import topics

pytestmark = pytest.mark.integration


def stream_of_records(kv_topic: str, n: int, partitions: int = 2) -> list[RawRecord]:
    """``n`` KV events from four nodes, each node on one partition, offsets per partition."""
    offsets = [0] * partitions
    out = []
    for env in KvStream(seed=11, max_store=8, max_remove=5).take(n):
        part = int(env.producer_id[1:]) % partitions
        out.append(RawRecord(kv_topic, part, offsets[part], env.producer_id.encode(), encode(env)))
        offsets[part] += 1
    return out


async def run_writer(ingestor: Ingestor, records: list[RawRecord], seed: int, pause_s: float = 0.0) -> dict[str, int]:
    """Feed ``records`` in random-sized batches (``pause_s`` after each); return the outcome counts."""
    rng = random.Random(seed)
    i = 0
    counts = {"applied": 0}
    while i < len(records):
        n = rng.randint(1, 40)
        res = await ingestor.process(records[i : i + n])
        counts["applied"] += res.applied
        for k, v in res.skipped.items():
            counts[k] = counts.get(k, 0) + v
        i += n
        await asyncio.sleep(pause_s)
    return counts


async def test_two_writers_racing_on_the_same_records(settings):
    t = topics(settings.topic_config())
    records = stream_of_records(t.kv_events.name, 1500)
    a, b = RedisViewStore.connect(settings.redis(), settings.view_namespace), RedisViewStore.connect(settings.redis(), settings.view_namespace)
    try:
        first = Ingestor(t, a)
        await run_writer(first, records[:100], seed=0)
        # Then a second owner starts from an older committed offset (re-delivering 60-99)
        # while the first one carries on with what it had fetched. The zombie is the slower of
        # the two (it pauses between batches), so the new owner overtakes it whatever the
        # machine's load: both write, and their writes interleave.
        late, new = await asyncio.gather(
            run_writer(first, records[100:], seed=1, pause_s=0.01),
            run_writer(Ingestor(t, b), records[60:], seed=2),
        )
        ref = InMemoryViewStore()
        for r in records:
            ref.apply_sync(decode(r.value), SourcePosition(r.topic, r.partition, r.offset))
        got, want = await a.dump(), ref.dump_sync()
        assert got["blocks"] == want["blocks"]
        diff = {n: {k: (v, want["nodes"][n].get(k)) for k, v in d.items() if v != want["nodes"][n].get(k)} for n, d in got["nodes"].items()}
        assert got["nodes"] == want["nodes"], diff  # no phantom gaps, same last seq, same counts
        assert got["watermark"] == want["watermark"]
        # both wrote: each record went in once, and the other writer's copy was skipped
        assert late["applied"] > 0 and new["applied"] > 0, (late, new)
        assert 100 + late["applied"] + new["applied"] == len(records)
    finally:
        await a.clear()
        await a.close()
        await b.close()
