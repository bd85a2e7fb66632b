"""The bridge's translator on its own (pure): which copies of a block put it in the view."""

from __future__ import annotations

from conductor.bridge.translate import NodeTranslator
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
