"""The search for the smallest cluster that meets a target: instance counts in, one simulation per probe.

Pure: it calls ``evaluate(prefill, decode)`` (the simulator, in :mod:`conductor.harness.plan.planner`;
a toy model in the tests) and never runs anything itself. The two roles are nearly independent
(prefill instances set TTFT, decode instances TBT), so each is bisected with the other one ample,
and the pair is then checked together: about ``log2(P) + log2(D) + 2`` simulations, not ``P x D``.
Once the goal is known, a probe is only asked whether it meets it: ``evaluate`` may stop a replay as
soon as more requests have missed than the goal allows (``stop_below``), which is where most of a
too-small cluster's time would go.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from conductor.errors import ConfigError


@dataclass(frozen=True)
class Probe:
    """What one simulated cluster achieved: shares of every request (a rejected one meets no SLO)."""

    prefill: int
    decode: int
    slo_attainment: float
    """Both SLOs met."""
    ttft_attainment: float
    tbt_attainment: float
    stopped: bool = False
    """The replay stopped once the goal was out of reach: the attainments are upper bounds (what the
    requests replayed so far allow), the first below ``stop_below``."""


class Evaluate(Protocol):
    """``evaluate(prefill, decode, stop_below=None)``: simulate that cluster on the planned traffic; with
    ``stop_below``, it may stop as soon as the SLO attainment cannot reach it (a :attr:`Probe.stopped` one)."""

    def __call__(self, prefill: int, decode: int, /, stop_below: float | None = None) -> Probe: ...


@dataclass(frozen=True)
class SearchLimits:
    """Bounds on the search: no role grows past ``max_instances``; at most ``max_runs`` simulations."""

    max_instances: int = 1024
    max_runs: int = 48
    slack: float = 0.005
    """When doubling every role no longer raises attainment by this much and the target is still
    missed, more instances cannot meet it (requests no instance serves in time: prompts too long for
    the TTFT SLO); the plan then aims this far below the best attainment seen."""

    def __post_init__(self) -> None:
        if self.max_instances < 1 or self.max_runs < 4:
            raise ConfigError("search limits: max_instances >= 1 and max_runs >= 4")


@dataclass(frozen=True)
class PlanSearch:
    """The smallest (prefill, decode) found, what it achieved, and every probe tried in order."""

    prefill: int
    decode: int
    goal: float
    """The attainment searched for: the target, or just under the best reachable one (``target_met`` False)."""
    target_met: bool
    at_plan: Probe
    probes: tuple[Probe, ...] = field(default=())
    exhausted: bool = False
    """The run budget ran out: the plan is the smallest cluster known to meet ``goal``, maybe not the minimum."""


class _Budget(Exception):
    pass


def find_plan(evaluate: Evaluate, *, start: tuple[int, int], target: float,
              limits: SearchLimits = SearchLimits()) -> PlanSearch:
    """The fewest prefill and decode instances whose simulated SLO attainment is at least ``target``.

    Assumes attainment does not fall when either role grows (true up to simulation noise; the joint
    check catches a pair that misses, and the short role grows until the pair meets). ``start`` is
    today's cluster: the upper bracket grows from it by doubling.
    """
    if not 0.0 < target <= 1.0:
        raise ConfigError(f"--target {target}: expected a share in (0, 1]")
    seen: dict[tuple[int, int], Probe] = {}
    order: list[Probe] = []

    def run(p: int, d: int, stop_below: float | None = None) -> Probe:
        if (p, d) not in seen:
            if len(seen) >= limits.max_runs:
                raise _Budget
            seen[p, d] = evaluate(p, d, stop_below=stop_below)
            order.append(seen[p, d])
        return seen[p, d]

    cap = limits.max_instances
    hi_p, hi_d = min(cap, max(1, start[0])), min(cap, max(1, start[1]))
    top = run(hi_p, hi_d)
    best_seen = top.slo_attainment
    try:
        while top.slo_attainment < target and (hi_p < cap or hi_d < cap):
            nxt = min(cap, 2 * hi_p), min(cap, 2 * hi_d)
            grown = run(*nxt)
            best_seen = max(best_seen, grown.slo_attainment)
            if grown.slo_attainment < top.slo_attainment + limits.slack and grown.slo_attainment >= 0.5:
                # Twice the instances no longer help: what is missed, no cluster size fixes. (Below
                # half met, a flat attainment is a cluster still far too small: queues grow either way.)
                break
            top, (hi_p, hi_d) = grown, nxt
    except _Budget:
        pass  # the largest cluster simulated is the bracket
    met = top.slo_attainment >= target
    goal = target if met else max(0.0, best_seen - limits.slack)

    def ok(p: int, d: int) -> bool:
        return run(p, d, goal).slo_attainment >= goal

    best = (hi_p, hi_d)
    try:
        p = _smallest(lambda n: ok(n, hi_d), hi_p)
        d = _smallest(lambda n: ok(hi_p, n), hi_d)
        while not ok(p, d):  # the roles interact a little (a slow prefill shifts decode arrivals)
            probe = seen[p, d]
            if (probe.ttft_attainment <= probe.tbt_attainment and p < hi_p) or d >= hi_d:
                p = min(hi_p, p + max(1, math.ceil(0.1 * p)))
            else:
                d = min(hi_d, d + max(1, math.ceil(0.1 * d)))
        best = (p, d)
        exhausted = False
    except _Budget:
        known = [(q.prefill + q.decode, q.prefill, q.decode) for q in order if q.slo_attainment >= goal]
        best = min(known)[1:] if known else best
        exhausted = True
    return PlanSearch(prefill=best[0], decode=best[1], goal=goal, target_met=met, at_plan=seen[best],
                      probes=tuple(order), exhausted=exhausted)


def _smallest(meets: Callable[[int], bool], hi: int) -> int:
    """The least ``n`` in ``[1, hi]`` with ``meets(n)``, given ``meets(hi)`` and monotone ``meets``."""
    lo = 0  # known (or assumed) to miss
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["Evaluate", "PlanSearch", "Probe", "SearchLimits", "find_plan"]
