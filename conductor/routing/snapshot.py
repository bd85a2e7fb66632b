"""What a routing policy sees: a frozen picture of the cluster for one request.

:func:`build_cluster` is the one conversion from a view read (``state.view``) plus
in-flight reservations to that picture; the routing worker, ``explain`` and the
simulator all call it. Policies are pure functions of (request, snapshot, params, rng).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, overload

from conductor.costmodel.profiles import ModelProfile
from schemas import Role, can_hand_off
from state.view import NodeState, ViewSnapshot

K = TypeVar("K", bound=Hashable)
Shape = tuple[int, int, int]
"""A prefix of a chain held by one instance, in blocks: HBM, HBM+DRAM, HBM+DRAM+SSD."""


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
    handoff: bool | None = None
    """Whether it takes part in P/D hand-offs (``schemas.can_hand_off``); None: by role."""
    endpoint: str | None = None
    """Where a gateway reaches it (its heartbeats' ``endpoint``), with its DP rank and SGLang
    bootstrap port: carried into the decisions that name it."""
    dp_rank: int | None = None
    bootstrap_port: int | None = None
    resident_blocks: int = 0
    """Blocks the view holds on this node in HBM (its KV events: stored, not yet removed), whatever
    the request: with ``total_kv_blocks``, whether a request's new blocks fit beside them or
    evict some (vLLM counts its cached blocks as free, so ``free_kv_blocks`` cannot say)."""

    @property
    def can_hand_off(self) -> bool:
        return can_hand_off(self.role, self.handoff)


class LazyInstances(Sequence[Instance]):
    """A tuple of instances made on first use (a policy deciding from the index never asks);
    compares equal to the tuple it stands for."""

    __slots__ = ("_items", "_make")

    def __init__(self, make: Callable[[], tuple[Instance, ...]]) -> None:
        self._make: Callable[[], tuple[Instance, ...]] | None = make
        self._items: tuple[Instance, ...] | None = None

    def items(self) -> tuple[Instance, ...]:
        if self._items is None:
            assert self._make is not None
            self._items, self._make = self._make(), None
        return self._items

    @overload
    def __getitem__(self, i: int) -> Instance: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Instance, ...]: ...

    def __getitem__(self, i: int | slice) -> Instance | tuple[Instance, ...]:
        return self.items()[i]

    def __len__(self) -> int:
        return len(self.items())

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        return self.items() == (other.items() if isinstance(other, LazyInstances) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.items())


@dataclass(frozen=True, slots=True)
class IndexView:
    """What a policy may use beside ``ClusterSnapshot.instances``, valid for one decision: the
    same instances kept in order by a :class:`~conductor.routing.index.ClusterIndex`."""

    profile: ModelProfile
    """The profile the waits and loads were computed with (a policy of another ignores them)."""
    holders: tuple[Instance, ...]
    """The instances holding a prefix of the chain, in the order of ``instances``, as they are
    without it (their prefixes are ``shapes``)."""
    shapes: tuple[tuple[int, int, int], ...]
    groups: dict[tuple[int, int, int], tuple[int, ...]]
    """prefix → the indexes in ``holders`` of its holders, ascending."""
    prefix: dict[str, tuple[int, int, int]]
    """node → its prefix of the chain, for the holders."""
    base: dict[str, Instance]
    """node → its instance without prefix, for every instance."""
    waits: list[tuple[float, str]]
    """(queue wait, node) of every prefill-capable instance, ascending."""
    wait_of: dict[str, float]
    decode_loads: list[tuple[float, str, int, int, int]]
    """(:func:`decode_load`, node, free KV blocks, total KV blocks, decode context tokens) of
    every decode-capable instance, ascending (what the decode band reads of each)."""
    decode_ranks: list[int]
    """Beside ``decode_loads``, entry for entry: the node's ``id_rank``."""
    decode_room: list[float]
    """Beside ``decode_loads``, entry for entry: the free KV blocks, infinite where the total is
    not known (0: such an instance always fits), so ``min`` of a slice says whether all fit."""
    by_rank: list[str]
    """The instances in node-id order (``by_rank[id_rank[node]] == node``)."""
    prefill_count: int
    decode_count: int
    decode_negative_contexts: int
    """Decode entries with a context below zero (0 from any real heartbeat)."""
    with_prefix: Callable[[str, tuple[int, int, int]], Instance]
    """(node, prefix) → the node's instance as ``instances`` has it."""
    id_rank: dict[str, int]
    """node → its place among the instances in node-id order (sorting by it sorts by id)."""
    rack_holders: dict[str | None, tuple[int, ...]]
    """rack → the indexes in ``holders`` of the holders in that rack, ascending (racks
    without holders absent)."""
    prefill_shapes: frozenset[tuple[int, int, int]]
    """The prefixes some prefill-capable holder has."""
    both_count: int = 0
    """Instances of role ``both`` (none: every request runs disaggregated, ``policies.mode``)."""

    def instance(self, node: str) -> Instance:
        """``node`` as ``instances`` has it."""
        p = self.prefix.get(node)
        return self.base[node] if p is None else self.with_prefix(node, p)


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    instances: Sequence[Instance]
    """A tuple, or from a :class:`~conductor.routing.index.ClusterIndex` a :class:`LazyInstances`
    (equal to the tuple it stands for)."""
    block_size: int
    """Tokens per block of the chains in ``prefix_blocks``."""
    watermark: dict[str, int] = field(default_factory=dict)
    """Applied source offsets (``topic:partition`` → offset) the view reflected."""
    age_ms: float = 0.0
    index: IndexView | None = field(default=None, compare=False, repr=False)
    """The same instances kept in order of queue wait and decode load, when the snapshot came
    from a :class:`~conductor.routing.index.ClusterIndex` (policies may look at the few that
    can win instead of at all of them; ``build_cluster`` leaves it out)."""
    copyable: Mapping[str, Shape] | None = None
    """Per instance whose ``prefix_blocks`` count blocks still pending (placed by a decision, not
    yet made by its prefill: ``routing.decision_time``), the prefix another instance may copy from
    it; None: every instance's prefix may be copied as it is."""

    def copy_shapes(self, holders: Sequence[Instance],
                    shapes: Sequence[Shape] | None = None) -> list[Shape] | None:
        """The prefixes ``holders`` may be copied from, beside their own (``shapes``, else their
        ``prefix_blocks``); None when no holder's differs (copy from each what it holds)."""
        copyable = self.copyable
        if not copyable:
            return None
        own = shapes if shapes is not None else [h.prefix_blocks for h in holders]
        out = [copyable.get(h.node_id, s) for h, s in zip(holders, own)]
        return None if out == list(own) else out

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
    ordinal: int = 0
    """The request's position in the log (its ``requests`` offset; the trace index in the
    simulator): what order-based policies rotate by, so a decision can be re-derived."""
    session_instance: str | None = None
    """The prefill instance that served the request's session last (the router's memory of its
    decisions): the stay rule's holder (:func:`~conductor.routing.policies.prefill_plan.stay_on_holder`)."""


class PendingLoad(Protocol):
    """Amounts reserved on a node that its heartbeats do not show yet (``state.reservations.Load``)."""

    @property
    def prefill_tokens(self) -> int: ...
    @property
    def prefill_requests(self) -> int: ...
    @property
    def decode_requests(self) -> int: ...
    @property
    def decode_context_tokens(self) -> int: ...
    @property
    def kv_blocks(self) -> int: ...


NO_PREFIX = (0, 0, 0)


def indexes_by(keys: Iterable[K]) -> dict[K, list[int]]:
    """Each distinct key → the positions where it occurs, ascending (how an :class:`IndexView`
    groups the holders by prefix and by rack, and how a policy without one groups them)."""
    out: dict[K, list[int]] = {}
    for i, k in enumerate(keys):
        at = out.get(k)
        if at is None:
            out[k] = [i]
        else:
            at.append(i)
    return out

InstanceMemo = dict[str, tuple[NodeState, tuple[int, int, int], "PendingLoad | None", Instance]]
"""node → (state, prefix, pending, Instance) of the last build: most nodes look the same
request after request, so a caller that builds often keeps one and passes it in."""


def instance(node: NodeState, prefix: tuple[int, int, int], pending: PendingLoad | None) -> Instance:
    """One node as the policy sees it: its heartbeat state plus what is reserved on it."""
    if pending is None:
        pt = pr = dr = dc = kv = 0
    else:
        pt, pr, dr = pending.prefill_tokens, pending.prefill_requests, pending.decode_requests
        dc, kv = pending.decode_context_tokens, pending.kv_blocks
    return Instance(
        node_id=node.node_id,
        role=node.role,
        prefix_blocks=prefix,
        queued_prefill_tokens=node.queued_prefill_tokens + pt,
        queued_requests=node.queue_depth + pr,
        running_requests=node.running_requests,
        batch_size=node.batch_size + dr,
        decode_context_tokens=node.decode_context_tokens + dc,
        free_kv_blocks=max(node.free_kv_blocks - kv, 0),
        total_kv_blocks=node.total_kv_blocks,
        rack=node.rack,
        zone=node.zone,
        handoff=node.kv_transfer,
        endpoint=node.endpoint,
        dp_rank=node.dp_rank,
        bootstrap_port=node.bootstrap_port,
        resident_blocks=node.blocks.get("hbm", 0),
    )


def build_cluster(
    view: ViewSnapshot,
    pending: Mapping[str, PendingLoad],
    *,
    block_size: int,
    ttl_s: float,
    model: str | None = None,
    age_ms: float = 0.0,
    memo: InstanceMemo | None = None,
    exclude: Collection[str] = (),
) -> ClusterSnapshot:
    """The policy's picture of ``view``: live nodes serving ``model`` (stores serve every
    model; ``None`` = no filter) and not named in ``exclude``, each with its prefix of the
    chain and its ``pending`` reservations added. Pure; ``memo`` only saves rebuilding
    unchanged instances."""
    insts = []
    for n in view.live_nodes(ttl_s):
        if (model is not None and n.model != model and n.role != "store") or n.node_id in exclude:
            continue
        prefix = view.prefix.get(n.node_id, NO_PREFIX)
        extra = pending.get(n.node_id)
        if memo is None:
            insts.append(instance(n, prefix, extra))
            continue
        hit = memo.get(n.node_id)
        if hit is not None and hit[0] is n and hit[1] == prefix and hit[2] == extra:
            insts.append(hit[3])
            continue
        inst = instance(n, prefix, extra)
        memo[n.node_id] = (n, prefix, extra, inst)
        insts.append(inst)
    return ClusterSnapshot(tuple(insts), block_size, dict(view.watermark), age_ms)
