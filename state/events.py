"""Numbering what a producer shares on a Redis stream, and what a follower has applied of it.

Operations shared through a stream (the decision-time records of :mod:`state.shared_log`, the
reservations of :mod:`state.reservations`) reach the other processes a flush and a round trip
after they were made, so what a decision counted depends on which had arrived, not only on
their times. Each producer numbers what it shares (:class:`EventSeq`: the operations of one call
share a number; numbers grow across restarts), each stream entry carries the last number in it,
and a follower keeps, per producer, the last number it applied (:class:`Cut`). A decision records
that cut; ``explain`` then applies exactly the operations the deciding router had
(``conductor.routing.explain``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

MAX_CUT = 64
"""Producers a cut names before the quiet ones are dropped (``schemas.records.MAX_SEEN`` bounds it
on the record; a producer dropped is one whose operations no decision still counts, or, past that,
the longest quiet)."""

log = logging.getLogger(__name__)


class EventSeq:
    """One producer's numbers for what it shares: every operation appended inside one
    :meth:`event` carries that event's number, any other its own. Numbers only grow, across a
    restart of the producer too: they start from the wall clock in microseconds."""

    def __init__(self, start: int | None = None) -> None:
        self.last = start if start is not None else time.time_ns() // 1000
        """The number of the latest event (the next is one more)."""
        self._open = False

    @contextlib.contextmanager
    def event(self) -> Iterator[int]:
        """Number the operations appended until the block ends as one event; yields its number."""
        self.last += 1
        self._open = True
        try:
            yield self.last
        finally:
            self._open = False

    def stamp(self) -> int:
        """The number for an operation appended now: the open event's, else a new one."""
        if not self._open:
            self.last += 1
        return self.last


class Cut:
    """What a follower of one stream has applied: per producer, the last event number (its own:
    the last it appended). Producers quiet for longer than ``retain_ms`` (nothing they shared
    still counts) are dropped once more than :data:`MAX_CUT` are known."""

    def __init__(self, producer_id: str, retain_ms: int) -> None:
        self.producer_id = producer_id
        self.retain_ms = retain_ms
        self._seen: dict[str, tuple[int, int]] = {}
        """Producer -> (the last event number applied from it, its entry's time in ms)."""
        self.own_last: int | None = None

    def saw(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A stream entry of another producer was applied (its ``p`` and ``s`` fields; an entry
        without a number, from an older producer, changes nothing)."""
        producer, seq = fields.get(b"p"), fields.get(b"s")
        if producer is None or seq is None:
            return
        try:
            p = producer.decode()
            self._seen[p] = (max(self._seen.get(p, (0, 0))[0], int(seq)), int(entry_id.split(b"-", 1)[0]))
        except ValueError:
            log.warning("stream entry %r has a bad producer or number", entry_id)

    def as_dict(self) -> dict[str, int]:
        seen = self._seen
        if len(seen) > MAX_CUT:
            newest = max(ms for _, ms in seen.values())
            for p in [p for p, (_, ms) in seen.items() if ms < newest - self.retain_ms]:
                del seen[p]
            if len(seen) > MAX_CUT:
                for p, _ in sorted(seen.items(), key=lambda kv: kv[1][1])[:len(seen) - MAX_CUT]:
                    del seen[p]
        out = {p: seq for p, (seq, _) in seen.items()}
        if self.own_last is not None:
            out[self.producer_id] = self.own_last
        return out


__all__ = ["MAX_CUT", "Cut", "EventSeq"]
