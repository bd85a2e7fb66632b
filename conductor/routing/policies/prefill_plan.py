"""The prefill plan: per prefill instance, the cheapest way to get the request's prefix in and
the predicted TTFT; the lowest is picked.

An instance's plan is its own cache (HBM, then DRAM, then SSD) or the best prefix held anywhere,
copied over the link between holder and instance when that is cheaper (and longer than
``kvcache_balancing_threshold`` x its own), plus compute of the rest: :class:`ReusePlanner`.
Its TTFT is its queue wait plus that plan (:func:`ttft_s`), and the pick is the lowest TTFT,
ties within ``prefill_tie_s`` broken by the seeded generator in node-id order
(:func:`pick_prefill`). With CPP, :func:`cpp_group` finds the best group when no single
instance meets the SLO. Pure.

Where the plan grows: what counts as reusable enters through the holders and their prefix
shapes (:meth:`ReusePlanner.plan`; a holder's pending blocks count for its own reuse, not for a
copy, which could not start before its prefill made them); a term of the TTFT beyond the wait and the plan goes in
:func:`ttft_s` (and in the lower bounds of the index walk,
:func:`~conductor.routing.policies.candidates.walk_queues`, which assume TTFT = wait + plan);
a rule for which of the near-lowest wins goes in :func:`pick_prefill`.

**Staying on the holder** (:func:`stay_on_holder`): the lowest predicted TTFT wins only when it
beats the instance holding the longest prefix of the chain in its own cache (confirmed or
pending) by more than the prediction's own error: ``holder's TTFT x error``, the error being the
profile's measured ``ttft_error_p50`` when it was fitted from outcomes, else the policy's
``stay_margin``. A gain inside the error is noise, and leaving the holder loses its prefix for
the requests that follow (a conversation's next turn); a decision that leaves it says why. A
request of a session (``PolicyRequest.session_instance``) takes the instance that served its
session last as the holder, whatever prefix it holds (its conversation's context is there), so
the conversation stays there unless leaving pays by the same rule; that instance counts only
when it is among the costed candidates (one the candidate walk left out could not come near the
lowest TTFT).
"""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from conductor.costmodel.costs import CopyPlan, Costs, PlaceKey, Reuse
from conductor.costmodel.profiles import ModelProfile
from conductor.routing.policies.cpp import STAGES, plan_pipeline
from conductor.routing.policies.parts import pick_lowest
from conductor.routing.snapshot import NO_PREFIX, Instance, PolicyRequest, indexes_by
from conductor.topology import Link

_first = operator.itemgetter(0)
"""A tuple's first item: an option's cost."""
RUNS_MEMO_SIZE = 1024
"""Holder groups whose copy runs a planner remembers (as many as the cluster index remembers
holder sets)."""
_NO_HOLDERS = object()
"""Stands for "any rack holding no prefix of the chain" in the bare instances' memo."""

