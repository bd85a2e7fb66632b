"""The shared prefix walk against a plain per-node, per-tier walk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from state.view import longest_prefixes


def naive(masks: list[int], slot_nodes: dict[int, str]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for slot, node in slot_nodes.items():
        lens = []
        for tiers in (1, 2, 3):  # hbm; hbm+dram; hbm+dram+ssd
            n = 0
            for m in masks:
                if not any(m >> (3 * slot + t) & 1 for t in range(tiers)):
                    break
                n += 1
            lens.append(n)
        if lens[2]:
            out[node] = tuple(lens)
    return out


@given(
    st.lists(st.integers(0, 2**24 - 1), max_size=40),
    st.sets(st.integers(0, 7), max_size=8),
)
def test_matches_a_plain_walk(masks, slots):
    slot_nodes = {s: f"n{s}" for s in slots}
    assert longest_prefixes(masks, slot_nodes) == naive(masks, slot_nodes)


def test_retired_slots_do_not_count():
    masks = [0b111_111, 0b111_000]  # slot 0 holds block 0 only; slot 1 holds both
    assert longest_prefixes(masks, {1: "b"}) == {"b": (2, 2, 2)}
    assert longest_prefixes(masks, {0: "a", 1: "b"}) == {"a": (1, 1, 1), "b": (2, 2, 2)}
