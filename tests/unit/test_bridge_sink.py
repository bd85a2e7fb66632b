"""The bridge's Kafka sink: sends in order without waiting for each ack, and never hides a failed send."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conductor.bridge.runner import KafkaSink
from schemas import AllBlocksCleared, envelope


class RecordingProducer:
    """Stands in for aiokafka's producer: send() queues and returns the ack future."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.acks: list[asyncio.Future[Any]] = []

    async def send(self, topic: str, value: bytes, key: bytes, headers: Any) -> asyncio.Future[Any]:
        self.sent.append((topic, key))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(fut)
        return fut


def env(seq: int):  # type: ignore[no-untyped-def]
    return envelope(AllBlocksCleared(), producer_id="n0", producer_seq=seq, ts_ms=0)


async def test_sends_do_not_wait_for_acks_but_a_failure_surfaces_on_the_next_call() -> None:
    prod = RecordingProducer()
    sink = KafkaSink(prod, "t.kv-events")
    await sink([env(0), env(1)])
    await sink([env(2)])  # returned although nothing was acknowledged yet
    assert prod.sent == [("t.kv-events", b"n0")] * 3 and len(sink.pending) == 3
    prod.acks[0].set_result(None)
    prod.acks[1].set_exception(RuntimeError("broker said no"))
    with pytest.raises(RuntimeError, match="broker said no"):
        await sink([env(3)])


async def test_flush_waits_for_every_ack_and_the_backlog_is_bounded() -> None:
    prod = RecordingProducer()
    sink = KafkaSink(prod, "t", max_pending=2)
    for f in prod.acks:
        f.set_result(None)

    async def ack_later() -> None:
        while len(prod.acks) < 3:
            await asyncio.sleep(0.01)
        for f in prod.acks:
            if not f.done():
                f.set_result(None)

    acker = asyncio.create_task(ack_later())
    await sink([env(0), env(1), env(2)])  # a third pending send waits for the oldest ack
    await sink.flush()
    await acker
    assert not sink.pending
