"""Early rejection (Mooncake arXiv v3 §7): whether a predicted placement may be admitted, and why not.

The test holds the prediction to the SLO with a margin for its own error. With a profile fitted
from served requests (``conductor fit``: it carries its observed, out-of-sample errors), a request
is rejected when ``predicted x (real / predicted, p90)`` exceeds the budget, i.e. when requests
predicted like it missed the SLO more than about one time in ten (a profile with only
``ttft_error_p90``: ``predicted x (1 + it)``). A hand-set profile has no measured error; the test
then counts the predicted queue wait ``queue_wait_safety`` times (2 by default): the wait is
estimated from a heartbeat's queued tokens as equal-length prompts, which under load is
optimistic (long prompts cost quadratically), while the request's own prefill estimate is not;
see docs/simulation/ANALYSIS.md for the measurement behind that default. Setting
``queue_wait_safety`` explicitly keeps that rule, fitted profile or not.

Priority moves the line: the budget is the SLO x ``slo_margin`` x ``1 + priority_shift x
priority / 100`` (:func:`~conductor.routing.policies.base.slo_budgets`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from conductor.costmodel.profiles import ModelProfile
from conductor.routing.policies.base import Rejection, slo_budgets
from conductor.routing.snapshot import PolicyRequest

MarginKind = Literal["ratio", "error", "wait"]


def margin_of(profile: ModelProfile, queue_wait_safety: float | None) -> tuple[MarginKind, float]:
    """The prediction's margin for its own error: ``("ratio", x)`` (the fitted profile's measured
    p90 of real / predicted, at least 1), else ``("error", e)`` (its p90 of the relative error),
    else ``("wait", k)`` (the queue wait counted ``queue_wait_safety`` times, 2 when unset)."""
    if queue_wait_safety is None:
        if profile.ttft_ratio_p90 is not None:
            return "ratio", max(profile.ttft_ratio_p90, 1.0)
        if profile.ttft_error_p90 is not None:
            return "error", profile.ttft_error_p90
    return "wait", 2.0 if queue_wait_safety is None else queue_wait_safety


def held_to(request: PolicyRequest, budget: float, unit: str) -> str:
    """What a rejection message says of a priority other than 0: the budget it was held to."""
    return f" (held to {budget:g}{unit} at priority {request.priority})" if request.priority else ""


@dataclass(frozen=True, slots=True)
class Admission:
    """Early rejection as one policy's parameters and profile set it (fixed for the policy's life)."""

    enabled: bool
    slo_margin: float
    priority_shift: float
    kind: MarginKind
    x: float

    @classmethod
    def of(cls, profile: ModelProfile, *, enabled: bool, slo_margin: float, priority_shift: float,
           queue_wait_safety: float | None) -> Admission:
        kind, x = margin_of(profile, queue_wait_safety)
        return cls(enabled, slo_margin, priority_shift, kind, x)

    def budgets(self, request: PolicyRequest) -> tuple[float, float]:
        """(TTFT budget s, TBT budget ms): the request's SLOs x the margin, scaled by its priority."""
        return slo_budgets(request, self.slo_margin, self.priority_shift)

    def guarded(self, ttft: float, wait: float) -> float:
        """The TTFT held to the budget: the prediction with its margin."""
        if self.kind == "ratio":
            return ttft * self.x
        if self.kind == "error":
            return ttft * (1.0 + self.x)
        return ttft + (self.x - 1.0) * wait

    def margin_text(self, wait: float) -> str:
        """How :meth:`guarded` came from the prediction, for a rejection's message."""
        if self.kind == "ratio":
            return f"x{self.x:.2f}, the model's measured real/predicted p90"
        if self.kind == "error":
            return f"with the model's measured error p90 {self.x:.0%} added"
        return f"with its queue wait {wait:.3f}s counted x{self.x:g}"

    # --- the explanations ------------------------------------------------------------

    def queues_too_long(self, request: PolicyRequest, shortest_wait: float, instances: int) -> Rejection:
        budget = self.budgets(request)[0]
        return Rejection(
            "overloaded",
            f"every prefill queue alone exceeds the TTFT SLO {request.ttft_slo_s:g}s{held_to(request, budget, 's')} "
            f"(shortest wait {shortest_wait:.3f}s over {instances} instances)",
        )

    def ttft_too_long(self, request: PolicyRequest, ttft: float, node: str, wait: float, instances: int,
                      cpp: bool) -> Rejection:
        budget = self.budgets(request)[0]
        return Rejection(
            "ttft_slo",
            f"best predicted TTFT {ttft:.3f}s on {node}, {self.guarded(ttft, wait):.3f}s {self.margin_text(wait)}, "
            f"exceeds the SLO {request.ttft_slo_s:g}s"
            f"{held_to(request, budget, 's')} "
            f"on every one of {instances} prefill instances" + (" and every CPP group" if cpp else ""),
        )

    def no_decode_room(self, need: int) -> Rejection:
        return Rejection("overloaded", f"no decode instance has {need} free KV blocks for the request")

    def tbt_too_long(self, request: PolicyRequest, lowest_ms: float, instances: int) -> Rejection:
        budget = self.budgets(request)[1]
        return Rejection(
            "tbt_slo",
            f"lowest predicted TBT {lowest_ms:.1f}ms exceeds the SLO {request.tbt_slo_ms:g}ms"
            f"{held_to(request, budget, 'ms')} "
            f"on all {instances} decode instances",
        )


__all__ = ["Admission", "MarginKind", "held_to", "margin_of"]
