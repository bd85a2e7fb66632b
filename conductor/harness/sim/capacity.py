"""Effective request capacity: the highest arrival speed at which enough requests meet both SLOs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CapacitySearch:
    """Result of a bisection on speed; ``probes`` are every (speed, attainment) tried."""

    capacity_speed: float
    """Highest speed found meeting the target (0.0 if even the slowest probe missed it)."""
    at_capacity: dict[str, Any] | None
    probes: list[tuple[float, float]] = field(default_factory=list)


def find_capacity(
    run: Callable[[float], dict[str, Any]],
    *,
    target: float = 0.9,
    start: float = 1.0,
    rel_tol: float = 0.03,
    min_speed: float = 1 / 64,
    max_speed: float = 256.0,
) -> CapacitySearch:
    """Bracket the target by doubling/halving from ``start``, then bisect until the bracket
    is narrower than ``rel_tol`` of its lower end. Assumes attainment falls as speed
    rises (true up to simulation noise; a non-monotone curve yields one crossing)."""
    probes: list[tuple[float, float]] = []
    results: dict[float, dict[str, Any]] = {}

    def ok(speed: float) -> bool:
        s = run(speed)
        results[speed] = s
        att = s["slo_attainment"] or 0.0
        probes.append((speed, att))
        return att >= target

    lo: float | None = None
    hi: float | None = None
    s = start
    if ok(s):
        lo = s
        while hi is None:
            s *= 2.0
            if s > max_speed:
                return CapacitySearch(lo, results[lo], probes)
            if ok(s):
                lo = s
            else:
                hi = s
    else:
        hi = s
        while lo is None:
            s /= 2.0
            if s < min_speed:
                return CapacitySearch(0.0, None, probes)
            if ok(s):
                lo = s
            else:
                hi = s
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2.0
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return CapacitySearch(lo, results[lo], probes)
