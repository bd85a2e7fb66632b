"""``kvcache-centric``: Conductor's own policy (Mooncake, FAST'25 Algorithm 1).

Prefill: for every prefill-capable instance, TTFT = its queue wait + the cheapest
way to get a prefix in (its own cache from HBM/DRAM/SSD, or the best prefix held
anywhere in the cluster, copied over the rack or cross-rack link) + compute of the
rest; the lowest TTFT wins, not the longest match. Decode: among instances with
room for the request whose predicted TBT (with it added) meets the SLO, the least
loaded, picked at random within a low-load band. When no pair can meet the SLOs
the request is rejected before any compute is spent (prediction-based early
rejection, Mooncake arXiv v3 §7). The rejection test holds the prediction to the SLO with a
margin for its own error: with a profile fitted from served requests (``conductor fit``: it
carries its observed, out-of-sample errors), a request is rejected when ``predicted x (real /
predicted, p90)`` exceeds the budget, i.e. when requests predicted like it missed the SLO more
than about one time in ten (a profile with only ``ttft_error_p90``: ``predicted x (1 + it)``). A hand-set profile has no measured error; the test
then counts the predicted queue wait ``queue_wait_safety`` times (2 by default): the wait is
estimated from a heartbeat's queued tokens as equal-length prompts, which under load is
optimistic (long prompts cost quadratically), while the request's own prefill estimate is not;
see docs/simulation/ANALYSIS.md for the measurement behind that default. Setting
``queue_wait_safety`` explicitly keeps that rule, fitted profile or not.

Priority (the request's ``priority``, -100..100, recorded on ``requests`` so ``explain``
re-derives with it) moves where early rejection draws the line: the SLO budget is scaled by
``1 + priority_shift * priority / 100`` (:func:`~conductor.routing.policies.base.slo_budgets`).
A router decides each request as it reads it and holds no queue of its own (queues are the
engines'), so there is no admission order to reorder; what it controls is who is turned away
when the queues fill: low priority first, keeping the headroom for the rest. A client cannot
raise its own priority past what its API key allows (``conductor/gateway/auth.py``).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from conductor.costmodel.costs import CopyPlan, PlaceKey, Reuse, tbt_of_load
from conductor.routing.policies.base import Decision, PolicyParams, Rejection, slo_budgets
from conductor.routing.policies.cpp import STAGES, plan_pipeline
from conductor.routing.policies.parts import RoleSplitPolicy, pick_lowest, placement
from conductor.routing.snapshot import NO_PREFIX, ClusterSnapshot, IndexView, Instance, PolicyRequest, indexes_by
from conductor.topology import Link

_first = operator.itemgetter(0)
"""A tuple's first item: an option's cost, an index decode entry's load."""
RUNS_MEMO_SIZE = 1024
"""Holder groups whose copy runs a policy remembers (as many as the cluster index remembers
holder sets)."""
_NO_HOLDERS = object()
"""Stands for "any rack holding no prefix of the chain" in the bare instances' memo."""

Shape = tuple[int, int, int]
LinkRuns = tuple[int, list[tuple[float, Sequence[int]]], dict[Shape, CopyPlan]]
"""One link class's copies: (its index, the runs of equal copy cost as (cost, holder indexes in
order), prefix shape → its copy plan, for the shapes that can be copied)."""


def _tie_margin(p: KvCacheCentricParams) -> float:
    """How far above the shortest wait (or the lowest TTFT) an instance is still kept as a
    candidate: generous, since keeping one too many is harmless."""
    return 2 * p.prefill_tie_s + 1e-9


def _at(request: PolicyRequest, budget: float, unit: str) -> str:
    """What a rejection message says of a priority other than 0: the budget it was held to."""
    return f" (held to {budget:g}{unit} at priority {request.priority})" if request.priority else ""


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    instance: Instance
    reuse: Reuse
    ttft_s: float
    group: tuple[str, ...] = ()
    boundaries: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Group:
    members: tuple[int, ...]
    """Indexes into the prefill instances, in pipeline order."""
    boundaries: tuple[int, ...]
    finish_s: float


