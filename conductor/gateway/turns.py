"""Engines that share one device take turns at prefill: one member of a capacity group at a time.

Two engines on one set of cores (or one GPU) that prefill at once each run at about half speed:
both requests reach their first token late, where one after the other the first would have been
early and the second no later. One engine keeps its own queue first come, first served (vLLM's
scheduler batches the requests it holds), so only the switch between engines needs a gate.
A topology file names the groups whose members take turns (``prefill_turns``, a subset of its
``capacity_groups``); for those, :class:`PrefillTurns` lets a request's prefill start when no
other member of its group is prefilling for this gateway, or when its own engine is the one
prefilling and nobody waits. Otherwise it waits, first come first served, until the group's
prefills in flight have their first tokens; then the engine of the first waiter has the turn,
with every waiter behind it bound to the same engine.

This is not a queue for overload (``admission``: overload is answered 429): the wait is bounded
by the prefills ahead of it on the same device, which it would have shared anyway, and by
``max_wait_s``, after which a request goes ahead without its turn (a first token that never comes,
an engine that hangs, must not hold its group). The router's prediction already counts the
group's work ahead of a request (``conductor.routing.own_load``), which is what a turn waits for.
Turns are per gateway process: several gateways in front of one group each keep their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_WAIT_S = 10.0
"""The longest a request waits for its group's turn before it goes ahead without one."""


@dataclass
class _Group:
    active: str | None = None
    """The member prefilling now (None: none)."""
    running: int = 0
    """Prefills in flight on ``active``."""
    waiters: deque[tuple[str, asyncio.Future[None]]] = field(default_factory=deque)


@dataclass(eq=False)
class Turn:
    """One request's turn; :meth:`end` at its first token or when it ends (once, however often called)."""

    turns: PrefillTurns | None
    group: tuple[str, ...] = ()
    waited_s: float = 0.0
    ended: bool = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.turns is not None:
                self.turns._end(self.group)


NO_TURN = Turn(None, ended=True)
"""What a request outside any turn-taking group holds."""


class PrefillTurns:
    """Turns at prefill for the capacity groups ``group_of`` names (a node's group, itself among
    them; a node alone takes no turns)."""

    def __init__(self, group_of: Callable[[str], tuple[str, ...]], *, max_wait_s: float = MAX_WAIT_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.group_of = group_of
        self.max_wait_s = max_wait_s
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._groups: dict[tuple[str, ...], _Group] = {}
        self.waited = 0
        """Requests that waited for a turn (for tests and metrics)."""
        self.timed_out = 0
        """Requests that went ahead without a turn after ``max_wait_s``."""

    def waiting(self, node: str) -> int:
        """Requests waiting for a turn in ``node``'s group."""
        g = self._groups.get(self.group_of(node))
        return len(g.waiters) if g is not None else 0

    async def take(self, node: str) -> Turn:
        """``node``'s turn to prefill: at once when its group is free (or ``node`` prefills and
        nobody waits), else after the turns ahead of it (at most ``max_wait_s``)."""
        key = self.group_of(node)
        if len(key) < 2:
            return NO_TURN
        g = self._groups.setdefault(key, _Group())
        if not g.waiters and (g.running == 0 or g.active == node):
            g.active = node
            g.running += 1
            return Turn(self, key)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        g.waiters.append((node, fut))
        self.waited += 1
        t0 = self._clock()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except TimeoutError:
            if fut.done():  # given the turn as the wait ran out: it holds it
                return Turn(self, key, self._clock() - t0)
            self._drop(g, fut)
            self.timed_out += 1
            log.warning("a request for %s waited %.1fs for its capacity group's turn to prefill (group %s "
                        "busy on %s): it goes ahead without one", node, self.max_wait_s, ",".join(key), g.active)
            return Turn(None, key, self._clock() - t0, ended=True)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._end(key)  # given the turn as its client went: pass it on
            else:
                self._drop(g, fut)
            raise
        return Turn(self, key, self._clock() - t0)

    def _drop(self, g: _Group, fut: asyncio.Future[None]) -> None:
        for i, (_, f) in enumerate(g.waiters):
            if f is fut:
                del g.waiters[i]
                break
        fut.cancel()
        if g.running == 0:
            self._admit(g)  # the first waiter may have been the one that left

    def _end(self, key: tuple[str, ...]) -> None:
        g = self._groups[key]
        g.running -= 1
        if g.running <= 0:
            g.running = 0
            g.active = None
            self._admit(g)

    def _admit(self, g: _Group) -> None:
        """The first waiter's engine has the turn, with every waiter right behind it bound there too."""
        if not g.waiters:
            return
        g.active = g.waiters[0][0]
        while g.waiters and g.waiters[0][0] == g.active:
            _, fut = g.waiters.popleft()
            if not fut.done():
                g.running += 1
                fut.set_result(None)


__all__ = ["MAX_WAIT_S", "NO_TURN", "PrefillTurns", "Turn"]
