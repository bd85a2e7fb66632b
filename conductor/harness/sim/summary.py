"""Per-policy numbers of one simulation run (the JSON line and the report's table)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from conductor.harness.sim.engine import PATH_CLASS, Outcome, SimResult
from conductor.stats import percentile

ATTAINMENT_PLACES = 4
"""Decimal places of the SLO attainments a summary reports (and a search compares with its goal)."""


def load_imbalance(busy: Sequence[float]) -> float:
    """Busiest instance's busy time over the mean (1.0 = perfectly even)."""
    if not busy:
        return math.nan
    mean = sum(busy) / len(busy)
    return max(busy) / mean if mean > 0 else 1.0


def meets_slo(o: Outcome, ttft_slo_s: float, tbt_slo_ms: float) -> tuple[bool, bool]:
    """(TTFT met, TBT met); a rejected request meets neither. The TTFT counted is the simulated one plus
    the request's recorded time outside the engines (``path_s``, 0 for a trace)."""
    if o.rejected is not None:
        return False, False
    return o.ttft_s + o.path_s <= ttft_slo_s, o.tbt_ms <= tbt_slo_ms


def summarize(
    result: SimResult,
    *,
    policy: str,
    speed: float,
    reuse_upper_bound: float,
    sim_wall_s: float,
) -> dict[str, Any]:
    """The numbers of one run. TTFT/TBT statistics cover the requests that were served;
    SLO attainment and goodput count every request (a rejected one meets no SLO).

    A run stopped early (``result.stopped_s``) counts a request whose TTFT or TBT was not known yet
    as meeting it: its attainments are upper bounds (``stopped_early``), its statistics cover what
    had happened."""
    c = result.cluster
    outs = result.outcomes
    stopped = result.stopped_s is not None
    served = [o for o in outs if o.rejected is None]
    ttft = sorted(v for o in served if not math.isnan(v := o.ttft_s))
    tbt = sorted(v for o in served if not math.isnan(v := o.tbt_ms))
    n = len(outs)
    t_ok = b_ok = both = 0
    for o in outs:
        if stopped and o.rejected is None:
            a, b = not o.ttft_s + o.path_s > c.ttft_slo_s, not o.tbt_ms > c.tbt_slo_ms  # unknown yet (NaN): met
        else:
            a, b = meets_slo(o, c.ttft_slo_s, c.tbt_slo_ms)
        t_ok += a
        b_ok += b
        both += a and b
    start = min((o.arrival_s for o in outs), default=0.0)
    span = max(result.makespan_s - start, 1e-9)
    input_tokens = sum(o.input_length for o in outs)
    busy = [v["busy_s"] for v in result.prefill_load.values()]
    dbusy = [v["tokens"] for v in result.decode_load.values()]
    reasons = Counter(o.rejected for o in outs if o.rejected is not None)

    def r(x: float | None, nd: int = ATTAINMENT_PLACES) -> float | None:
        return None if x is None or math.isnan(x) else round(x, nd)

    return {
        "policy": policy,
        "cluster": f"{c.prefill_instances}P{c.decode_instances}D",
        "speed": round(speed, 4),
        "requests": n,
        "served": len(served),
        "rejected": n - len(served),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "ttft_mean_s": r(sum(ttft) / len(ttft) if ttft else math.nan),
        "ttft_p50_s": r(percentile(ttft, 50)),
        "ttft_p90_s": r(percentile(ttft, 90)),
        "ttft_p99_s": r(percentile(ttft, 99)),
        "tbt_mean_ms": r(sum(tbt) / len(tbt) if tbt else math.nan, 3),
        "tbt_p50_ms": r(percentile(tbt, 50), 3),
        "tbt_p90_ms": r(percentile(tbt, 90), 3),
        "tbt_p99_ms": r(percentile(tbt, 99), 3),
        "ttft_slo_s": c.ttft_slo_s,
        "tbt_slo_ms": c.tbt_slo_ms,
        "ttft_slo_attainment": r(t_ok / n if n else math.nan),
        "tbt_slo_attainment": r(b_ok / n if n else math.nan),
        "slo_attainment": r(both / n if n else math.nan),
        "goodput_rps": r(both / span),
        "reuse_ratio": r(sum(o.reused_tokens for o in served) / input_tokens if input_tokens else 0.0),
        "reuse_upper_bound": r(reuse_upper_bound),
        "remote_reuse_requests": sum(o.remote_reuse for o in served),
        "prefill_imbalance": r(load_imbalance(busy), 3),
        "decode_imbalance": r(load_imbalance(dbusy), 3),
        "makespan_s": r(result.makespan_s, 2),
        "kv_events": result.events_published,
        "sim_wall_s": round(sim_wall_s, 3),
        "stopped_early": stopped,
        "topology": result.topology,
        "cpp_requests": sum(bool(o.group) for o in served),
        "prefix_reads": _prefix_reads(served),
        "handoff_mean_s": r(sum(o.handoff_s for o in served) / len(served) if served else math.nan),
        "paths": _paths(result),
    }


def _prefix_reads(served: Sequence[Outcome]) -> dict[str, dict[str, float]]:
    """Per place a reused prefix was read from (``local`` or a path class): requests, tokens
    reused and the mean read time."""
    out: dict[str, dict[str, float]] = {}
    for o in served:
        if o.prefix_path is None:
            continue
        row = out.setdefault(o.prefix_path, {"requests": 0, "tokens": 0, "read_s": 0.0})
        row["requests"] += 1
        row["tokens"] += o.reused_tokens
        row["read_s"] += o.prefix_read_s
    for row in out.values():
        row["read_s_mean"] = round(row.pop("read_s") / row["requests"], 4)
    return dict(sorted(out.items()))


def _paths(result: SimResult) -> dict[str, dict[str, float]]:
    """Per path class: transfers, GB moved, the busiest path's busy time and the most
    transfers that ever shared one path."""
    out: dict[str, dict[str, float]] = {}
    for key, st in result.paths.items():
        row = out.setdefault(PATH_CLASS[key[0]], {"transfers": 0, "gb": 0.0, "busiest_s": 0.0, "max_concurrent": 0})
        row["transfers"] += st.transfers
        row["gb"] += st.bytes / 1e9
        row["busiest_s"] = max(row["busiest_s"], st.busy_s)
        row["max_concurrent"] = max(row["max_concurrent"], st.max_concurrent)
    for row in out.values():
        row["gb"] = round(row["gb"], 1)
        row["busiest_s"] = round(row["busiest_s"], 2)
    return dict(sorted(out.items()))
