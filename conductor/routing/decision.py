"""The one place a policy's answer becomes a record on ``dispatch``, and a decision becomes
the reservations it holds until heartbeats show it.

A policy answers in blocks (:class:`~conductor.routing.policies.Placement`) or with a
:class:`~conductor.routing.policies.Rejection`; the wire carries tokens and everything
needed to re-derive the answer later (policy, params, seed, view watermark).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from conductor.routing.policies import Placement, Rejection
from conductor.routing.policies.mode import Option
from schemas import Endpoint, ModeOption, RejectReason, RoutingDecision, RoutingRejection, RoutingRequest
from state.reservations import Load, Reservation, placement_reservations


def rejection_record(request_id: str, reason: RejectReason, message: str, *, policy: str | None,
                     params: Mapping[str, Any], seed: int = 0,
                     watermark: Mapping[str, int] | None = None,
                     rederivation: Mapping[str, Any] | None = None) -> RoutingRejection:
    """A rejection on the wire (ids and messages clipped to the schema's caps).

    ``rederivation`` holds what `explain` needs besides the log (``control_offset``,
    ``block_size``, ``model_profile``), on rejections and decisions alike."""
    return RoutingRejection(
        request_id=request_id[:256] or "unknown",
        reason=reason,
        message=message[:4096],
        policy=policy,
        params=dict(params),
        seed=seed,
        watermark=dict(watermark or {}),
        **(rederivation or {}),
    )


def decision_record(req: RoutingRequest, answer: Placement | Rejection, *, block_size: int, policy: str,
                    params: Mapping[str, Any], seed: int, watermark: Mapping[str, int],
                    degraded: bool = False, age_ms: float = 0.0, degraded_reason: str = "",
                    rederivation: Mapping[str, Any] | None = None, options: Sequence[Option] = (),
                    endpoints: Mapping[str, Endpoint] | None = None) -> RoutingDecision | RoutingRejection:
    """The record of ``answer`` for ``req``: a placement's reused blocks become tokens
    (never more than the prompt); ``options``: the modes costed (``policies.mode``);
    ``endpoints``: node → how to reach it, for the nodes the placement names."""
    if isinstance(answer, Rejection):
        return rejection_record(req.request_id, answer.reason, answer.message, policy=policy, params=params,
                                seed=seed, watermark=watermark, rederivation=rederivation)
    return RoutingDecision(
        request_id=req.request_id,
        prefill_instance=answer.prefill,
        decode_instance=answer.decode,
        reused_tokens=min(answer.reused_blocks * block_size, req.prompt_tokens),
        reuse_source=answer.reuse_source,
        reuse_tier=answer.reuse_tier,
        predicted_ttft_s=answer.predicted_ttft_s,
        predicted_tbt_ms=answer.predicted_tbt_ms,
        policy=policy,
        params=dict(params),
        seed=seed,
        watermark=dict(watermark),
        degraded=degraded,
        degraded_reason=degraded_reason[:4096],
        snapshot_age_ms=age_ms,
        prefill_group=list(answer.prefill_group) if answer.prefill_group else None,
        chunk_boundaries=list(answer.chunk_boundaries) if answer.prefill_group else None,
        mode="aggregated" if answer.prefill == answer.decode else "disaggregated",
        options=[ModeOption(mode=o.mode, prefill_instance=o.prefill, decode_instance=o.decode,
                            predicted_ttft_s=o.ttft_s, predicted_tbt_ms=o.tbt_ms, fits=o.fits) for o in options],
        endpoints={n: e for n in (answer.prefill, answer.decode, *answer.prefill_group)
                   if endpoints and (e := endpoints.get(n)) is not None},
        left_holder=answer.left_holder,
        **(rederivation or {}),
    )


def decision_reservations(req: RoutingRequest, d: RoutingDecision, block_size: int) -> list[Reservation]:
    """What ``d`` holds on its nodes: the prompt tokens it computes and one queued request on
    the prefill instance (on each member of a CPP group: its own chunk and one queued
    request); a batch slot, the prompt as context and the whole request's KV blocks on the
    decode instance."""
    kv_blocks = -(-(req.prompt_tokens + req.expected_output_tokens) // block_size)
    out = placement_reservations(
        d.prefill_instance, d.decode_instance,
        prefill_tokens=(d.chunk_boundaries[0] if d.chunk_boundaries else req.prompt_tokens) - d.reused_tokens,
        context_tokens=req.prompt_tokens,
        kv_blocks=kv_blocks,
    )
    if d.prefill_group and d.chunk_boundaries:
        ends = d.chunk_boundaries
        for node, lo, hi in zip(d.prefill_group[1:], ends, ends[1:]):
            out = _add(out, Reservation(node, Load(prefill_tokens=hi - lo, prefill_requests=1)))
    return out


def _add(rs: list[Reservation], r: Reservation) -> list[Reservation]:
    """``rs`` with ``r`` merged into the reservation of its node (one per node)."""
    for i, x in enumerate(rs):
        if x.node == r.node:
            merged = Load(*(a + b for a, b in zip(x.load.as_tuple(), r.load.as_tuple())))
            return [*rs[:i], Reservation(x.node, merged), *rs[i + 1:]]
    return [*rs, r]


__all__ = ["decision_record", "decision_reservations", "rejection_record"]