class KvCacheCentricParams(PolicyParams):
    kvcache_balancing_threshold: float = Field(
        default=1.0,
        ge=0,
        description="read a prefix from another node only if it is longer than this x the local one",
    )
    remote_reuse: bool = Field(default=True, description="consider prefixes held on other nodes at all")
    early_rejection: bool = Field(default=True, description="reject when no pair meets the SLOs")
    slo_margin: float = Field(default=1.0, gt=0, description="reject when prediction > SLO x margin")
    priority_shift: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="a request's priority (-100..100) scales the SLO budget early rejection holds it to by "
        "1 + priority_shift x priority/100: low priority is shed first, leaving the queues' headroom to the rest",
    )
    queue_wait_safety: float | None = Field(
        default=None,
        ge=1.0,
        description="early rejection counts the predicted queue wait this many times (the wait estimate "
        "is optimistic under load; 1 = trust it); unset: the profile's measured TTFT error p90 as the margin "
        "when the profile was fitted (conductor fit), else 2",
    )
    decode_low_load_band: float = Field(
        default=0.1, ge=0, description="decode picks at random among TBTs within (1 + band) x the lowest"
    )
    prefill_tie_s: float = Field(default=1e-6, ge=0, description="TTFTs closer than this are a tie")
    cpp: bool = Field(
        default=False,
        description="chunked pipeline parallelism: a prompt no single prefill instance can serve within the "
        "TTFT SLO may be split over a group (off until the engines and the gateway carry groups out)",
    )
    cpp_max_group: int = Field(default=4, ge=2, le=16, description="most prefill instances in one CPP group")
    cpp_min_tokens: int = Field(default=16_384, ge=1, description="shortest prompt considered for CPP")


