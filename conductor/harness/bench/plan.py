"""``conductor bench plan``: is ``conductor plan``'s predicted SLO attainment what the planned cluster achieves?

On emulated engines (``conductor engine``, ``speed`` times faster than the model), one slice of the
Mooncake trace (the demo's ``load_slice``), the same SLOs throughout:

1. **record**: the slice through Conductor (stream worker, router, a bridge per engine, the gateway)
   on the recorded cluster (1P1D by default), every record on an embedded broker's topics; each
   request's TTFT (model time, the demo's accounting) and TBT (the decode engine's report) measured;
2. **plan**: :func:`~conductor.harness.plan.planner.plan_cluster` on those topics (``conductor plan
   --since``) with the recorded policy and ``time_scale`` = ``speed`` (the log's times are the engines'
   sped-up ones: replayed that much slower, they are model time); the engines' cost model calibrated
   on the gateways' outcomes (their engine part in model time: what the engines achieved on this
   machine, not what they were told), and each request's observed time outside the engines
   (gateway, log, hand-off: real time, as the measured TTFT counts it) on top of its simulated TTFT;
3. **run the plan**: the same slice at the same times on a fresh cluster of the planned size;
4. compare the attainment the plan predicted for each cluster with what it measured.

The emulated engines time themselves with the same cost model the policy and the simulator use, so
this checks the search, the replay of the log and the simulator's queueing against a running
cluster (gateway, router, view, engines), not the cost model: real engines need ``bench
sim-fidelity`` and ``conductor fit``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from conductor.errors import ConductorError
from conductor.harness.bench.live import quiet_clients, replay, servers, trace_slice
from conductor.harness.demo import DemoRequest, RunStats
from conductor.harness.devstack import free_port
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.harness.plan.planner import Plan, PlanConfig, plan_cluster
from conductor.settings import Settings
from conductor.stats import percentile

log = logging.getLogger(__name__)


class PlanBenchError(ConductorError):
    pass


@dataclass(frozen=True)
class PlanBenchOptions:
    duration_s: float = 30.0
    """Trace time replayed, in wall seconds (arrivals within it at ``speed``)."""
    speed: float = 10.0
    """Arrival speed-up of the slice and the engines' time scale (the same: model time throughout)."""
    sample: int = 6
    trace: Path | None = None
    prefill: int = 1
    decode: int = 1
    """The recorded cluster."""
    target: float = 0.95
    ttft_slo_s: float | None = None
    """None: the settings' (CONDUCTOR_TTFT_SLO_S)."""
    tbt_slo_ms: float | None = None
    block_size: int = 64
    kv_blocks: int = 16_384
    max_requests: int | None = None
    drain_s: float = 60.0
    seed: int = 0
    path_overhead: bool = True
    """The plan counts each request's recorded time outside the engines toward its TTFT (as measured)."""


@dataclass(frozen=True)
class Attainment:
    """What one cluster achieved on the slice: shares of every request sent (unanswered or rejected: missed)."""

    requests: int
    served: int
    ttft: float
    tbt: float
    both: float
    without_tbt: int
    """Served requests no decode report was found for (their TBT counted as met)."""


def measured_attainment(sent: Iterable[str], ttft_s: Mapping[str, float], tbt_ms: Mapping[str, float], *,
                        ttft_slo_s: float, tbt_slo_ms: float) -> Attainment:
    """SLO attainment as the simulator counts it (``sim.summary.meets_slo``), over the request ids ``sent``:
    a request meets an SLO when it was served (it has a TTFT) and is within it."""
    ids = list(sent)
    t_ok = b_ok = both = served = missing = 0
    for rid in ids:
        ttft = ttft_s.get(rid)
        if ttft is None:
            continue
        served += 1
        tbt = tbt_ms.get(rid)
        missing += tbt is None
        a, b = ttft <= ttft_slo_s, tbt is None or tbt <= tbt_slo_ms
        t_ok += a
        b_ok += b
        both += a and b
    n = max(1, len(ids))
    return Attainment(requests=len(ids), served=served, ttft=round(t_ok / n, 4), tbt=round(b_ok / n, 4),
                      both=round(both / n, 4), without_tbt=missing)


