"""The one percentile (conductor/stats.py): linear between closest ranks, NumPy's default."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conductor.stats import percentile


@pytest.mark.parametrize(("values", "p", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 50, 2.5),  # any order
    ([3, 1, 2], 50, 2.0),
    (list(range(100)), 99, 98.01),  # between ranks 98 and 99, not a nearest rank
    (list(range(101)), 90, 90.0),
    ([5.0], 90, 5.0),
    ([1.0, 9.0], 0, 1.0),
    ([1.0, 9.0], 100, 9.0),
])
def test_percentile_interpolates_between_ranks(values: list[float], p: float, expected: float) -> None:
    assert percentile(values, p) == pytest.approx(expected)


def test_no_values_give_none_or_the_given_empty() -> None:
    assert percentile([], 50) is None
    assert percentile([], 99, empty=0.0) == 0.0
    assert percentile(iter(()), 50, empty=-1.0) == -1.0


@pytest.mark.parametrize("p", [-1.0, 100.5])
def test_percentile_outside_0_to_100_is_refused(p: float) -> None:
    with pytest.raises(ValueError, match="outside 0..100"):
        percentile([1.0, 2.0], p)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0.0, 100.0))
def test_percentile_agrees_with_numpy_and_stays_within_the_samples(values: list[float], p: float) -> None:
    got = percentile(values, p)
    assert got is not None
    assert min(values) <= got <= max(values)
    assert got == pytest.approx(float(np.quantile(np.array(values), p / 100.0)), rel=1e-9, abs=1e-6)
