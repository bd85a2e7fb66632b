"""The KVCache balance scheduler: replicate hot prefixes, demote cold ones.

Pure: the caller feeds request chains with their time (:meth:`HeatTracker.record`),
reads a view snapshot for each chain the tracker names, and asks :func:`plan` for
the commands to publish on ``kv-commands``. No I/O, no clock.

Heat is an exponentially decayed access count per block (half-life
``half_life_s``), so it weighs both frequency and recency. A prefix is *hot* when
its last block's heat reaches ``hot_threshold``; it is worth replicating when
every instance holding it is overloaded (Mooncake's cache-load balancing: copy
the hot prefix to where there is compute, instead of queueing behind it). A
prefix that was hot and has decayed below ``cold_threshold`` is demoted from HBM
to DRAM on instances whose HBM is under pressure.

Given a cost model (:class:`BalanceCosts`, e.g. a ``ModelProfile``), the replicate
trigger is the cost rule instead of the token bars (the ``kvcache_balancing_threshold``
idea): copy the prefix to the least-loaded instance when the queue it lets a request
skip (the holders' shortest wait minus the target's) exceeds ``balancing_threshold``
times the transfer, and the transfer is cheaper than recomputing the prefix there. Under
overload it stands down: no replica onto a target whose own queue wait (its backlog costed as
``queue_depth`` equal prompts, as the router costs it) exceeds ``stand_down_wait_s``. The
target is the least loaded instance without the prefix, so then every instance is that far
behind: a request sent to the copy still waits out the target's queue, the copy evicts blocks
there and its transfer shares the links with the requests' own KV reads, while the
queue-avoided estimate (one prompt of the summed length) grows quadratically with the queues
and keeps firing between instances that are all about equally behind.

With a shared KV pool in the view (a live ``store`` node: Mooncake Store), a hot prefix is
copied into the pool, pushed by a holder, instead of to one more instance: every prefill
instance can then read it at the pool's speed. The rule (``pool_copies``): the pool is live,
does not hold the whole prefix yet and has room for it, and either the prefix is held by
``pool_min_holders`` instances or more (its demand has spread: one shared copy serves every
other instance), or every holder is overloaded by the same trigger as an instance replica
(with a cost model: the queue avoided exceeds ``balancing_threshold`` times loading the prefix
from the pool, and loading is cheaper than recomputing). A cooled prefix is evicted from
the pool (a forced remove, by a live prefill instance, which must be joined to the pool)
once the pool is ``pool_pressure`` full.

Every command gets a deterministic ``command_id`` (a replay of the same requests plans
the same ids) and a deadline ``command_ttl_s`` after the planning time.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from conductor.topology import Topology
from schemas import KvCommand, Tier
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
    max_tracked: int = Field(default=50_000, ge=1, description="blocks tracked; the least recently used are forgotten")
    max_commands: int = Field(default=32, ge=1, description="commands per planning round")
    command_ttl_s: float = Field(default=10.0, gt=0, description="a command not carried out this long after it "
                                 "was planned expires")
    replica_tier: Tier = Field(default="hbm", description="the tier a replica is written to")
    balancing_threshold: float = Field(default=1.0, gt=0, description="with a cost model: replicate when the queue "
                                       "avoided exceeds this times the transfer time")
    min_avoided_s: float = Field(default=0.5, ge=0, description="with a cost model: ignore queues shorter than this")
    stand_down_wait_s: float | None = Field(default=20.0, gt=0, description="with a cost model: stand down under "
                                            "overload: no replica onto an instance (nor into a pool for an "
                                            "overloaded holder) when the target's own queue wait, its queued "
                                            "prefill costed as equal prompts, already exceeds this; None: never")
    pool_copies: bool = Field(default=True, description="copy hot prefixes into a live shared pool (a store node) "
                              "and evict cooled ones from it")
    pool_min_holders: int = Field(default=2, ge=1, description="a hot prefix held by this many instances is copied "
                                  "into the pool even when no holder is overloaded")
    pool_pressure: float = Field(default=0.8, gt=0, le=1, description="pool use above which cooled prefixes are "
                                 "evicted from it")
    heat_window_s: float = Field(default=60.0, ge=1, description="the balance worker's heat: accesses in the last "
                                 "this many seconds (tumbling windows in Faust tables; the simulator decays instead)")


class BalanceCosts(Protocol):
    """What the cost rule needs of a model profile (``conductor.costmodel.profiles.ModelProfile`` fits)."""

    def prefill_seconds(self, total_tokens: int, cached_tokens: int = 0) -> float: ...

    def transfer_seconds(self, tokens: int, tier: str, remote: bool, same_rack: bool = True) -> float: ...


def command_id(action: str, chain_tip: int, blocks: int, from_node: str, to_node: str | None, now_s: float) -> str:
    """A deterministic id: the same plan on a replay names the same command."""
    text = f"{action}|{chain_tip}|{blocks}|{from_node}|{to_node or ''}|{int(now_s * 1000)}"
    return f"{action[:3]}-{hashlib.blake2b(text.encode(), digest_size=10).hexdigest()}"


@dataclass(slots=True)
class _Block:
    parent: int | None
    heat: float = 0.0
    at_s: float = 0.0


@dataclass
class HeatTracker:
    """Decayed access counts per block; a prefix is named by its deepest block.

    Every request heats each block of its chain (block keys are chained hashes, so a block
    stands for the whole prefix ending at it). The hot prefixes are the chains that end at a
    hot block none of whose children is hot: a system prompt shared by everyone and a
    conversation that keeps coming back are two different prefixes, the second one longer.
    """

    params: BalanceParams = field(default_factory=BalanceParams)
    _blocks: OrderedDict[int, _Block] = field(default_factory=OrderedDict)
    _was_hot: set[int] = field(default_factory=set)
    """Blocks that reached ``hot_threshold`` and were not forgotten: the only ones hot() and
    cold() look at, so a planning round costs the hot set, not every block tracked."""

    def _decay(self, b: _Block, now_s: float) -> float:
        dt = max(0.0, now_s - b.at_s)
        return b.heat * math.pow(0.5, dt / self.params.half_life_s)

    def record(self, chain: Sequence[int], now_s: float) -> None:
        chain = chain[: self.params.max_prefix_blocks]
        blocks = self._blocks
        parent: int | None = None
        for key in chain:
            b = blocks.get(key)
            if b is None:
                b = blocks[key] = _Block(parent)
            b.heat = self._decay(b, now_s) + 1.0
            b.at_s = now_s
            if b.heat >= self.params.hot_threshold:
                self._was_hot.add(key)
            parent = key
        # Deepest first, so a chain's root is the most recently used and is forgotten last.
        for key in reversed(chain):
            blocks.move_to_end(key)
        while len(blocks) > self.params.max_tracked:
            self._was_hot.discard(blocks.popitem(last=False)[0])

    def heat(self, key: int, now_s: float) -> float:
        b = self._blocks.get(key)
        return 0.0 if b is None else self._decay(b, now_s)

    def _chain(self, key: int) -> tuple[int, ...] | None:
        out = [key]
        b = self._blocks[key]
        while b.parent is not None:
            nxt = self._blocks.get(b.parent)
            if nxt is None:
                return None  # an ancestor was forgotten: the prefix is not known from its root
            out.append(b.parent)
            b = nxt
        return tuple(reversed(out))

    def _tips(self, keys: dict[int, float]) -> list[tuple[tuple[int, ...], float]]:
        inner = {self._blocks[k].parent for k in keys}
        out = []
        for k, h in keys.items():
            if k not in inner and (c := self._chain(k)) is not None:
                out.append((c, h))
        return out

    def hot(self, now_s: float) -> list[tuple[tuple[int, ...], float]]:
        """Hot prefixes (each ending at a hot block with no hot child), hottest first."""
        blocks, bar = self._blocks, self.params.hot_threshold
        hot = {k: h for k in self._was_hot if (h := self._decay(blocks[k], now_s)) >= bar}
        return sorted(self._tips(hot), key=lambda x: (-x[1], -len(x[0])))

    def cold(self, now_s: float) -> list[tuple[int, ...]]:
        """Prefixes that were hot once and have cooled below ``cold_threshold``."""
        blocks, bar = self._blocks, self.params.cold_threshold
        cold = {k: h for k in self._was_hot if (h := self._decay(blocks[k], now_s)) < bar}
        return [c for c, _ in self._tips(cold)]

    def forget(self, chain: Sequence[int]) -> None:
        """Stop reporting ``chain`` as cold (its blocks keep their heat)."""
        for key in chain:
            self._was_hot.discard(key)


def sliding_heat(current: float, previous: float, into_window: float) -> float:
    """Accesses in the last window length, from two tumbling windows: all of the current
    one, and the previous one weighted by the share of it still inside that span
    (``into_window`` is how far into the current window ``now`` is, 0..1)."""
    return current + previous * max(0.0, 1.0 - into_window)


def hot_and_cold(
    heat: Mapping[int, float], parents: Mapping[int, int | None], params: BalanceParams
) -> tuple[list[tuple[tuple[int, ...], float]], list[tuple[int, ...]]]:
    """The hot prefixes (hottest first) and the cooled ones, from a heat per block.

    ``parents`` names the blocks that were hot once (with their parent block); ``heat`` gives
    their heat now. As in :class:`HeatTracker`, a prefix is named by its deepest block: the
    hot prefixes end at a hot block with no hot child; the cold ones at a block below
    ``cold_threshold`` with no such child. A chain whose ancestors are not all in ``parents``
    is skipped (its root is not known)."""

    def chain(key: int) -> tuple[int, ...] | None:
        out = [key]
        parent = parents[key]
        while parent is not None:
            if parent not in parents or len(out) > params.max_prefix_blocks:
                return None
            out.append(parent)
            parent = parents[parent]
        return tuple(reversed(out))

    def tips(keys: dict[int, float]) -> list[tuple[tuple[int, ...], float]]:
        inner = {parents[k] for k in keys}
        return [(c, h) for k, h in keys.items() if k not in inner and (c := chain(k)) is not None]

    hot = {k: h for k in parents if (h := heat.get(k, 0.0)) >= params.hot_threshold}
    cold = {k: h for k in parents if (h := heat.get(k, 0.0)) < params.cold_threshold}
    return (sorted(tips(hot), key=lambda x: (-x[1], -len(x[0]))), [c for c, _ in tips(cold)])


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


def _pool_tier(n: NodeState) -> Tier:
    """The tier a shared pool holds blocks on (its heartbeat's one tier; DRAM by default)."""
    return next(iter(n.tier_capacity), "dram")


def _pool_room(n: NodeState) -> tuple[int, int]:
    """(capacity, blocks indexed) of a shared pool's tier; capacity 0 when it reports none."""
    tier = _pool_tier(n)
    return n.tier_capacity.get(tier) or n.total_kv_blocks, n.blocks.get(tier, 0)


def queue_wait_s(costs: BalanceCosts, queued_tokens: int, queue_depth: int) -> float:
    """Prefill time of a backlog of ``queued_tokens`` in ``queue_depth`` requests, costed as that
    many equal prompts (the router's ``queue_wait_s``: one prompt of the summed length would
    overstate the attention term, and the more so the longer the queue)."""
    if queued_tokens <= 0:
        return 0.0
    k = max(1, queue_depth)
    return k * costs.prefill_seconds(round(queued_tokens / k))


def _saturated(target: NodeState, costs: BalanceCosts, params: BalanceParams,
               queued: Callable[[NodeState], int]) -> bool:
    """Whether the would-be replica target's own queue wait exceeds ``stand_down_wait_s``.

    The target is the least loaded instance that lacks the prefix, so when it is saturated
    every candidate is: the cluster is overloaded, and the planner stands down."""
    bound = params.stand_down_wait_s
    return bound is not None and queue_wait_s(costs, queued(target), target.queue_depth) > bound


def plan(
    hot: Sequence[tuple[tuple[int, ...], float]],
    cold: Sequence[tuple[int, ...]],
    snapshots: dict[tuple[int, ...], ViewSnapshot],
    *,
    ttl_s: float,
    now_s: float,
    params: BalanceParams,
    cooldown: Cooldown,
    costs: BalanceCosts | None = None,
    block_size: int = 16,
    reserved: Mapping[str, int] | None = None,
    topology: Topology | None = None,
    kv_bytes_per_block: float = 0.0,
) -> list[KvCommand]:
    """Commands for this round; ``snapshots`` holds a view read for each prefix named.

    ``costs`` switches the replicate trigger from the token bars to the cost rule
    (``block_size`` then converts blocks to tokens). ``reserved`` adds, per node, the
    prefill tokens the routers placed that its heartbeats do not show yet (the routers'
    reservations), so a node that just received a burst counts as loaded. With a
    ``topology``, a replica is copied from the holder with the cheapest path to the target
    (``kv_bytes_per_block`` x the prefix's blocks over the path's link), the least loaded
    holder breaking ties; without one, from the least loaded holder."""
    rnd = _Round(ttl_s=ttl_s, now_s=now_s, params=params, cooldown=cooldown, costs=costs, block_size=block_size,
                 reserved=reserved or {}, topology=topology, kv_bytes_per_block=kv_bytes_per_block)
    for chain, h in hot:
        snap = snapshots.get(chain)
        if snap is not None and not rnd.full():
            rnd.replicate(chain, h, snap)
    for chain in cold:
        snap = snapshots.get(chain)
        if snap is not None and not rnd.full():
            rnd.demote(chain, snap)
    return rnd.commands


@dataclass
class _Round:
    """One round of :func:`plan`: its inputs, shared by the steps, and the commands planned so far."""

    ttl_s: float
    now_s: float
    params: BalanceParams
    cooldown: Cooldown
    costs: BalanceCosts | None
    block_size: int
    reserved: Mapping[str, int]
    topology: Topology | None
    kv_bytes_per_block: float
    commands: list[KvCommand] = field(default_factory=list)
    deadline_ms: int = field(init=False)

    def __post_init__(self) -> None:
        self.deadline_ms = int((self.now_s + self.params.command_ttl_s) * 1000)

    def queued(self, n: NodeState) -> int:
        """The node's queued prefill tokens, the routers' reservations added."""
        return n.queued_prefill_tokens + self.reserved.get(n.node_id, 0)

    def full(self) -> bool:
        return len(self.commands) >= self.params.max_commands

    def replicate(self, chain: tuple[int, ...], heat: float, snap: ViewSnapshot) -> None:
        """A hot prefix: a copy into the shared pool, else onto one more instance, when the rules say so."""
        live = [n for n in snap.live_nodes(self.ttl_s) if _prefill_capable(n)]
        if not live:
            return
        need = len(chain)
        holders = [n for n in live if snap.prefix.get(n.node_id, (0, 0, 0))[1] >= need]
        if not holders:
            return
        if self.params.pool_copies:
            cmd = _pool_copy(chain, heat, snap, live, holders, ttl_s=self.ttl_s, now_s=self.now_s,
                             params=self.params, cooldown=self.cooldown, costs=self.costs,
                             block_size=self.block_size, queued=self.queued, deadline_ms=self.deadline_ms)
            if cmd is not None:
                self.commands.append(cmd)
                return  # one shared copy serves every instance: no instance replica this round
        if len(holders) >= self.params.max_replicas:
            return
        held = {n.node_id for n in holders}
        others = [n for n in live if n.node_id not in held]
        if not others:
            return
        target = min(others, key=lambda n: (self.queued(n), n.node_id))
        source, src_tier, via = self._source(snap, holders, target, need)
        why = self._overloaded(live, holders, source, target, src_tier, need)
        if why is None:
            return
        key = (chain[-1], "replicate", target.node_id)
        if not self.cooldown.ready(key, self.now_s, self.params.cooldown_s):
            return
        self.commands.append(
            KvCommand(
                command_id=command_id("replicate", chain[-1], need, source.node_id, target.node_id, self.now_s),
                action="replicate",
                block_keys=list(chain),
                from_node=source.node_id,
                from_tier=src_tier,
                to_node=target.node_id,
                to_tier=self.params.replica_tier,
                deadline_ms=self.deadline_ms,
                reason=f"hot prefix (heat {heat:.1f}); {why}{via}",
            )
        )
        self.cooldown.mark(key, self.now_s)

    def _source(self, snap: ViewSnapshot, holders: Sequence[NodeState], target: NodeState,
                need: int) -> tuple[NodeState, Tier, str]:
        """The holder a replica is copied from, its tier, and the path's words for the reason: the
        cheapest path to ``target`` with a topology, else (and on a tie) the least loaded holder."""
        queued = self.queued
        if self.topology is None:
            source = min(holders, key=lambda n: (queued(n), n.node_id))
            via = ""
        else:
            topology, nbytes = self.topology, self.kv_bytes_per_block * need
            source = min(holders, key=lambda n: (topology.link_between(n, target).seconds(nbytes), queued(n),
                                                 n.node_id))
            path = topology.link_between(source, target)
            via = f"; copied over {path.transport} {path.bandwidth_gbps:g} Gb/s"
        src_tier: Tier = "hbm" if snap.prefix[source.node_id][0] >= need else "dram"
        return source, src_tier, via

    def _overloaded(self, live: Sequence[NodeState], holders: Sequence[NodeState], source: NodeState,
                    target: NodeState, src_tier: Tier, need: int) -> str | None:
        """Why a replica from ``source`` onto ``target`` is worth it (the token bars, or with a cost
        model the cost rule and the stand-down); ``None`` when it is not."""
        queued, params, costs = self.queued, self.params, self.costs
        if costs is None:
            mean = sum(queued(n) for n in live) / len(live)
            bar = max(params.overload_tokens, params.overload_factor * mean)
            if min(queued(n) for n in holders) < bar or queued(target) >= bar:
                return None  # some holder still has room (routing will use it), or nowhere better to go
            return f"all {len(holders)} holder(s) have >= {bar:.0f} queued prefill tokens"
        tokens = need * self.block_size
        if _saturated(target, costs, params, queued):
            return None  # stand down: the target is saturated itself, a copy would only move the wait
        avoided = costs.prefill_seconds(queued(source)) - costs.prefill_seconds(queued(target))
        transfer = costs.transfer_seconds(tokens, src_tier, remote=True)
        recompute = costs.prefill_seconds(tokens)
        if avoided < params.min_avoided_s or avoided <= params.balancing_threshold * transfer \
                or transfer >= recompute:
            return None
        return f"transfer {transfer:.3f} s < queue avoided {avoided:.2f} s and < recompute {recompute:.2f} s"

    def demote(self, chain: tuple[int, ...], snap: ViewSnapshot) -> None:
        """A cooled prefix: out of HBM on every live node under HBM pressure, and out of a full pool."""
        params = self.params
        for n in snap.live_nodes(self.ttl_s):
            if n.total_kv_blocks <= 0 or 1 - n.free_kv_blocks / n.total_kv_blocks < params.hbm_pressure:
                continue
            in_hbm = snap.prefix.get(n.node_id, (0, 0, 0))[0]
            if in_hbm <= 0:
                continue
            key = (chain[-1], "demote", n.node_id)
            if not self.cooldown.ready(key, self.now_s, params.cooldown_s):
                continue
            self.commands.append(
                KvCommand(
                    command_id=command_id("demote", chain[-1], in_hbm, n.node_id, None, self.now_s),
                    action="demote",
                    block_keys=list(chain[:in_hbm]),
                    from_node=n.node_id,
                    from_tier="hbm",
                    to_tier="dram",
                    deadline_ms=self.deadline_ms,
                    reason=f"cold prefix; HBM {100 * (1 - n.free_kv_blocks / n.total_kv_blocks):.0f}% used",
                )
            )
            self.cooldown.mark(key, self.now_s)
        if params.pool_copies and not self.full():
            cmd = _pool_evict(chain, snap, ttl_s=self.ttl_s, now_s=self.now_s, params=params, cooldown=self.cooldown,
                              queued=self.queued, deadline_ms=self.deadline_ms)
            if cmd is not None:
                self.commands.append(cmd)


def _pool_copy(
    chain: tuple[int, ...], heat: float, snap: ViewSnapshot, live: Sequence[NodeState], holders: Sequence[NodeState],
    *, ttl_s: float, now_s: float, params: BalanceParams, cooldown: Cooldown, costs: BalanceCosts | None,
    block_size: int, queued: Callable[[NodeState], int], deadline_ms: int,
) -> KvCommand | None:
    """A ``replicate`` of ``chain`` into a live shared pool, pushed by its least loaded holder,
    when the module's pool rule says so; ``None`` otherwise."""
    need = len(chain)
    pools = []
    for n in snap.live_nodes(ttl_s):
        if n.role != "store" or snap.prefix.get(n.node_id, (0, 0, 0))[1] >= need:
            continue
        cap, used = _pool_room(n)
        if cap - used >= need - snap.prefix.get(n.node_id, (0, 0, 0))[1]:
            pools.append((cap - used, n))
    if not pools:
        return None
    pool = max(pools, key=lambda x: (x[0], x[1].node_id))[1]  # the roomiest
    source = min(holders, key=lambda n: (queued(n), n.node_id))
    src_tier: Tier = "hbm" if snap.prefix[source.node_id][0] >= need else "dram"
    pool_tier = _pool_tier(pool)
    held = {n.node_id for n in holders}
    others = [n for n in live if n.node_id not in held]
    target = min(others, key=lambda n: (queued(n), n.node_id)) if others else None
    if len(holders) >= params.pool_min_holders:
        why = f"held by {len(holders)} instances"
    elif target is None:
        return None
    elif costs is None:
        mean = sum(queued(n) for n in live) / len(live)
        bar = max(params.overload_tokens, params.overload_factor * mean)
        if min(queued(n) for n in holders) < bar or queued(target) >= bar:
            return None
        why = f"all {len(holders)} holder(s) have >= {bar:.0f} queued prefill tokens"
    else:
        if _saturated(target, costs, params, queued):
            return None  # stand down: the instances that would read the copy are saturated too
        tokens = need * block_size
        avoided = costs.prefill_seconds(queued(source)) - costs.prefill_seconds(queued(target))
        load = costs.transfer_seconds(tokens, pool_tier, remote=True)
        recompute = costs.prefill_seconds(tokens)
        if avoided < params.min_avoided_s or avoided <= params.balancing_threshold * load or load >= recompute:
            return None
        why = f"loading from the pool {load:.3f} s < queue avoided {avoided:.2f} s and < recompute {recompute:.2f} s"
    key = (chain[-1], "replicate", pool.node_id)
    if not cooldown.ready(key, now_s, params.cooldown_s):
        return None
    cooldown.mark(key, now_s)
    return KvCommand(
        command_id=command_id("replicate", chain[-1], need, source.node_id, pool.node_id, now_s),
        action="replicate",
        block_keys=list(chain),
        from_node=source.node_id,
        from_tier=src_tier,
        to_node=pool.node_id,
        to_tier=pool_tier,
        by_node=source.node_id,
        deadline_ms=deadline_ms,
        reason=f"hot prefix (heat {heat:.1f}) into the shared pool; {why}",
    )


def _pool_evict(
    chain: tuple[int, ...], snap: ViewSnapshot, *, ttl_s: float, now_s: float, params: BalanceParams,
    cooldown: Cooldown, queued: Callable[[NodeState], int], deadline_ms: int,
) -> KvCommand | None:
    """An ``evict`` of a cooled ``chain`` from a shared pool that is ``pool_pressure`` full,
    carried out by the least loaded live prefill instance; ``None`` otherwise."""
    live = snap.live_nodes(ttl_s)
    engines = [n for n in live if _prefill_capable(n)]
    for pool in live:
        if pool.role != "store" or snap.prefix.get(pool.node_id, (0, 0, 0))[1] <= 0 or not engines:
            continue
        cap, used = _pool_room(pool)
        if cap <= 0 or used / cap < params.pool_pressure:
            continue
        key = (chain[-1], "evict", pool.node_id)
        if not cooldown.ready(key, now_s, params.cooldown_s):
            continue
        cooldown.mark(key, now_s)
        by = min(engines, key=lambda n: (queued(n), n.node_id))
        return KvCommand(
            command_id=command_id("evict", chain[-1], len(chain), pool.node_id, by.node_id, now_s),
            action="evict",
            block_keys=list(chain),
            from_node=pool.node_id,
            from_tier=_pool_tier(pool),
            by_node=by.node_id,
            deadline_ms=deadline_ms,
            reason=f"cold prefix; the shared pool is {100 * used / cap:.0f}% full",
        )
    return None