def ttft_split(stats: RunStats) -> dict[str, float | None]:
    """p50/p90 of the two parts of the measured TTFTs: ``path`` (real seconds outside the engines'
    emulation: gateway, log, HTTP, hand-off) and ``engines`` (model seconds the engines emulated:
    prefill queue and compute, KV transfer), over the requests with engine reports."""
    path, engines = [], []
    for rid, (wall, _) in stats.client_ttft.items():
        model = stats.emulated_s.get(rid)
        if model is not None:
            path.append(max(wall - model / stats.speed, 0.0))
            engines.append(model)

    def q(xs: list[float], p: float) -> float | None:
        v = percentile(xs, p)
        return None if v is None else round(v, 3)

    return {"path_p50_s": q(path, 50), "path_p90_s": q(path, 90), "engines_p50_s": q(engines, 50),
            "engines_p90_s": q(engines, 90)}


def difference_points(measured: float, predicted: float) -> float:
    """Measured minus predicted attainment in percentage points (+2.0: the cluster did 2 points better)."""
    return round(100.0 * (measured - predicted), 2)


async def _run(s: Settings, opts: PlanBenchOptions, prefill: int, decode: int, requests: list[DemoRequest],
               log_dir: Path, side: str) -> dict[str, Any]:
    """The slice on a fresh ``prefill``P``decode``D emulated cluster: what each request achieved."""
    stats = RunStats(s.policy, opts.speed)
    async with GatewayCluster(s, log_dir / side, prefill, decode, time_scale=opts.speed, report=True, bridges=True,
                              engine_args=["--kv-blocks", str(opts.kv_blocks)],
                              gateway_args=["--decision-timeout-s", "10"]) as c:
        await asyncio.sleep(1.0)  # the last process finishes starting on a busy machine
        c.reports.clear()
        prefix = f"{c.gateway_id}-"
        wall = await replay(c.gateway_url, stats, requests, side=side, engine_id_prefix=prefix, seed=opts.seed,
                            drain_s=opts.drain_s, max_output_tokens=None, api_key=c.api_key)
        await asyncio.sleep(0.5)  # the engines' last report lines
        for row in c.reports:
            stats.on_report(row)
        tbt = {str(r["request_id"]): float(r["tbt_ms"]) for r in c.reports if r.get("event") == "decode_done"}
    att = measured_attainment([f"{prefix}{side}-{r.index}" for r in requests], stats.observed, tbt,
                              ttft_slo_s=s.ttft_slo_s, tbt_slo_ms=s.tbt_slo_ms)
    return {"attainment": att, "ttft_split": ttft_split(stats), "rejected": sum(n for code, n in stats.client_errors.items() if code in ("429", "503")),
            "errors_by_kind": dict(stats.client_errors), "reuse_ratio": round(stats.reuse_ratio, 4), "wall_s": wall,
            "load": round(os.getloadavg()[0], 1)}


def _side_settings(base: Settings, opts: PlanBenchOptions, side: str) -> Settings:
    # No bound on decisions at once: on a busy machine the log's acknowledgements slow down and the
    # gateway's backpressure (429 gateway_busy) would turn away requests the log never sees, so the
    # plan would be made on a fraction of the traffic. A slow decision counts in the TTFT instead.
    tag = f"{os.getpid():x}{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"
    slos = {k: v for k, v in (("ttft_slo_s", opts.ttft_slo_s), ("tbt_slo_ms", opts.tbt_slo_ms)) if v is not None}
    return base.model_copy(update={"topic_prefix": f"planbench-{side}-{tag}.", "view_namespace": f"planbench-{side}-{tag}",
                                   "block_size": opts.block_size, "seed": opts.seed, "metrics_port": 0,
                                   "web_port": free_port(base.bind_host), "gateway_max_deciding": 0, **slos})


