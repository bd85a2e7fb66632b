"""The view in process memory: the reference store, and the simulator's view.

Synchronous use (the simulator's discrete-event loop; no event loop needed)::

    store = InMemoryViewStore()
    outcome = store.apply_sync(envelope)             # fold + write one record; no fence
    outcome = store.apply_sync(envelope, position)   # ... fenced by its source position
    snap = store.snapshot_sync(chain, now_ms)        # ViewSnapshot for a chain of block keys
    snap.prefix["node-3"]                            # (hbm, hbm+dram, hbm+dram+ssd) blocks
    snap.live_nodes(ttl_s)                           # nodes whose heartbeat is fresh at now_ms

``apply_sync`` goes through the same fold-and-write passes as every store
(``state.write``); ``apply_groups_sync(batch)`` writes operations already folded
(``state.fold``) and is the bulk path for synthetic views. The async methods implement
:class:`state.view.ViewStore` with the same semantics, for the contract tests and for
code written against the protocol.

Cost: a stored/removed event is a dict and a set update per block; a snapshot walks the
chain once with integer masks (one bit per node and tier) and stops at the first block
no node holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from schemas import TIERS, Envelope

from .fold import AddBlocks, ClearNode, NodeStream, Op, RemoveBlocks, SetHeartbeat, SetStream
from .view import NodeState, Outcome, SourcePosition, ViewSnapshot, canonical_dump, longest_prefixes, mask_holders
from .write import Group, Record, fold_and_write_sync


class _Node:
    __slots__ = ("cached", "hb", "keys", "node_id", "slot", "stream")

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
                blocks={t: len(k) for t, k in zip(TIERS, self.keys) if k},
                **{k: v for k, v in hb.items() if k != "role"},
            )
        return self.cached


class InMemoryViewStore:
    """A :class:`state.view.ViewStore` in plain dicts and sets."""

    def __init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._slots: dict[int, str] = {}
        self._blocks: dict[int, int] = {}  # block key → bit 3*slot+tier per holder
        self._watermark: dict[str, int] = {}

    # --- writing ------------------------------------------------------------

    def _node(self, node_id: str) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            n = _Node(node_id, len(self._slots))
            self._nodes[node_id] = n
            self._slots[n.slot] = node_id
        return n

    def apply_sync(self, env: Envelope, pos: SourcePosition | None = None) -> Outcome:
        """Fold one record with the stored stream state and write it; return its outcome."""
        return self.apply_records_sync([(env, pos)])[0]

    def apply_records_sync(self, records: Sequence[Record]) -> list[Outcome]:
        """:meth:`apply` without an event loop."""
        return fold_and_write_sync(self.streams_sync, self.apply_groups_sync, records).outcomes()

    def apply_groups_sync(self, batch: Sequence[Group]) -> list[Outcome]:
        """:meth:`apply_groups` without an event loop."""
        out: list[Outcome] = []
        for pos, ops in batch:
            if pos is not None:
                cur = self._watermark.get(pos.key)
                if cur is not None and pos.offset <= cur:
                    out.append(Outcome.FENCED)
                    continue
                if pos.after is not None and (-1 if cur is None else cur) != pos.after:
                    return out + [Outcome.HOLE] + [Outcome.CONFLICT] * (len(batch) - len(out) - 1)
            if self._moved(ops):
                return out + [Outcome.CONFLICT] * (len(batch) - len(out))
            self._apply(ops)
            if pos is not None:
                self._watermark[pos.key] = pos.offset
            out.append(Outcome.APPLIED)
        return out

    def _moved(self, ops: Sequence[Op]) -> bool:
        """Whether a ``SetStream.prev`` among ``ops`` differs from the stored stream."""
        for op in ops:
            if type(op) is SetStream and op.prev is not None:
                n = self._nodes.get(op.node)
                if (n.stream if n is not None else NodeStream()).part(op.part) != op.prev.part(op.part):
                    return True
        return False

    def streams_sync(self, node_ids: Sequence[str]) -> dict[str, NodeStream]:
        return {n: self._nodes[n].stream for n in node_ids if n in self._nodes}

    def _apply(self, ops: Sequence[Op]) -> None:
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
        self._empty()

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

    def holders(self, key: int) -> dict[str, tuple[str, ...]]:
        """Which nodes hold block ``key``, in which tiers."""
        return mask_holders(self._blocks.get(key, 0), self._slots)

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

    async def apply(self, records: Sequence[Record]) -> list[Outcome]:
        return self.apply_records_sync(records)

    async def apply_groups(self, batch: Sequence[Group]) -> list[Outcome]:
        return self.apply_groups_sync(batch)

    async def streams(self, node_ids: Sequence[str]) -> dict[str, NodeStream]:
        return self.streams_sync(node_ids)

    async def clear(self) -> None:
        self.clear_sync()

