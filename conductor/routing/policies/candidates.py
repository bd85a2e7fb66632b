"""The candidates: which prefill instances can win, so only those are costed.

Every holder of a prefix of the chain can, and of the others, per place (rack, zone: what
their reuse options depend on, ``Costs.place_key``), those whose queue wait is within the tie
tolerance of the place's shortest: instances without a prefix at one place have the same reuse
plan, so their predicted TTFT (and guarded TTFT) grows with the wait alone, and a longer queue
there can never be lowest, tie with the lowest, or be the lowest safe one
(:func:`shortest_queues`). From the router's index the queues are walked in order of wait and
the walk stops once no wait left can reach the lowest TTFT so far (:func:`walk_queues`).
Both are exact: ``tests/property/test_candidate_pruning.py`` and
``tests/property/test_cluster_index.py`` check them against costing every instance. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from conductor.costmodel.costs import Costs, PlaceKey
from conductor.routing.policies.prefill_plan import BestReuse, Costed, Shape
from conductor.routing.snapshot import NO_PREFIX, IndexView, Instance, PolicyRequest


def tie_margin(prefill_tie_s: float) -> float:
    """How far above the shortest wait (or the lowest TTFT) an instance is still kept as a
    candidate: generous, since keeping one too many is harmless."""
    return 2 * prefill_tie_s + 1e-9


def shortest_queues(costs: Costs, prefills: Sequence[Instance], waits: Sequence[float],
                    margin: float) -> list[tuple[Instance, float]]:
    """The prefill instances that can win, with their waits: every holder of a prefix of the
    chain, and of the others, per place, those whose wait is within ``margin`` of the place's
    shortest (in the order given)."""
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


def walk_queues(costs: Costs, request: PolicyRequest, ix: IndexView, bs: int, best_reuse: BestReuse,
                bare_floor: float, margin: float) -> Costed:
    """The candidates from the index, costed: the prefill instances in order of queue wait,
    holders and bare ones alike (a bare one only within ``margin`` of its place's shortest),
    until the wait plus the cheapest plan any instance may have exceeds the lowest TTFT found
    plus ``margin``: nothing further can be lowest or tie with it."""
    out = Costed([], [], [], [])
    lo = float("inf")
    prefix, base = ix.prefix, ix.base
    # No instance can do better than its wait plus the cheapest plan of any shape it may
    # have: the whole compute, a copy from anywhere, its own prefix.
    shape_floor: dict[Shape, float] = {shape: min(bare_floor, costs.local_plan(shape, request, bs)[2])
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
        lo = min(lo, out.add(inst, w, best_reuse(inst)))
    return out


__all__ = ["shortest_queues", "tie_margin", "walk_queues"]
