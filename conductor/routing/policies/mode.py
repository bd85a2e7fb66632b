"""Aggregated, disaggregated or conditional: how one request runs, around any policy.

Most vLLM fleets run aggregated instances (role ``both``, no KV connector): one engine
prefills and decodes a request in one call. Some run prefill/decode pairs that hand the KV
off over a connector (NIXL, Mooncake), and some run ``both`` instances that can do either.
:func:`decide_mode` wraps a policy's answer so that every request gets a mode it can be
carried out in:

* **disaggregated**: the policy's placement over the instances that can take part in a
  hand-off (``prefill``, ``decode``, and ``both`` instances whose heartbeats say they run a
  KV connector);
* **aggregated on Z**: for each ``both`` instance, its queue wait plus the cheapest prefill
  with its own cache, and its decode step with the request added; *which* ``both`` instance is
  the policy's own rule (:class:`PicksAggregated`: ``sglang-style`` its cache-aware pick,
  ``round-robin`` its turn, ...), or, for a policy without one, the lowest predicted TTFT kept
  on the prefix holder unless leaving pays. Mode decides how the request runs, not where;
* **conditional disaggregation** (what Dynamo's and llm-d's P/D deciders do): when the
  disaggregated prefill instance is itself a ``both`` instance, the request stays on it
  when what it would compute is short (``aggregate_below_tokens``) or it decodes no slower
  than the chosen decode instance; otherwise, against an aggregated option on another
  instance, the lower predicted TTFT wins, and a tie goes to aggregated (no KV crosses the
  network).

A cluster with no ``both`` instance is passed through untouched (the policy's answer, no
options): the cost is one scan of the roles. Pure; the only randomness is the policy's.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, runtime_checkable

from conductor.costmodel.costs import Costs
from conductor.routing.policies.base import (
    BasePolicy,
    Decision,
    Placement,
    Policy,
    RejectCode,
    Rejection,
    StagedPolicy,
    slo_budgets,
)
from conductor.routing.policies.prefill_plan import fits_in_cache, holder_error, spill_in_group, stay_on_holder
from conductor.routing.policies.stages import DECIDE, MODE, Mark, no_mark
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from schemas import Mode

AGGREGATED: Final = "aggregated"
DISAGGREGATED: Final = "disaggregated"


@runtime_checkable
class EarlyRejecting(Protocol):
    """The parameters of a policy that rejects by prediction (``kvcache-centric``'s): the SLO
    margin and the priority's shift its budgets use, and whether it rejects at all."""

    @property
    def slo_margin(self) -> float: ...
    @property
    def priority_shift(self) -> float: ...
    @property
    def early_rejection(self) -> bool: ...


@runtime_checkable
class StaysOnHolder(Protocol):
    """The parameters of a policy that keeps a request on the holder of its longest prefix unless
    leaving pays (``kvcache-centric``'s ``stay_margin``: ``prefill_plan.stay_on_holder``)."""

    @property
    def stay_margin(self) -> float: ...


@runtime_checkable
class PicksAggregated(Protocol):
    """A policy with its own rule for which aggregated instance serves a request (the baselines'
    prefill pick: ``parts.PickEachPolicy.pick_aggregated``). Mode then decides only aggregated or
    disaggregated; the policy picks the instance. A policy without one (``kvcache-centric``) is
    served by the lowest predicted TTFT, kept on the prefix holder by ``stay_on_holder``."""

    def pick_aggregated(self, request: PolicyRequest, snapshot: ClusterSnapshot, candidates: Sequence[Instance],
                        rng: random.Random) -> Instance: ...


@dataclass(frozen=True, slots=True)
class Option:
    """One costed way to run the request (what ``explain`` shows beside the choice)."""

    mode: Mode
    prefill: str
    decode: str
    ttft_s: float
    tbt_ms: float
    fits: bool


@dataclass(frozen=True, slots=True)
class ModeChoice:
    decision: Decision
    options: tuple[Option, ...] = ()

    @property
    def mode(self) -> Mode:
        d = self.decision
        return AGGREGATED if isinstance(d, Placement) and d.prefill == d.decode else DISAGGREGATED


def _aggregated(costs: Costs, request: PolicyRequest, inst: Instance, bs: int,
                ttft_budget: float, tbt_budget: float) -> tuple[Placement, bool, RejectCode | Literal[""]]:
    """``inst`` prefilling with its own cache and decoding: the placement, whether it meets
    the SLOs with room for the request, and the reason when it does not."""
    reuse = costs.local_reuse(inst, request, bs)
    ttft = costs.queue_wait_s(inst) + reuse.cost_s
    tbt = costs.tbt_ms(inst, request)
    why: RejectCode | Literal[""] = ""
    if not costs.decode_fits(inst, request, bs):
        why = "overloaded"
    elif ttft > ttft_budget:
        why = "ttft_slo"
    elif tbt > tbt_budget:
        why = "tbt_slo"
    p = Placement(prefill=inst.node_id, decode=inst.node_id, reused_blocks=reuse.blocks,
                  reuse_source=reuse.source, reuse_tier=reuse.tier, predicted_ttft_s=ttft, predicted_tbt_ms=tbt)
    return p, not why, why


def _stay(pool: list[tuple[Placement, bool, RejectCode | Literal[""]]],
          best: tuple[Placement, bool, RejectCode | Literal[""]],
          error: float, session: str | None = None) -> tuple[Placement, bool, RejectCode | Literal[""]]:
    """``best``, or the aggregated option on the holder of the longest prefix (the session's
    instance, when it is among them) when ``best`` beats it by no more than the prediction's error
    (the reason recorded when the holder is left)."""
    ps = [a[0] for a in pool]
    nodes = [x.prefill for x in ps]
    at, why = stay_on_holder([x.predicted_ttft_s for x in ps],
                             [x.reused_blocks if x.reuse_source == x.prefill else 0 for x in ps],
                             nodes, ps.index(best[0]), error, nodes.index(session) if session in nodes else -1)
    out = pool[at]
    return out if why is None else (dataclasses.replace(out[0], left_holder=why), out[1], out[2])


def _spill(pool: list[tuple[Placement, bool, RejectCode | Literal[""]]],
           best: tuple[Placement, bool, RejectCode | Literal[""]], error: float, request: PolicyRequest,
           both: Sequence[Instance], group_of: Callable[[str], tuple[str, ...]] | None,
           ) -> tuple[Placement, bool, RejectCode | Literal[""]]:
    """``best``, or a mate of its capacity group with room in its cache when ``best``'s is full
    (:func:`.prefill_plan.spill_in_group`; the reason recorded as the holder left)."""
    if group_of is None:
        return best
    inst_of = {i.node_id: i for i in both}
    nodes = [a[0].prefill for a in pool]
    at, why = spill_in_group([inst_of[n] for n in nodes], [a[0].predicted_ttft_s for a in pool], request.chain_len,
                             nodes.index(best[0].prefill), error, group_of)
    if why is None:
        return best
    out = pool[at]
    return dataclasses.replace(out[0], left_holder=why), out[1], out[2]


def _option(mode: Mode, p: Placement, fits: bool) -> Option:
    return Option(mode, p.prefill, p.decode, p.predicted_ttft_s, p.predicted_tbt_ms, fits)


def decide_mode(policy: Policy, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random,
                mark: Mark = no_mark) -> ModeChoice:
    """``policy``'s answer where every instance can hand KV off; otherwise the mode (and the
    instances) by predicted cost, with both options' costs. ``mark``: told of each stage as it
    ends (the policy's, when it reports them, then :data:`~.stages.MODE`)."""
    def decide(snap: ClusterSnapshot) -> Decision:
        if isinstance(policy, StagedPolicy):
            return policy.decide_staged(request, snap, rng, mark)
        out = policy.decide(request, snap, rng)
        mark(DECIDE)
        return out

    if snapshot.index is not None and not snapshot.index.both_count:
        return ModeChoice(decide(snapshot))  # without listing the instances
    insts = snapshot.instances
    both = [i for i in insts if i.role == "both"]
    if not both:
        return ModeChoice(decide(snapshot))
    if not isinstance(policy, BasePolicy):
        raise TypeError(f"policy {policy.name!r} has no cost model to weigh the aggregated options with")
    costs, p = policy.costs, policy.p
    # The SLO margin, the priority's shift and early rejection are parameters of the policies that have them.
    margin, shift, rejects = 1.0, 0.0, False
    if isinstance(p, EarlyRejecting):
        margin, shift, rejects = float(p.slo_margin), float(p.priority_shift), bool(p.early_rejection)
    below = p.aggregate_below_tokens
    bs = snapshot.block_size
    ttft_budget, tbt_budget = slo_budgets(request, margin, shift)

    if all(i.can_hand_off for i in both):
        pd = decide(snapshot)
    else:  # the policy places hand-offs only among instances that can carry them out
        able = tuple(i for i in insts if i.role != "both" or i.can_hand_off)
        pd = decide(dataclasses.replace(snapshot, instances=able, index=None))
    error = holder_error(costs.profile, float(p.stay_margin)) if isinstance(p, StaysOnHolder) else None
    picked = None
    if isinstance(policy, PicksAggregated):  # the policy's own rule picks among the aggregated instances
        only = dataclasses.replace(snapshot, instances=tuple(both), index=None)
        picked = policy.pick_aggregated(request, only, both, rng).node_id
    choice = _weigh(costs, request, pd, both, bs, ttft_budget, tbt_budget, below, rejects, error, picked)
    mark(MODE)
    return choice


def _weigh(costs: Costs, request: PolicyRequest, pd: Decision, both: list[Instance], bs: int, ttft_budget: float,
           tbt_budget: float, below: int, rejects: bool, stay_error: float | None = None,
           picked: str | None = None) -> ModeChoice:
    """The hand-off ``pd`` against each ``both`` instance run aggregated: which mode, with the
    options' costs. ``picked``: the aggregated instance the policy's own rule chose (None: the
    lowest predicted TTFT among those that fit, else among all); ``stay_error``: that lowest stays
    on the holder of the longest prefix unless another beats it by more than this share
    (``stay_on_holder``); None: no such rule."""
    aggs = {i.node_id: _aggregated(costs, request, i, bs, ttft_budget, tbt_budget) for i in both}
    if picked is not None:
        best = aggs[picked]
    else:
        # The lowest TTFT among those that fit, else among all; of equals (a capacity group's
        # members count the device's load alike) the first in node order whose cache the request
        # goes into without evicting, so a group's work gathers on one member until its cache is
        # full, then on the next.
        pool = [a for a in aggs.values() if a[1]] or list(aggs.values())
        room = {i.node_id: fits_in_cache(i, request.chain_len) for i in both}
        best = min(pool, key=lambda a: (a[0].predicted_ttft_s, a[0].predicted_tbt_ms, not room[a[0].prefill],
                                        a[0].prefill))
        if stay_error is not None:
            best = _stay(pool, best, stay_error, request.session_instance)
            best = _spill(pool, best, stay_error, request, both, costs.topology.grouping)

    if isinstance(pd, Placement) and pd.prefill == pd.decode:
        return ModeChoice(pd, (_option(AGGREGATED, pd, True),))
    if isinstance(pd, Rejection):
        if best[1] or (pd.reason == "no_live_instance" and not rejects):
            return ModeChoice(best[0], (_option(AGGREGATED, best[0], best[1]),))
        b, _, why = best
        if pd.reason == "no_live_instance" and why:  # (it does not fit, so there is a reason)
            return ModeChoice(Rejection(why, f"aggregated on {b.prefill}: predicted TTFT {b.predicted_ttft_s:.3f}s, "
                                        f"TBT {b.predicted_tbt_ms:.1f}ms ({why}); {pd.message}"),
                              (_option(AGGREGATED, b, False),))
        return ModeChoice(pd, (_option(AGGREGATED, best[0], False),))
    pd_opt = _option(DISAGGREGATED, pd, True)
    on_prefill = aggs.get(pd.prefill)
    if on_prefill is not None and on_prefill[1]:
        # Conditional disaggregation: the prefill instance could keep the request.
        local, _, _ = on_prefill
        uncached = request.prompt_tokens - local.reused_blocks * bs
        if uncached <= below or local.predicted_tbt_ms <= pd.predicted_tbt_ms:
            return ModeChoice(local, (_option(AGGREGATED, local, True), pd_opt))
    if best[1] and best[0].prefill != pd.prefill and best[0].predicted_ttft_s <= pd.predicted_ttft_s:
        return ModeChoice(best[0], (_option(AGGREGATED, best[0], True), pd_opt))
    return ModeChoice(pd, (pd_opt, _option(AGGREGATED, best[0], best[1])))


__all__ = ["AGGREGATED", "DISAGGREGATED", "ModeChoice", "Option", "PicksAggregated", "decide_mode"]
