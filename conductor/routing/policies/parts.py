"""The parts policies are composed of, in the spirit of llm-d's filter → scorer → picker.

* filter: :func:`split_roles` (prefill-capable and decode-capable live instances, or
  ``no_live_instance``);
* scorers: functions of one instance (lower is better), e.g. :func:`queued_tokens`,
  :func:`batch_size`, :func:`kv_used_blocks`; [0, 1] scorers for weighted sums,
  e.g. :func:`prefix_share`, :func:`kv_free_share`, :func:`shortest_first`;
* pickers: :func:`pick_lowest` (ties broken by the seeded generator in node-id order),
  :func:`pick_uniform`, :func:`pick_in_turn`;
* :class:`RoleSplitPolicy` runs the filter once and hands the two groups to ``place``;
  :class:`PickEachPolicy` places on a ``prefill`` and a ``decode`` pick, reusing only the
  prefill instance's own cache (what the baselines do).

Every part is pure: the only randomness is the ``random.Random`` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from conductor.costmodel.costs import Costs, Reuse
from conductor.routing.policies.base import BasePolicy, Decision, P, Placement, Rejection
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest

T = TypeVar("T")
Scorer = Callable[[Instance], float]

# --- the filter -------------------------------------------------------------------------


def split_roles(snapshot: ClusterSnapshot) -> tuple[tuple[Instance, ...], tuple[Instance, ...]] | Rejection:
    """(prefill-capable, decode-capable) instances, or ``no_live_instance``."""
    prefills = tuple(i for i in snapshot.instances if i.role == "prefill" or i.role == "both")
    decodes = tuple(i for i in snapshot.instances if i.role == "decode" or i.role == "both")
    if not prefills or not decodes:
        missing = "prefill" if not prefills else "decode"
        return Rejection("no_live_instance", f"no live {missing} instance among {len(snapshot.instances)}")
    return prefills, decodes


# --- scorers (lower is better) ------------------------------------------------------------


def queued_tokens(i: Instance) -> float:
    """Prompt tokens waiting for prefill."""
    return float(i.queued_prefill_tokens)


def batch_size(i: Instance) -> float:
    """Requests in the decode batch."""
    return float(i.batch_size)


def kv_used_blocks(i: Instance, block_size: int) -> float:
    """KV blocks in use (from the decode context when the capacity is unknown)."""
    if i.total_kv_blocks > 0:
        return float(i.total_kv_blocks - i.free_kv_blocks)
    return i.decode_context_tokens / block_size


# --- [0, 1] scorers (higher is better) ------------------------------------------------------


def prefix_share(i: Instance, request: PolicyRequest) -> float:
    """Share of the request's chain this instance holds (any tier)."""
    cap = request.chain_len
    return min(i.prefix_blocks[2], cap) / cap if cap > 0 else 0.0


def kv_free_share(i: Instance) -> float:
    """Free / total KV blocks (1 when the capacity is unknown)."""
    return i.free_kv_blocks / i.total_kv_blocks if i.total_kv_blocks > 0 else 1.0


