"""The balance loop inside the simulator: the production planner and executor core.

What ``conductor balance`` does, on the simulated clock: every request's chain feeds the
heat tracker as it arrives (the worker reads ``requests``), and every ``interval_s`` the
planner reads the view (the same in-memory view the policies read, heartbeats included)
for the prefixes the tracker names and plans commands. Each command goes to its executor
(a simulated prefill instance), which runs :func:`conductor.balance.executor.execute` on
its cache: a ``replicate`` pulls the prefix from its holder (only as much as the holder
really holds by then) and the blocks land in the target's cache after the topology's
transfer time, proven by a ``blocks_migrated`` event through the delayed view.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conductor.balance.executor import CommandMemory, Step, execute
from conductor.balance.planner import BalanceCosts, BalanceParams, Cooldown, HeatTracker, plan
from conductor.harness.sim.cache import LruBlockCache
from schemas import BlocksMigrated, KvCommand, Tier

DEFAULT_INTERVAL_S = 2.0
"""The worker's planning interval (``conductor balance --interval``)."""


@dataclass(slots=True)
class CacheTiers:
    """A simulated prefill instance's one-tier cache as the executor's :class:`NodeCache`."""

    cache: LruBlockCache
    tier: Tier

    def tiers(self) -> Sequence[Tier]:
        return (self.tier,)

    def holds(self, key: int, tier: Tier) -> bool:
        return tier == self.tier and key in self.cache

    def capacity(self, tier: Tier) -> int:
        return self.cache.capacity if tier == self.tier else 0


@dataclass
class BalanceLoop:
    """Heat, cooldowns and the executors' memories of one simulation run."""

    params: BalanceParams
    costs: BalanceCosts
    block_size: int
    interval_s: float = DEFAULT_INTERVAL_S
    tracker: HeatTracker = field(init=False)
    cooldown: Cooldown = field(default_factory=Cooldown)
    memories: dict[str, CommandMemory] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    bytes_moved: int = 0
    blocks_moved: int = 0

    def __post_init__(self) -> None:
        self.tracker = HeatTracker(self.params)

    def observe(self, chain: Sequence[int], now_s: float) -> None:
        self.tracker.record(chain, now_s)

    def memory_of(self, node: str) -> CommandMemory:
        """The command ids ``node``'s executor answered."""
        return self.memories.setdefault(node, CommandMemory())

    def plan(self, snapshot_of: Any, now_s: float) -> list[KvCommand]:
        """This round's commands; ``snapshot_of(chain)`` reads the view for a prefix."""
        hot = self.tracker.hot(now_s)[: self.params.max_commands * 2]
        cold = self.tracker.cold(now_s)[: self.params.max_commands * 2]
        chains = [c for c, _ in hot] + list(cold)
        snaps = {c: snapshot_of(c) for c in chains}
        cmds = plan(hot, cold, snaps, ttl_s=float("inf"), now_s=now_s, params=self.params, cooldown=self.cooldown,
                    costs=self.costs, block_size=self.block_size)
        self.counts["commands"] += len(cmds)
        return cmds

    def summary(self) -> dict[str, Any]:
        return {
            "balance_commands": self.counts["commands"],
            "balance_done": self.counts["done"],
            "balance_failed": self.counts["failed"],
            "balance_expired": self.counts["expired"],
            "balance_blocks_moved": self.blocks_moved,
            "balance_bytes_moved": self.bytes_moved,
        }


def replicate_arrival(step: Step, cache: LruBlockCache, node: str, tier: Tier) -> tuple[BlocksMigrated | None, list[int]]:
    """Land pulled blocks in ``cache``: the proof event for the blocks newly held, and the evicted keys."""
    stored, evicted = cache.insert(list(step.keys))
    ev = None
    if stored:
        ev = BlocksMigrated(mode="replicate", block_keys=stored, from_node=step.from_node or "",
                            from_tier=step.from_tier or tier, to_node=node, to_tier=tier)
    return ev, evicted


__all__ = ["DEFAULT_INTERVAL_S", "BalanceLoop", "CacheTiers", "execute", "replicate_arrival"]
