"""KV transfers in the simulator: concurrent transfers on one path share its bandwidth.

A path is what :meth:`conductor.topology.Topology.path` names: the two NICs of a pair of
nodes in one rack, the uplink between two racks, or the link between two zones. Every
transfer on a path gets an equal share of its bandwidth (processor sharing), recomputed
whenever a transfer starts or ends; a transfer is done when its bytes have crossed and
its source has read them (``read_s``: DRAM/SSD reads pipelined with the network), plus
the link's set-up latency — alone on its path it takes exactly ``Link.seconds``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conductor.topology import Link, PathKey

Push = Callable[[float, PathKey, int], None]
"""``push(time, path, version)``: wake the network at ``time`` for ``path``."""


@dataclass(slots=True)
class _Flow:
    remaining: float
    start: float
    read_s: float
    latency_s: float
    payload: Any


@dataclass(slots=True)
class PathStats:
    transfers: int = 0
    bytes: float = 0.0
    busy_s: float = 0.0
    """Time the path carried at least one transfer."""
    max_concurrent: int = 0


@dataclass(slots=True)
class _Path:
    bytes_per_s: float
    stats: PathStats
    flows: list[_Flow] = field(default_factory=list)
    last: float = 0.0
    version: int = 0


class Network:
    """Processor-sharing transfers per path; the owner's event loop calls :meth:`wake`."""

    def __init__(self, push: Push) -> None:
        self._push = push
        self._paths: dict[PathKey, _Path] = {}
        self.stats: dict[PathKey, PathStats] = {}

    def active(self, key: PathKey) -> int:
        p = self._paths.get(key)
        return len(p.flows) if p is not None else 0

    def start(self, now: float, key: PathKey, link: Link, nbytes: float, payload: Any, read_s: float = 0.0) -> None:
        """Begin moving ``nbytes`` on ``key``; ``payload`` comes back from :meth:`wake` when done."""
        p = self._paths.get(key)
        if p is None:
            p = self._paths[key] = _Path(link.bytes_per_s, self.stats.setdefault(key, PathStats()), last=now)
        self._advance(p, now)
        p.flows.append(_Flow(max(nbytes, 0.0), now, read_s, link.latency_s, payload))
        st = p.stats
        st.transfers += 1
        st.bytes += max(nbytes, 0.0)
        st.max_concurrent = max(st.max_concurrent, len(p.flows))
        self._reschedule(key, p, now)

    def wake(self, now: float, key: PathKey, version: int) -> list[tuple[float, Any]]:
        """(ready time, payload) of the transfers on ``key`` that finished by ``now``."""
        p = self._paths[key]
        if version != p.version:
            return []
        self._advance(p, now)
        eps = p.bytes_per_s * 1e-9  # a nanosecond's worth: clock rounding only
        done = [f for f in p.flows if f.remaining <= eps]
        if not done:
            self._reschedule(key, p, now)
            return []
        p.flows = [f for f in p.flows if f.remaining > eps]
        self._reschedule(key, p, now)
        return [(max(now, f.start + f.read_s) + f.latency_s, f.payload) for f in done]

    def _advance(self, p: _Path, now: float) -> None:
        dt = now - p.last
        if dt > 0 and p.flows:
            p.stats.busy_s += dt
            share = p.bytes_per_s * dt / len(p.flows)
            for f in p.flows:
                f.remaining -= share
        p.last = now

    def _reschedule(self, key: PathKey, p: _Path, now: float) -> None:
        p.version += 1
        if p.flows:
            nxt = min(f.remaining for f in p.flows)
            t = now + max(nxt, 0.0) * len(p.flows) / p.bytes_per_s
            self._push(t, key, p.version)
