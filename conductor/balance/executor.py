"""The KV command executor's core: what one node does with one command. Pure.

Given a :class:`~schemas.KvCommand`, the node's cache (by Conductor block key), the clock
and the node's memory of the command ids it already answered, :func:`execute` says which
blocks move where (:class:`Step`), which KV events prove it (Conductor form; an engine
that speaks vLLM's wire format re-expresses the steps in its own events), and the
:class:`~schemas.KvCommandResult` to publish. The protocol is in ``schemas/README.md``:

* a command id is carried out once: a repeat gets the first result and no steps;
* a command past its deadline is ``expired`` and changes nothing;
* commands are idempotent on state too: only blocks not yet where the command wants them
  move, so an executor that forgot its ids still changes nothing the second time.

A shared KV pool (a ``store`` node: Mooncake Store) has no process of its own; a node joined
to it (``pool``, a :class:`SharedPool`) acts on it: a ``replicate`` into the pool is pushed
by a holder (``push`` steps: puts), an ``evict`` from it is a forced ``remove`` there.

The I/O (pulling bytes from the holder, sleeping the transfer time, publishing) belongs to
the caller: the emulated engine (``conductor.harness.engine.executor``) and the simulator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas import (
    BlocksMigrated,
    BlocksRemoved,
    BlocksStored,
    KvCommand,
    KvCommandResult,
    KvCommandStatus,
    KvEvent,
    KvFailure,
    Tier,
)

MAX_REMEMBERED = 10_000


class NodeCache(Protocol):
    """An executor's view of its own node's KV cache, keyed by Conductor block keys."""

    def tiers(self) -> Sequence[Tier]:
        """The tiers this node has."""
        ...

    def holds(self, key: int, tier: Tier) -> bool: ...

    def capacity(self, tier: Tier) -> int:
        """Blocks ``tier`` can hold at all (writing may evict others, as the cache does)."""
        ...


class SharedPool(Protocol):
    """The shared KV pool as a node joined to it sees it (for one command's keys)."""

    @property
    def node(self) -> str:
        """The pool's node id in the view (role ``store``)."""
        ...

    @property
    def tier(self) -> Tier:
        """The one tier the pool holds blocks on."""
        ...

    def holds(self, key: int) -> bool: ...

    def capacity(self) -> int:
        """Blocks the pool can hold at all."""
        ...


@dataclass(frozen=True, slots=True)
class Step:
    """One thing the node does, in order: ``pull`` keys from another node's tier into
    ``tier``, ``store`` keys on ``tier`` (a local copy from ``from_tier``), ``push`` keys from
    this node's ``from_tier`` into ``to_node``'s ``tier`` (a shared pool: puts), or ``remove``
    them from ``tier`` (of ``to_node`` when set: a shared pool, a forced remove)."""

    op: Literal["pull", "store", "push", "remove"]
    tier: Tier
    keys: tuple[int, ...]
    from_node: str | None = None
    from_tier: Tier | None = None
    to_node: str | None = None


@dataclass(frozen=True, slots=True)
class Execution:
    result: KvCommandResult
    steps: tuple[Step, ...] = ()
    events: tuple[KvEvent, ...] = ()
    repeat: bool = False
    """The command id was answered before: nothing is to be done, the result is the old one."""


@dataclass
class CommandMemory:
    """The results of the command ids this node answered (bounded, oldest forgotten)."""

    limit: int = MAX_REMEMBERED
    results: OrderedDict[str, KvCommandResult] = field(default_factory=OrderedDict)

    def get(self, command_id: str) -> KvCommandResult | None:
        return self.results.get(command_id)

    def remember(self, result: KvCommandResult) -> None:
        self.results[result.command_id] = result
        self.results.move_to_end(result.command_id)
        while len(self.results) > self.limit:
            self.results.popitem(last=False)


def _result(cmd: KvCommand, node: str, status: KvCommandStatus, *, error: KvFailure | None = None, reason: str = "",
            blocks: int = 0, bytes_moved: int = 0) -> KvCommandResult:
    return KvCommandResult(command_id=cmd.command_id, action=cmd.action, node=node, status=status, error=error,
                           reason=reason, blocks=blocks, bytes_moved=bytes_moved)


def execute(
    cmd: KvCommand,
    *,
    node: str,
    cache: NodeCache,
    now_ms: int,
    memory: CommandMemory,
    source_prefix: int | None = None,
    bytes_per_block: int = 0,
    pool: SharedPool | None = None,
) -> Execution | None:
    """What ``node`` does with ``cmd``; ``None`` when the command is not for this node.

    ``source_prefix`` is how many leading blocks of the command the source holds, when
    the caller knows (the simulator does; an engine may read the view); ``None`` trusts
    the command. ``pool`` is the shared pool this node is joined to, if any (a command
    that names a pool is answered ``unsupported`` by a node not joined to it). The result
    is remembered in ``memory`` (call it once per delivery).
    """
    if cmd.executor != node:
        return None
    old = memory.get(cmd.command_id)
    if old is not None:
        return Execution(old, repeat=True)
    if cmd.deadline_ms is not None and now_ms > cmd.deadline_ms:
        ex = Execution(_result(cmd, node, "expired", reason=f"read {now_ms - cmd.deadline_ms} ms after its deadline"))
    elif _names_a_pool(cmd, node):
        ex = _decide_pool(cmd, node, cache, pool, bytes_per_block)
    else:
        ex = _decide(cmd, node, cache, now_ms, source_prefix, bytes_per_block)
    memory.remember(ex.result)
    return ex


def _names_a_pool(cmd: KvCommand, node: str) -> bool:
    """The command acts on another node than its executor: a shared pool (a replicate pushed
    into it by a holder, an evict or demote of its blocks by an engine joined to it)."""
    if cmd.action == "replicate":
        return cmd.to_node != node
    return cmd.from_node != node


def _decide_pool(cmd: KvCommand, node: str, cache: NodeCache, pool: SharedPool | None,
                 bytes_per_block: int) -> Execution:
    target = cmd.to_node if cmd.action == "replicate" else cmd.from_node
    if pool is None or pool.node != target:
        return Execution(_result(cmd, node, "failed", error="unsupported",
                                 reason=f"this node is not joined to a shared pool named {target}"))
    keys = list(dict.fromkeys(cmd.block_keys))
    if cmd.action == "replicate":
        if cmd.to_tier != pool.tier:
            return Execution(_result(cmd, node, "failed", error="unsupported",
                                     reason=f"the pool {pool.node} holds blocks on {pool.tier}, not {cmd.to_tier}"))
        usable: list[int] = []
        for k in keys:  # a prefix is usable only from its first block: push the leading run held here
            if not (cache.holds(k, cmd.from_tier) or pool.holds(k)):
                break
            usable.append(k)
        moving = tuple(k for k in usable if not pool.holds(k))
        if not moving:
            if usable and len(usable) == len(keys):
                return Execution(_result(cmd, node, "done", reason="already in the pool"))
            if usable:
                return Execution(_result(cmd, node, "done", reason=f"the {len(usable)} leading blocks held here "
                                         "are already in the pool"))
            return Execution(_result(cmd, node, "failed", error="not_held",
                                     reason=f"{node} does not hold the prefix's first block on {cmd.from_tier}"))
        if len(moving) > pool.capacity():
            return Execution(_result(cmd, node, "failed", error="no_room",
                                     reason=f"{len(moving)} blocks do not fit in the pool ({pool.capacity()})"))
        ev = BlocksMigrated(mode="replicate", block_keys=list(moving), from_node=node, from_tier=cmd.from_tier,
                            to_node=pool.node, to_tier=pool.tier)
        return Execution(
            _result(cmd, node, "done", blocks=len(moving), bytes_moved=len(moving) * bytes_per_block),
            steps=(Step("push", pool.tier, moving, node, cmd.from_tier, to_node=pool.node),),
            events=(ev,),
        )
    if cmd.from_tier != pool.tier:
        return Execution(_result(cmd, node, "failed", error="not_held",
                                 reason=f"the pool {pool.node} holds blocks on {pool.tier} only"))
    if cmd.action != "evict":
        # The pool's tier is its last: nothing below it to move the blocks to.
        return Execution(_result(cmd, node, "failed", error="unsupported",
                                 reason=f"the pool {pool.node} has no tier below {pool.tier}: evict instead"))
    there = tuple(k for k in keys if pool.holds(k))
    if not there:
        return Execution(_result(cmd, node, "done", reason="not in the pool"))
    return Execution(
        _result(cmd, node, "done", blocks=len(there)),
        steps=(Step("remove", pool.tier, there, to_node=pool.node),),
        events=(BlocksRemoved(block_keys=list(there), tier=pool.tier, node=pool.node),),
    )


def _decide(cmd: KvCommand, node: str, cache: NodeCache, now_ms: int, source_prefix: int | None,
            bytes_per_block: int) -> Execution:
    have = set(cache.tiers())
    wanted = [t for t in (cmd.from_tier if cmd.action != "replicate" else None, cmd.to_tier) if t is not None]
    missing_tiers = [t for t in wanted if t not in have]
    if missing_tiers:
        return Execution(_result(cmd, node, "failed", error="unsupported",
                                 reason=f"this node has no {'/'.join(missing_tiers)} tier"))
    keys = list(dict.fromkeys(cmd.block_keys))  # a key named twice moves once

    if cmd.action == "replicate":
        to_tier = cmd.to_tier
        assert to_tier is not None and cmd.to_node is not None
        usable = keys if source_prefix is None else keys[: max(0, source_prefix)]
        if not usable:
            if all(cache.holds(k, to_tier) for k in keys):
                return Execution(_result(cmd, node, "done", reason="already held"))
            return Execution(_result(cmd, node, "failed", error="not_held",
                                     reason=f"{cmd.from_node} no longer holds the prefix's first block"))
        moving = tuple(k for k in usable if not cache.holds(k, to_tier))
        if not moving:
            return Execution(_result(cmd, node, "done", reason="already held"))
        if len(moving) > cache.capacity(to_tier):
            return Execution(_result(cmd, node, "failed", error="no_room",
                                     reason=f"{len(moving)} blocks do not fit in {to_tier} ({cache.capacity(to_tier)})"))
        ev = BlocksMigrated(mode="replicate", block_keys=list(moving), from_node=cmd.from_node,
                            from_tier=cmd.from_tier, to_node=node, to_tier=to_tier)
        return Execution(
            _result(cmd, node, "done", blocks=len(moving), bytes_moved=len(moving) * bytes_per_block),
            steps=(Step("pull", to_tier, moving, cmd.from_node, cmd.from_tier),),
            events=(ev,),
        )

    on_source = tuple(k for k in keys if cache.holds(k, cmd.from_tier))
    if cmd.action == "evict":
        if not on_source:
            return Execution(_result(cmd, node, "done", reason="not held"))
        return Execution(
            _result(cmd, node, "done", blocks=len(on_source)),
            steps=(Step("remove", cmd.from_tier, on_source),),
            events=(BlocksRemoved(block_keys=list(on_source), tier=cmd.from_tier),),
        )

    # migrate / demote: a move between two tiers of this node
    to_tier = cmd.to_tier
    assert to_tier is not None
    if not on_source:
        if all(cache.holds(k, to_tier) for k in keys):
            return Execution(_result(cmd, node, "done", reason="already moved"))
        return Execution(_result(cmd, node, "failed", error="not_held",
                                 reason=f"none of the blocks is on {cmd.from_tier}"))
    if to_tier == cmd.from_tier:
        return Execution(_result(cmd, node, "done", reason="source and destination are the same tier"))
    new = tuple(k for k in on_source if not cache.holds(k, to_tier))
    if len(new) > cache.capacity(to_tier):
        return Execution(_result(cmd, node, "failed", error="no_room",
                                 reason=f"{len(new)} blocks do not fit in {to_tier} ({cache.capacity(to_tier)})"))
    steps = (Step("store", to_tier, new, node, cmd.from_tier), Step("remove", cmd.from_tier, on_source))
    if cmd.action == "migrate":
        events: tuple[KvEvent, ...] = (BlocksMigrated(mode="migrate", block_keys=list(on_source), from_node=node,
                                                      from_tier=cmd.from_tier, to_node=node, to_tier=to_tier),)
    else:  # demote: what an offloading engine reports
        events = tuple(e for e in (
            BlocksStored(block_keys=list(new), tier=to_tier) if new else None,
            BlocksRemoved(block_keys=list(on_source), tier=cmd.from_tier),
        ) if e is not None)
    return Execution(
        _result(cmd, node, "done", blocks=len(on_source), bytes_moved=len(new) * bytes_per_block),
        steps=steps,
        events=events,
    )
