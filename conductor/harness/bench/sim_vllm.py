"""``conductor bench sim-fidelity``: does the simulator, fed the engines' measured costs, predict a real run?

On real vLLM engines (the CPU build and tiny model of ``scripts/vllm-kit``, every engine
aggregated, ``--enable-prompt-tokens-details`` so the outcomes carry the engines' own cached
tokens):

1. **calibrate**: ``conductor profile calibrate``'s sweep against every engine at once (they
   are alike; on a small machine they share its cores, as in the run), with the cluster up,
   before the recording and again after it, gives one profile of the engines' measured costs;
2. **record**: the demo's trace slice goes through Conductor (worker, router, a bridge per
   engine, the gateway) with every record on the topics of an embedded broker, sent by the
   official ``openai`` client at the trace's times; the clients' TTFTs are kept;
3. **simulate**: ``conductor simulate --from-topics --policy recorded`` on those topics, once
   with ``--profile <the calibrated file>`` (no calibration to the outcomes), once with the
   configured profile as it is, once with the configured profile scaled to the observed TTFT
   p50 (today's default ``--calibrate scale``, which sees the outcomes it is compared with);
   and once with ``--profile control`` after the profile ``conductor fit`` would fit to the
   run's outcomes is published there as ``set_profile``;
4. compare each simulated TTFT p50/p90 with what the clients observed (and with the gateway's
   TTFT less its routing, what the simulator models: arrival at the router to first token).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from conductor.costmodel.fitting import sample_of
from conductor.costmodel.profiles import ModelProfile, fit_outcomes, load_profile
from conductor.errors import ConductorError, ConfigError
from conductor.harness.bench.live import quiet_clients, read_outcomes, servers, trace_slice
from conductor.harness.bench.live_vllm import MODEL, VllmLiveOptions, replay
from conductor.harness.calibrate import CalibrateConfig, Calibration, SweepPlan, calibrate_engine, merged, write_profile
from conductor.harness.demo import DemoRequest
from conductor.harness.devstack import free_port
from conductor.harness.settings import load_harness_settings
from conductor.harness.sim.run import SimulateConfig, run_simulation
from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.harness.vllm_kit import BLOCK_SIZE, VllmEngine, kit_available, kit_dir, start_engines, tiny_model_dir
from conductor.routing.control_log import publish_control
from conductor.settings import Settings
from conductor.stats import percentile
from schemas import ControlCommand, RequestOutcome

log = logging.getLogger(__name__)


class SimFidelityError(ConductorError):
    pass


@dataclass(frozen=True)
class SimFidelityOptions:
    live: VllmLiveOptions = field(default_factory=VllmLiveOptions)
    plan: SweepPlan = field(default_factory=lambda: SweepPlan(
        prompt_lengths=(64, 512, 1024, 2048), cached_fractions=(0.0, 0.5, 0.9), batch_sizes=(1, 2, 4),
        decode_contexts=(256, 1024), decode_tokens=16, repeats=2, block_size=BLOCK_SIZE))
    profile_out: Path | None = None
    """Where the calibrated profile goes [default: the run's data folder]."""
    calibrate_after: bool = True
    """Sweep the engines again after the recording and fit on both sweeps."""


def _pcts(values: list[float]) -> dict[str, float | None]:
    def r(p: float) -> float | None:
        v = percentile(values, p)
        return None if v is None else round(v, 4)

    return {"p50": r(50), "p90": r(90)}


async def _record(s: Settings, opts: SimFidelityOptions, requests: list[DemoRequest], kit: Path,
                  log_dir: Path) -> dict[str, Any]:
    live = opts.live
    engines = [VllmEngine(tiny_model_dir(kit), log_dir, name=f"vllm-{i}", served_name=MODEL, kit=kit,
                          block_size=BLOCK_SIZE, max_model_len=live.max_model_len, start_timeout_s=600.0,
                          extra_args=("--enable-prompt-tokens-details",))
               for i in range(live.engines)]
    await start_engines(*engines)
    base = load_profile(s.model_profile)
    try:
        nodes = [VllmNode(f"vllm-{i}", "both", e) for i, e in enumerate(engines)]
        async with VllmGatewayCluster(s, log_dir / "cluster", nodes=nodes, model=MODEL) as c:
            # Every engine swept at once, the cluster up: the engines share the machine's cores as
            # they will in the run (one engine alone takes every core and measures several times
            # faster than two busy at once on a small machine). Swept before the recording and
            # again after it, the fit on both: a shared machine's load drifts during a run.
            async def sweep(seed: int) -> list[Calibration]:
                return list(await asyncio.gather(*(calibrate_engine(CalibrateConfig(
                    engine=e.url, plan=opts.plan, base=base, model=MODEL, seed=seed + i))
                    for i, e in enumerate(engines))))

            before = await sweep(live.seed)
            load = {"calibration_before": round(os.getloadavg()[0], 1)}
            t0 = time.monotonic()
            stats = await replay(c.gateway_url, requests, live, "conductor", api_key=c.api_key)
            wall = time.monotonic() - t0
            load["recording"] = round(os.getloadavg()[0], 1)
            outcomes = await read_outcomes(s, wait_s=15.0)
            fitted = await _publish_fit(s, base, list(outcomes.values()))
            after = await sweep(live.seed + 1000) if opts.calibrate_after else []
            if after:
                load["calibration_after"] = round(os.getloadavg()[0], 1)
            cal = merged(before + after, base, "tiny-llama-vllm-cpu")
    finally:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
    engine_side = [o.ttft_s - (o.routing_ms or 0.0) / 1000.0 for o in outcomes.values()
                   if o.status == 200 and o.error is None and o.ttft_s is not None]
    return {"calibration": cal, "fitted": fitted, "client_ttft": list(stats.ttft), "engine_ttft": engine_side,
            "sent": stats.sent, "statuses": dict(stats.statuses), "wall_s": wall, "outcomes": len(outcomes),
            "load": load}


async def _publish_fit(s: Settings, base: ModelProfile, outcomes: list[RequestOutcome]) -> str | None:
    """What ``conductor fit`` would publish after this run: the profile fitted to its served
    requests (``profiles.fit_outcomes``), as a ``set_profile`` on ``control``; its name, or None
    when too few requests were served to fit."""
    samples = [x for o in outcomes if (x := sample_of(o, base)) is not None]
    try:
        fit = fit_outcomes(samples, base, name="fitted-from-outcomes")
    except ConfigError as e:
        log.warning("no fit from the outcomes: %s", e)
        return None
    profile = fit.profile.model_copy(update={"description": f"fitted to {fit.rows} served requests"})
    await publish_control(s, ControlCommand(action="set_profile", profile=profile.model_dump(),
                                            reason="bench sim-fidelity"), producer_id="bench-sim-fidelity")
    return fit.profile.name


def _simulate(s: Settings, profile: str | None, calibrate: str) -> dict[str, Any]:
    quiet = Console(file=io.StringIO(), width=200)
    runs = run_simulation(s, SimulateConfig(from_topics=True, policy="recorded", model_profile=profile,
                                            calibrate=calibrate), console=quiet)
    summary = runs[0].summary
    return {"ttft_p50_s": summary["ttft_p50_s"], "ttft_p90_s": summary["ttft_p90_s"],
            "rejected": summary["rejected"], "calibration": summary.get("calibration")}


def _versus(sim: dict[str, Any], observed: dict[str, float | None]) -> dict[str, float | None]:
    """Simulated over observed, minus one, for p50 and p90 (0.1: the simulation 10 % slow)."""
    out: dict[str, float | None] = {}
    for q in ("p50", "p90"):
        o, v = observed[q], sim[f"ttft_{q}_s"]
        out[q] = None if not o or v is None else round(v / o - 1.0, 4)
    return out


def run_sim_fidelity(settings: Settings, opts: SimFidelityOptions) -> dict[str, Any]:
    """Calibrate, record, simulate, compare: one result dict (see the module's docstring)."""
    kit = kit_dir(load_harness_settings())
    why = kit_available(kit)
    if why:
        raise SimFidelityError(why)
    live = opts.live
    trace, requests = trace_slice(live.trace, live.speed, live.sample, live.duration_s, live.max_requests,
                                  SimFidelityError)
    quiet_clients()
    logging.getLogger("conductor.harness.sim").setLevel(logging.WARNING)
    data_dir = (Path(settings.data_dir) / "bench-sim-fidelity").resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t_all = time.monotonic()
    with servers(settings, data_dir) as base:
        tag = f"{time.time_ns() // 1_000_000 % 0xFFFFFFF:07x}"
        s = base.model_copy(update={"topic_prefix": f"simfid-{tag}.", "view_namespace": f"simfid-{tag}",
                                    "block_size": BLOCK_SIZE, "seed": live.seed, "metrics_port": 0,
                                    "web_port": free_port(base.bind_host)})
        rec = asyncio.run(_record(s, opts, requests, kit, log_dir))
        cal = rec["calibration"]
        out = opts.profile_out or (log_dir / "calibrated-profile.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_profile(cal.profile, out)
        sims = {
            "calibrated_profile": _simulate(s, str(out), "off"),
            "configured_profile": _simulate(s, None, "off"),
            "configured_scaled_to_outcomes": _simulate(s, None, "scale"),
        }
        if rec["fitted"] is not None:
            sims["fitted_on_control"] = _simulate(s, "control", "off")
    client, engine = _pcts(rec["client_ttft"]), _pcts(rec["engine_ttft"])
    return {
        "bench": "sim-fidelity",
        "engines": "vllm",
        "instances": {"aggregated": live.engines},
        "trace": trace.name,
        "requests": len(requests),
        "sent": rec["sent"],
        "statuses": rec["statuses"],
        "outcomes": rec["outcomes"],
        "observed_client_ttft": client,
        "observed_gateway_ttft_less_routing": engine,
        "calibration": {k: v for k, v in cal.summary().items() if k not in ("engine",)},
        "profile_file": str(out),
        "simulated": {k: v | {"vs_client": _versus(v, client), "vs_gateway_less_routing": _versus(v, engine)}
                      for k, v in sims.items()},
        "model_profile": settings.model_profile,
        "options": {"duration_s": live.duration_s, "speed": live.speed, "sample": live.sample,
                    "max_output_tokens": live.max_output_tokens, "repeats": opts.plan.repeats},
        "record_wall_s": round(rec["wall_s"], 1),
        "load_average_1m": rec["load"],
        "wall_s": round(time.monotonic() - t_all, 1),
    }


__all__ = ["SimFidelityError", "SimFidelityOptions", "run_sim_fidelity"]
