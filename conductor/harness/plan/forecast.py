"""How much more traffic to plan for, from the arrival times of the traffic itself.

Pure. The forecast is a straight line through the arrival rate per bucket (least squares),
read ``horizon_s`` past the last arrival and divided by the mean rate: the growth factor
the planner replays the traffic at. A flat or falling trend plans for no less than today's
traffic (``floor``): a planner that shrinks the cluster on a quiet hour's slope would be
wrong every morning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Forecast:
    """The arrival rate now (mean of the window) and projected, and their ratio (the growth to plan for)."""

    mean_rps: float
    projected_rps: float
    growth: float
    slope_rps_per_h: float
    buckets: int


def forecast_growth(arrivals_ms: Sequence[float], *, horizon_s: float = 3600.0, bucket_s: float = 60.0,
                    floor: float = 1.0) -> Forecast:
    """Fit the arrival rate's trend over ``arrivals_ms`` (any order) and project it ``horizon_s`` ahead."""
    if not arrivals_ms:
        return Forecast(0.0, 0.0, floor, 0.0, 0)
    t0, t1 = min(arrivals_ms), max(arrivals_ms)
    span_s = max((t1 - t0) / 1000.0, bucket_s)
    n = max(1, math.ceil(span_s / bucket_s))
    counts = [0] * n
    for t in arrivals_ms:
        counts[min(n - 1, int((t - t0) / 1000.0 // bucket_s))] += 1
    if n > 1 and span_s - (n - 1) * bucket_s < bucket_s / 2:
        n -= 1  # a last bucket cut short would read as a spike or a dip
        counts = counts[:n]
    rates = [c / bucket_s for c in counts]
    mean = len(arrivals_ms) / span_s
    xs = [(i + 0.5) * bucket_s for i in range(n)]
    mx = sum(xs) / n
    my = sum(rates) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, rates, strict=True)) / var if var > 0 else 0.0
    projected = max(0.0, my + slope * (span_s + horizon_s - mx))
    growth = max(floor, projected / mean) if mean > 0 else floor
    return Forecast(mean_rps=mean, projected_rps=projected, growth=growth, slope_rps_per_h=slope * 3600.0, buckets=n)


__all__ = ["Forecast", "forecast_growth"]
