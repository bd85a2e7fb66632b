"""Benchmarks that print their numbers (``conductor bench ...``), all in one place.

- :mod:`.ingest`: engines → Kafka → stream worker → Redis, end to end (``bench ingest``).
- :mod:`.view_read`: the routing read's layouts on a dedicated Valkey (``bench view-read``).
- :mod:`.route`: full routing decisions on a synthetic view (``bench route``).
- :mod:`.bridge`: one bridge, engine batches → Conductor records (``bench bridge``).
"""

from __future__ import annotations


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (0 for no samples)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
