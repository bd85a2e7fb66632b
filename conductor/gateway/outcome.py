"""What one client request went through (:class:`Trace`) and the ``request_outcome`` it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conductor.frontdoor.protocol import ReleaseMark, outcome_decision_fields, outcome_release_fields
from conductor.stats import percentile
from schemas import RequestOutcome, RoutingDecision

if TYPE_CHECKING:
    from conductor.gateway.handoff import Call


@dataclass
class Trace:
    """What one client request went through (becomes its ``request_outcome``)."""

    request_id: str
    t0: float
    stream: bool
    attempts: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    busy: str | None = None
    """Why an engine this gateway had at its bound turned the request away (it is routed again once
    without that engine; the client's 429 if nothing else takes it)."""
    decision: RoutingDecision | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    gaps_ms: list[float] = field(default_factory=list)
    routing_ms: float = 0.0
    decided_s: float = 0.0
    """From the request's arrival to its (last) decision: parse, tokenize, route through the log."""
    model: str | None = None
    prefill_s: float = 0.0
    """Wall time of the prefill call(s) of a hand-off (the last attempt's)."""
    decode_sent: float | None = None
    """When the decode (or aggregated) call was sent (the clock's time)."""
    status: int = 200
    error: str | None = None
    message: str = ""
    first_token_release: ReleaseMark | None = None
    """The (last) decision's first token as released (``Decider.released``): its time on the view's
    clock and its number on the shared streams."""
    finished_release: ReleaseMark | None = None
    """Its end, as released."""
    finished: str | None = None
    """The attempt whose end was released (a decision's end is released once)."""
    held_kv: tuple[str, dict[str, Any], dict[str, Any]] | None = None
    """vLLM P/D: (prefill instance, its ``kv_transfer_params``, its answer) of a prefill whose decode
    failed before it took the request: the blocks stay pinned there for a decode to pull, so a
    retry that keeps that prefill instance sends only the decode half (:mod:`.handoff.vllm`)."""
    held_call: Call | None = None
    """The call whose prefill ``held_kv`` is (what a later freeing pull repeats, one token long)."""

    def exclude(self, node: str) -> None:
        """Route this request's next attempt without ``node`` (it failed, or was at its bound)."""
        if node not in self.excluded:
            self.excluded.append(node)


def outcome_of(tr: Trace, gateway_id: str, now: float) -> RequestOutcome:
    """``tr`` as its ``request_outcome``, ``now`` on the clock of ``tr.t0``."""
    d = tr.decision
    return RequestOutcome(
        request_id=tr.request_id, gateway=gateway_id, status=tr.status, error=tr.error,
        message=tr.message[:4096], attempts=tr.attempts[:16],
        **outcome_decision_fields(d), excluded=tr.excluded[:64], prompt_tokens=tr.prompt_tokens,
        cached_tokens=min(tr.cached_tokens, tr.prompt_tokens),
        output_tokens=tr.output_tokens, ttft_s=tr.ttft_s,
        tbt_p50_ms=percentile(tr.gaps_ms, 50), tbt_p99_ms=percentile(tr.gaps_ms, 99),
        routing_ms=tr.routing_ms or None, total_s=max(0.0, now - tr.t0), stream=tr.stream,
        model=tr.model, decided_s=tr.decided_s if d else None,
        prefill_s=tr.prefill_s if d and not d.aggregated and tr.prefill_s else None,
        decode_ttft_s=(tr.t0 + tr.ttft_s - tr.decode_sent
                       if tr.ttft_s is not None and tr.decode_sent is not None else None),
        **outcome_release_fields(tr.first_token_release if d else None, tr.finished_release if d else None),
    )
