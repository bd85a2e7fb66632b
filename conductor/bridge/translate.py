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

Memory is bounded: at most ``max_tracked`` engine hashes per node (each costs one ordered
map entry: the hash, its key and its copies packed in one int). Past the bound the least
recently stored hash is forgotten and counted (``hashes_evicted``), and its blocks leave the
view (a ``BlocksRemoved`` per tier that held them), so the view never holds a block whose
later removal the translator could no longer apply. A later event naming a forgotten hash
is what it would be for any unknown hash: a removal is counted (``unknown_removed``) and
dropped; a store whose parent was forgotten is an orphan (counted, skipped: its key cannot
be derived); a copy announced without tokens is an orphan too; the block stored again with
its tokens is indexed again.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, get_args

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

DEFAULT_MAX_TRACKED = 1_000_000
"""Engine hashes remembered per node when neither the operator nor the engine's capacity says."""
MIN_TRACKED = 65_536
"""The least bound taken from an engine's capacity (a small engine still gets room to spare)."""
CAPACITY_MARGIN = 2
"""Hashes per block of capacity: a node cannot hold more distinct blocks than its tiers' blocks,
so past twice that the translator has missed removals."""

Holder = tuple[Tier, int | None]
"""A copy of a block: its tier and its KV-cache group (None: no group named, the block as a whole)."""

_TIERS: tuple[Tier, ...] = get_args(Tier)
_TIER_INDEX = {t: i for i, t in enumerate(_TIERS)}
_KEY_BITS = 64
_KEY_MASK = (1 << _KEY_BITS) - 1


def tracked_bound(gpu_blocks: int | None, cpu_blocks: int | None = None, tiers: Iterable[Tier] = ()) -> int | None:
    """The hashes worth tracking for an engine of this capacity (None: capacity unknown). ``tiers``: those
    the node has reported copies on; one whose size no metric gives (disk, a shared pool, or host memory
    without ``cpu_blocks``, e.g. vLLM's offloading connector) keeps :data:`DEFAULT_MAX_TRACKED` at least."""
    if not gpu_blocks:
        return None
    bound = max(MIN_TRACKED, CAPACITY_MARGIN * (gpu_blocks + (cpu_blocks or 0)))
    tiers = set(tiers)
    if "ssd" in tiers or ("dram" in tiers and not cpu_blocks):
        bound = max(bound, DEFAULT_MAX_TRACKED)
    return bound


def _scalar(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_scalar(e) for e in x)
    return repr(x)[:200]


