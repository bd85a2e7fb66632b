"""Every router's view of the ``control`` topic: its records folded in, in log order."""

from __future__ import annotations

import time

from conductor.routing.router import Router
from conductor.settings import Settings
from schemas import ControlCommand
from streams.follow import Earliest, Follower, OnBad
from streams.topics import topics


class ControlFollower:
    """Reads the one-partition ``control`` topic from the start (every replica, no group) and
    hands each record to :meth:`Router.apply_control` in offset order (an unreadable one is
    logged and skipped)."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.topic = topics(settings.topic_config()).control
        self._follower: Follower | None = None
        self.position = 0  # the next offset to read

    async def start(self, catch_up_timeout_s: float = 10.0) -> None:
        """Start following; return once every record there was is applied (or after the timeout)."""
        self._follower = Follower(self.settings.kafka(), [(self.topic, Earliest())], on_bad=OnBad.LOG_AND_SKIP,
                                  name="control follower", max_records=100, track_end=True)
        await self._follower.start()
        deadline = time.monotonic() + catch_up_timeout_s
        while not self._follower.caught_up and time.monotonic() < deadline:
            await self.poll(timeout_ms=200)

    async def poll(self, timeout_ms: int = 0) -> None:
        """Apply what one fetch (waiting up to ``timeout_ms``) brings."""
        if self._follower is None:
            raise RuntimeError("ControlFollower.start() was not called")
        for batch in await self._follower.fetch(timeout_ms):
            for rec in batch.records:
                if rec.env is not None and isinstance(rec.env.body, ControlCommand):
                    self.router.apply_control(rec.env.body, rec.offset)
        self.position = self._follower.positions.get((self.topic.name, 0), self.position)

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()
