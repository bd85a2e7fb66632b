"""Engine events → Conductor KV events, for one node. Pure: no I/O, no clock.

Engines' own block hashes are not reproducible across processes, so Conductor
derives its block keys from each stored event's token ids (``schemas.chain_keys``,
parent = the Conductor key of the engine's parent block) and remembers, per node,
engine hash → Conductor key, so that removals (which carry no tokens) still apply.

A stored event whose parent this translator never saw (the bridge joined late and
the engine's replay buffer no longer reaches back) cannot be keyed correctly, so
it is skipped and counted as an orphan: the view then lacks those blocks, which
only costs reuse, instead of holding wrong keys.

Offload placeholders (a ``BlockStored`` with no tokens, e.g. vLLM's CPU offload
announcing copies of blocks the GPU tier reported) resolve through the same map.

Hybrid models: the translator tracks which (tier, KV-cache group) holds each block;
a block is in the view at a tier while every full-attention group that the node has
announced holds it there. Sliding-window (and other windowed) groups are tracked but
neither add nor remove view entries, because vLLM's hybrid manager reuses a prefix as
far as its full-attention groups hold it, and a windowed group only needs the last
window before the cut (see the README for the rule and its bound).

An event without ``group_idx`` (vLLM's array form, SGLang, offload connectors) names no
group: it is about the block as a whole, i.e. the engine's only group, or every group of a
hybrid one. Such a copy holds the block for every group; a removal without a group takes
the block out of the tier in every group; a removal naming group g of a block held as a
whole leaves it held by the node's other announced groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from conductor.bridge.wire import (
    BadEvent,
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EngineHash,
    UnknownEvent,
)
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier, chain_keys_per_block
from schemas.records import MAX_BLOCKS, Record

MAX_TRACKED_BLOCKS = 4_000_000
"""Engine hashes remembered per node before the node is declared stale (a leak guard)."""


Holder = tuple[Tier, int | None]
"""A copy of a block: its tier and its KV-cache group (None: no group named, the block as a whole)."""


def _scalar(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_scalar(e) for e in x)
    return repr(x)[:200]


@dataclass
class NodeTranslator:
    """Translate one node's engine events, keeping its engine-hash → block-key map."""

    expected_block_size: int | None = None
    max_tracked: int = MAX_TRACKED_BLOCKS
    keys: dict[EngineHash, int] = field(default_factory=dict)
    holders: dict[EngineHash, set[Holder]] = field(default_factory=dict)
    windowed: dict[int | None, bool] = field(default_factory=dict)
    """The node's KV-cache groups as announced by its stored events: True = sliding-window-like."""
    counts: Counter[str] = field(default_factory=Counter)

    def reset(self) -> None:
        """Forget everything (a new epoch: the engine restarted or the node went stale)."""
        self.keys.clear()
        self.holders.clear()
        self.windowed.clear()

    @property
    def overflowed(self) -> bool:
        return len(self.keys) > self.max_tracked

    def translate(self, batch: EngineBatch) -> list[Record]:
        out: list[Record] = []
        for ev in batch.events:
            out.extend(self.translate_event(ev))
        return out

    def translate_event(self, ev: EngineEvent) -> list[Record]:
        if isinstance(ev, EngineBlockStored):
            return self._stored(ev)
        if isinstance(ev, EngineBlockRemoved):
            return self._removed(ev)
        if isinstance(ev, EngineAllCleared):
            self.reset()
            self.counts["cleared"] += 1
            return [AllBlocksCleared()]
        if isinstance(ev, UnknownEvent):
            self.counts["unknown_event"] += 1
        elif isinstance(ev, BadEvent):
            self.counts["bad_event"] += 1
        return []

    # --- which copies count for the view --------------------------------------

    def _counts_for_view(self, group: int | None) -> bool:
        if not self.windowed.get(group, False):
            return True
        # A model whose groups are all windowed: each of them is all the engine has.
        return not any(not w for w in self.windowed.values())

    def _present(self, h: EngineHash, tier: Tier) -> bool:
        held = {g for t, g in self.holders.get(h, ()) if t == tier and self._counts_for_view(g)}
        if not held:
            return False
        if None in held:  # a copy of the block as a whole: every group holds it
            return True
        full = {g for g, w in self.windowed.items() if not w}
        return not full or full <= held

    # --- stored -------------------------------------------------------------------

    def _stored(self, ev: EngineBlockStored) -> list[Record]:
        if ev.group_idx is not None:  # no group named is no group of its own (see the module's docstring)
            self.windowed.setdefault(ev.group_idx, ev.sliding_window)
        if ev.placeholder:
            return self._placeholder(ev)
        if ev.parent_block_hash is None:
            parent_key = None
        else:
            parent_key = self.keys.get(ev.parent_block_hash)
            if parent_key is None:
                self.counts["orphan_blocks"] += len(ev.block_hashes)
                return []
        if self.expected_block_size is not None and ev.block_size != self.expected_block_size:
            # Still correct for this node, but requests hashed at another size will never match.
            self.counts["block_size_mismatch"] += 1
        derived = self._derive(ev, parent_key)
        if derived is None or len(derived) != len(ev.block_hashes):
            self.counts["bad_event"] += 1
            return []
        for h, k in zip(ev.block_hashes, derived):
            self.keys[h] = k
        return self._hold(list(zip(ev.block_hashes, derived)), ev.tier, ev.group_idx, ev.block_size, parent_key)

    def _placeholder(self, ev: EngineBlockStored) -> list[Record]:
        """Copies of blocks already known by hash (offload to CPU, disk, a shared pool)."""
        known = []
        for h in ev.block_hashes:
            k = self.keys.get(h)
            if k is None:
                self.counts["orphan_blocks"] += 1
            else:
                known.append((h, k))
        self.counts["placeholder_blocks"] += len(known)
        return self._hold(known, ev.tier, ev.group_idx, ev.block_size or self.expected_block_size or 16)

    def _hold(
        self, blocks: list[tuple[EngineHash, int]], tier: Tier, group: int | None, bs: int, parent: int | None = None
    ) -> list[Record]:
        new: list[int] = []
        for h, k in blocks:
            before = self._present(h, tier)
            self.holders.setdefault(h, set()).add((tier, group))
            if not before and self._present(h, tier):
                new.append(k)
        self.counts["blocks_stored"] += len(new)
        whole_run = len(new) == len(blocks)  # else the keys alone say it all: no parent to name
        out: list[Record] = []
        for i in range(0, len(new), MAX_BLOCKS):
            part = new[i : i + MAX_BLOCKS]
            out.append(BlocksStored(block_keys=part, parent_key=parent if whole_run else None, block_size=bs,
                                    tier=tier))
            parent = part[-1]
        return out

    def _derive(self, ev: EngineBlockStored, parent_key: int | None) -> list[int] | None:
        """Conductor keys of the event's blocks: the engine's own extra keys, block by block.

        vLLM >= 0.11 reports each block's extra keys (LoRA name first, then multimodal ids,
        the cache salt, prompt-embedding digests); older engines only name the LoRA adapter,
        which is then the one extra key of every block, as vLLM hashes it.
        """
        n, bs = len(ev.block_hashes), ev.block_size
        if len(ev.token_ids) != n * bs:
            return None
        if ev.extra_keys is not None:
            extras: list[tuple[Any, ...] | None] = [
                None if e is None else tuple(_scalar(x) for x in e) for e in ev.extra_keys
            ]
        else:
            extras = [(ev.lora_name,) if ev.lora_name else None] * n
        try:
            return chain_keys_per_block(ev.token_ids, bs, extras, parent=parent_key)
        except TypeError:
            return None

    # --- removed ------------------------------------------------------------------

    def _removed(self, ev: EngineBlockRemoved) -> list[Record]:
        gone: list[int] = []
        tier, group = ev.tier, ev.group_idx
        for h in ev.block_hashes:
            key = self.keys.get(h)
            held = self.holders.get(h)
            at_tier = {g for t, g in held if t == tier} if held else set()
            if key is None or held is None or not at_tier or (group is not None and not at_tier & {group, None}):
                self.counts["unknown_removed"] += 1
                continue
            before = self._present(h, tier)
            if group is None:
                held.difference_update((tier, g) for g in at_tier)  # the block left the tier, every group of it
            else:
                if None in at_tier:  # held as a whole: the node's other groups still hold it
                    held.discard((tier, None))
                    held.update((tier, g) for g in self.windowed if g != group)
                held.discard((tier, group))
            if before and not self._present(h, tier):
                gone.append(key)
            if not held:
                del self.keys[h]
                del self.holders[h]
        self.counts["blocks_removed"] += len(gone)
        return [
            BlocksRemoved(block_keys=gone[i : i + MAX_BLOCKS], tier=tier) for i in range(0, len(gone), MAX_BLOCKS)
        ]
