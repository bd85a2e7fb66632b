"""Every router's view of the ``control`` topic: its records folded in, in log order."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiokafka import TopicPartition

from conductor.routing.router import Router
from conductor.settings import Settings
from schemas import ControlCommand, DecodeError, decode
from streams.kafka import consumer, end_offsets
from streams.topics import topics

log = logging.getLogger(__name__)


class ControlFollower:
    """Reads the one-partition ``control`` topic from the start (every replica, no group) and
    hands each record to :meth:`Router.apply_control` in offset order."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.topic = topics(settings.topic_config()).control
        self._cons: Any = None
        self.position = 0  # the next offset to read

    async def start(self, catch_up_timeout_s: float = 10.0) -> None:
        tp = TopicPartition(self.topic.name, 0)
        self._cons = consumer(self.settings.kafka(), group_id=None)
        await self._cons.start()
        self._cons.assign([tp])
        end = (await end_offsets(self._cons, [tp]))[tp]
        await self._cons.seek_to_beginning(tp)
        deadline = time.monotonic() + catch_up_timeout_s
        while self.position < end and time.monotonic() < deadline:
            await self.poll(timeout_ms=200)

    async def poll(self, timeout_ms: int = 0) -> None:
        got = await self._cons.getmany(timeout_ms=timeout_ms, max_records=100)
        for msgs in got.values():
            for m in msgs:
                self.position = m.offset + 1
                try:
                    env = decode(m.value or b"")
                except DecodeError as e:
                    log.error("control offset %d unreadable, skipped: %s", m.offset, e)
                    continue
                if isinstance(env.body, ControlCommand):
                    self.router.apply_control(env.body, m.offset)

    async def stop(self) -> None:
        if self._cons is not None:
            await self._cons.stop()
