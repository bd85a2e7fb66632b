"""Engine events → Conductor KV events, for one node. Pure: no I/O, no clock.

Engines' own block hashes are not reproducible across processes, so Conductor
derives its block keys from each stored event's token ids (``schemas.chain_keys``,
parent = the Conductor key of the engine's parent block) and remembers, per node,
engine hash → Conductor key, so that removals (which carry no tokens) still apply.

A stored event whose parent this translator never saw (the bridge joined late and
the engine's replay buffer no longer reaches back) cannot be keyed correctly, so
it is skipped and counted as an orphan: the view then lacks those blocks, which
only costs reuse, instead of holding wrong keys.
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
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, Tier, chain_keys
from schemas.records import MAX_BLOCKS, Record

MAX_TRACKED_BLOCKS = 4_000_000
"""Engine hashes remembered per node before the node is declared stale (a leak guard)."""


def _scalar(x: Any) -> Any:
    return x if x is None or isinstance(x, (bool, int, float, str)) else repr(x)[:200]


@dataclass
class NodeTranslator:
    """Translate one node's engine events, keeping its engine-hash → block-key map."""

    expected_block_size: int | None = None
    max_tracked: int = MAX_TRACKED_BLOCKS
    keys: dict[EngineHash, int] = field(default_factory=dict)
    tiers: dict[EngineHash, set[Tier]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def reset(self) -> None:
        """Forget everything (a new epoch: the engine restarted or the node went stale)."""
        self.keys.clear()
        self.tiers.clear()

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

    def _stored(self, ev: EngineBlockStored) -> list[Record]:
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
            self.tiers.setdefault(h, set()).add(ev.tier)
        self.counts["blocks_stored"] += len(derived)
        out: list[Record] = []
        parent = parent_key
        for i in range(0, len(derived), MAX_BLOCKS):
            part = derived[i : i + MAX_BLOCKS]
            out.append(
                BlocksStored(
                    block_keys=part, parent_key=parent, block_size=ev.block_size, tier=ev.tier,
                    lora_name=ev.lora_name,
                )
            )
            parent = part[-1]
        return out

    def _derive(self, ev: EngineBlockStored, parent_key: int | None) -> list[int] | None:
        n, bs = len(ev.block_hashes), ev.block_size
        if len(ev.token_ids) != n * bs:
            return None
        if ev.extra_keys is None or all(e is None for e in ev.extra_keys):
            return chain_keys(ev.token_ids, bs, parent=parent_key, lora_name=ev.lora_name)
        # Per-block extras (multimodal ids, cache salt): one chain step per block.
        keys: list[int] = []
        parent = parent_key
        for i, extra in enumerate(ev.extra_keys):
            step = chain_keys(
                ev.token_ids[i * bs : (i + 1) * bs], bs, parent=parent, lora_name=ev.lora_name,
                extra_keys=[_scalar(x) for x in (extra or ())],
            )
            keys.extend(step)
            parent = step[-1]
        return keys

    def _removed(self, ev: EngineBlockRemoved) -> list[Record]:
        gone: list[int] = []
        for h in ev.block_hashes:
            key = self.keys.get(h)
            if key is None:
                self.counts["unknown_removed"] += 1
                continue
            held = self.tiers.get(h, set())
            if ev.tier not in held:
                self.counts["unknown_removed"] += 1
                continue
            held.discard(ev.tier)
            if not held:
                del self.keys[h]
                del self.tiers[h]
            gone.append(key)
        self.counts["blocks_removed"] += len(gone)
        return [
            BlocksRemoved(block_keys=gone[i : i + MAX_BLOCKS], tier=ev.tier) for i in range(0, len(gone), MAX_BLOCKS)
        ]
