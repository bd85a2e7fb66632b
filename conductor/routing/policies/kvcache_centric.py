"""``kvcache-centric``: Conductor's own policy (Mooncake, FAST'25 Algorithm 1), as a pipeline of stages.

1. **Candidates** (:mod:`.candidates`): the prefill instances that can win: the prefix holders
   and, per place, the shortest queues.
2. **Prefill plan** (:mod:`.prefill_plan`): for each candidate, TTFT = its queue wait + the
   cheapest way to get a prefix in (its own cache from HBM/DRAM/SSD, or the best prefix held
   anywhere in the cluster, copied over the rack or cross-rack link) + compute of the rest; the
   lowest TTFT wins, not the longest match, unless it beats the holder of the longest prefix by
   no more than the prediction's error (``stay_margin``, or a fitted profile's measured error):
   then the request stays on the holder.
3. **Admission** (:mod:`.admission`): when the pick cannot meet the TTFT SLO with the margin for
   the prediction's own error, one with a shorter queue that can, else a CPP group (with
   ``cpp``), else the request is rejected before any compute is spent, with the reason.
4. **Decode pick** (:mod:`.decode_pick`): among instances with room for the request whose
   predicted TBT (with it added) meets the SLO, the least loaded, picked at random within a
   low-load band (or the rejection).

Each stage is timed by the caller's clock (:mod:`.stages`); costs are in seconds throughout.
With the router's index, only the instances that can win are looked at; whatever that cannot
settle exactly is decided over every instance with the generator as it was.

Priority (the request's ``priority``, -100..100, recorded on ``requests`` so ``explain``
re-derives with it) moves where early rejection draws the line: the SLO budget is scaled by
``1 + priority_shift * priority / 100`` (:func:`~conductor.routing.policies.base.slo_budgets`).
A router decides each request as it reads it and holds no queue of its own (queues are the
engines'), so there is no admission order to reorder; what it controls is who is turned away
when the queues fill: low priority first, keeping the headroom for the rest. A client cannot
raise its own priority past what its API key allows (``conductor/gateway/auth.py``).
"""

from __future__ import annotations

import dataclasses
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import Field

from conductor.routing.policies.admission import Admission
from conductor.routing.policies.base import Decision, PolicyParams, Rejection
from conductor.routing.policies.candidates import shortest_queues, tie_margin, walk_queues
from conductor.routing.policies.decode_pick import decode_pick, decode_pick_indexed
from conductor.routing.policies.parts import RoleSplitPolicy, placement, split_roles
from conductor.routing.policies.prefill_plan import (
    BestReuse,
    Costed,
    PendingCopy,
    PrefillPlan,
    ReusePlan,
    ReusePlanner,
    Shape,
    cost_candidates,
    cpp_group,
    fits_in_cache,
    holder_error,
    own_blocks,
    pick_prefill,
    same_rack_class,
    spill_in_group,
    stay_on_holder,
)
from conductor.routing.policies.stages import ADMISSION, CANDIDATES, DECODE_PICK, PREFILL_PLAN, Mark, no_mark
from conductor.routing.snapshot import NO_PREFIX, ClusterSnapshot, IndexView, Instance, PolicyRequest

PREFILL_ROLES = ("prefill", "both")


_node_id = operator.attrgetter("node_id")


