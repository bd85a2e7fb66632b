"""The bridge's translator on its own (pure): which copies of a block put it in the view."""

from __future__ import annotations

import gc
import random
import tracemalloc

from conductor.bridge.translate import DEFAULT_MAX_TRACKED, MIN_TRACKED, NodeTranslator, tracked_bound
from conductor.bridge.wire import EngineBlockRemoved, EngineBlockStored
from schemas import BlocksRemoved, BlocksStored, chain_keys

BS = 16
TOKENS = tuple(range(500, 500 + 4 * BS))
KEYS = chain_keys(TOKENS, BS)
HASHES = (1, 2, 3, 4)


def stored(tier: str = "hbm", group: int | None = None, kind: str | None = None) -> EngineBlockStored:
    return EngineBlockStored(HASHES, None, TOKENS, BS, tier, group_idx=group,  # type: ignore[arg-type]
                             sliding_window=kind == "swa")


def hybrid() -> NodeTranslator:
    """A node with a full-attention group 0 and a sliding-window group 1, both holding the 4 blocks in HBM."""
    t = NodeTranslator()
    t.translate_event(stored(group=0))
    t.translate_event(stored(group=1, kind="swa"))
    return t


def test_a_whole_block_copy_of_a_hybrid_model_is_in_the_view() -> None:
    t = hybrid()
    # An offload connector names no group: the block as a whole, every group of it.
    assert t.translate_event(stored("ssd")) == [BlocksStored(block_keys=KEYS, block_size=BS, tier="ssd")]


def test_a_group_removal_of_a_whole_block_copy_leaves_it_with_the_other_groups() -> None:
    t = hybrid()
    t.translate_event(stored("ssd"))
    # The sliding-window group lets go: the full-attention group still holds it.
    assert t.translate_event(EngineBlockRemoved((1,), "ssd", group_idx=1)) == []
    # The full-attention group lets go: no full copy left on that tier.
    assert t.translate_event(EngineBlockRemoved((1, 2), "ssd", group_idx=0)) == [
        BlocksRemoved(block_keys=KEYS[:2], tier="ssd")]
    assert t.counts["unknown_removed"] == 0


def test_a_removal_naming_no_group_takes_the_block_out_of_the_tier() -> None:
    t = hybrid()
    assert t.translate_event(EngineBlockRemoved((4,), "hbm")) == [BlocksRemoved(block_keys=KEYS[3:], tier="hbm")]
    # Neither group holds it there any more: a group's removal of it is unknown.
    assert t.translate_event(EngineBlockRemoved((4,), "hbm", group_idx=1)) == []
    assert t.counts["unknown_removed"] == 1


def test_one_group_named_or_not_is_one_group() -> None:
    t = NodeTranslator()
    assert t.translate_event(stored(group=0)) == [BlocksStored(block_keys=KEYS, block_size=BS, tier="hbm")]
    assert t.translate_event(stored()) == []  # the same copy again: nothing new
    assert t.translate_event(EngineBlockRemoved((1,), "hbm")) == [BlocksRemoved(block_keys=KEYS[:1], tier="hbm")]
    assert t.translate_event(EngineBlockRemoved((2,), "hbm", group_idx=0)) == [
        BlocksRemoved(block_keys=KEYS[1:2], tier="hbm")]


# --- the memory bound -------------------------------------------------------------------------

LONG = tuple(range(900, 900 + 8 * BS))
LONG_KEYS = chain_keys(LONG, BS)


def chain(t: NodeTranslator, first: int, last: int, tier: str = "hbm") -> list[object]:
    """Blocks ``first``..``last`` of LONG, hashes 100 + i, one event each, each the child of the one before."""
    out: list[object] = []
    for i in range(first, last + 1):
        out += t.translate_event(EngineBlockStored((100 + i,), None if i == 0 else 99 + i, LONG[i * BS:(i + 1) * BS],
                                                   BS, tier))  # type: ignore[arg-type]
    return out


def test_past_the_bound_the_least_recent_hashes_leave_the_map_and_the_view() -> None:
    t = NodeTranslator(max_tracked=3)
    out = chain(t, 0, 4)
    assert len(t) == 3 and t.counts["hashes_evicted"] == 2
    removed = [r for r in out if isinstance(r, BlocksRemoved)]
    assert removed == [BlocksRemoved(block_keys=LONG_KEYS[:1], tier="hbm"),
                       BlocksRemoved(block_keys=LONG_KEYS[1:2], tier="hbm")]
    assert t.key_of(100) is None and t.key_of(104) == LONG_KEYS[4]