def _cluster(name: str, predicted: float, run: dict[str, Any], prefill: int, decode: int) -> dict[str, Any]:
    att: Attainment = run["attainment"]
    return {"cluster": name, "prefill": prefill, "decode": decode, "predicted_slo_attainment": predicted,
            "measured_slo_attainment": att.both, "difference_points": difference_points(att.both, predicted),
            "measured": asdict(att), "rejected": run["rejected"], "errors_by_kind": run["errors_by_kind"],
            "reuse_ratio": run["reuse_ratio"], "ttft_split": run["ttft_split"], "wall_s": round(run["wall_s"], 1),
            "load_average_1m": run["load"]}


def run_plan_bench(settings: Settings, opts: PlanBenchOptions) -> dict[str, Any]:
    """Record, plan, run the plan, compare: one result dict (see the module's docstring)."""
    trace, requests = trace_slice(opts.trace, opts.speed, opts.sample, opts.duration_s, opts.max_requests,
                                  PlanBenchError)
    quiet_clients()
    logging.getLogger("conductor.harness.sim").setLevel(logging.WARNING)
    data_dir = (Path(settings.data_dir) / "bench-plan").resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t_all = time.monotonic()
    with servers(settings, data_dir) as base:
        rec_s = _side_settings(base, opts, "recorded")
        recorded = asyncio.run(_run(rec_s, opts, opts.prefill, opts.decode, requests, log_dir, "recorded"))
        t_plan = time.monotonic()
        # No --profile: the engines' profile calibrated on what the gateways observed (in model time).
        plan: Plan = plan_cluster(rec_s, PlanConfig(
            since="0", target=opts.target, headroom=False, time_scale=opts.speed, seed=opts.seed,
            path_overhead=opts.path_overhead), console=Console(file=io.StringIO(), width=200))
        plan_wall = time.monotonic() - t_plan
        p, d = plan.plan.prefill, plan.plan.decode
        planned = asyncio.run(_run(_side_settings(base, opts, "planned"), opts, p, d, requests, log_dir, "planned"))
    rec = _cluster("recorded", plan.cluster.predicted_slo_attainment, recorded, plan.cluster.prefill,
                   plan.cluster.decode)
    out = _cluster("planned", plan.plan.predicted_slo_attainment, planned, p, d)
    return {
        "bench": "plan",
        "engines": "emulated (timed by the policy's own cost model: not an independent check of it)",
        "prefill": p, "decode": d,
        "predicted_slo_attainment": out["predicted_slo_attainment"],
        "measured_slo_attainment": out["measured_slo_attainment"],
        "difference_points": out["difference_points"],
        "recorded_prefill": opts.prefill, "recorded_decode": opts.decode,
        "planned": out, "recorded": rec,
        "target": opts.target, "goal": round(plan.goal, 4), "target_met": plan.target_met,
        "ttft_slo_s": plan.ttft_slo_s, "tbt_slo_ms": plan.tbt_slo_ms, "policy": plan.policy,
        "model_profile": plan.model_profile,
        "requests": len(requests), "planned_requests": plan.requests, "trace": trace.name,
        "speed": opts.speed, "sample": opts.sample, "duration_s": opts.duration_s,
        "calibration": plan.calibration,
        "path_overhead": opts.path_overhead, "path_p50_s": plan.path_s[0], "path_p90_s": plan.path_s[1],
        "simulations": plan.simulations, "probes": [[q.prefill, q.decode, q.slo_attainment] for q in plan.probes],
        "plan_wall_s": round(plan_wall, 1),
        "logs": str(log_dir),
        "wall_s": round(time.monotonic() - t_all, 1),
    }


__all__ = ["Attainment", "PlanBenchError", "PlanBenchOptions", "difference_points", "measured_attainment",
           "run_plan_bench"]
