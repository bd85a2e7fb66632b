"""What a routing policy sees: a frozen picture of the cluster for one request.

Built by the routing worker from a view read (``state``) plus in-flight
reservations, by the simulator from its in-memory view, and by the audit replay
from the log. Policies are pure functions of (request, snapshot, params, rng).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import Role, Tier


@dataclass(frozen=True, slots=True)
class Instance:
    """One live instance as the policy sees it, for one request."""

    node_id: str
    role: Role
    prefix_blocks: tuple[int, int, int] = (0, 0, 0)
    """Longest contiguous prefix of *this request's* chain held by this node, in blocks,
    counting HBM only, then HBM+DRAM, then HBM+DRAM+SSD (so non-decreasing)."""
    queued_prefill_tokens: int = 0
    """Prompt tokens waiting for (or in) prefill here, including in-flight reservations."""
    queued_requests: int = 0
    """Requests behind ``queued_prefill_tokens`` (0 = unknown), so the queue wait can be
    costed per request instead of as one huge quadratic prompt."""
    running_requests: int = 0
    batch_size: int = 0
    """Requests in the decode batch, including in-flight reservations."""
    decode_context_tokens: int = 0
    """Sum of the context lengths of the decode batch, including reservations."""
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    rack: str | None = None
    zone: str | None = None

    @property
    def best_prefix(self) -> int:
        return self.prefix_blocks[2]

    def prefix_tier(self, blocks: int) -> Tier | None:
        """Slowest tier needed to read the first ``blocks`` blocks from this node."""
        if blocks <= 0:
            return None
        for tier, n in zip(("hbm", "dram", "ssd"), self.prefix_blocks):
            if blocks <= n:
                return tier  # type: ignore[return-value]
        return None


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    instances: tuple[Instance, ...]
    block_size: int
    """Tokens per block of the chains in ``prefix_blocks``."""
    watermark: dict[str, int] = field(default_factory=dict)
    """Applied source offsets (``topic:partition`` → offset) the view reflected."""
    age_ms: float = 0.0

    def by_role(self, *roles: str) -> tuple[Instance, ...]:
        return tuple(i for i in self.instances if i.role in roles)


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """The part of a routing request a policy needs."""

    request_id: str
    prompt_tokens: int
    chain_len: int
    """Blocks in the request's chain (full blocks only)."""
    expected_output_tokens: int = 256
    ttft_slo_s: float = 30.0
    tbt_slo_ms: float = 100.0
    priority: int = 0
