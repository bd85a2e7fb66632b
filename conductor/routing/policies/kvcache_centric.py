"""``kvcache-centric``: Conductor's own policy (Mooncake, FAST'25 Algorithm 1).

Prefill: for every prefill-capable instance, TTFT = its queue wait + the cheapest
way to get a prefix in (its own cache from HBM/DRAM/SSD, or the best prefix held
anywhere in the cluster, copied over the rack or cross-rack link) + compute of the
rest; the lowest TTFT wins, not the longest match. Decode: among instances with
room for the request whose predicted TBT (with it added) meets the SLO, the least
loaded, picked at random within a low-load band. When no pair can meet the SLOs
the request is rejected before any compute is spent (prediction-based early
rejection, Mooncake arXiv v3 §7). The rejection test counts the predicted queue
wait ``queue_wait_safety`` times: the wait is estimated from a heartbeat's queued
tokens as equal-length prompts, which under load is optimistic (long prompts cost
quadratically), while the request's own prefill estimate is not; see
docs/simulation/ANALYSIS.md for the measurement behind the default.
"""

from __future__ import annotations

import random

from pydantic import Field

from conductor.routing.policies.base import (
    Decision,
    PolicyParams,
    Rejection,
    Reuse,
)
from conductor.routing.policies.parts import RoleSplitPolicy, pick_lowest, placement
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


def _first(item: tuple) -> float:
    return item[0]


class KvCacheCentricParams(PolicyParams):
    kvcache_balancing_threshold: float = Field(
        default=1.0,
        ge=0,
        description="read a prefix from another node only if it is longer than this x the local one",
    )
    remote_reuse: bool = Field(default=True, description="consider prefixes held on other nodes at all")
    early_rejection: bool = Field(default=True, description="reject when no pair meets the SLOs")
    slo_margin: float = Field(default=1.0, gt=0, description="reject when prediction > SLO x margin")
    queue_wait_safety: float = Field(
        default=2.0,
        ge=1.0,
        description="early rejection counts the predicted queue wait this many times (the wait estimate "
        "is optimistic under load; 1 = trust it)",
    )
    decode_low_load_band: float = Field(
        default=0.1, ge=0, description="decode picks at random among TBTs within (1 + band) x the lowest"
    )
    prefill_tie_s: float = Field(default=1e-6, ge=0, description="TTFTs closer than this are a tie")


