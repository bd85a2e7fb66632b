"""The read side of the cache-location view: what a store returns to the router.

Both stores (in memory and Redis) return these types; the routing worker turns
a :class:`ViewSnapshot` into the policy's ``conductor.routing.snapshot.ClusterSnapshot``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from schemas import TIERS, Role, Tier

TIER_INDEX: dict[str, int] = {t: i for i, t in enumerate(TIERS)}
"""Tier → its bit within a node's three (``3*slot + tier``): the order of ``schemas.TIERS``,
fastest first, which is also the order prefixes accumulate in (HBM, +DRAM, +SSD)."""


@dataclass(frozen=True, slots=True)
class SourcePosition:
    """Where a record came from: the fence that makes re-delivery harmless."""

    topic: str
    partition: int
    offset: int
    after: int | None = None
    """The fence this record continues from: the offset of the partition's record before it
    in the log, ``-1`` for the partition's first record (the view must then hold no fence for
    the partition). The write is refused (``Outcome.HOLE``) unless the view's fence is exactly
    that, so a view that lost writes (Redis flushed, restarted empty, a lagging replica
    promoted) is never written on as if it had them. ``None``: not checked (bulk loads, a
    replay into a namespace of its own); a missing fence then reads as -1."""

    @property
    def key(self) -> str:
        return f"{self.topic}:{self.partition}"


@dataclass(frozen=True, slots=True)
class NodeState:
    """Everything the view knows about one node (from its heartbeats and KV events)."""

    node_id: str
    role: Role
    model: str = "default"
    epoch: int = 0
    last_seq: int = -1
    last_heartbeat_ms: int = 0
    heartbeat_interval_s: float = 1.0
    queue_depth: int = 0
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    batch_size: int = 0
    decode_context_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    tier_capacity: dict[Tier, int] = field(default_factory=dict)
    rack: str | None = None
    zone: str | None = None
    endpoint: str | None = None
    """The engine's serving base URL, as its heartbeats announce it (discovery)."""
    dp_rank: int | None = None
    bootstrap_port: int | None = None
    kv_transfer: bool | None = None
    """Whether it runs a KV connector (``schemas.can_hand_off``); None: by role."""
    kv_events: bool | None = None
    """False: the node publishes no KV events (its bridge runs ``--no-events``), so ``blocks`` stays
    empty and a router knows its blocks only from decisions (pending blocks, at most
    ``total_kv_blocks`` of them where known). None: it publishes them (or its heartbeats predate v4)."""
    blocks: dict[Tier, int] = field(default_factory=dict)
    """Blocks the view indexes for this node, per tier."""
    seq_gaps: int = 0

    @property
    def publishes_kv_events(self) -> bool:
        """Whether the view learns this node's blocks from its own KV events."""
        return self.kv_events is not False

    def is_live(self, now_ms: int, ttl_s: float) -> bool:
        return self.last_heartbeat_ms > 0 and now_ms - self.last_heartbeat_ms <= ttl_s * 1000


@dataclass(frozen=True, slots=True)
class ViewSnapshot:
    """One consistent-enough read for one request chain."""

    now_ms: int
    """The store's clock at read time (Redis TIME), so liveness uses one clock."""
    nodes: tuple[NodeState, ...]
    prefix: dict[str, tuple[int, int, int]]
    """node id → longest contiguous prefix of the chain the node holds, in blocks, counting
    HBM only / HBM+DRAM / HBM+DRAM+SSD. Nodes holding no prefix may be absent. Read-only: a
    reader may hand out one answer for every read of a hot chain (``state.keys.PrefixWalk``)."""
    watermark: dict[str, int]
    """``topic:partition`` → highest applied offset."""

    def live_nodes(self, ttl_s: float) -> tuple[NodeState, ...]:
        return tuple(n for n in self.nodes if n.is_live(self.now_ms, ttl_s))


