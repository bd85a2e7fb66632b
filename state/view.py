"""The read side of the cache-location view: what a store returns to the router.

Both stores (in memory and Redis) return these types; the routing worker turns
a :class:`ViewSnapshot` into the policy's ``conductor.snapshot.ClusterSnapshot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import Role, Tier


@dataclass(frozen=True, slots=True)
class SourcePosition:
    """Where a record came from: the fence that makes re-delivery harmless."""

    topic: str
    partition: int
    offset: int

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
    blocks: dict[Tier, int] = field(default_factory=dict)
    """Blocks the view indexes for this node, per tier."""
    seq_gaps: int = 0

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
    HBM only / HBM+DRAM / HBM+DRAM+SSD. Nodes holding no prefix may be absent."""
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
