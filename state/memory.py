"""The view in process memory: the reference store, and the simulator's view.

Synchronous use (the simulator's discrete-event loop; no event loop needed)::

    store = InMemoryViewStore()
    outcome = store.apply_sync(envelope)             # fold + apply one record; no fence
    outcome = store.apply_sync(envelope, position)   # ... fenced by its source position
    snap = store.snapshot_sync(chain, now_ms)        # ViewSnapshot for a chain of block keys
    snap.prefix["node-3"]                            # (hbm, hbm+dram, hbm+dram+ssd) blocks
    snap.live_nodes(ttl_s)                           # nodes whose heartbeat is fresh at now_ms

``apply_ops_sync(ops, position)`` applies operations already folded (``state.fold``) and
is the bulk path for synthetic views. The async methods implement
:class:`state.view.ViewStore` with the same semantics, for the contract tests and for
code written against the protocol.

Cost: a stored/removed event is a dict and a set update per block; a snapshot walks the
chain once with integer masks (one bit per node and tier) and stops at the first block
no node holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any

from schemas import Envelope

from .fold import (
    APPLIED,
    TIER_NAMES,
    AddBlocks,
    ClearNode,
    NodeStream,
    Op,
    RemoveBlocks,
    SetHeartbeat,
    SetStream,
    fold,
)
from .view import (
    APPLIED_GROUP,
    CONFLICT,
    FENCED_GROUP,
    NodeState,
    SourcePosition,
    ViewSnapshot,
    longest_prefixes,
)

FENCED = "fenced"


class _Node:
    __slots__ = ("node_id", "slot", "hb", "stream", "keys", "cached")

    def __init__(self, node_id: str, slot: int) -> None:
        self.node_id = node_id
        self.slot = slot
        self.hb: dict[str, Any] = {}
        self.stream = NodeStream()
        self.keys: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self.cached: NodeState | None = None

    def state(self) -> NodeState:
        if self.cached is None:
            hb = self.hb
            st = self.stream
            self.cached = NodeState(
                node_id=self.node_id,
                role=hb.get("role", "prefill"),
                epoch=max(st.epoch, 0),
                last_seq=st.seq,
                seq_gaps=st.gaps,
                blocks={t: len(k) for t, k in zip(TIER_NAMES, self.keys) if k},
                **{k: v for k, v in hb.items() if k != "role"},
            )
        return self.cached


class InMemoryViewStore:
    """A :class:`state.view.ViewStore` in plain dicts and sets."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._slots: dict[int, str] = {}
        self._blocks: dict[int, int] = {}  # block key → bit 3*slot+tier per holder
        self._watermark: dict[str, int] = {}
        self._missed: dict[str, int] = {}

    # --- writing ------------------------------------------------------------

    def _node(self, node_id: str) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            n = _Node(node_id, len(self._slots))
            self._nodes[node_id] = n
            self._slots[n.slot] = node_id
        return n

    def _fenced(self, pos: SourcePosition | None) -> bool:
        return pos is not None and pos.offset <= self._watermark.get(pos.key, -1)

    def apply_sync(self, env: Envelope, pos: SourcePosition | None = None) -> str:
        """Fold one record with the stored stream state and apply it; return its outcome."""
        if self._fenced(pos):
            return FENCED
        n = self._nodes.get(env.producer_id)
        f = fold(env, n.stream if n is not None else None)
        if f.outcome == APPLIED:
            self._apply(f.ops)
        if pos is not None:
            self._watermark[pos.key] = pos.offset
        return f.outcome

    def apply_ops_sync(self, ops: Iterable[Op], pos: SourcePosition | None = None) -> bool:
        """Apply folded operations of one record; False if its position was already applied
        or its stream precondition no longer holds (see :meth:`apply_group_sync`)."""
        return self.apply_group_sync(ops, pos) == APPLIED_GROUP

    def apply_group_sync(self, ops: Iterable[Op], pos: SourcePosition | None = None) -> int:
        """Apply one record's operations: ``APPLIED_GROUP``, ``FENCED_GROUP`` (position already
        applied) or ``CONFLICT`` (a ``SetStream.prev`` differs from the stored stream)."""
        if self._fenced(pos):
            return FENCED_GROUP
        ops = tuple(ops)
        for op in ops:
            if isinstance(op, SetStream) and op.prev is not None and self.stream_sync(op.node).part(op.part) != op.prev.part(op.part):
                return CONFLICT
        self._apply(ops)
        if pos is not None:
            self._watermark[pos.key] = pos.offset
        return APPLIED_GROUP

    def _apply(self, ops: Iterable[Op]) -> None:
        blocks = self._blocks
        for op in ops:
            if isinstance(op, AddBlocks):
                n = self._node(op.node)
                bit = 1 << (3 * n.slot + op.tier)
                held = n.keys[op.tier]
                for k in op.keys:
                    if k not in held:
                        held.add(k)
                        blocks[k] = blocks.get(k, 0) | bit
                n.cached = None
            elif isinstance(op, RemoveBlocks):
                n = self._node(op.node)
                keep = ~(1 << (3 * n.slot + op.tier))
                held = n.keys[op.tier]
                for k in op.keys:
                    if k in held:
                        held.discard(k)
                        m = blocks[k] & keep
                        if m:
                            blocks[k] = m
                        else:
                            del blocks[k]
                n.cached = None
            elif isinstance(op, ClearNode):
                n = self._node(op.node)
                for tier, held in enumerate(n.keys):
                    keep = ~(1 << (3 * n.slot + tier))
                    for k in held:
                        m = blocks[k] & keep
                        if m:
                            blocks[k] = m
                        else:
                            del blocks[k]
                    held.clear()
                n.cached = None
            elif isinstance(op, SetHeartbeat):
                n = self._node(op.node)
                n.hb = op.state
                n.cached = None
            elif isinstance(op, SetStream):
                n = self._node(op.node)
                new, cur = op.stream, n.stream
                if op.part == "hb":
                    n.stream = replace(cur, hb_epoch=new.hb_epoch, hb_seq=new.hb_seq)
                else:
                    n.stream = replace(new, hb_epoch=cur.hb_epoch, hb_seq=cur.hb_seq)
                n.cached = None
            else:  # pragma: no cover - the Op union is closed
                raise TypeError(f"unknown view operation {op!r}")

    def clear_sync(self) -> None:
        self.__init__()  # type: ignore[misc]

    # --- reading ------------------------------------------------------------

    def snapshot_sync(self, chain: Sequence[int], now_ms: int) -> ViewSnapshot:
        """Every node's state and its longest cached prefix of ``chain`` (block keys)."""
        get = self._blocks.get
        prefix = longest_prefixes((get(k, 0) for k in chain), self._slots) if chain else {}
        return ViewSnapshot(
            now_ms=now_ms,
            nodes=tuple(n.state() for n in self._nodes.values()),
            prefix=prefix,
            watermark=dict(self._watermark),
        )

    def nodes_sync(self) -> list[NodeState]:
        return [n.state() for n in self._nodes.values()]

    def stream_sync(self, node_id: str) -> NodeStream:
        n = self._nodes.get(node_id)
        return n.stream if n is not None else NodeStream()

    def holders(self, key: int) -> dict[str, tuple[str, ...]]:
        """Which nodes hold block ``key``, in which tiers."""
        m = self._blocks.get(key, 0)
        out: dict[str, tuple[str, ...]] = {}
        for slot, node in self._slots.items():
            tiers = tuple(TIER_NAMES[t] for t in range(3) if m >> (3 * slot + t) & 1)
            if tiers:
                out[node] = tiers
        return out

    def dump_sync(self) -> dict[str, Any]:
        return canonical_dump(
            (n.state() for n in self._nodes.values()),
            {n.node_id: n.stream for n in self._nodes.values()},
            ((k, self.holders(k)) for k in self._blocks),
            self._watermark,
        )

    # --- the async ViewStore protocol ----------------------------------------

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:

        return self.snapshot_sync(chain, int(time.time() * 1000) if now_ms is None else now_ms)

    async def nodes(self) -> list[NodeState]:
        return self.nodes_sync()

    async def watermark(self) -> dict[str, int]:
        return dict(self._watermark)

    async def dump(self) -> dict[str, Any]:
        return self.dump_sync()

    async def apply(self, records: Sequence[tuple[Envelope, SourcePosition | None]]) -> list[str]:
        return [self.apply_sync(env, pos) for env, pos in records]

    async def apply_ops(self, batch: Sequence[tuple[SourcePosition | None, Sequence[Op]]]) -> int:
        return sum(self.apply_ops_sync(ops, pos) for pos, ops in batch)

    async def apply_groups(self, batch: Sequence[tuple[SourcePosition | None, Sequence[Op]]]) -> list[int]:
        """Like :meth:`apply_ops`, with a flag per group; after a conflict, nothing more is
        applied (see ``state.view.ViewStore.apply_groups``)."""
        flags: list[int] = []
        for pos, ops in batch:
            flags.append(self.apply_group_sync(ops, pos) if CONFLICT not in flags[-1:] else CONFLICT)
        return flags

    async def streams(self, node_ids: Sequence[str]) -> dict[str, NodeStream]:
        return {n: self._nodes[n].stream for n in node_ids if n in self._nodes}

    async def clear(self) -> None:
        self.clear_sync()


def canonical_dump(
    nodes: Iterable[NodeState],
    streams: dict[str, NodeStream],
    blocks: Iterable[tuple[int, dict[str, tuple[str, ...]]]],
    watermark: dict[str, int],
) -> dict[str, Any]:
    """The comparable picture both stores return from ``dump()``: plain, sorted, JSON-able."""
    node_out = {}
    for n in sorted(nodes, key=lambda n: n.node_id):
        d = asdict(n)
        d["blocks"] = {t: c for t, c in sorted(d["blocks"].items()) if c}
        d["tier_capacity"] = dict(sorted(d["tier_capacity"].items()))
        d["missed"] = streams.get(n.node_id, NodeStream()).missed
        node_out[n.node_id] = d
    block_out = {
        f"{k:016x}": {node: list(t) for node, t in sorted(h.items())} for k, h in blocks if h
    }
    return {
        "nodes": node_out,
        "blocks": dict(sorted(block_out.items())),
        "watermark": dict(sorted(watermark.items())),
    }