def test_a_later_event_naming_a_forgotten_hash_changes_nothing_and_is_counted() -> None:
    t = NodeTranslator(max_tracked=3)
    chain(t, 0, 4)
    # The engine evicts the forgotten block at last: unknown, dropped (the view lost it already).
    assert t.translate_event(EngineBlockRemoved((100,), "hbm")) == []
    assert t.counts["unknown_removed"] == 1
    # A child of a forgotten block cannot be keyed: an orphan, never a wrong key.
    sibling = EngineBlockStored((200,), 100, LONG[BS:2 * BS], BS, "hbm")
    assert t.translate_event(sibling) == [] and t.counts["orphan_blocks"] == 1
    # A copy of it announced without tokens is an orphan too.
    assert t.translate_event(EngineBlockStored((100,), None, (), 0, "dram")) == []
    assert t.counts["orphan_blocks"] == 2
    # Stored again with its tokens, it is indexed again (and the oldest tracked one goes).
    again = t.translate_event(EngineBlockStored((100,), None, LONG[:BS], BS, "hbm"))
    assert again[0] == BlocksStored(block_keys=LONG_KEYS[:1], block_size=BS, tier="hbm")
    assert t.key_of(100) == LONG_KEYS[0] and t.key_of(102) is None


def test_a_chain_still_growing_keeps_its_parent_recent() -> None:
    t = NodeTranslator(max_tracked=3)
    chain(t, 0, 0)  # the root, hash 100
    t.translate_event(EngineBlockStored((300,), None, LONG[5 * BS:6 * BS], BS, "hbm"))
    t.translate_event(EngineBlockStored((301,), None, LONG[6 * BS:7 * BS], BS, "hbm"))
    # The root is the least recently stored, but its child names it: the root stays, 300 goes.
    t.translate_event(EngineBlockStored((101,), 100, LONG[BS:2 * BS], BS, "hbm"))
    assert t.key_of(100) == LONG_KEYS[0] and t.key_of(101) == LONG_KEYS[1]
    assert t.key_of(300) is None and t.counts["hashes_evicted"] == 1
    # A copy on another tier makes a hash recent too.
    t.translate_event(EngineBlockStored((301,), None, (), 0, "dram"))
    chain(t, 2, 2)
    assert t.key_of(301) is not None and t.key_of(100) is None


def test_a_lower_bound_applies_at_once() -> None:
    t = NodeTranslator()
    chain(t, 0, 5)
    out = t.bound(2)
    assert len(t) == 2 and t.counts["hashes_evicted"] == 4
    assert out == [BlocksRemoved(block_keys=LONG_KEYS[:4], tier="hbm")]


def test_the_bound_from_the_engines_capacity() -> None:
    assert tracked_bound(None) is None and tracked_bound(0) is None
    assert tracked_bound(1_000) == MIN_TRACKED  # a small engine still gets room to spare
    assert tracked_bound(100_000, 400_000) == 1_000_000
    # A tier whose size no metric gives keeps the default at least: disk, or host memory without cpu_blocks.
    assert tracked_bound(1_000, None, {"hbm", "ssd"}) == DEFAULT_MAX_TRACKED
    assert tracked_bound(1_000, None, {"hbm", "dram"}) == DEFAULT_MAX_TRACKED
    assert tracked_bound(1_000, 4_000, {"hbm", "dram"}) == MIN_TRACKED


def test_a_tracked_block_costs_well_under_the_old_map_and_set() -> None:
    """A key in a dict plus a set of (tier, group) per hash cost ~370 bytes a block; one packed entry ~165."""
    n = 20_000
    rng = random.Random(7)
    t = NodeTranslator(max_tracked=n)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parent = None
        for i in range(n // 50):
            hashes = tuple(rng.getrandbits(64) for _ in range(50))
            t.translate_event(EngineBlockStored(hashes, parent, tuple(range(i, i + 50 * BS)), BS, "hbm"))
            parent = hashes[-1]
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(t) == n
    assert per_block < 250, per_block
