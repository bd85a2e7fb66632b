"""Every router's view of the ``control`` topic: its records folded in, in log order."""

from __future__ import annotations

import logging
import time

from conductor.routing.router import Router
from conductor.settings import Settings
from schemas import ControlCommand
from streams.follow import Earliest, Follower, OnBad
from streams.kafka import KAFKA_FETCH_WAIT_MS, QUIET_STEPS
from streams.topics import topics

log = logging.getLogger(__name__)

CATCH_UP_LOG_S = 10.0


class ControlFollower:
    """Reads the one-partition ``control`` topic from the start (every replica, no group) and
    hands each record to :meth:`Router.apply_control` in offset order (an unreadable one is
    logged and skipped). After 10 s without a control record it fetches once a second instead
    of twice (:data:`streams.kafka.QUIET_STEPS`): an operator's command then takes effect up
    to ~250 ms later on the embedded broker."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self.topic = topics(settings.topic_config()).control
        self._follower: Follower | None = None
        self.position = 0  # the next offset to read

    async def start(self, catch_up_timeout_s: float | None = None) -> None:
        """Start following; return once every record there was is applied, so nothing is decided on a
        control state older than the log's (a router or gateway stays "starting" until then). A slow
        catch-up is said every 10 s; ``catch_up_timeout_s`` (tools that may go on without it): stop
        waiting after that long."""
        self._follower = Follower(self.settings.kafka(), [(self.topic, Earliest())], on_bad=OnBad.LOG_AND_SKIP,
                                  name="control follower", max_records=100, track_end=True,
                                  fetch_wait_ms=KAFKA_FETCH_WAIT_MS, idle_steps=QUIET_STEPS)
        await self._follower.start()
        started = said = time.monotonic()
        while not self._follower.caught_up:
            now = time.monotonic()
            if catch_up_timeout_s is not None and now - started >= catch_up_timeout_s:
                break
            if now - said >= CATCH_UP_LOG_S:
                said = now
                log.warning("control topic: still catching up after %.0f s (at offset %d of %s); not deciding yet",
                            now - started, self.position, self._follower.ends.get((self.topic.name, 0), "?"))
            await self.poll(timeout_ms=200)

    @property
    def caught_up(self) -> bool:
        """Whether every control record there was at start is applied."""
        return self._follower is not None and self._follower.caught_up

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
