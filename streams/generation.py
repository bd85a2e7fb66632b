"""The view-generation watcher: a view lost, replaced or rolled back is read back from the log at once.

The stream worker calls :meth:`GenerationWatcher.tick` on a timer (every 0.5 s), traffic or
not; a tick reads the view (3 Redis reads) only every ``check_every_s`` (2 s in the worker),
or at once when the generation this process adopted changed since the last check (an agent's
guard found the view lost or replaced: with engines heartbeating, within a second) or the last
check found work. So a view lost with no traffic at all is read back up to 1.5 s later than
with a check every tick; one lost under traffic, no later. A view with a new or missing
generation (Redis lost or flushed, another copy put in its place), or with partitions still
marked as rebuilding (``ns|rebuild``), has every
assigned partition read from the log up to its end, after which ``ns|rebuild`` tells the
routers it is done. So has a view whose fences moved back under the same generation: it
lost its last writes (a replica promoted while it lagged its primary, an older copy
restored). No Faust here: the worker passes in what its app knows (the assignment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from schemas.errors import ViewRefused
from state.view import RebuildingView

from .ingest import RawRecord
from .resume import TopicLane

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]


class GenerationWatcher:
    """Checks the view's generation and fences; reads back from the log what it lost."""

    def __init__(
        self,
        view: RebuildingView,
        topics: Sequence[str],
        *,
        assigned: Callable[[], Iterable[TopicPartition]],
        lane: Callable[[str], TopicLane],
        process: Callable[[list[RawRecord]], Awaitable[None]],
        check_every_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``topics``: the topics the worker folds; ``assigned()``: the partitions this worker
        holds now; ``lane(topic)``: that topic's guard, reader and lock (shared with the agent);
        ``process(records)``: apply records to the view (retrying until done);
        ``check_every_s``: how often a tick with nothing new reads the view (0: every tick)."""
        self.view = view
        self.topics = tuple(topics)
        self._assigned = assigned
        self._lane = lane
        self._process = process
        self._generation: str | None = None
        self._high: dict[str, int] = {}
        """The highest fence seen per partition under :attr:`_generation`."""
        self.check_every_s = check_every_s
        self._clock = clock
        self._checked_at: float | None = None
        self._checked_adopted: str | None = None
        """The generation this process had adopted (``view.generation``) after the last check."""
        self._busy = False
        """The last check read partitions back (the next tick checks again)."""
        self.checks = 0
        """Checks that read the view."""

    def due(self) -> bool:
        """Whether this tick reads the view: the last check was ``check_every_s`` ago or more, or
        it found work, or the adopted generation changed since (an agent adopted a new one)."""
        if self._checked_at is None or self._busy or self.view.generation != self._checked_adopted:
            return True
        return self._clock() - self._checked_at >= self.check_every_s

    def fences_moved_back(self, generation: str | None, fences: dict[str, int]) -> dict[str, tuple[int, int]]:
        """The partitions whose fence is below the highest seen under the same generation
        (``topic:partition`` → (highest seen, now); -1: gone), then remember ``fences``.
        Fences never move back under one generation unless the view lost its last writes."""
        if generation != self._generation:
            self._generation, self._high = generation, {}
        moved = {k: (self._high[k], v) for k, v in fences.items() if v < self._high.get(k, -1)}
        moved.update({k: (h, -1) for k, h in self._high.items() if k not in fences})
        self._high = dict(fences)
        return moved

    async def tick(self) -> None:
        """One check when :meth:`due`; reads back what needs it. Never raises: the next tick tries again."""
        if not self.due():
            return
        self._checked_at = self._clock()
        self.checks += 1
        self._busy = False
        try:
            generation, fences = await self.view.fences()
            pending = await self.view.rebuild_pending()
            assigned = list(self._assigned())
        except Exception as e:  # noqa: BLE001 (Redis down, or no assignment yet: the next tick tries again)
            log.debug("generation check skipped: %s", e)
            self._busy = True  # again at the next tick, as before the view went away
            return
        mine = [tp for tp in assigned if f"{tp[0]}:{tp[1]}" in pending]
        moved = self.fences_moved_back(generation, fences)
        if moved:
            log.warning(
                "the view's fences moved back (%s): it lost its last writes (a lagging replica promoted?); "
                "reading those partitions back from the log",
                ", ".join(f"{k} {was} -> {now}" for k, (was, now) in sorted(moved.items())),
            )
        if generation is not None and generation == self.view.generation and not mine and not moved:
            self._checked_adopted = self.view.generation
            return
        self._busy = True
        for topic in self.topics:
            tps = [tp for tp in assigned if tp[0] == topic]
            if tps:
                await self.read_back(topic, tps)
        self._checked_adopted = self.view.generation

    async def read_back(self, topic: str, tps: list[TopicPartition]) -> None:
        """Adopt the view's generation, then read ``tps`` from the view's fences to the log's end,
        marking them as rebuilding until their fences get there. Logs a failure, never raises."""
        lane = self._lane(topic)
        try:
            async with lane.lock:
                await lane.guard.fences()  # adopts a new generation (marking all partitions rebuilding)
                generation = self.view.generation
                if generation is None:  # (fences() adopted one, or raised)
                    return
                ends = await lane.reader.end_offsets(tps)
                targets = {f"{t}:{p}": end for (t, p), end in ends.items()}
                await self.view.mark_rebuilding(targets, generation)
                async for part in lane.guard.catch_up(tps, ends):
                    await self._process(part)
                await self.view.mark_rebuilding(targets, generation)
        except ViewRefused as e:
            log.warning("rebuild of %s interrupted (%s); trying again", topic, e)
        except Exception as e:  # noqa: BLE001 (the next tick retries; the worker must keep going)
            log.error("rebuild of %s failed, will retry: %s", topic, e)
