"""Whether a colocated gateway's log takes its decisions: tripped after repeated acknowledgement failures.

A colocated gateway serves nothing the broker did not acknowledge (``log_unavailable``). With the
broker down, every request would wait the decision timeout for its 503 while ``/health`` said 200,
so the load balancer kept sending. :class:`LogHealth` counts the unacknowledged decisions in a row;
at ``trip_after`` the gateway is unready (``/health`` 503) and refuses new requests at once, letting
one through a second as a trial. One acknowledged decision clears it; so does the broker answering
a metadata request (``/health`` asks it, at most once a second, while tripped): behind a Service an
unready gateway gets no trial requests, and it must become ready to get any.
"""

from __future__ import annotations

import time
from collections.abc import Callable

TRIAL_EVERY_S = 1.0
"""While tripped: one trial request (or one broker probe) per this many seconds."""


class LogHealth:
    """Unacknowledged decisions in a row (:meth:`failed`, :meth:`acknowledged`); tripped at ``trip_after``."""

    def __init__(self, trip_after: int, clock: Callable[[], float] = time.monotonic) -> None:
        if trip_after < 1:
            raise ValueError("trip_after must be at least 1")
        self.trip_after = trip_after
        self.clock = clock
        self.failures = 0
        self._last_try = float("-inf")

    @property
    def tripped(self) -> bool:
        return self.failures >= self.trip_after

    def failed(self) -> None:
        self.failures += 1

    def acknowledged(self) -> None:
        self.failures = 0

    def half_open(self) -> None:
        """The broker answers again: ready, but the next unacknowledged decision trips it at once."""
        if self.tripped:
            self.failures = self.trip_after - 1

    def may_try(self) -> bool:
        """While tripped, True at most once per :data:`TRIAL_EVERY_S` (a trial request or a probe may go)."""
        now = self.clock()
        if now - self._last_try < TRIAL_EVERY_S:
            return False
        self._last_try = now
        return True

    def problem(self) -> str | None:
        if not self.tripped:
            return None
        return (
            f"the broker did not acknowledge the last {self.failures} decisions (the log is the system of "
            "record: nothing is served unlogged)"
        )
