"""Bounded KV block caches with LRU eviction, as a prefill instance or the shared pool keeps them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from schemas import Tier


class LruBlockCache:
    """A set of block keys of bounded size; inserting beyond capacity evicts the least recently used."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def prefix_len(self, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` are held (a chain is only usable as a prefix)."""
        n = 0
        for k in chain:
            if k not in self._blocks:
                break
            n += 1
        return n

    def touch(self, chain: Sequence[int]) -> None:
        """Mark held blocks of ``chain`` as just used."""
        # Tail first, so a chain's first blocks end up most recent: eviction then cuts
        # chains from the end and the shared prefixes (system prompts) survive longest.
        blocks = self._blocks
        for k in reversed(chain):
            if k in blocks:
                blocks.move_to_end(k)

    def insert(self, chain: Sequence[int]) -> tuple[list[int], list[int]]:
        """Hold the blocks of ``chain`` (at most ``capacity`` leading ones) as just used.

        Returns ``(stored, evicted)``: keys newly held, and keys dropped to make room,
        in the order they happened, which is what the node reports as KV events.
        """
        if self.capacity <= 0:
            return [], []
        chain = chain[: self.capacity]
        blocks = self._blocks
        stored = [k for k in chain if k not in blocks]
        evicted: list[int] = []
        room = self.capacity - len(blocks)
        need = len(stored) - room
        if need > 0:
            # Never evict a block of the chain being inserted: popped ones go back below.
            keep = set(chain)
            while need > 0:
                k, _ = blocks.popitem(last=False)
                if k in keep:
                    continue
                evicted.append(k)
                need -= 1
        for k in reversed(chain):
            blocks[k] = None
            blocks.move_to_end(k)
        return stored, evicted


class TieredPool:
    """The shared KV pool (Mooncake Store): an LRU DRAM tier whose evictions are demoted
    to an LRU SSD tier (when it has one)."""

    __slots__ = ("dram", "ssd")

    def __init__(self, dram_blocks: int, ssd_blocks: int = 0) -> None:
        self.dram = LruBlockCache(dram_blocks)
        self.ssd = LruBlockCache(ssd_blocks)

    def prefix(self, chain: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of ``chain`` held in DRAM, and in DRAM or SSD."""
        d = self.dram.prefix_len(chain)
        n = d
        for k in chain[d:]:
            if k not in self.dram and k not in self.ssd:
                break
            n += 1
        return d, n

    def touch(self, chain: Sequence[int]) -> None:
        self.dram.touch(chain)
        self.ssd.touch(chain)

    def insert(self, chain: Sequence[int]) -> list[tuple[str, Tier, list[int]]]:
        """Write ``chain`` to DRAM; returns the KV events as ``(op, tier, keys)``, op ∈ {stored, removed}."""
        stored, evicted = self.dram.insert(chain)
        events: list[tuple[str, Tier, list[int]]] = [("stored", "dram", stored), ("removed", "dram", evicted)]
        if self.ssd.capacity > 0 and evicted:
            s_ssd, e_ssd = self.ssd.insert(evicted)
            events += [("stored", "ssd", s_ssd), ("removed", "ssd", e_ssd)]
        return [e for e in events if e[2]]
