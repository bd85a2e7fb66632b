"""Setting a record aside: the dead letter of one bad record, on the dead-letter topic, with its reason.

Each topic's records are dead-lettered once, by the consumer whose work they are: the stream
worker for ``kv-events`` and ``heartbeats`` (through :class:`streams.ingest.Ingestor`), the
routers for ``requests``, a gateway for its reply topic. Every other reader of a topic (the
balance worker and the admin feed on ``requests``, engines and the admin on ``dispatch``,
every router and the admin on ``control``, executors on ``kv-commands``) skips a record it
cannot read and counts it: dead-lettering it there too would set it aside once per reader
(and, on ``control``, read from the start by each router, once per start).

A letter is built by :meth:`schemas.DeadLetter.of`, which takes any bytes and never raises,
so a bad record can never stop the consumer that found it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from schemas import DeadLetter, Envelope, encode, envelope, headers
from streams.config import KafkaConnection
from streams.kafka import producer as new_producer
from streams.topics import Topic

log = logging.getLogger(__name__)


class DeadLetters:
    """The dead letters of one producer (``producer_id``), each in an envelope of its own sequence,
    keyed by its source topic. Sends on ``producer`` when given (the consumer's own, so the letters
    are acknowledged with its other sends; ``wrap`` then puts each in that producer's envelope
    sequence), else on one of its own, started at the first letter."""

    def __init__(self, kafka: KafkaConnection, topic: Topic, producer_id: str, *,
                 producer: AIOKafkaProducer | None = None, wrap: Callable[[DeadLetter], Envelope] | None = None,
                 clock_ms: Callable[[], float] = lambda: time.time() * 1000):
        self.kafka = kafka
        self.topic = topic
        self.producer_id = producer_id
        self.clock_ms = clock_ms
        self._producer = producer
        self._wrap = wrap
        self._own = producer is None
        self._started = False
        self._seq = 0
        self.counts: Counter[str] = Counter()
        """Letters by reason, plus ``unsent`` for those the broker did not take (logged)."""

    def wrap(self, letter: DeadLetter) -> Envelope:
        """``letter`` in its envelope: the ``wrap`` given (a producer's own sequence), else this one's."""
        if self._wrap is not None:
            return self._wrap(letter)
        self._seq += 1
        return envelope(letter, producer_id=self.producer_id, producer_seq=self._seq, ts_ms=int(self.clock_ms()))

    async def send(self, source_topic: str, partition: int, offset: int, reason: str, error: str,
                   value: bytes | None, key: bytes | None = None) -> asyncio.Future[Any]:
        """Queue the dead letter of the record at ``source_topic``[``partition``]@``offset``.

        Returns the broker's acknowledgement, to await with the caller's other sends before it
        commits; it never fails: a letter the broker refuses is logged with its position and
        counted (``unsent``)."""
        letter = DeadLetter.of(source_topic, partition, offset, reason, error, value, key)
        self.counts[letter.reason] += 1
        log.warning("dead-letter %s[%d]@%d (%d bytes): %s: %s", letter.source_topic, letter.partition, letter.offset,
                    letter.original_size or 0, letter.reason, letter.error[:200])
        env = self.wrap(letter)
        try:
            prod = await self._ready()
            ack = await prod.send(self.topic.name, encode(env), key=letter.source_topic.encode(), headers=headers(env))
        except Exception as e:  # noqa: BLE001 - the broker's refusal must not stop the consumer either
            self._unsent(letter, e)
            ack = asyncio.get_running_loop().create_future()
            ack.set_result(None)
            return ack
        return asyncio.ensure_future(self._acknowledged(letter, ack))

    async def send_and_wait(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`send`, waiting for the broker's acknowledgement."""
        await (await self.send(*args, **kwargs))

    async def close(self) -> None:
        """Stop the producer this started (a consumer's own is its to stop)."""
        if self._own and self._started and self._producer is not None:
            await self._producer.stop()
            self._started = False

    async def _ready(self) -> AIOKafkaProducer:
        if self._producer is None:
            self._producer = new_producer(self.kafka)
        if self._own and not self._started:
            await self._producer.start()
            self._started = True
        return self._producer

    async def _acknowledged(self, letter: DeadLetter, ack: asyncio.Future[Any]) -> None:
        try:
            await ack
        except Exception as e:  # noqa: BLE001 - as in send
            self._unsent(letter, e)

    def _unsent(self, letter: DeadLetter, e: Exception) -> None:
        self.counts["unsent"] += 1
        log.error("dead letter of %s[%d]@%d not sent (%s: %s); the record stays at that position",
                  letter.source_topic, letter.partition, letter.offset, type(e).__name__, e)


__all__ = ["DeadLetters"]