class KvCacheCentric(RoleSplitPolicy[KvCacheCentricParams]):
    name = "kvcache-centric"
    summary = "Mooncake's policy: lowest predicted TTFT over local and remote prefixes, SLO-aware decode, early rejection"
    prune_candidates = True
    """Evaluate only the prefill instances that can win (:meth:`_candidates`); False: all."""
    _same_li: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._runs_memo: dict[tuple[int, int, int, int], tuple[Mapping[Shape, Sequence[int]], list[LinkRuns]]] = {}

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        """With an index (the router's :class:`~conductor.routing.index.ClusterIndex`), only the
        instances that can win are looked at: the prefix holders and the shortest queues, the
        least-loaded decode instances. Whatever that cannot settle exactly (CPP, a guarded
        check that fails, a rejection) is decided over every instance, with the generator as
        it was, so the answer is always the exhaustive one (``tests/property/test_cluster_index.py``)."""
        ix = snapshot.index
        if (ix is None or self.p.cpp or not self.prune_candidates
                or not ix.prefill_count or not ix.decode_count
                or (ix.profile is not self.profile and ix.profile != self.profile)):
            return super().decide(request, snapshot, rng)
        state = rng.getstate()
        pre = self._prefill_fast(request, snapshot, ix, rng)
        if pre is None:
            rng.setstate(state)
            return super().decide(request, snapshot, rng)
        dec = self._decode_fast(request, ix, snapshot.block_size, rng)
        if dec is None:
            every = self._decode(request, snapshot, snapshot.by_role("decode", "both"), rng)
            if isinstance(every, Rejection):
                return every
            dec = every
        return placement(pre.instance, dec[0], pre.reuse, pre.ttft_s, dec[1])

    def _margin(self) -> tuple[str, float]:
        """Early rejection's margin for the prediction's own error: ``("ratio", x)`` (the fitted
        profile's measured p90 of real / predicted, at least 1), else ``("error", e)`` (its p90 of
        the relative error), else ``("wait", k)`` (the queue wait counted ``queue_wait_safety`` times)."""
        safety = self.p.queue_wait_safety
        if safety is None:
            prof = self.profile
            if prof.ttft_ratio_p90 is not None:
                return "ratio", max(prof.ttft_ratio_p90, 1.0)
            if prof.ttft_error_p90 is not None:
                return "error", prof.ttft_error_p90
        return "wait", 2.0 if safety is None else safety

    def _guarded(self, ttft: float, wait: float) -> float:
        """The TTFT early rejection holds to the budget: the prediction with :meth:`_margin`."""
        kind, x = self._margin()
        if kind == "ratio":
            return ttft * x
        if kind == "error":
            return ttft * (1.0 + x)
        return ttft + (x - 1.0) * wait

    def _margin_text(self, wait: float) -> str:
        kind, x = self._margin()
        if kind == "ratio":
            return f"x{x:.2f}, the model's measured real/predicted p90"
        if kind == "error":
            return f"with the model's measured error p90 {x:.0%} added"
        return f"with its queue wait {wait:.3f}s counted x{x:g}"

    def _budgets(self, request: PolicyRequest) -> tuple[float, float]:
        """(TTFT budget s, TBT budget ms): the request's SLOs x the margin, scaled by its priority."""
        return slo_budgets(request, self.p.slo_margin, self.p.priority_shift)

    def _prefill_fast(self, request: PolicyRequest, snapshot: ClusterSnapshot, ix: IndexView,
                      rng: random.Random) -> PrefillPlan | None:
        """:meth:`_prefill` over the holders and the shortest queues in order of wait, stopping
        once no wait left can reach the lowest TTFT so far; None when the lowest fails the
        guarded check (the safe ones and the rejection need every instance)."""
        p = self.p
        holders = ix.holders
        best_reuse, bare_floor, _ = self._reuse_planner(request, holders, snapshot.block_size, ix.shapes,
                                                        ix.rack_holders, ix.groups)
        margin = _tie_margin(p)
        pool: list[Instance] = []
        reuses: list[Reuse] = []
        waits: list[float] = []
        ttfts: list[float] = []
        lo = float("inf")
        prefix, base = ix.prefix, ix.base
        # No instance can do better than its wait plus the cheapest plan of any shape it may
        # have: the whole compute, a copy from anywhere, its own prefix.
        costs = self.costs
        shape_floor = {shape: min(bare_floor, costs.local_plan(shape, request, snapshot.block_size)[2])
                       for shape in ix.prefill_shapes}
        floor = min(shape_floor.values(), default=bare_floor)
        shortest: dict[PlaceKey, float] = {}
        place_key = costs.place_key
        for w, node in ix.waits:  # ascending: a place's first bare instance is its shortest queue
            if w + floor > lo + margin:
                break  # no instance from here on can reach (or tie) the lowest TTFT so far
            shape = prefix.get(node)
            if shape is not None:
                if w + shape_floor[shape] > lo + margin:
                    continue  # its wait and the cheapest plan of its prefix exceed the lowest
                inst = ix.with_prefix(node, shape)
            else:  # holds no prefix: only the shortest queues of its place can win
                if w + bare_floor > lo + margin:
                    continue  # nor one whose wait and cheapest bare plan exceed the lowest
                inst = base[node]
                k = place_key(inst)
                s = shortest.get(k)
                if s is None:
                    shortest[k] = w
                elif w > s + margin:
                    continue
            r = best_reuse(inst)
            pool.append(inst)
            reuses.append(r)
            waits.append(w)
            ttfts.append(w + r.cost_s)
            lo = min(lo, w + r.cost_s)
        chosen = pick_lowest(range(len(pool)), ttfts, rng, tol=p.prefill_tie_s, node_id=lambda i: pool[i].node_id)
        if p.early_rejection and self._guarded(ttfts[chosen], waits[chosen]) > self._budgets(request)[0]:
            return None
        return PrefillPlan(pool[chosen], reuses[chosen], ttfts[chosen])

    def _decode_fast(self, request: PolicyRequest, ix: IndexView, bs: int,
                     rng: random.Random) -> tuple[Instance, float] | None:
        """:meth:`_decode` over the decode instances in order of load, up to the end of the
        low-load band of the first that fits; None when that one misses the TBT SLO or none
        fits (the rejection, or the fallback without early rejection, needs every instance).

        The band is often a hundred instances or more, so TBTs are computed only where the
        load alone cannot settle it: a request's TBT is ``tbt_of_load`` of the instance's
        load up to rounding, so an instance whose load is below the band's edge by more than
        a relative 1e-9 is in it, one above it by as much (and every later one) is out, and
        only the lowest loads (for the lowest TBT) and those near the edge are computed with
        Costs.tbt_ms: the answer is _decode's to the bit (tests/property/test_cluster_index.py).
        A context below zero (counted as zero by the TBT, never sent by an engine) leaves it
        to _decode."""
        p = self.p
        costs = self.costs
        budget = self._budgets(request)[1]
        need = costs.decode_blocks_needed(request, bs)
        prompt = request.prompt_tokens
        loads, base = ix.decode_loads, ix.base
        if ix.decode_negative_contexts or prompt < 0:
            return None  # a context below zero counts as zero: the loads do not order the TBTs
        n = len(loads)
        j = 0
        while j < n:  # the first that fits: the lowest load
            _, _, free, total, _ = loads[j]
            if total <= 0 or free >= need:  # Costs.decode_fits
                break
            j += 1
        else:
            return None
        lo = costs.tbt_ms(base[loads[j][1]], request)  # as it is without its prefix: decode does not look at it
        if lo > budget:
            return None
        at0 = tbt_of_load(costs.profile, prompt, 0.0) / 1000.0  # the TBT of a zero load, in s
        k0 = loads[j][0]
        slack = 1e-9 * (at0 + abs(k0)) + 1e-18
        m = j + 1
        while m < n and loads[m][0] <= k0 + slack:  # equal loads: one may round lower
            _, node, free, total, _ = loads[m]
            if total <= 0 or free >= need:
                lo = min(lo, costs.tbt_ms(base[node], request))
            m += 1
        # The band of _decode: within the SLO and the low-load band of the lowest TBT.
        cut = min(budget, lo * (1.0 + p.decode_low_load_band) + 1e-9)
        edge = cut / 1000.0 - at0
        slack = 1e-9 * (at0 + abs(edge)) + 1e-18
        inside = max(j, bisect.bisect_right(loads, edge - slack, key=_first))  # below: in the band
        outside = bisect.bisect_right(loads, edge + slack, key=_first)  # from here on: out of it
        at_edge = [node for _, node, free, total, _ in loads[inside:outside]
                   if (total <= 0 or free >= need) and costs.tbt_ms(base[node], request) <= cut]
        # All in the band tie: the pick is pick_lowest's, by the generator in node-id order
        # (the id ranks, sorted as ints). The band's inside is usually most of the decode
        # instances and all of them fit: then its ranks are a slice of those the index keeps
        # beside the loads, with no Python per entry; else they are read entry by entry.
        rank = ix.id_rank
        if j < inside and min(ix.decode_room[j:inside]) >= need:
            ranks = ix.decode_ranks[j:inside]
        else:
            ranks = [rank[node] for _, node, free, total, _ in loads[j:inside] if total <= 0 or free >= need]
        ranks += [rank[node] for node in at_edge]
        if len(ranks) > 1:
            ranks.sort()  # node-id order
            chosen = base[ix.by_rank[ranks[rng.randrange(len(ranks))]]]
        else:
            chosen = base[ix.by_rank[ranks[0]]]
        return chosen, costs.tbt_ms(chosen, request)

    def place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
              decodes: tuple[Instance, ...], rng: random.Random) -> Decision:
        pre = self._prefill(request, snapshot, prefills, rng)
        if isinstance(pre, Rejection):
            return pre
        dec = self._decode(request, snapshot, decodes, rng)
        if isinstance(dec, Rejection):
            return dec
        decode, tbt = dec
        out = placement(pre.instance, decode, pre.reuse, pre.ttft_s, tbt)
        if pre.group:
            out = dataclasses.replace(out, prefill_group=pre.group, chunk_boundaries=pre.boundaries)
        return out

    def _prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
                 rng: random.Random) -> PrefillPlan | Rejection:
        """Lowest predicted TTFT, with its reuse plan (and a CPP group when one instance
        cannot meet the SLO and a group can); or why none meets the SLO."""
        p = self.p
        costs = self.costs
        bs = snapshot.block_size
        best_reuse, _, _ = self._reuse_planner(request, [h for h in snapshot.instances if h.prefix_blocks[2] > 0], bs)
        every_wait = [costs.queue_wait_s(inst) for inst in prefills]  # cheap arithmetic, per instance
        # Candidates: the holders and, per place, the shortest queues; with CPP every
        # instance may join a group, so all stay.
        pool = (list(zip(prefills, every_wait)) if p.cpp or not self.prune_candidates
                else self._candidates(prefills, every_wait, p))
        reuses = [best_reuse(inst) for inst, _ in pool]
        waits = [w for _, w in pool]
        ttfts = [w + r.cost_s for w, r in zip(waits, reuses)]
        chosen = pick_lowest(range(len(pool)), ttfts, rng, tol=p.prefill_tie_s, node_id=lambda i: pool[i][0].node_id)
        ttft = ttfts[chosen]
        ttft_budget = self._budgets(request)[0]
        # Admitting work whose TTFT lands just under the SLO by an optimistic wait estimate
        # fills queues until most of it misses (measured in the simulator), so the wait
        # part of the prediction must clear the budget with a safety factor.
        guard = self._guarded
        if p.early_rejection and guard(ttft, waits[chosen]) > ttft_budget:
            # The fastest instance fails the guarded check; one with a shorter queue may pass it.
            safe = [i for i in range(len(pool)) if guard(ttfts[i], waits[i]) <= ttft_budget]
            if safe:
                chosen = pick_lowest(safe, [ttfts[i] for i in safe], rng, tol=p.prefill_tie_s,
                                     node_id=lambda i: pool[i][0].node_id)
                ttft = ttfts[chosen]
        guarded = guard(ttft, waits[chosen])
        single_fits = guarded <= ttft_budget if p.early_rejection else ttft <= ttft_budget
        if not single_fits and p.cpp and request.prompt_tokens >= p.cpp_min_tokens and len(prefills) > 1:
            # Only a request no single instance can serve in time pays for a pipeline.
            group = self._pipeline(request, prefills, reuses, waits, ttfts, bs)  # pool == prefills with CPP
            if group is not None:
                g_guarded = guard(group.finish_s, max(waits[i] for i in group.members))
                if (g_guarded <= ttft_budget) if p.early_rejection else (group.finish_s < ttft):
                    return PrefillPlan(prefills[group.members[0]], reuses[group.members[0]], group.finish_s,
                                       tuple(prefills[i].node_id for i in group.members), group.boundaries)
        if p.early_rejection and guarded > ttft_budget:
            if min(every_wait) > ttft_budget:
                return Rejection(
                    "overloaded",
                    f"every prefill queue alone exceeds the TTFT SLO {request.ttft_slo_s:g}s{_at(request, ttft_budget, 's')} "
                    f"(shortest wait {min(every_wait):.3f}s over {len(prefills)} instances)",
                )
            return Rejection(
                "ttft_slo",
                f"best predicted TTFT {ttft:.3f}s on {pool[chosen][0].node_id}, {guarded:.3f}s {self._margin_text(waits[chosen])}, "
                f"exceeds the SLO {request.ttft_slo_s:g}s"
                f"{_at(request, ttft_budget, 's')} "
                f"on every one of {len(prefills)} prefill instances" + (" and every CPP group" if p.cpp else ""),
            )
        return PrefillPlan(pool[chosen][0], reuses[chosen], ttft)

    def _reuse_planner(self, request: PolicyRequest, holders: Sequence[Instance], bs: int,
                       shapes: Sequence[tuple[int, int, int]] | None = None,
                       rack_holders: Mapping[str | None, Sequence[int]] | None = None,
                       groups: Mapping[tuple[int, int, int], Sequence[int]] | None = None,
                       ) -> tuple[Callable[[Instance], Reuse], float, Mapping[tuple[int, int, int], Sequence[int]]]:
        """(instance → its cheapest reuse plan: its own cache or a holder's copy over a link,
        the lowest cost any instance holding no prefix can have, prefix shape → the indexes
        of its holders). ``holders``: the instances holding a prefix of the chain, in snapshot
        order (ties between copies go to the first); ``shapes``: their prefixes, when not
        their ``prefix_blocks``; ``rack_holders``: rack → indexes of its holders, in order,
        and ``groups``: prefix shape → indexes of its holders, in order (both found by a scan
        of the holders when not given).

        The work per request follows the prefix shapes, not the holders: holders of one
        shape have the same copy plan, so each link class's copies are walked as runs of
        equal cost (a shape, or the shapes whose plans cost the same, holders in snapshot
        order: what a stable sort of the holders by cost gives), and an instance stops at
        its first usable copy."""
        p = self.p
        costs = self.costs
        if shapes is None:
            shapes = [h.prefix_blocks for h in holders]
        if groups is None:
            groups = indexes_by(shapes)
        by_link = self._link_runs(request, bs, groups) if p.remote_reuse and holders else []
        table = costs.path_table
        place_key = costs.place_key
        threshold = p.kvcache_balancing_threshold
        # Instances holding no prefix of the chain at the same place have the same options.
        by_place: dict[tuple[object, ...] | None, Reuse] = {}
        # Where "same rack" is a link class of its own (no rack pairs or node places in the
        # topology), an instance's same-rack copies are those of the holders in its rack:
        # a lookup instead of a walk over the holders of other racks.
        same_li = self._same_rack_class() if by_link else -1
        in_rack: dict[str | None, list[tuple[float, int]]] = {}
        racks: Mapping[str | None, Sequence[int]] = {}  # read only where same_li >= 0
        if same_li >= 0:
            racks = rack_holders if rack_holders is not None else indexes_by(h.rack for h in holders)
        same_plan = by_link[same_li][2] if same_li >= 0 else {}
        place = costs.topology.place
        keys: list[PlaceKey | None] = [None] * len(holders)  # holders' place keys, made when needed

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

        bare_floor = costs.local_plan(NO_PREFIX, request, bs)[2]
        for _, runs, _ in by_link:
            if runs and runs[0][0] < bare_floor:
                bare_floor = runs[0][0]
        return best_reuse, bare_floor, groups

    def _link_runs(self, request: PolicyRequest, bs: int, groups: Mapping[tuple[int, int, int], Sequence[int]],
                   ) -> list[LinkRuns]:
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

    def _same_rack_class(self) -> int:
        """Index of the same-rack link class when "same rack" is a class of its own (no rack
        pairs or node places in the topology), else -1 (found once: the topology is fixed)."""
        if self._same_li is None:
            topo = self.costs.topology
            links = topo.links
            if topo.nodes or topo.rack_pairs or links.same_rack in (links.cross_rack, links.cross_zone):
                self._same_li = -1
            else:
                self._same_li = self.costs.links.index(links.same_rack)
        return self._same_li

    def _candidates(self, prefills: tuple[Instance, ...], waits: list[float],
                    p: KvCacheCentricParams) -> list[tuple[Instance, float]]:
        """The prefill instances that can win, with their waits: every holder of a prefix of
        the chain, and of the others, per place (rack, zone: what their reuse options depend
        on), those whose wait is within the tie tolerance of the place's shortest.

        Exact: instances without a prefix at one place have the same reuse plan, so their
        predicted TTFT (and guarded TTFT) grows with the wait alone; one whose wait exceeds the
        place's shortest by more than the tie tolerance can never be lowest, nor tie with the
        lowest, nor be the lowest safe one (property-tested against the full policy)."""
        costs = self.costs
        margin = _tie_margin(p)
        shortest: dict[PlaceKey, float] = {}
        keys: list[PlaceKey | None] = []
        for inst, w in zip(prefills, waits):
            if inst.prefix_blocks != NO_PREFIX:
                keys.append(None)
                continue
            k = costs.place_key(inst)
            keys.append(k)
            b = shortest.get(k)
            if b is None or w < b:
                shortest[k] = w
        return [(inst, w) for inst, w, k in zip(prefills, waits, keys) if k is None or w <= shortest[k] + margin]

    def _pipeline(self, request: PolicyRequest, prefills: tuple[Instance, ...], reuses: list[Reuse],
                  waits: list[float], ttfts: list[float], bs: int) -> _Group | None:
        """The best CPP group: a head (the instance with the lowest single-instance TTFT, or
        the shortest queue: it reads the reusable prefix), then 1..k-1 more members of
        shortest queue plus hand-off lag; the group of lowest predicted finish wins (the
        smaller group on a tie). Pure and deterministic (ties by node id)."""
        p = self.p
        costs, prof = self.costs, self.profile
        n = request.prompt_tokens
        order = sorted(range(len(prefills)), key=lambda i: prefills[i].node_id)
        heads = {min(order, key=lambda i: ttfts[i]), min(order, key=lambda i: waits[i])}
        best: _Group | None = None
        kv_stage = n * prof.kv_bytes_per_token / STAGES
        for head in sorted(heads, key=lambda i: prefills[i].node_id):
            reuse = reuses[head]
            start = min(reuse.blocks * bs, n - 1)
            load_s = reuse.cost_s - costs.prefill_s(n, start)  # the prefix load part of its plan
            h = prefills[head]
            rest = sorted((i for i in order if i != head),
                          key=lambda i: (waits[i] + costs.link(h, prefills[i]).seconds(kv_stage), prefills[i].node_id))
            for k in range(2, min(p.cpp_max_group, len(prefills)) + 1):
                idx = [head, *rest[: k - 1]]
                ready = [waits[head] + max(load_s, 0.0)] + [waits[i] for i in idx[1:]]
                links: list[Link | None] = [None] + [costs.link(prefills[a], prefills[b])
                                                     for a, b in itertools.pairwise(idx)]
                plan = plan_pipeline(prof, [str(i) for i in idx], ready, links, start=start, total=n, block_size=bs)
                if len(plan.members) < k:
                    break  # the prompt is too short for more members
                if best is None or plan.finish_s < best.finish_s - 1e-9:
                    best = _Group(tuple(idx), plan.boundaries, plan.finish_s)
        return best

    def _decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: tuple[Instance, ...],
                rng: random.Random) -> tuple[Instance, float] | Rejection:
        """Least loaded under the TBT SLO (at random in a low-load band), with its predicted TBT."""
        p = self.p
        costs = self.costs
        bs = snapshot.block_size
        fitting = [d for d in decodes if costs.decode_fits(d, request, bs)]
        if not fitting:
            if p.early_rejection:
                need = costs.decode_blocks_needed(request, bs)
                return Rejection("overloaded", f"no decode instance has {need} free KV blocks for the request")
            fitting = list(decodes)
        tbts = [costs.tbt_ms(d, request) for d in fitting]
        tbt_budget = self._budgets(request)[1]
        ok = [i for i, t in enumerate(tbts) if t <= tbt_budget]
        if not ok:
            if p.early_rejection:
                return Rejection(
                    "tbt_slo",
                    f"lowest predicted TBT {min(tbts):.1f}ms exceeds the SLO {request.tbt_slo_ms:g}ms"
                    f"{_at(request, tbt_budget, 'ms')} "
                    f"on all {len(fitting)} decode instances",
                )
            ok = list(range(len(fitting)))
        lo = min(tbts[i] for i in ok)
        band = [i for i in ok if tbts[i] <= lo * (1.0 + p.decode_low_load_band) + 1e-9]
        d_idx = pick_lowest(band, [0.0] * len(band), rng, node_id=lambda i: fitting[i].node_id)
        return fitting[d_idx], tbts[d_idx]
