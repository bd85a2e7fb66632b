"""The cost model: what a prefill, a prefix copy, a queue and a decode step are predicted to
cost, from a :class:`~conductor.costmodel.profiles.ModelProfile` and a topology.

The policies cost their options with it and the cluster index orders instances by it (queue
wait, decode load), so both read the same numbers; it imports neither: what it reads of an
instance and a request is said by :class:`CostedInstance` and :class:`CostedRequest` (routing's
``Instance`` and ``PolicyRequest`` are both). Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from conductor.costmodel.profiles import ModelProfile
from conductor.topology import Link, Located, Topology, flat_topology
from schemas import TIERS, Tier


class CostedInstance(Located, Protocol):
    """What the cost model reads of an instance (``conductor.routing.snapshot.Instance``)."""

    @property
    def prefix_blocks(self) -> tuple[int, int, int]: ...
    @property
    def queued_prefill_tokens(self) -> int: ...
    @property
    def queued_requests(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def decode_context_tokens(self) -> int: ...
    @property
    def free_kv_blocks(self) -> int: ...
    @property
    def total_kv_blocks(self) -> int: ...


class CostedRequest(Protocol):
    """What the cost model reads of a request (``conductor.routing.snapshot.PolicyRequest``)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def chain_len(self) -> int: ...
    @property
    def expected_output_tokens(self) -> int: ...


PlaceKey = tuple[str | None, str | None, str | None]
"""What the links from and to an instance depend on (:meth:`Costs.place_key`)."""
CopyPlan = tuple[int, Tier, float]
"""(blocks, slowest tier, cost) of reading a holder's prefix over a link (:meth:`Costs.remote_plan`)."""


@dataclass(frozen=True, slots=True)
class Reuse:
    """One way to get a prefix into a prefill instance, and what the prefill then costs."""

    blocks: int
    source: str | None
    tier: Tier | None
    cost_s: float
    """Load time of the prefix plus prefill compute of the rest (queue wait excluded)."""


