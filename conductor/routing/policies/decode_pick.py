"""The decode pick: among instances with room for the request whose predicted TBT (with it added)
meets the SLO, the least loaded, picked at random (by the seeded generator, in node-id order)
within a low-load band of the lowest TBT. Pure.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Sequence

from conductor.costmodel.costs import Costs, tbt_of_load
from conductor.routing.policies.admission import Admission
from conductor.routing.policies.base import Rejection
from conductor.routing.policies.parts import pick_lowest
from conductor.routing.snapshot import IndexView, Instance, PolicyRequest

_first = operator.itemgetter(0)
"""An index decode entry's load."""


def decode_pick(costs: Costs, admission: Admission, request: PolicyRequest, decodes: Sequence[Instance], bs: int,
                band: float, rng: random.Random) -> tuple[Instance, float] | Rejection:
    """Least loaded under the TBT SLO (at random in the band), with its predicted TBT; without
    early rejection, the least loaded of all when none fits or meets the SLO."""
    fitting = [d for d in decodes if costs.decode_fits(d, request, bs)]
    if not fitting:
        if admission.enabled:
            return admission.no_decode_room(costs.decode_blocks_needed(request, bs))
        fitting = list(decodes)
    tbts = [costs.tbt_ms(d, request) for d in fitting]
    tbt_budget = admission.budgets(request)[1]
    ok = [i for i, t in enumerate(tbts) if t <= tbt_budget]
    if not ok:
        if admission.enabled:
            return admission.tbt_too_long(request, min(tbts), len(fitting))
        ok = list(range(len(fitting)))
    lo = min(tbts[i] for i in ok)
    in_band = [i for i in ok if tbts[i] <= lo * (1.0 + band) + 1e-9]
    d_idx = pick_lowest(in_band, [0.0] * len(in_band), rng, node_id=lambda i: fitting[i].node_id)
    return fitting[d_idx], tbts[d_idx]


def decode_pick_indexed(costs: Costs, admission: Admission, request: PolicyRequest, ix: IndexView, bs: int,
                        band: float, rng: random.Random) -> tuple[Instance, float] | None:
    """:func:`decode_pick` over the index's decode instances in order of load, up to the end of
    the low-load band of the first that fits; None when that one misses the TBT SLO or none
    fits (the rejection, or the fallback without early rejection, needs every instance).

    The band is often a hundred instances or more, so TBTs are computed only where the
    load alone cannot settle it: a request's TBT is ``tbt_of_load`` of the instance's
    load up to rounding, so an instance whose load is below the band's edge by more than
    a relative 1e-9 is in it, one above it by as much (and every later one) is out, and
    only the lowest loads (for the lowest TBT) and those near the edge are computed with
    Costs.tbt_ms: the answer is decode_pick's to the bit (tests/property/test_cluster_index.py).
    A context below zero (counted as zero by the TBT, never sent by an engine) leaves it
    to decode_pick."""
    budget = admission.budgets(request)[1]
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
    # The band of decode_pick: within the SLO and the low-load band of the lowest TBT.
    cut = min(budget, lo * (1.0 + band) + 1e-9)
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


__all__ = ["decode_pick", "decode_pick_indexed"]