@dataclass
class NodeTranslator:
    """Translate one node's engine events, keeping its engine-hash → block-key map (bounded)."""

    expected_block_size: int | None = None
    max_tracked: int = DEFAULT_MAX_TRACKED
    """The most engine hashes remembered; past it the least recently stored are forgotten."""
    windowed: dict[int | None, bool] = field(default_factory=dict)
    """The node's KV-cache groups as announced by its stored events: True = sliding-window-like."""
    counts: Counter[str] = field(default_factory=Counter)
    tiers_seen: set[Tier] = field(default_factory=set)
    """The tiers this node's engine has reported copies on (kept across epochs: it is the engine's setup)."""
    _blocks: OrderedDict[EngineHash, int] = field(default_factory=OrderedDict, init=False, repr=False)
    """Engine hash → its block key (low 64 bits) | the bits of its copies above them, least recently stored
    first. One int per hash, not a key plus a set of holders: a third of the memory."""
    _slots: dict[int | None, int] = field(default_factory=lambda: {None: 0}, init=False, repr=False)
    """KV-cache group → its slot among a hash's copy bits (None: the block as a whole)."""
    _view_bits: dict[Tier, int] = field(default_factory=dict, init=False, repr=False)
    _full_bits: dict[Tier, int] = field(default_factory=dict, init=False, repr=False)
    _tier_bits: dict[Tier, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._groups_changed()

    def reset(self) -> None:
        """Forget everything (a new epoch: the engine restarted or the node went stale)."""
        self._blocks.clear()
        self.windowed.clear()
        self._slots = {None: 0}
        self._groups_changed()

    def __len__(self) -> int:
        """Engine hashes tracked now."""
        return len(self._blocks)

    def key_of(self, h: EngineHash) -> int | None:
        """The Conductor key of engine hash ``h``, if tracked."""
        v = self._blocks.get(h)
        return None if v is None else v & _KEY_MASK

    def holders_of(self, h: EngineHash) -> set[Holder]:
        """Which (tier, group) copies of ``h`` the engine reported and has not removed."""
        v = self._blocks.get(h, 0) >> _KEY_BITS
        return {(t, g) for g in self._slots for t in _TIERS if v & self._bit(t, g)}

    def bound(self, max_tracked: int) -> list[Record]:
        """Track at most ``max_tracked`` hashes from now on; what falls out now leaves the view."""
        self.max_tracked = max(1, max_tracked)
        return self._evict()

    def translate(self, batch: EngineBatch) -> list[Record]:
        out: list[Record] = []
        for ev in batch.events:
            out.extend(self.translate_event(ev))
        return out

    def translate_event(self, ev: EngineEvent) -> list[Record]:
        if isinstance(ev, EngineBlockStored):
            return self._stored(ev) + self._evict()
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

    def _bit(self, tier: Tier, group: int | None) -> int:
        slot = self._slots.get(group)
        return 0 if slot is None else 1 << (len(_TIERS) * slot + _TIER_INDEX[tier])

    def _counts_for_view(self, group: int | None) -> bool:
        if not self.windowed.get(group, False):
            return True
        # A model whose groups are all windowed: each of them is all the engine has.
        return not any(not w for w in self.windowed.values())

    def _announce(self, group: int, windowed: bool) -> None:
        if group in self.windowed:
            return
        self.windowed[group] = windowed
        self._slots.setdefault(group, len(self._slots))
        self._groups_changed()

    def _groups_changed(self) -> None:
        full = [g for g, w in self.windowed.items() if not w]
        for t in _TIERS:
            self._tier_bits[t] = sum(self._bit(t, g) for g in self._slots)
            self._view_bits[t] = sum(self._bit(t, g) for g in self._slots if self._counts_for_view(g))
            self._full_bits[t] = sum(self._bit(t, g) for g in full)

    def _present(self, copies: int, tier: Tier) -> bool:
        held = copies & self._view_bits[tier]
        if not held:
            return False
        if held & 1 << _TIER_INDEX[tier]:  # a copy of the block as a whole (slot 0): every group holds it
            return True
        full = self._full_bits[tier]
        return held & full == full

    # --- stored -------------------------------------------------------------------

    def _stored(self, ev: EngineBlockStored) -> list[Record]:
        if ev.group_idx is not None:  # no group named is no group of its own (see the module's docstring)
            self._announce(ev.group_idx, ev.sliding_window)
        if ev.placeholder:
            return self._placeholder(ev)
        if ev.parent_block_hash is None:
            parent_key = None
        else:
            parent_key = self.key_of(ev.parent_block_hash)
            if parent_key is None:
                self.counts["orphan_blocks"] += len(ev.block_hashes)
                return []
            # A chain still growing keeps its root's entries recent (their children name them).
            self._blocks.move_to_end(ev.parent_block_hash)
        if self.expected_block_size is not None and ev.block_size != self.expected_block_size:
            # Still correct for this node, but requests hashed at another size will never match.
            self.counts["block_size_mismatch"] += 1
        derived = self._derive(ev, parent_key)
        if derived is None or len(derived) != len(ev.block_hashes):
            self.counts["bad_event"] += 1
            return []
        return self._hold(list(zip(ev.block_hashes, derived)), ev.tier, ev.group_idx, ev.block_size, parent_key)

    def _placeholder(self, ev: EngineBlockStored) -> list[Record]:
        """Copies of blocks already known by hash (offload to CPU, disk, a shared pool)."""
        known = []
        for h in ev.block_hashes:
            k = self.key_of(h)
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
        self.tiers_seen.add(tier)
        bit = self._bit(tier, group)
        for h, k in blocks:
            copies = self._blocks.pop(h, 0) >> _KEY_BITS  # popped and put back: now the most recent
            before = self._present(copies, tier)
            copies |= bit
            self._blocks[h] = k | copies << _KEY_BITS
            if not before and self._present(copies, tier):
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
        which is then the one extra key of every block, as vLLM hashes it. SGLang names the
        cache salt apart: it goes after the LoRA name on the chain's first block, where a
        request's salt goes (``schemas.vllm_block_extras``), so a salted request's keys match.
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
            if ev.cache_salt and parent_key is None and n:  # a child's key carries the salt through its parent
                extras[0] = (*(extras[0] or ()), ev.cache_salt)
        try:
            return chain_keys_per_block(ev.token_ids, bs, extras, parent=parent_key)
        except TypeError:
            return None

    # --- removed ------------------------------------------------------------------

    def _removed(self, ev: EngineBlockRemoved) -> list[Record]:
        gone: list[int] = []
        tier, group = ev.tier, ev.group_idx
        whole, named, at_tier = self._bit(tier, None), self._bit(tier, group), self._tier_bits[tier]
        for h in ev.block_hashes:
            v = self._blocks.get(h)
            copies = 0 if v is None else (v >> _KEY_BITS) & at_tier
            if v is None or not copies or (group is not None and not copies & (named | whole)):
                self.counts["unknown_removed"] += 1
                continue
            before = self._present(v >> _KEY_BITS, tier)
            if group is None:
                v &= ~(at_tier << _KEY_BITS)  # the block left the tier, every group of it
            else:
                if copies & whole:  # held as a whole: the node's other groups still hold it
                    others = sum(self._bit(tier, g) for g in self.windowed if g != group)
                    v = (v & ~(whole << _KEY_BITS)) | others << _KEY_BITS
                v &= ~(named << _KEY_BITS)
            if before and not self._present(v >> _KEY_BITS, tier):
                gone.append(v & _KEY_MASK)
            if v >> _KEY_BITS:
                self._blocks[h] = v
            else:
                del self._blocks[h]
        self.counts["blocks_removed"] += len(gone)
        return _removals({tier: gone})

    # --- the bound ----------------------------------------------------------------

    def _evict(self) -> list[Record]:
        """Forget the least recently stored hashes past ``max_tracked``; their blocks leave the view."""
        over = len(self._blocks) - self.max_tracked
        if over <= 0:
            return []
        gone: dict[Tier, list[int]] = {}
        for _ in range(over):
            _, v = self._blocks.popitem(last=False)
            for t in _TIERS:
                if self._present(v >> _KEY_BITS, t):
                    gone.setdefault(t, []).append(v & _KEY_MASK)
        self.counts["hashes_evicted"] += over
        self.counts["blocks_removed"] += sum(map(len, gone.values()))
        return _removals(gone)


def _removals(gone: dict[Tier, list[int]]) -> list[Record]:
    return [BlocksRemoved(block_keys=keys[i : i + MAX_BLOCKS], tier=t)
            for t, keys in gone.items() for i in range(0, len(keys), MAX_BLOCKS)]
