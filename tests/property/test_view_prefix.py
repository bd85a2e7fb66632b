"""The shared prefix walk against a plain per-node, per-tier walk; the walk over Redis's holder
entries against the mask walk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from state.keys import MAX_SLOTS, entry_holders, entry_prefixes, holder_entries, holder_entry
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


def as_entries(mask: int, order: list[int]) -> bytes | None:
    """A mask as the Redis layout stores it: one holder entry per slot, in ``order``."""
    out = b""
    for slot in order:
        tiers = mask >> (3 * slot) & 7
        if tiers:
            out += holder_entry(slot, tiers)
    return out or None


@given(
    st.lists(st.integers(0, 2**24 - 1), max_size=40),
    st.sets(st.integers(0, 7), max_size=8),
    st.randoms(use_true_random=False),
)
def test_holder_entries_walk_the_same_prefixes(masks, slots, rnd):
    """The walk over stored holder entries (what Redis holds) answers as the mask walk does,
    whatever the entries' order; repeated values (a shared prefix) included."""
    slot_nodes = {s: f"n{s}" for s in slots}
    masks = [m for m in masks for _ in range(rnd.choice((1, 1, 3)))]
    order = list(range(8))
    values = []
    for m in masks:
        if rnd.random() < 0.3:
            rnd.shuffle(order)
        values.append(as_entries(m, order))
    assert entry_prefixes(values, slot_nodes) == longest_prefixes(masks, slot_nodes)


@given(st.dictionaries(st.integers(0, MAX_SLOTS - 1), st.integers(1, 7), max_size=20))
def test_holder_entries_round_trip(held):
    value = b"".join(holder_entry(s, t) for s, t in held.items())
    assert holder_entries(value) == held
    assert entry_holders(value, {s: f"n{s}" for s in held}) == {
        f"n{s}": tuple(name for i, name in enumerate(("hbm", "dram", "ssd")) if t >> i & 1) for s, t in held.items()
    }