class KvCacheCentric(RoleSplitPolicy):
    name = "kvcache-centric"
    summary = "Mooncake's policy: lowest predicted TTFT over local and remote prefixes, SLO-aware decode, early rejection"
    Params = KvCacheCentricParams

    def place(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
              decodes: tuple[Instance, ...], rng: random.Random) -> Decision:
        pre = self._prefill(request, snapshot, prefills, rng)
        if isinstance(pre, Rejection):
            return pre
        inst, reuse, ttft = pre
        dec = self._decode(request, snapshot, decodes, rng)
        if isinstance(dec, Rejection):
            return dec
        decode, tbt = dec
        return placement(inst, decode, reuse, ttft, tbt)

    def _prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: tuple[Instance, ...],
                 rng: random.Random) -> tuple[Instance, Reuse, float] | Rejection:
        """Lowest predicted TTFT, with its reuse plan; or why none meets the SLO."""
        p: KvCacheCentricParams = self.p  # type: ignore[assignment]
        costs = self.costs
        bs = snapshot.block_size
        same_rack: list[tuple[float, str, str | None, Reuse]] = []
        cross_rack: list[tuple[float, str, str | None, Reuse]] = []
        if p.remote_reuse:
            for h in snapshot.instances:
                if h.prefix_blocks[2] > 0:
                    opts = costs.remote_options(h, request, bs)
                    if opts is not None:
                        same_rack.append((opts[0].cost_s, h.node_id, h.rack, opts[0]))
                        cross_rack.append((opts[1].cost_s, h.node_id, h.rack, opts[1]))
            # Cheapest first: each prefill instance stops at its first usable copy.
            same_rack.sort(key=_first)
            cross_rack.sort(key=_first)
        threshold = p.kvcache_balancing_threshold
        ttfts: list[float] = []
        reuses: list[Reuse] = []
        waits: list[float] = []
        for inst in prefills:
            best = costs.local_reuse(inst, request, bs)
            floor = best.blocks * threshold
            node, rack = inst.node_id, inst.rack
            for cost, holder, hrack, r in same_rack:
                if cost >= best.cost_s:
                    break
                if hrack == rack and holder != node and r.blocks > floor:
                    best = r
                    break
            for cost, holder, hrack, r in cross_rack:
                if cost >= best.cost_s:
                    break
                if hrack != rack and r.blocks > floor:
                    best = r
                    break
            wait = costs.queue_wait_s(inst)
            waits.append(wait)
            reuses.append(best)
            ttfts.append(wait + best.cost_s)
        chosen = pick_lowest(range(len(prefills)), ttfts, rng, tol=p.prefill_tie_s, node_id=lambda i: prefills[i].node_id)
        ttft = ttfts[chosen]
        ttft_budget = request.ttft_slo_s * p.slo_margin
        # Admitting work whose TTFT lands just under the SLO by an optimistic wait estimate
        # fills queues until most of it misses (measured in the simulator), so the wait
        # part of the prediction must clear the budget with a safety factor.
        extra = p.queue_wait_safety - 1.0
        if p.early_rejection and ttft + extra * waits[chosen] > ttft_budget:
            # The fastest instance fails the guarded check; one with a shorter queue may pass it.
            safe = [i for i in range(len(prefills)) if ttfts[i] + extra * waits[i] <= ttft_budget]
            if safe:
                chosen = pick_lowest(safe, [ttfts[i] for i in safe], rng, tol=p.prefill_tie_s,
                                     node_id=lambda i: prefills[i].node_id)
                ttft = ttfts[chosen]
        guarded = ttft + extra * waits[chosen]
        if p.early_rejection and guarded > ttft_budget:
            if min(waits) > ttft_budget:
                return Rejection(
                    "overloaded",
                    f"every prefill queue alone exceeds the TTFT SLO {request.ttft_slo_s:g}s "
                    f"(shortest wait {min(waits):.3f}s over {len(prefills)} instances)",
                )
            return Rejection(
                "ttft_slo",
                f"best predicted TTFT {ttft:.3f}s on {prefills[chosen].node_id}, {guarded:.3f}s with its queue wait "
                f"{waits[chosen]:.3f}s counted x{p.queue_wait_safety:g}, exceeds the SLO {request.ttft_slo_s:g}s "
                f"on every one of {len(prefills)} prefill instances",
            )
        return prefills[chosen], reuses[chosen], ttft

    def _decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: tuple[Instance, ...],
                rng: random.Random) -> tuple[Instance, float] | Rejection:
        """Least loaded under the TBT SLO (at random in a low-load band), with its predicted TBT."""
        p: KvCacheCentricParams = self.p  # type: ignore[assignment]
        costs = self.costs
        bs = snapshot.block_size
        fitting = [d for d in decodes if costs.decode_fits(d, request, bs)]
        if not fitting:
            if p.early_rejection:
                need = costs.decode_blocks_needed(request, bs)
                return Rejection("overloaded", f"no decode instance has {need} free KV blocks for the request")
            fitting = list(decodes)
        tbts = [costs.tbt_ms(d, request) for d in fitting]
        tbt_budget = request.tbt_slo_ms * p.slo_margin
        ok = [i for i, t in enumerate(tbts) if t <= tbt_budget]
        if not ok:
            if p.early_rejection:
                return Rejection(
                    "tbt_slo",
                    f"lowest predicted TBT {min(tbts):.1f}ms exceeds the SLO {request.tbt_slo_ms:g}ms "
                    f"on all {len(fitting)} decode instances",
                )
            ok = list(range(len(fitting)))
        lo = min(tbts[i] for i in ok)
        band = [i for i in ok if tbts[i] <= lo * (1.0 + p.decode_low_load_band) + 1e-9]
        d_idx = pick_lowest(band, [0.0] * len(band), rng, node_id=lambda i: fitting[i].node_id)
        return fitting[d_idx], tbts[d_idx]