def shortest_first(values: Sequence[float]) -> list[float]:
    """Min-max normalised and inverted: 1 for the smallest value, 0 for the largest."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


# --- pickers ---------------------------------------------------------------------------------


def by_node(items: Sequence[Instance]) -> list[Instance]:
    """In node-id order, so a pick depends on the set of instances, not their order."""
    return sorted(items, key=lambda i: i.node_id)


def pick_lowest(items: Sequence[T], scores: Sequence[float], rng: random.Random, *, tol: float = 1e-9,
                node_id: Any = None, group_of: Callable[[str], tuple[str, ...]] | None = None,
                fits: Callable[[T], bool] | None = None) -> T:
    """The item of lowest score; ties (within ``tol``) broken by ``rng`` in node-id order.

    Sorting the tied group first makes the pick independent of snapshot order, so a
    decision re-derived from the log with the same seed lands on the same instance.
    ``group_of`` (a node's capacity group, the topology's): of tied items sharing one device only
    one stays in the draw, so a group's work gathers on one member instead of being split
    between engines that batch apart: the first in node-id order that ``fits`` (the request's
    new blocks go in beside what its cache holds), else the first. So the group's work fills
    one member's cache, then the next one's, and evicts only once every member is full.
    """
    lo = min(scores)
    group = [it for it, s in zip(items, scores) if s <= lo + tol]
    if len(group) == 1:
        return group[0]
    key = node_id or (lambda it: it.node_id)
    group.sort(key=key)
    if group_of is not None:
        kept: dict[tuple[str, ...], tuple[T, bool]] = {}
        for it in group:
            g = group_of(key(it))
            have = kept.get(g)
            if have is None:
                kept[g] = (it, fits is None or fits(it))
            elif not have[1] and fits is not None and fits(it):
                kept[g] = (it, True)
        if len(kept) == 1:
            return next(iter(kept.values()))[0]
        group = sorted((it for it, _ in kept.values()), key=key)
    return group[rng.randrange(len(group))]


def lowest(items: Sequence[Instance], scorer: Scorer, rng: random.Random, *, tol: float = 1e-9) -> Instance:
    """:func:`pick_lowest` over one scorer."""
    return pick_lowest(items, [scorer(i) for i in items], rng, tol=tol)


def pick_uniform(items: Sequence[Instance], rng: random.Random) -> Instance:
    """Any one, uniformly, by the seed."""
    ordered = by_node(items)
    return ordered[rng.randrange(len(ordered))]


def pick_in_turn(items: Sequence[Instance], ordinal: int) -> Instance:
    """The ``ordinal``-th in node-id order, wrapping around."""
    ordered = by_node(items)
    return ordered[ordinal % len(ordered)]


def local_placement(
    costs: Costs, request: PolicyRequest, snapshot: ClusterSnapshot, prefill: Instance, decode: Instance
) -> Placement:
    """A placement that reuses only the prefill instance's own cache (what the peers do)."""
    reuse = costs.local_reuse(prefill, request, snapshot.block_size)
    return placement(prefill, decode, reuse, costs.queue_wait_s(prefill) + reuse.cost_s, costs.tbt_ms(decode, request))


def placement(prefill: Instance, decode: Instance, reuse: Reuse, ttft_s: float, tbt_ms: float) -> Placement:
    """Prefill on ``prefill`` with ``reuse``'s prefix, decode on ``decode``, with the predictions."""
    return Placement(prefill=prefill.node_id, decode=decode.node_id, reused_blocks=reuse.blocks,
                     reuse_source=reuse.source, reuse_tier=reuse.tier, predicted_ttft_s=ttft_s,
                     predicted_tbt_ms=tbt_ms)


# --- composed policies -----------------------------------------------------------------------


class RoleSplitPolicy(BasePolicy[P]):
    """Runs :func:`split_roles` once; subclasses implement :meth:`place`."""

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        return self.place(request, snapshot, roles[0], roles[1], rng)

    def place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
              decodes: tuple[Instance, ...], rng: random.Random) -> Decision:
        raise NotImplementedError


class PickEachPolicy(RoleSplitPolicy[P]):
    """A prefill pick, then a decode pick (the smallest batch unless overridden), each
    prefill reusing only its own cache; never rejects once both roles are present."""

    def place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
              decodes: tuple[Instance, ...], rng: random.Random) -> Decision:
        prefill = self.prefill(request, snapshot, prefills, rng)  # first: the seed's draws keep their order
        decode = self.decode(request, snapshot, decodes, rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        raise NotImplementedError

    def pick_aggregated(self, request: PolicyRequest, snapshot: ClusterSnapshot, candidates: Sequence[Instance],
                        rng: random.Random) -> Instance:
        """The aggregated instance (prefill and decode in one call) this policy's own rule picks:
        its prefill pick, since the instance that prefills also decodes (``mode.py`` asks it)."""
        return self.prefill(request, snapshot, candidates, rng)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        return lowest(decodes, batch_size, rng)
