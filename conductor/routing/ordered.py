"""Decisions in arrival order, with their reads overlapping.

Each decision reads the view, then decides and reserves. Reads may run side by side, but a
decision must see the reservations of every decision that arrived before it, and the order they
are logged in must be the order they were made in. :class:`Turns` hands out the turns: the
router worker (a fetched batch) and the colocated router (requests as they come) both use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

Step = Callable[[Awaitable[None] | None], Awaitable[T]]
"""One decision, given what to await before its turn (None: the first, nothing to wait for)."""


class Turns:
    """Hands out turns in the order :meth:`take` is called."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def take(self, step: Step[T]) -> Awaitable[T]:
        """``step`` as the next turn: it gets the previous turn's end to await where its turn
        begins; this turn ends when ``step`` has and the previous turn has (a step that returns
        early, an early rejection, still holds the next one back until its own turn came).
        Called in arrival order; the awaitables may then run together."""
        before, done = self._last, asyncio.get_running_loop().create_future()
        self._last = done
        return self._run(step, before, done)

    @property
    def last(self) -> asyncio.Future[None] | None:
        """The end of the last turn taken (None: none taken yet)."""
        return self._last

    @staticmethod
    async def _run(step: Step[T], before: asyncio.Future[None] | None, done: asyncio.Future[None]) -> T:
        try:
            return await step(before)
        finally:
            if before is not None:
                await before
            if not done.done():
                done.set_result(None)


__all__ = ["Step", "Turns"]
