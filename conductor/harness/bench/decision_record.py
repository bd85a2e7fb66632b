"""``conductor bench decision-record``: what folding the decision-time record costs each reader.

Every router, gateway (each worker) and picker keeps the cluster's pending blocks
(:class:`state.pending.InMemoryPendingBlocks`) and in-flight ledger
(:class:`state.inflight.InMemoryInflight`) in memory and folds every decision of the cluster
into them, its own and everyone else's. So their cost per decision grows with the cluster's
decision rate, not with one process's. This bench replays a synthetic stream of decisions at
each rate in model time (no sleeping, one process, pure code) and times, per decision, what a
reader does: the view's confirmed prefix applied (``confirm_held``), the pending prefixes read,
the placements recorded, the charge made, and the first token, finish and the engine's own
events of a decision made a little earlier.

The traffic: every prompt starts with one shared system prefix (``shared_blocks``) that the
view shows on every prefill instance, then blocks of its own; P/D, so each decision also places
the whole chain on its decode instance, where no engine event confirms it (the pull's copy is
not announced before the TTL runs out on the emulated and the vLLM decode side alike). That is
the shape that piles placements up on the shared blocks: ``rate x pending_ttl_s`` of them.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from conductor.stats import percentile
from state.inflight import InMemoryInflight
from state.pending import InMemoryPendingBlocks

EVENTS_AFTER = 20
"""Decisions between a request's decision and its engine's events, first token and finish."""


def run_decision_record_bench(rates: Sequence[int], *, seconds: float = 10.0, prefill: int = 8, decode: int = 4,
                              shared_blocks: int = 8, own_blocks: int = 8, ttl_s: float = 5.0, lease_s: float = 30.0,
                              seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": seconds, "prefill": prefill, "decode": decode, "shared_blocks": shared_blocks,
                           "own_blocks": own_blocks, "pending_ttl_s": ttl_s, "rates": {}}
    for rate in rates:
        out["rates"][str(rate)] = _one_rate(rate, seconds, prefill, decode, shared_blocks, own_blocks,
                                            int(ttl_s * 1000), int(lease_s * 1000), seed)
        if progress is not None:
            r = out["rates"][str(rate)]
            progress(f"{rate} decisions/s: {r['us_per_decision_p50']} us p50, {r['us_per_decision_p99']} us p99 "
                     f"({r['placements_live']} placements live)")
    return out


def _one_rate(rate: int, seconds: float, prefill: int, decode: int, shared: int, own: int, ttl_ms: int,
              lease_ms: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    pending = InMemoryPendingBlocks(ttl_ms)
    ledger = InMemoryInflight(lease_ms)
    system = [1_000_000 + k for k in range(shared)]
    p_nodes = [f"prefill-{i}" for i in range(prefill)]
    d_nodes = [f"decode-{i}" for i in range(decode)]
    held_all = {n: shared for n in p_nodes}  # the view shows the system prefix everywhere
    n = max(int(rate * seconds), EVENTS_AFTER + 1)
    step_ms = 1000.0 / rate
    t0_ms = 1_700_000_000_000
    made: list[tuple[str, str, list[int]]] = []
    took: list[float] = []
    for i in range(n):
        now = int(t0_ms + i * step_ms)
        chain = system + [10_000_000 + i * own + k for k in range(own)]
        p, d = rnd.choice(p_nodes), rnd.choice(d_nodes)
        rid = f"r{i}"
        t = time.perf_counter()
        pending.confirm_held(chain, held_all, now)
        pending.prefixes(chain, now, held_all)
        pending.record(rid, {p: chain[shared:], d: chain}, now)
        ledger.charge(rid, p, d, own * 32, len(chain) * 32, now)
        ledger.loads(now)
        if i >= EVENTS_AFTER:
            old, old_p, old_chain = made[i - EVENTS_AFTER]
            pending.confirm(old_p, old_chain[shared:], now)
            ledger.first_token(old, now)
            ledger.finish(old, now)
        took.append(time.perf_counter() - t)
        made.append((rid, p, chain))
    steady = took[len(took) // 2:]  # past the first TTL's build-up
    live = len(pending.pending_requests())
    mean_s = statistics.fmean(steady)
    return {
        "decisions": n,
        "us_per_decision_p50": round(percentile(steady, 50, empty=0.0) * 1e6, 1),
        "us_per_decision_p99": round(percentile(steady, 99, empty=0.0) * 1e6, 1),
        "us_per_decision_mean": round(mean_s * 1e6, 1),
        "core_share_at_rate": round(mean_s * rate, 4),
        "placements_live": live,
    }
