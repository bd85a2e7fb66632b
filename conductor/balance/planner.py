"""The KVCache balance scheduler: replicate hot prefixes, demote cold ones.

Pure: the caller feeds request chains with their time (:meth:`HeatTracker.record`),
reads a view snapshot for each chain the tracker names, and asks :func:`plan` for
the commands to publish on ``kv-commands``. No I/O, no clock.

Heat is an exponentially decayed access count per block (half-life
``half_life_s``), so it weighs both frequency and recency. A prefix is *hot* when
its first block's heat reaches ``hot_threshold``; it is worth replicating when
every instance holding it is overloaded (Mooncake's cache-load balancing: copy
the hot prefix to where there is compute, instead of queueing behind it). A
prefix that was hot and has decayed below ``cold_threshold`` is demoted from HBM
to DRAM on instances whose HBM is under pressure.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from conductor.topology import Topology
from schemas import KvCommand
from state.view import NodeState, ViewSnapshot


class BalanceParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    half_life_s: float = Field(default=60.0, gt=0, description="heat halves after this long without access")
    hot_threshold: float = Field(default=8.0, gt=0, description="decayed accesses that make a prefix hot")
    cold_threshold: float = Field(default=0.5, ge=0, description="a once-hot prefix below this is cold")
    overload_tokens: int = Field(default=16_384, ge=0, description="queued prefill tokens that count as overloaded")
    overload_factor: float = Field(default=1.5, ge=1, description="...and at least this times the cluster mean")
    max_replicas: int = Field(default=3, ge=1, description="never hold a hot prefix on more instances than this")
    hbm_pressure: float = Field(default=0.9, gt=0, le=1, description="HBM use above which cold prefixes are demoted")
    cooldown_s: float = Field(default=30.0, ge=0, description="no second command for a prefix and target within this")
    max_prefix_blocks: int = Field(default=512, ge=1, description="longest prefix one command moves")
    max_tracked: int = Field(default=10_000, ge=1, description="prefixes tracked; the coldest are forgotten")
    max_commands: int = Field(default=32, ge=1, description="commands per planning round")


@dataclass
class _Prefix:
    chain: tuple[int, ...]
    heat: float = 0.0
    at_s: float = 0.0
    was_hot: bool = False


@dataclass
class HeatTracker:
    """Decayed access counts per prefix (keyed by its first block)."""

    params: BalanceParams = field(default_factory=BalanceParams)
    _prefixes: OrderedDict[int, _Prefix] = field(default_factory=OrderedDict)

    def _decay(self, p: _Prefix, now_s: float) -> float:
        dt = max(0.0, now_s - p.at_s)
        return p.heat * math.pow(0.5, dt / self.params.half_life_s)

    def record(self, chain: Sequence[int], now_s: float) -> None:
        if not chain:
            return
        head = chain[0]
        p = self._prefixes.get(head)
        if p is None:
            p = self._prefixes[head] = _Prefix(tuple(chain[: self.params.max_prefix_blocks]))
        else:
            self._prefixes.move_to_end(head)
            # The tracked prefix is the part every request under this head shared.
            common = 0
            for a, b in zip(p.chain, chain):
                if a != b:
                    break
                common += 1
            p.chain = p.chain[: max(common, 1)]
        p.heat = self._decay(p, now_s) + 1.0
        p.at_s = now_s
        if p.heat >= self.params.hot_threshold:
            p.was_hot = True
        while len(self._prefixes) > self.params.max_tracked:
            self._prefixes.popitem(last=False)  # least recently seen

    def heat(self, head: int, now_s: float) -> float:
        p = self._prefixes.get(head)
        return 0.0 if p is None else self._decay(p, now_s)

    def hot(self, now_s: float) -> list[tuple[tuple[int, ...], float]]:
        """Hot prefixes, hottest first."""
        out = [(p.chain, h) for p in self._prefixes.values() if (h := self._decay(p, now_s)) >= self.params.hot_threshold]
        return sorted(out, key=lambda x: -x[1])

    def cold(self, now_s: float) -> list[tuple[int, ...]]:
        """Prefixes that were hot once and have cooled below ``cold_threshold``."""
        return [p.chain for p in self._prefixes.values() if p.was_hot and self._decay(p, now_s) < self.params.cold_threshold]

    def forget(self, chain: Sequence[int]) -> None:
        if chain:
            self._prefixes.pop(chain[0], None)


@dataclass
class Cooldown:
    """When each (prefix head, target) last got a command."""

    last_s: dict[tuple[int, str, str], float] = field(default_factory=dict)

    def ready(self, key: tuple[int, str, str], now_s: float, cooldown_s: float) -> bool:
        t = self.last_s.get(key)
        return t is None or now_s - t >= cooldown_s

    def mark(self, key: tuple[int, str, str], now_s: float) -> None:
        self.last_s[key] = now_s


def _prefill_capable(n: NodeState) -> bool:
    return n.role in ("prefill", "both")


def plan(
    hot: Sequence[tuple[tuple[int, ...], float]],
    cold: Sequence[tuple[int, ...]],
    snapshots: dict[tuple[int, ...], ViewSnapshot],
    *,
    ttl_s: float,
    now_s: float,
    params: BalanceParams,
    cooldown: Cooldown,
    topology: Topology | None = None,
    kv_bytes_per_block: float = 0.0,
) -> list[KvCommand]:
    """Commands for this round; ``snapshots`` holds a view read for each prefix named.

    With a ``topology``, a replica is copied from the holder with the cheapest path to the
    target (``kv_bytes_per_block`` x the prefix's blocks over the path's link), the least
    queued holder breaking ties; without one, from the least queued holder."""
    commands: list[KvCommand] = []
    for chain, h in hot:
        snap = snapshots.get(chain)
        if snap is None or len(commands) >= params.max_commands:
            continue
        live = [n for n in snap.live_nodes(ttl_s) if _prefill_capable(n)]
        if not live:
            continue
        need = len(chain)
        holders = [n for n in live if snap.prefix.get(n.node_id, (0, 0, 0))[1] >= need]
        if not holders or len(holders) >= params.max_replicas:
            continue
        mean = sum(n.queued_prefill_tokens for n in live) / len(live)
        bar = max(params.overload_tokens, params.overload_factor * mean)
        if min(n.queued_prefill_tokens for n in holders) < bar:
            continue  # some holder still has room: routing will use it
        held = {n.node_id for n in holders}
        candidates = [n for n in live if n.node_id not in held and n.queued_prefill_tokens < bar]
        if not candidates:
            continue
        target = min(candidates, key=lambda n: (n.queued_prefill_tokens, n.node_id))
        if topology is not None:
            nbytes = kv_bytes_per_block * need
            source = min(holders, key=lambda n: (topology.link_between(n, target).seconds(nbytes),
                                                 n.queued_prefill_tokens, n.node_id))
            path = topology.link_between(source, target)
            via = f"; copied over {path.transport} {path.bandwidth_gbps:g} Gb/s"
        else:
            source = min(holders, key=lambda n: (n.queued_prefill_tokens, n.node_id))
            via = ""
        key = (chain[0], "replicate", target.node_id)
        if not cooldown.ready(key, now_s, params.cooldown_s):
            continue
        src_tier = "hbm" if snap.prefix[source.node_id][0] >= need else "dram"
        commands.append(
            KvCommand(
                action="replicate",
                block_keys=list(chain),
                from_node=source.node_id,
                from_tier=src_tier,
                to_node=target.node_id,
                to_tier="hbm",
                reason=f"hot prefix (heat {h:.1f}); all {len(holders)} holder(s) have >= {bar:.0f} queued prefill "
                       f"tokens{via}",
            )
        )
        cooldown.mark(key, now_s)
    for chain in cold:
        snap = snapshots.get(chain)
        if snap is None or len(commands) >= params.max_commands:
            continue
        for n in snap.live_nodes(ttl_s):
            if n.total_kv_blocks <= 0 or 1 - n.free_kv_blocks / n.total_kv_blocks < params.hbm_pressure:
                continue
            in_hbm = snap.prefix.get(n.node_id, (0, 0, 0))[0]
            if in_hbm <= 0:
                continue
            key = (chain[0], "demote", n.node_id)
            if not cooldown.ready(key, now_s, params.cooldown_s):
                continue
            commands.append(
                KvCommand(
                    action="demote",
                    block_keys=list(chain[:in_hbm]),
                    from_node=n.node_id,
                    from_tier="hbm",
                    to_node=n.node_id,
                    to_tier="dram",
                    reason=f"cold prefix; HBM {100 * (1 - n.free_kv_blocks / n.total_kv_blocks):.0f}% used",
                )
            )
            cooldown.mark(key, now_s)
    return commands