class Costs:
    """The estimates the policies share, bound to one profile and one topology (default:
    the profile's two link speeds, :func:`~conductor.topology.flat_topology`)."""

    __slots__ = ("_local", "_paths", "_prefill", "_remote", "links", "profile", "topology")

    def __init__(self, profile: ModelProfile, topology: Topology | None = None) -> None:
        self.profile = profile
        self.topology = topology if topology is not None else flat_topology(profile)
        self.links: tuple[Link, ...] = self.topology.classes()
        """Every distinct link a remote prefix may cross."""
        self._paths: dict[tuple[Any, ...], int] = {}
        self._prefill: dict[tuple[float, float], float] = {}
        self._local: dict[tuple[Any, ...], tuple[int, Tier | None, float]] = {}
        self._remote: dict[tuple[Any, ...], CopyPlan | None] = {}

    def prefill_s(self, total: float, cached: float) -> float:
        """``profile.prefill_seconds``, memoised: a decision asks for the same few pairs many times."""
        key = (total, cached)
        v = self._prefill.get(key)
        if v is None:
            if len(self._prefill) > 65_536:
                self._prefill.clear()
            v = self._prefill[key] = self.profile.prefill_seconds(total, cached)
        return v

    def queue_wait_s(self, inst: CostedInstance) -> float:
        """Prefill time of what is already queued on ``inst``, plus what its running requests add.

        With a request count, the backlog is costed as that many equal prompts (the
        quadratic term of one prompt of the summed length would overstate it). A fitted
        profile's ``running_wait_s`` adds the share of the instance's steps its running
        requests (its batch, the router's in-flight decisions included) take from a new one.
        """
        running = self.profile.running_wait_s * inst.batch_size
        q = inst.queued_prefill_tokens
        if q <= 0:
            return running
        k = inst.queued_requests
        scale = self.profile.queue_wait_scale  # 1 unless fitted: the queue's measured drain rate
        if k <= 1:
            return running + scale * self.prefill_s(q, 0)
        return running + scale * k * self.prefill_s(q / k, 0)

    def local_reuse(self, inst: CostedInstance, request: CostedRequest, block_size: int) -> Reuse:
        """Cheapest way to prefill on ``inst`` using only its own cache (possibly none of it)."""
        blocks, tier, cost = self.local_plan(inst.prefix_blocks, request, block_size)
        return Reuse(blocks, inst.node_id if blocks else None, tier, cost)

    def link(self, a: CostedInstance, b: CostedInstance) -> Link:
        """The link a transfer from ``a`` to ``b`` crosses."""
        return self.links[self.link_index(a, b)]

    def place_key(self, a: CostedInstance) -> PlaceKey:
        """What the link from or to ``a`` depends on: its rack and zone (and its id when the
        topology file places nodes by id)."""
        return (a.node_id if self.topology.nodes else None, a.rack, a.zone)

    def link_index(self, a: CostedInstance, b: CostedInstance, key: tuple[Any, ...] | None = None) -> int:
        """Index in :attr:`links` of the link from ``a`` to ``b``, memoised per
        ``(place_key(a), place_key(b))`` (pass it as ``key`` when already built)."""
        if key is None:
            key = (self.place_key(a), self.place_key(b))
        i = self._paths.get(key)
        if i is None:
            if len(self._paths) > 65_536:
                self._paths.clear()
            i = self._paths[key] = self.links.index(self.topology.link_between(a, b))
        return i

    @property
    def path_table(self) -> dict[tuple[Any, ...], int]:
        """The memo of :meth:`link_index` (for hot loops that look links up inline)."""
        return self._paths

    def remote_reuse(self, holder: CostedInstance, request: CostedRequest, block_size: int, link: int) -> Reuse | None:
        """Cheapest prefill on another node reading ``holder``'s prefix over ``links[link]``."""
        opt = self.remote_plan(holder.prefix_blocks, request, block_size, link)
        if opt is None:
            return None
        return Reuse(opt[0], holder.node_id, opt[1], opt[2])

    def local_plan(self, prefix: tuple[int, int, int], request: CostedRequest,
                   block_size: int) -> tuple[int, Tier | None, float]:
        """(blocks, slowest tier, cost) of :meth:`local_reuse` for any instance holding ``prefix``."""
        return self._local_cost(prefix, request.chain_len, request.prompt_tokens, block_size)

    def remote_plan(self, prefix: tuple[int, int, int], request: CostedRequest, block_size: int,
                    link: int) -> CopyPlan | None:
        """(blocks, slowest tier, cost) of :meth:`remote_reuse` for any holder of ``prefix``
        (it depends on the shape only), or None."""
        return self._remote_cost(prefix, request.chain_len, request.prompt_tokens, block_size, link)

    # The costs depend on the prefix shape and the request only, and many instances share
    # a shape (no prefix, the same system prompt...): memoised per shape.

    def _local_cost(self, prefix: tuple[int, int, int], cap: int, n: int, bs: int) -> tuple[int, Tier | None, float]:
        key = (prefix, cap, n, bs)
        hit = self._local.get(key)
        if hit is not None:
            return hit
        prof = self.profile
        best: tuple[int, Tier | None, float] = (0, None, self.prefill_s(n, 0))
        for cum, tier, toks, compute in self._prefix_steps(prefix, cap, n, bs):
            cost = prof.prefix_load_seconds(*toks, remote=False) + compute
            if cost < best[2]:
                best = (cum, tier, cost)
        if len(self._local) > 65_536:
            self._local.clear()
        self._local[key] = best
        return best

    def _prefix_steps(
        self, prefix: tuple[int, int, int], cap: int, n: int, bs: int
    ) -> list[tuple[int, Tier, tuple[int, int, int], float]]:
        """Each way to reuse a prefix: read it through HBM, then also DRAM, then also SSD.

        Yields (blocks reused, slowest tier read, tokens read per tier, compute of the rest).
        """
        steps = []
        toks = [0, 0, 0]
        cum = 0
        for i, (tier, seg) in enumerate(zip(TIERS, _segments(prefix, cap))):
            if seg <= 0:
                continue
            cum += seg
            toks[i] = seg * bs
            cached = min(cum * bs, n - 1)  # engines always compute the last token
            steps.append((cum, tier, (toks[0], toks[1], toks[2]), self.prefill_s(n, cached)))
        return steps

    def _remote_cost(self, prefix: tuple[int, int, int], cap: int, n: int, bs: int,
                     li: int) -> CopyPlan | None:
        key = (prefix, cap, n, bs, li)
        if key in self._remote:
            return self._remote[key]
        out: CopyPlan | None = None
        if sum(_segments(prefix, cap)) > 0:
            prof = self.profile
            link = self.links[li]
            for cum, tier, toks, compute in self._prefix_steps(prefix, cap, n, bs):
                c = prof.prefix_load_seconds(*toks, remote=True, link=link) + compute
                if out is None or c < out[2]:
                    out = (cum, tier, c)
        if len(self._remote) > 65_536:
            self._remote.clear()
        self._remote[key] = out
        return out

    def decode_blocks_needed(self, request: CostedRequest, block_size: int) -> int:
        return -(-(request.prompt_tokens + request.expected_output_tokens) // block_size)

    def decode_fits(self, inst: CostedInstance, request: CostedRequest, block_size: int) -> bool:
        """Whether ``inst`` has free KV blocks for the whole request (unknown capacity fits)."""
        if inst.total_kv_blocks <= 0:
            return True
        return inst.free_kv_blocks >= self.decode_blocks_needed(request, block_size)

    def tbt_ms(self, inst: CostedInstance, request: CostedRequest) -> float:
        """Predicted decode step time on ``inst`` with this request added to its batch.

        The request joins with its prompt as context; its growth over the output is
        ignored, as is the growth of the others (they also finish and leave).
        """
        return 1000.0 * self.profile.decode_step_seconds(
            inst.batch_size + 1, inst.decode_context_tokens + request.prompt_tokens
        )


def decode_load(profile: ModelProfile, inst: CostedInstance) -> float:
    """The part of a decode step's predicted time that differs between instances: the
    predicted TBT of any request is an increasing function of it (``decode_step_seconds`` is
    linear in the batch and the context): :func:`tbt_of_load`."""
    return inst.batch_size * profile.per_sequence_s + inst.decode_context_tokens * (
        profile.kv_bytes_per_token / profile.hbm_bandwidth)


def tbt_of_load(profile: ModelProfile, prompt_tokens: int, load: float) -> float:
    """:meth:`Costs.tbt_ms` of a request of ``prompt_tokens`` on an instance of
    :func:`decode_load` ``load``, up to rounding (for an instance whose context with the
    prompt is not below zero)."""
    return 1000.0 * (profile.step_overhead_s + profile.per_sequence_s
                     + (profile.weight_bytes + prompt_tokens * profile.kv_bytes_per_token) / profile.hbm_bandwidth
                     + load)


def _segments(prefix_blocks: tuple[int, int, int], cap: int) -> tuple[int, int, int]:
    """Blocks read from HBM, DRAM and SSD for the longest prefix, capped at the chain length."""
    h, hd, hds = prefix_blocks
    h = min(h, cap)
    hd = min(max(hd, h), cap)
    hds = min(max(hds, hd), cap)
    return h, hd - h, hds - hd