class ViewReader(Protocol):
    """The read half of a view store, which is all the router needs."""

    async def snapshot(self, chain: Sequence[int], *, now_ms: int | None = None) -> ViewSnapshot:
        """Every node's state and its longest prefix of ``chain``, in one round trip."""
        ...

    async def nodes(self) -> list[NodeState]: ...

    async def watermark(self) -> dict[str, int]: ...

    async def dump(self) -> dict[str, Any]:
        """A canonical, comparable picture of the whole view (for rebuild checks and tests)."""
        ...


# --- the write side -----------------------------------------------------------------


class Outcome(StrEnum):
    """What became of one record (or one group of folded operations) written to the view.

    The values are also the ``outcome`` labels of the pipeline's counters."""

    APPLIED = "applied"
    """Its effects and its position are in the view."""
    DUPLICATE = "duplicate"
    """At or below its node's last applied ``(epoch, seq)``: nothing to do (the fold says so)."""
    OLD_EPOCH = "old_epoch"
    """From an epoch before its node's current one (a straggler from before a restart)."""
    FENCED = "fenced"
    """Its position is at or below the view's fence for its ``topic:partition``: done before."""
    CONFLICT = "conflict"
    """Refused: the node's stream state moved since the record was folded (another writer);
    fold it again (see ``SetStream.prev``)."""
    HOLE = "hole"
    """Refused: the view's fence for its partition is not the one the record continues from
    (``SourcePosition.after``): the view lost writes, or the record skipped some; read the
    hole back from the log."""
    LOST = "lost"
    """Refused: the view's generation is not the writer's (the view was lost or replaced
    since the writer looked): rebuild every partition from the log."""


MAX_REFOLDS = 20
"""Fold-and-write passes over one batch whose streams keep moving before a writer gives up
(with ``ViewStoreError``, which the stream worker retries with backoff)."""


class ViewStore(ViewReader, Protocol):
    """A view that can also be written: what the stream worker and ``view rebuild`` use.

    Every write carries the source position of its record; a record at or below the
    recorded offset of its ``topic:partition`` is skipped in the same atomic step, so
    re-delivery and replays change nothing. ``pos=None`` means "no fence" (simulator,
    synthetic loads).
    """

    async def apply(self, records: Sequence[tuple[Any, SourcePosition | None]]) -> list[Outcome]:
        """Fold ``(Envelope, position)`` pairs in order from the view's own stream state and
        write them (``state.write.fold_and_write``); return each one's outcome (``APPLIED``,
        ``DUPLICATE``, ``OLD_EPOCH`` or ``FENCED``)."""
        ...

    async def apply_groups(self, batch: Sequence[tuple[SourcePosition | None, Sequence[Any]]]) -> list[Outcome]:
        """Write already-folded operations (``state.fold`` ops), one group per record, in order
        and each atomically with its position; report each group ``APPLIED``, ``FENCED`` or
        ``CONFLICT`` (a ``SetStream`` precondition failed: the node's stream moved since the
        fold read it). A conflicting group changes nothing, and every group after it in the
        batch is reported ``CONFLICT`` and left unapplied too (they were folded on the same
        assumption, and applying a later offset would fence the conflicting record out); the
        caller re-reads the stream state and folds them again. Groups with no ``prev``
        (bulk loads, ``pos=None``) never conflict."""
        ...

    async def streams(self, node_ids: Sequence[str]) -> dict[str, Any]:
        """The stored ``state.fold.NodeStream`` of each known node among ``node_ids``."""
        ...

    async def clear(self) -> None:
        """Remove the whole view (this namespace only)."""
        ...


@runtime_checkable
class GenerationalView(Protocol):
    """A view with a generation (``ns|gen``; :class:`state.redis_view.RedisViewStore`): a view
    lost or replaced shows a new or missing generation, and is read back from the log."""

    generation: str | None
    """The generation this store's writes are folded on."""

    async def fences(self) -> tuple[str | None, dict[str, int]]:
        """(the view's generation or None, its fences), read in one atomic step."""
        ...

    async def adopt_generation(self, partitions: Sequence[str] = ()) -> tuple[str, bool]:
        """Fold this store's writes on the view's generation, created when absent (then
        ``partitions`` are marked as being rebuilt in the same step); (generation, created)."""
        ...