def _pending_copies(holders: Sequence[Instance], shapes: Sequence[Shape], copies: Sequence[Shape],
                    wait: Callable[[Instance], float]) -> list[PendingCopy]:
    """The prefill-capable holders whose prefix counts pending blocks (``shapes`` differs from what
    may be copied now, ``copies``), each ready once its queue (``wait``), which holds the placing
    request's prefill, has drained. A decode instance's pending prefix arrives with a hand-off whose
    time is not known here: it is not copied before its engine reports it."""
    return [PendingCopy(i, own, wait(h)) for i, (h, own, now) in enumerate(zip(holders, shapes, copies))
            if own != now and h.role in PREFILL_ROLES]


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
    stay_margin: float = Field(
        default=0.25, ge=0, le=10,
        description="stay on the instance holding the longest prefix (confirmed or pending) unless another's "
        "predicted TTFT is lower by more than this share of the holder's (the prediction's error; a profile "
        "fitted from outcomes uses its measured ttft_error_p50 instead); 0: the lowest TTFT always wins",
    )
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
    """Evaluate only the prefill instances that can win (:func:`.candidates.shortest_queues`); False: all."""
    _same_li: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        p = self.p
        self.planner = ReusePlanner(self.costs, lambda: self._same_rack_class())
        self.group_of = self.costs.topology.grouping
        """Ties inside a capacity group go to one member (:func:`.prefill_plan.pick_prefill`): the
        first whose cache the request fits in (:meth:`_fits`)."""
        self.admission = Admission.of(self.profile, enabled=p.early_rejection, slo_margin=p.slo_margin,
                                      priority_shift=p.priority_shift, queue_wait_safety=p.queue_wait_safety)

    def _fits(self, request: PolicyRequest) -> Callable[[Instance], bool] | None:
        """Whether ``request`` goes into an instance's cache without evicting: what decides which
        member of a capacity group its work gathers on (None without groups: nothing to ask)."""
        if self.group_of is None:
            return None
        n = request.chain_len
        return lambda inst: fits_in_cache(inst, n)

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        return self.decide_staged(request, snapshot, rng, no_mark)

    def decide_staged(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random,
                      mark: Mark) -> Decision:
        """With an index (the router's :class:`~conductor.routing.index.ClusterIndex`), only the
        instances that can win are looked at: the prefix holders and the shortest queues, the
        least-loaded decode instances. Whatever that cannot settle exactly (CPP, a guarded
        check that fails, a rejection) is decided over every instance, with the generator as
        it was, so the answer is always the exhaustive one (``tests/property/test_cluster_index.py``)."""
        ix = snapshot.index
        if (ix is None or self.p.cpp or not self.prune_candidates
                or not ix.prefill_count or not ix.decode_count
                or (ix.profile is not self.profile and ix.profile != self.profile)):
            return self._every(request, snapshot, rng, mark)
        state = rng.getstate()
        pre = self._prefill_fast(request, snapshot, ix, rng, mark)
        if pre is None:
            rng.setstate(state)
            return self._every(request, snapshot, rng, mark)
        dec = decode_pick_indexed(self.costs, self.admission, request, ix, snapshot.block_size,
                                  self.p.decode_low_load_band, rng)
        if dec is None:
            every = self._decode(request, snapshot, snapshot.by_role("decode", "both"), rng)
            if isinstance(every, Rejection):
                mark(DECODE_PICK)
                return every
            dec = every
        mark(DECODE_PICK)
        out = placement(pre.instance, dec[0], pre.reuse, pre.ttft_s, dec[1])
        return out if pre.left_holder is None else dataclasses.replace(out, left_holder=pre.left_holder)

    def _every(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random, mark: Mark) -> Decision:
        """The decision over every instance (:class:`RoleSplitPolicy`'s, with the stages marked)."""
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            mark(CANDIDATES)
            return roles
        return self._place(request, snapshot, roles[0], roles[1], rng, mark)

    def place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
              decodes: tuple[Instance, ...], rng: random.Random) -> Decision:
        return self._place(request, snapshot, prefills, decodes, rng, no_mark)

    def _place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
               decodes: tuple[Instance, ...], rng: random.Random, mark: Mark) -> Decision:
        pre = self._prefill(request, snapshot, prefills, rng, mark)
        if isinstance(pre, Rejection):
            return pre
        dec = self._decode(request, snapshot, decodes, rng)
        mark(DECODE_PICK)
        if isinstance(dec, Rejection):
            return dec
        decode, tbt = dec
        out = placement(pre.instance, decode, pre.reuse, pre.ttft_s, tbt)
        if pre.group:
            out = dataclasses.replace(out, prefill_group=pre.group, chunk_boundaries=pre.boundaries)
        if pre.left_holder is not None:
            out = dataclasses.replace(out, left_holder=pre.left_holder)
        return out

    def _prefill_fast(self, request: PolicyRequest, snapshot: ClusterSnapshot, ix: IndexView,
                      rng: random.Random, mark: Mark = no_mark) -> PrefillPlan | None:
        """:meth:`_prefill` over the holders and the shortest queues in order of wait, stopping
        once no wait left can reach the lowest TTFT so far; None when the lowest fails the
        guarded check (the safe ones and the rejection need every instance)."""
        p = self.p
        bs = snapshot.block_size
        copies = snapshot.copy_shapes(ix.holders, ix.shapes)
        if copies is None:
            best_reuse, bare_floor, _ = self._reuse_planner(request, ix.holders, bs, ix.shapes, ix.rack_holders,
                                                            ix.groups)
        else:  # pending blocks extend some holder's prefix: copied once it has made them
            pending = _pending_copies(ix.holders, ix.shapes, copies, lambda h: ix.wait_of[h.node_id])
            best_reuse, bare_floor, _ = self._reuse_planner(request, ix.holders, bs, copies, ix.rack_holders,
                                                            pending=pending)
        mark(PREFILL_PLAN)
        costed = walk_queues(self.costs, request, ix, bs, best_reuse, bare_floor, tie_margin(p.prefill_tie_s))
        self._add_longest_holders(costed, ix, best_reuse)
        self._add_session(request, costed, ix, best_reuse)
        mates = None if self.group_of is None else self._costed_mates(costed, best_reuse, lambda group: [
            (ix.with_prefix(n, ix.prefix.get(n, NO_PREFIX)), ix.wait_of[n]) for n in sorted(group) if n in ix.wait_of])
        chosen, left = self._stay(request, costed, pick_prefill(costed, rng, p.prefill_tie_s, group_of=self.group_of,
                                                                fits=self._fits(request)), mates)
        mark(CANDIDATES)
        adm = self.admission
        ttft = costed.ttfts[chosen]
        fails = adm.enabled and adm.guarded(ttft, costed.waits[chosen]) > adm.budgets(request)[0]
        mark(ADMISSION)
        return None if fails else PrefillPlan(costed.pool[chosen], costed.reuses[chosen], ttft, left_holder=left)

    def _add_longest_holders(self, costed: Costed, ix: IndexView, best_reuse: BestReuse) -> None:
        """The prefill-capable holders of the longest prefix, costed into ``costed`` where the walk
        left them out (the stay rule weighs them whatever their queue)."""
        longest = 0
        for inst, shape in zip(ix.holders, ix.shapes):
            if inst.role in PREFILL_ROLES and shape[2] > longest:
                longest = shape[2]
        if not longest:
            return
        have = {inst.node_id for inst in costed.pool}
        for inst, shape in zip(ix.holders, ix.shapes):
            if inst.role in PREFILL_ROLES and shape[2] == longest and inst.node_id not in have:
                h = ix.with_prefix(inst.node_id, shape)
                costed.add(h, ix.wait_of[h.node_id], best_reuse(h))

    def _add_session(self, request: PolicyRequest, costed: Costed, ix: IndexView, best_reuse: BestReuse) -> None:
        """The session's instance, costed into ``costed`` where the walk left it out (the stay rule
        weighs it whatever its queue)."""
        node = request.session_instance
        base = ix.base.get(node) if node is not None else None
        if base is None or base.role not in PREFILL_ROLES or any(i.node_id == node for i in costed.pool):
            return
        w = ix.wait_of.get(base.node_id)
        if w is None:
            return
        h = ix.with_prefix(base.node_id, ix.prefix.get(base.node_id, NO_PREFIX))
        costed.add(h, w, best_reuse(h))

    def _stay(self, request: PolicyRequest, costed: Costed, chosen: int,
              add_mates: Callable[[str], None] | None = None) -> tuple[int, str | None]:
        """:func:`.prefill_plan.stay_on_holder` over the candidates, with this policy's error; then,
        where the instance kept has no room in its cache for the request,
        :func:`.prefill_plan.spill_in_group` over its capacity group (``add_mates`` costs into
        ``costed`` the mates of a node that the candidates left out)."""
        pool = costed.pool
        nodes = [i.node_id for i in pool]
        session = request.session_instance
        error = holder_error(self.profile, self.p.stay_margin)
        at, why = stay_on_holder(costed.ttfts, [own_blocks(i) for i in pool], nodes, chosen, error,
                                 nodes.index(session) if session is not None and session in nodes else -1)
        if self.group_of is None or fits_in_cache(pool[at], request.chain_len):
            return at, why
        if add_mates is not None:
            add_mates(pool[at].node_id)
        to, spilled = spill_in_group(costed.pool, costed.ttfts, request.chain_len, at, error, self.group_of)
        return (at, why) if spilled is None else (to, spilled)

    def _costed_mates(self, costed: Costed, best_reuse: BestReuse,
                      candidates: Callable[[set[str]], Sequence[tuple[Instance, float]]]) -> Callable[[str], None]:
        """What :meth:`_stay` calls to cost a node's capacity-group mates into ``costed``: those
        ``candidates`` gives (instance, queue wait) of the group's nodes that it lacks."""
        def add(node: str) -> None:
            assert self.group_of is not None
            have = {i.node_id for i in costed.pool}
            for inst, w in candidates(set(self.group_of(node)) - have):
                if inst.role in PREFILL_ROLES:
                    costed.add(inst, w, best_reuse(inst))
        return add

    def _prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
                 rng: random.Random, mark: Mark = no_mark) -> PrefillPlan | Rejection:
        """Lowest predicted TTFT, with its reuse plan (and a CPP group when one instance
        cannot meet the SLO and a group can); or why none meets the SLO."""
        p = self.p
        bs = snapshot.block_size
        every_wait = [self.costs.queue_wait_s(inst) for inst in prefills]  # cheap arithmetic, per instance
        # With CPP every instance may join a group, so all stay.
        pool = (list(zip(prefills, every_wait)) if p.cpp or not self.prune_candidates
                else self._candidates(prefills, every_wait, p))
        session = request.session_instance
        if session is not None and all(inst.node_id != session for inst, _ in pool):
            pool += [(inst, w) for inst, w in zip(prefills, every_wait) if inst.node_id == session]
        mark(CANDIDATES)
        # Holders in node order, as the cluster index gives them: copies of equal cost go to the
        # first, so both ways of deciding (and `explain`, which decides this way) pick the same source.
        holders = sorted((h for h in snapshot.instances if h.prefix_blocks[2] > 0), key=_node_id)
        copies = snapshot.copy_shapes(holders)
        pending = () if copies is None else _pending_copies(holders, [h.prefix_blocks for h in holders], copies,
                                                            self.costs.queue_wait_s)
        best_reuse, _, _ = self._reuse_planner(request, holders, bs, copies, pending=pending)
        costed = cost_candidates(pool, best_reuse)
        mates = None if self.group_of is None else self._costed_mates(costed, best_reuse, lambda group: [
            (inst, w) for inst, w in zip(prefills, every_wait) if inst.node_id in group])
        chosen, left = self._stay(request, costed, pick_prefill(costed, rng, p.prefill_tie_s, group_of=self.group_of,
                                                                fits=self._fits(request)), mates)
        mark(PREFILL_PLAN)
        out = self._admit(request, prefills, every_wait, costed, chosen, bs, rng)
        mark(ADMISSION)
        if isinstance(out, PrefillPlan) and left is not None and out.instance is costed.pool[chosen]:
            out = dataclasses.replace(out, left_holder=left)
        return out

    def _admit(self, request: PolicyRequest, prefills: tuple[Instance, ...], every_wait: Sequence[float],
               costed: Costed, chosen: int, bs: int, rng: random.Random) -> PrefillPlan | Rejection:
        """The admission stage over every instance: the pick if it passes the guarded check, else
        the lowest safe one, else a CPP group (``cpp``), else the rejection with its reason."""
        p, adm = self.p, self.admission
        ttfts, waits = costed.ttfts, costed.waits
        ttft = ttfts[chosen]
        ttft_budget = adm.budgets(request)[0]
        # Admitting work whose TTFT lands just under the SLO by an optimistic wait estimate
        # fills queues until most of it misses (measured in the simulator), so the wait
        # part of the prediction must clear the budget with a safety factor.
        guard = adm.guarded
        if adm.enabled and guard(ttft, waits[chosen]) > ttft_budget:
            # The fastest instance fails the guarded check; one with a shorter queue may pass it.
            safe = [i for i in range(len(costed.pool)) if guard(ttfts[i], waits[i]) <= ttft_budget]
            if safe:
                chosen = pick_prefill(costed, rng, p.prefill_tie_s, safe, self.group_of, self._fits(request))
                ttft = ttfts[chosen]
        guarded = guard(ttft, waits[chosen])
        single_fits = guarded <= ttft_budget if adm.enabled else ttft <= ttft_budget
        if not single_fits and p.cpp and request.prompt_tokens >= p.cpp_min_tokens and len(prefills) > 1:
            # Only a request no single instance can serve in time pays for a pipeline.
            group = cpp_group(self.costs, request, costed, bs, p.cpp_max_group)  # pool == prefills with CPP
            if group is not None:
                g_guarded = guard(group.finish_s, max(waits[i] for i in group.members))
                if (g_guarded <= ttft_budget) if adm.enabled else (group.finish_s < ttft):
                    head = group.members[0]
                    return PrefillPlan(prefills[head], costed.reuses[head], group.finish_s,
                                       tuple(prefills[i].node_id for i in group.members), group.boundaries)
        if adm.enabled and guarded > ttft_budget:
            if min(every_wait) > ttft_budget:
                return adm.queues_too_long(request, min(every_wait), len(prefills))
            return adm.ttft_too_long(request, ttft, costed.pool[chosen].node_id, waits[chosen], len(prefills), p.cpp)
        return PrefillPlan(costed.pool[chosen], costed.reuses[chosen], ttft)

    def _decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
                rng: random.Random) -> tuple[Instance, float] | Rejection:
        return decode_pick(self.costs, self.admission, request, decodes, snapshot.block_size,
                           self.p.decode_low_load_band, rng)

    # --- the seams the property tests reach (tests/property/test_candidate_pruning.py) -----

    def _candidates(self, prefills: Sequence[Instance], waits: Sequence[float],
                    p: KvCacheCentricParams) -> list[tuple[Instance, float]]:
        return shortest_queues(self.costs, prefills, waits, tie_margin(p.prefill_tie_s))

    def _reuse_planner(self, request: PolicyRequest, holders: Sequence[Instance], bs: int,
                       shapes: Sequence[Shape] | None = None,
                       rack_holders: Mapping[str | None, Sequence[int]] | None = None,
                       groups: Mapping[Shape, Sequence[int]] | None = None,
                       pending: Sequence[PendingCopy] = ()) -> ReusePlan:
        """:meth:`ReusePlanner.plan` with this policy's parameters."""
        p = self.p
        return self.planner.plan(request, holders, bs, remote=p.remote_reuse, threshold=p.kvcache_balancing_threshold,
                                 shapes=shapes, rack_holders=rack_holders, groups=groups, pending=pending)

    def _same_rack_class(self) -> int:
        """:func:`.prefill_plan.same_rack_class`, found once (the topology is fixed)."""
        if self._same_li is None:
            self._same_li = same_rack_class(self.costs)
        return self._same_li
