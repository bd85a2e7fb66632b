"""The one percentile of the project: every p50, p90 and p99 that the product, the simulator and
the benchmarks report is :func:`percentile` of its samples.

The definition is linear interpolation between closest ranks (Hyndman and Fan's type 7, NumPy's
default, a spreadsheet's PERCENTILE.INC): the p-th percentile of n sorted values sits at rank
(n - 1) * p / 100, between the two values either side of it. It is exact for the median, never
returns a value outside the samples, and agrees with ``numpy.quantile``'s default to the last bit
or two of a float.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload


@overload
def percentile(values: Iterable[float], p: float) -> float | None: ...


@overload
def percentile(values: Iterable[float], p: float, *, empty: float) -> float: ...


def percentile(values: Iterable[float], p: float, *, empty: float | None = None) -> float | None:
    """The ``p``-th percentile (``p`` from 0 to 100) of ``values`` in any order, interpolated
    linearly between closest ranks; ``empty`` (None unless given) when there are no values.

    Raises ValueError for a ``p`` outside 0..100.
    """
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is outside 0..100")
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return empty
    if n == 1:
        return float(xs[0])
    pos = (n - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