@runtime_checkable
class RebuildingView(GenerationalView, Protocol):
    """A view with a generation that also records which partitions are still being read back."""

    async def rebuild_pending(self) -> dict[str, int]:
        """Partitions still being rebuilt → the offset each must reach (-1: not yet known)."""
        ...

    async def mark_rebuilding(self, targets: dict[str, int], generation: str) -> None:
        """Record the end offset each partition must reach (only under ``generation``)."""
        ...


# --- the prefix walk, shared by both stores ---------------------------------------


def longest_prefixes(masks: Iterable[int], slot_nodes: dict[int, str]) -> dict[str, tuple[int, int, int]]:
    """Per node, the longest contiguous prefix of a chain it holds, cumulatively per tier.

    ``masks`` yields, block by block along the chain, an integer whose bit
    ``3*slot + tier`` (tier 0 hbm, 1 dram, 2 ssd) is set when the node in ``slot`` holds
    the block in that tier. Only slots named in ``slot_nodes`` count (a cleared node's
    old slot does not). Stops at the first block no node holds.
    """
    if not slot_nodes:
        return {}
    m0 = 0
    for s in slot_nodes:
        m0 |= 1 << (3 * s)
    a1 = a2 = a3 = m0  # slots still holding the whole prefix so far, per cumulative tier
    ends: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
    i = 0
    for x in masks:
        h = x & m0
        hd = h | ((x >> 1) & m0)
        n3 = hd | ((x >> 2) & m0)
        if (a1 & ~h) | (a2 & ~hd) | (a3 & ~n3):  # most blocks end no node's prefix: skip the bookkeeping
            for alive, now, end in ((a1, h, ends[0]), (a2, hd, ends[1]), (a3, n3, ends[2])):
                dropped = alive & ~now
                while dropped:
                    low = dropped & -dropped
                    end[(low.bit_length() - 1) // 3] = i
                    dropped ^= low
            a1 &= h
            a2 &= hd
            a3 &= n3
        i += 1
        if not a3:
            break
    out: dict[str, tuple[int, int, int]] = {}
    for s, node in slot_nodes.items():
        n3 = ends[2].get(s, i)
        if n3 > 0:
            out[node] = (ends[0].get(s, i), ends[1].get(s, i), n3)
    return out


def mask_holders(mask: int, slot_nodes: dict[int, str]) -> dict[str, tuple[str, ...]]:
    """Which nodes a block's mask names, in which tiers (names from ``schemas.TIERS``)."""
    out: dict[str, tuple[str, ...]] = {}
    for slot, node in slot_nodes.items():
        tiers = tuple(t for i, t in enumerate(TIERS) if mask >> (3 * slot + i) & 1)
        if tiers:
            out[node] = tiers
    return out


def canonical_dump(
    nodes: Iterable[NodeState],
    streams: dict[str, Any],
    blocks: Iterable[tuple[int, dict[str, tuple[str, ...]]]],
    watermark: dict[str, int],
) -> dict[str, Any]:
    """The comparable picture both stores return from ``dump()``: plain, sorted, JSON-able.
    ``streams`` maps node → its ``state.fold.NodeStream``."""
    node_out = {}
    for n in sorted(nodes, key=lambda n: n.node_id):
        d = asdict(n)
        d["blocks"] = {t: c for t, c in sorted(d["blocks"].items()) if c}
        d["tier_capacity"] = dict(sorted(d["tier_capacity"].items()))
        st = streams.get(n.node_id)
        d["missed"] = st.missed if st is not None else 0
        node_out[n.node_id] = d
    block_out = {
        f"{k:016x}": {node: list(t) for node, t in sorted(h.items())} for k, h in blocks if h
    }
    return {
        "nodes": node_out,
        "blocks": dict(sorted(block_out.items())),
        "watermark": dict(sorted(watermark.items())),
    }