Shape = tuple[int, int, int]
LinkRuns = tuple[int, list[tuple[float, Sequence[int]]], dict[Shape, CopyPlan]]
"""One link class's copies: (its index, the runs of equal copy cost as (cost, holder indexes in
order), prefix shape → its copy plan, for the shapes that can be copied)."""
BestReuse = Callable[[Instance], Reuse]
ReusePlan = tuple[BestReuse, float, Mapping[Shape, Sequence[int]]]
"""(instance → its cheapest reuse plan, the lowest cost any instance holding no prefix can have,
prefix shape → the indexes of its holders)."""


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The prefill side of a placement: where, with which prefix, the predicted TTFT (and the
    CPP group with its chunk ends, when split)."""

    instance: Instance
    reuse: Reuse
    ttft_s: float
    group: tuple[str, ...] = ()
    boundaries: tuple[int, ...] = ()
    left_holder: str | None = None
    """Why the holder of the longest prefix was not chosen (:func:`stay_on_holder`), when it was not."""


@dataclass(frozen=True, slots=True)
class CppGroup:
    members: tuple[int, ...]
    """Indexes into the prefill instances, in pipeline order."""
    boundaries: tuple[int, ...]
    finish_s: float


@dataclass(slots=True)
class Costed:
    """The candidates with their plans, in one order: instance, reuse plan, queue wait, TTFT."""

    pool: list[Instance]
    reuses: list[Reuse]
    waits: list[float]
    ttfts: list[float]

    def add(self, inst: Instance, wait: float, reuse: Reuse) -> float:
        """Cost ``inst`` in after the others (its queue ``wait``, its plan ``reuse``); its TTFT."""
        t = ttft_s(wait, reuse)
        self.pool.append(inst)
        self.reuses.append(reuse)
        self.waits.append(wait)
        self.ttfts.append(t)
        return t


def ttft_s(wait: float, reuse: Reuse) -> float:
    """Predicted TTFT of an instance: its queue wait plus its reuse plan (load and compute)."""
    return wait + reuse.cost_s


def cost_candidates(pool: Sequence[tuple[Instance, float]], best_reuse: BestReuse) -> Costed:
    """Each candidate (instance, wait) with its plan and TTFT."""
    reuses = [best_reuse(inst) for inst, _ in pool]
    waits = [w for _, w in pool]
    return Costed([inst for inst, _ in pool], reuses, waits, [ttft_s(w, r) for w, r in zip(waits, reuses)])


def pick_prefill(c: Costed, rng: random.Random, tie_s: float, among: Sequence[int] | None = None,
                 group_of: Callable[[str], tuple[str, ...]] | None = None,
                 fits: Callable[[Instance], bool] | None = None) -> int:
    """Index of the lowest TTFT (of ``among``, default all); ties within ``tie_s`` by ``rng`` in
    node-id order, one member per capacity group (``group_of``), the first whose cache the
    request ``fits`` in (:func:`.parts.pick_lowest`)."""
    idx = range(len(c.pool)) if among is None else among
    ttfts = c.ttfts if among is None else [c.ttfts[i] for i in among]
    pool = c.pool
    return pick_lowest(idx, ttfts, rng, tol=tie_s, node_id=lambda i: pool[i].node_id, group_of=group_of,
                       fits=None if fits is None else (lambda i: fits(pool[i])))


def fits_in_cache(inst: Instance, chain_len: int) -> bool:
    """Whether the request's blocks this instance does not hold yet go in beside the blocks its
    cache holds (the view's, from its KV events) without evicting any; True where either count
    is unknown (an engine that reports no KV size or publishes no events)."""
    total, held = inst.total_kv_blocks, inst.resident_blocks
    if total <= 0 or held <= 0:
        return True
    return held + max(chain_len - inst.prefix_blocks[0], 0) <= total


def holder_error(profile: ModelProfile, stay_margin: float) -> float:
    """The share of the holder's predicted TTFT another instance must beat it by: the profile's
    measured median error when it was fitted from outcomes, else ``stay_margin`` (hand-set)."""
    if profile.fit_rows > 0 and profile.ttft_error_p50 is not None:
        return profile.ttft_error_p50
    return stay_margin


def stay_on_holder(ttfts: Sequence[float], held: Sequence[int], nodes: Sequence[str], chosen: int,
                   error: float, session: int = -1) -> tuple[int, str | None]:
    """``chosen`` (the lowest TTFT), or the holder of the longest prefix (``held``: blocks each
    candidate holds in its own cache; ties by lower TTFT, then node id) when ``chosen`` beats it
    by no more than ``holder's TTFT x error``; with, when a holder was left, why. ``session``:
    the index of the session's instance (-1: none), the holder whatever it holds. Pure."""
    holder = session
    if holder < 0:
        for i, h in enumerate(held):
            if h <= 0:
                continue
            if holder < 0 or (-h, ttfts[i], nodes[i]) < (-held[holder], ttfts[holder], nodes[holder]):
                holder = i
        if holder < 0 or holder == chosen or held[chosen] >= held[holder]:
            return chosen, None
    elif holder == chosen:
        return chosen, None
    gain = ttfts[holder] - ttfts[chosen]
    margin = ttfts[holder] * error
    if gain <= margin:
        return holder, None
    who = "session's instance" if session >= 0 else "holder"
    return chosen, (f"{who} {nodes[holder]} predicted {ttfts[holder]:.3f}s, {nodes[chosen]} {ttfts[chosen]:.3f}s: "
                    f"better by {gain:.3f}s > margin {margin:.3f}s")


CACHE_FULL = "cache full"
"""How the reason a decision spilled to a group mate begins (``left_holder``; what the metrics count by)."""


def spill_in_group(insts: Sequence[Instance], ttfts: Sequence[float], chain_len: int, chosen: int, error: float,
                   group_of: Callable[[str], tuple[str, ...]] | None) -> tuple[int, str | None]:
    """``chosen``, or a member of its capacity group whose cache the request fits in when
    ``chosen``'s does not (:func:`fits_in_cache`) and the member's predicted TTFT is at most
    ``chosen``'s x (1 + ``error``): the group's work gathers where a short shared prefix is (a
    system prompt) until that cache is full, then spills to a mate with room rather than evict,
    while a long prefix (a conversation's context) keeps its request where it is. With, when it
    spilled, why. Pure."""
    if group_of is None:
        return chosen, None
    c = insts[chosen]
    if fits_in_cache(c, chain_len):
        return chosen, None
    group = group_of(c.node_id)
    bound = ttfts[chosen] * (1.0 + error)
    mate = -1
    for i, inst in enumerate(insts):
        if (i != chosen and ttfts[i] <= bound and group_of(inst.node_id) == group and fits_in_cache(inst, chain_len)
                and (mate < 0 or (ttfts[i], inst.node_id) < (ttfts[mate], insts[mate].node_id))):
            mate = i
    if mate < 0:
        return chosen, None
    m = insts[mate]
    return mate, (f"{CACHE_FULL} on {c.node_id} ({c.resident_blocks} of {c.total_kv_blocks} blocks held, "
                  f"{max(chain_len - c.prefix_blocks[0], 0)} more needed): {m.node_id} of its capacity group "
                  f"predicted {ttfts[mate]:.3f}s against {ttfts[chosen]:.3f}s, within the margin {error:.2f}")


def own_blocks(inst: Instance) -> int:
    """Blocks of the chain ``inst`` holds in its own cache, any tier (pending ones counted)."""
    return inst.prefix_blocks[2]


class ReusePlanner:
    """Builds each request's :data:`ReusePlan`, remembering copy runs per holder groups.

    ``same_rack_class``: the index of the same-rack link class when "same rack" is a class of
    its own, else -1 (asked per plan, so a caller may turn the rack lookup off)."""

    def __init__(self, costs: Costs, same_rack_class: Callable[[], int]) -> None:
        self.costs = costs
        self.same_rack_class = same_rack_class
        self._runs_memo: dict[tuple[int, int, int, int], tuple[Mapping[Shape, Sequence[int]], list[LinkRuns]]] = {}

    def plan(self, request: PolicyRequest, holders: Sequence[Instance], bs: int, *, remote: bool, threshold: float,
             shapes: Sequence[Shape] | None = None, rack_holders: Mapping[str | None, Sequence[int]] | None = None,
             groups: Mapping[Shape, Sequence[int]] | None = None,
             pending: Sequence[PendingCopy] = ()) -> ReusePlan:
        """``holders``: the instances holding a prefix of the chain, in snapshot order (ties
        between copies go to the first); ``shapes``: the prefixes others may copy from them, when
        not their ``prefix_blocks`` (a pending prefix is not there to copy yet:
        ``ClusterSnapshot.copy_shapes``); each instance's own reuse is its ``prefix_blocks``;
        ``rack_holders``: rack → indexes of its holders, in order, and
        ``groups``: prefix shape → indexes of its holders, in order (both found by a scan of the
        holders when not given); ``remote``: consider copies at all.

        The work per request follows the prefix shapes, not the holders: holders of one shape
        have the same copy plan, so each link class's copies are walked as runs of equal cost
        (a shape, or the shapes whose plans cost the same, holders in snapshot order: what a
        stable sort of the holders by cost gives), and an instance stops at its first usable copy.

        ``pending``: holders whose prefix counts blocks their own prefill has not made yet, with the
        seconds until it has (:class:`PendingCopy`); a copy of that prefix costs that wait on top."""
        costs = self.costs
        if shapes is None:
            shapes = [h.prefix_blocks for h in holders]
        if groups is None:
            groups = indexes_by(shapes)
        by_link = self.link_runs(request, bs, groups) if remote and holders else []
        # Where "same rack" is a link class of its own (no rack pairs or node places in the
        # topology), an instance's same-rack copies are those of the holders in its rack:
        # a lookup instead of a walk over the holders of other racks.
        same_li = self.same_rack_class() if by_link else -1
        racks: Mapping[str | None, Sequence[int]] = {}  # read only where same_li >= 0
        if same_li >= 0:
            racks = rack_holders if rack_holders is not None else indexes_by(h.rack for h in holders)
        best_reuse = _best_reuse(costs, request, bs, holders, shapes, by_link, same_li, racks, threshold)
        bare_floor = costs.local_plan(NO_PREFIX, request, bs)[2]
        for _, runs, _ in by_link:
            if runs and runs[0][0] < bare_floor:
                bare_floor = runs[0][0]
        if remote and pending:
            best_reuse, bare_floor = _with_pending(costs, request, bs, holders, pending, best_reuse, bare_floor,
                                                   threshold)
        return best_reuse, bare_floor, groups

    def link_runs(self, request: PolicyRequest, bs: int, groups: Mapping[Shape, Sequence[int]]) -> list[LinkRuns]:
        """Per link class: (its index, the runs of equal copy cost as (cost, holder indexes in
        order), shape → its copy plan where it can be copied). They depend on the shapes' holder
        groups and the request's length only, so they are remembered per groups object: the
        cluster index hands out the same one for every read of a hot chain."""
        key = (id(groups), request.chain_len, request.prompt_tokens, bs)
        memo = self._runs_memo
        hit = memo.get(key)
        if hit is not None and hit[0] is groups:
            return hit[1]
        costs = self.costs
        by_link: list[LinkRuns] = []
        for li in range(len(costs.links)):
            plan = {shape: o for shape in groups if (o := costs.remote_plan(shape, request, bs, li)) is not None}
            runs = sorted(((o[2], groups[shape]) for shape, o in plan.items()), key=_first)
            merged: list[tuple[float, Sequence[int]]] = []
            for cost, idx in runs:
                if merged and merged[-1][0] == cost:  # equal costs: one run, holders in order
                    merged[-1] = (cost, sorted([*merged[-1][1], *idx]))
                else:
                    merged.append((cost, idx))
            by_link.append((li, merged, plan))
        if len(memo) >= RUNS_MEMO_SIZE:
            for k in list(itertools.islice(memo, RUNS_MEMO_SIZE // 2)):  # the older half
                del memo[k]
        memo[key] = (groups, by_link)  # holding groups keeps its id from being reused
        return by_link


@dataclass(frozen=True, slots=True)
class PendingCopy:
    """A holder (its index among the holders) whose prefix ``shape`` counts pending blocks: they
    exist ``ready_s`` from now (its queue, the placing request's prefill in it, drained)."""

    holder: int
    shape: Shape
    ready_s: float


def _with_pending(costs: Costs, request: PolicyRequest, bs: int, holders: Sequence[Instance],
                  pending: Sequence[PendingCopy], best_reuse: BestReuse, bare_floor: float,
                  threshold: float) -> tuple[BestReuse, float]:
    """``best_reuse`` that also weighs copying a pending prefix once its holder has made it (its
    ``ready_s``, then the copy), and the lowest plan cost any bare instance can have with them."""
    for pc in pending:
        for li in range(len(costs.links)):
            o = costs.remote_plan(pc.shape, request, bs, li)
            if o is not None and pc.ready_s + o[2] < bare_floor:
                bare_floor = pc.ready_s + o[2]

    def best(inst: Instance) -> Reuse:
        r = best_reuse(inst)
        floor = costs.local_plan(inst.prefix_blocks, request, bs)[0] * threshold
        for pc in pending:
            h = holders[pc.holder]
            if h.node_id == inst.node_id or pc.ready_s >= r.cost_s:
                continue
            o = costs.remote_plan(pc.shape, request, bs, costs.link_index(h, inst))
            if o is not None and o[0] > floor and pc.ready_s + o[2] < r.cost_s:
                r = Reuse(o[0], h.node_id, o[1], pc.ready_s + o[2])
        return r

    return best, bare_floor


def same_rack_class(costs: Costs) -> int:
    """Index of the same-rack link class when "same rack" is a class of its own (no rack pairs
    or node places in the topology), else -1."""
    topo = costs.topology
    links = topo.links
    if topo.nodes or topo.rack_pairs or links.same_rack in (links.cross_rack, links.cross_zone):
        return -1
    return costs.links.index(links.same_rack)


def _best_reuse(costs: Costs, request: PolicyRequest, bs: int, holders: Sequence[Instance], shapes: Sequence[Shape],
                by_link: list[LinkRuns], same_li: int, racks: Mapping[str | None, Sequence[int]],
                threshold: float) -> BestReuse:
    """Instance → its cheapest reuse plan: its own cache or a holder's copy over a link."""
    table = costs.path_table
    place_key = costs.place_key
    place = costs.topology.place
    # Instances holding no prefix of the chain at the same place have the same options.
    by_place: dict[tuple[object, ...] | None, Reuse] = {}
    rack_options = _rack_options(racks, by_link[same_li][2] if same_li >= 0 else {}, shapes)
    keys: list[PlaceKey | None] = [None] * len(holders)  # holders' place keys, made when needed

    def best_reuse(inst: Instance) -> Reuse:
        ik = place_key(inst) if by_link else None
        bare = inst.prefix_blocks == NO_PREFIX
        if bare:
            # Where racks decide the links, a rack without holders sees every holder over
            # the link its zone gives (cross-rack or cross-zone): all such racks of a zone
            # have the same options. At 1,000 instances there are ~125 racks, and the
            # shortest queue of each is a candidate.
            if same_li >= 0 and inst.rack not in racks:
                ik_memo: tuple[object, ...] | None = (_NO_HOLDERS, place(inst)[1])  # the zone the links see
            else:
                ik_memo = ik
            known = by_place.get(ik_memo)
            if known is not None:
                return known
        node = inst.node_id
        # Costs.local_reuse, and the copies that beat it, as (blocks, source, tier, cost):
        # one Reuse is made, for the plan chosen.
        blocks, tier, best = costs.local_plan(inst.prefix_blocks, request, bs)
        source = node if blocks else None
        floor = blocks * threshold
        for li, runs, plan in by_link:
            if li == same_li:
                for cost, i in rack_options(inst.rack):
                    if cost >= best:
                        break
                    o = plan[shapes[i]]
                    if holders[i].node_id != node and o[0] > floor:
                        blocks, source, tier, best = o[0], holders[i].node_id, o[1], cost
                        break
                continue
            found_one = False
            for cost, idx in runs:
                if cost >= best:
                    break
                for i in idx:
                    holder = holders[i]
                    o = plan[shapes[i]]
                    if holder.node_id == node or o[0] <= floor:
                        continue
                    hk = keys[i]
                    if hk is None:
                        hk = keys[i] = place_key(holder)
                    found = table.get((hk, ik))
                    if found is None:
                        found = costs.link_index(holder, inst, (hk, ik))
                    if found == li:
                        blocks, source, tier, best = o[0], holder.node_id, o[1], cost
                        found_one = True
                        break
                if found_one:
                    break
        out = Reuse(blocks, source, tier, best)
        if bare:
            by_place[ik_memo] = out
        return out

    return best_reuse


def _rack_options(racks: Mapping[str | None, Sequence[int]], same_plan: Mapping[Shape, CopyPlan],
                  shapes: Sequence[Shape]) -> Callable[[str | None], list[tuple[float, int]]]:
    """Rack → its holders' same-rack copies as (cost, holder index), cheapest first (found once per rack)."""
    in_rack: dict[str | None, list[tuple[float, int]]] = {}

    def rack_options(rack: str | None) -> list[tuple[float, int]]:
        opts = in_rack.get(rack)
        if opts is None:
            opts = []
            for i in racks.get(rack, ()):
                o = same_plan.get(shapes[i])
                if o is not None:
                    opts.append((o[2], i))
            opts.sort()  # cost, then snapshot order
            in_rack[rack] = opts
        return opts

    return rack_options


def cpp_group(costs: Costs, request: PolicyRequest, c: Costed, bs: int, max_group: int) -> CppGroup | None:
    """The best CPP group over ``c`` (every prefill instance): a head (the instance with the
    lowest single-instance TTFT, or the shortest queue: it reads the reusable prefix), then
    1..k-1 more members of shortest queue plus hand-off lag; the group of lowest predicted
    finish wins (the smaller group on a tie). Pure and deterministic (ties by node id)."""
    prefills, reuses, waits, ttfts = c.pool, c.reuses, c.waits, c.ttfts
    prof = costs.profile
    n = request.prompt_tokens
    order = sorted(range(len(prefills)), key=lambda i: prefills[i].node_id)
    heads = {min(order, key=lambda i: ttfts[i]), min(order, key=lambda i: waits[i])}
    best: CppGroup | None = None
    kv_stage = n * prof.kv_bytes_per_token / STAGES
    for head in sorted(heads, key=lambda i: prefills[i].node_id):
        reuse = reuses[head]
        start = min(reuse.blocks * bs, n - 1)
        load_s = reuse.cost_s - costs.prefill_s(n, start)  # the prefix load part of its plan
        h = prefills[head]
        rest = sorted((i for i in order if i != head),
                      key=lambda i: (waits[i] + costs.link(h, prefills[i]).seconds(kv_stage), prefills[i].node_id))
        for k in range(2, min(max_group, len(prefills)) + 1):
            idx = [head, *rest[: k - 1]]
            ready = [waits[head] + max(load_s, 0.0)] + [waits[i] for i in idx[1:]]
            links: list[Link | None] = [None] + [costs.link(prefills[a], prefills[b])
                                                 for a, b in itertools.pairwise(idx)]
            plan = plan_pipeline(prof, [str(i) for i in idx], ready, links, start=start, total=n, block_size=bs)
            if len(plan.members) < k:
                break  # the prompt is too short for more members
            if best is None or plan.finish_s < best.finish_s - 1e-9:
                best = CppGroup(tuple(idx), plan.boundaries, plan.finish_s)
    return best


__all__ = [
    "BestReuse",
    "Costed",
    "CppGroup",
    "PendingCopy",
    "PrefillPlan",
    "ReusePlan",
    "ReusePlanner",
    "cost_candidates",
    "cpp_group",
    "holder_error",
    "own_blocks",
    "pick_prefill",
    "same_rack_class",
    "stay_on_holder",
    "ttft_s",
]
