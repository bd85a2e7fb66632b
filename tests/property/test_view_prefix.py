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


@given(
    st.lists(st.lists(st.integers(0, 2**24 - 1), min_size=1, max_size=12), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=30),
)
def test_the_remembering_walk_answers_as_the_walk(chains, reads):
    """A reader's PrefixWalk gives entry_prefixes' answer read after read, whether the chain
    was read before (the same values, fresh bytes objects as a reply brings them) or its
    holders or slot names changed since; a small memo also forgets and re-learns."""
    from state.keys import PrefixWalk

    walk = PrefixWalk(size=3)
    names = [{s: f"n{s}" for s in range(8)}, {s: f"n{s}" for s in range(1, 8)}, {s: f"m{s}" for s in range(8)}]
    for which, names_at in reads:
        masks = chains[which % len(chains)]
        values = [bytes(v) if v else None for v in (as_entries(m, list(range(8))) for m in masks)]
        slot_nodes = names[names_at]
        assert walk(values, slot_nodes) == entry_prefixes(values, slot_nodes) == longest_prefixes(masks, slot_nodes)
    assert walk.hits + walk.misses == sum(1 for which, _ in reads if as_entries(chains[which % len(chains)][0], list(range(8))))


def test_the_remembering_walk_is_told_apart_by_holders_and_slot_names():
    from state.keys import PrefixWalk

    walk = PrefixWalk()
    names = {0: "a", 1: "b"}
    both = [holder_entry(0, 1) + holder_entry(1, 1)] * 3
    assert walk(both, names) == {"a": (3, 3, 3), "b": (3, 3, 3)}
    assert walk([bytes(v) for v in both], names) is walk(both, names)  # equal values: remembered
    assert (walk.hits, walk.misses) == (2, 1)
    moved = both[:2] + [holder_entry(1, 2)]  # node a dropped the third block, b moved it to DRAM
    assert walk(moved, names) == {"a": (2, 2, 2), "b": (2, 3, 3)}
    renamed = {0: "a", 1: "c"}  # a slot reused by another node: a new mapping object
    assert walk(both, renamed) == {"a": (3, 3, 3), "c": (3, 3, 3)}
    assert walk.misses == 3


def test_the_remembering_walk_keeps_to_its_holder_budget():
    from state.keys import PrefixWalk

    walk = PrefixWalk(size=100, max_holders=5)
    names = {s: f"n{s}" for s in range(8)}
    three = [holder_entry(0, 1) + holder_entry(1, 1) + holder_entry(2, 1)]
    two = [holder_entry(3, 1) + holder_entry(4, 1)]
    one = [holder_entry(5, 1)]
    for chain in (three, two, one):  # 3 + 2 holders fit; the third chain pushes out the first
        walk(chain, names)
    assert walk(two, names) is walk(two, names) and walk.hits == 2
    walk(three, names)
    assert walk.misses == 4 and walk._held <= 5
    big = [b"".join(holder_entry(s, 1) for s in range(6))]  # six holders: answered, never kept
    assert len(walk(big, names)) == 6 and walk._held <= 5
