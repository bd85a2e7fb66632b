"""streams.resume.LogReader: its partitions are not fetched between reads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from streams import resume
from streams.config import KafkaConnection


class FakeConsumer:
    """An aiokafka consumer over one partition of ``n`` records; fetches in the background
    what is assigned and not paused (as aiokafka does)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.assigned: list[TopicPartition] = []
        self.paused: set[TopicPartition] = set()
        self.pos: dict[TopicPartition, int] = {}

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned, self.paused = list(tps), set()  # a new assignment fetches again

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.update(tps)

    def unsubscribe(self) -> None:
        self.assigned, self.paused = [], set()

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.pos[tp] = offset

    async def position(self, tp: TopicPartition) -> int:
        return self.pos[tp]

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.n for tp in tps}

    def highwater(self, tp: TopicPartition) -> int:
        return self.n

    async def getmany(self, *tps: TopicPartition, timeout_ms: int = 0) -> dict[TopicPartition, list[Any]]:
        out = {}
        for tp in tps:
            start = self.pos[tp]
            out[tp] = [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=o, key=None, value=b"",
                                       timestamp=0) for o in range(start, self.n)]
            self.pos[tp] = self.n
        return out

    @property
    def fetching(self) -> set[TopicPartition]:
        return set(self.assigned) - self.paused


def test_a_log_reader_fetches_nothing_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeConsumer(5)
    monkeypatch.setattr(resume, "consumer", lambda *a, **k: fake)
    reader = resume.LogReader(KafkaConnection(bootstrap_servers="127.0.0.1:1", profile="embedded"))

    async def main() -> None:
        assert await reader.end_offsets([("t", 0)]) == {("t", 0): 5}
        assert fake.fetching == set()
        got = await reader.fetch_range("t", 0, 2, 5)
        assert [r.offset for r in got] == [2, 3, 4]
        assert fake.fetching == set()  # without the pause: fetched twice a second for good
        assert fake.assignment() == set()  # paused, aiokafka's fetcher still wakes every 200 ms
        assert [r.offset for r in await reader.fetch_range("t", 0, 0, 2)] == [0, 1]  # a new read fetches again

    asyncio.run(main())
