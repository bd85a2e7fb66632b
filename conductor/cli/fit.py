"""``conductor fit``: learn the cost model from served requests; ``conductor bench fit`` measures it on real vLLM."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from conductor.cli.common import JsonLine, exit_on, print_result, require_servers, settings_or_exit
from conductor.costmodel.fitting import FitConfig
from conductor.routing.fit_worker import run_fit_worker
from conductor.telemetry import setup_metrics

Window = Annotated[int, typer.Option(min=4, help="served requests kept per model (the newest)")]
MinRows = Annotated[int, typer.Option(min=4, help="no fit before this many served requests")]
RefitEvery = Annotated[int, typer.Option(min=1, help="refit after this many new served requests")]
Threshold = Annotated[float, typer.Option(min=0.0, help="publish when the fit's predictions move by more than this "
                                          "share (0.1 = 10 %)")]
Model = Annotated[str | None, typer.Option(help="fit this model's requests only [default: every model pooled: the "
                                           "routers hold one profile]")]


def fit(window: Window = 400, min_rows: MinRows = 30, refit_every: RefitEvery = 20, threshold: Threshold = 0.10,
        model: Model = None) -> None:
    """Run the cost-model fitter: request-outcomes in, set_profile records on control out.

    It pairs each served request's gateway outcome (real TTFT less routing, real TBT) with what its
    decision predicted and the profile it was decided under, refits the profile (prefill: a fixed
    cost plus linear and quadratic terms in the tokens not reused; the queue's drain rate; the
    decode step against batch and context) on a sliding window, and publishes it on the control
    topic when its predictions moved by more than --threshold. Every router applies it in log
    order; decisions record its control offset, so `conductor explain` re-derives them with it.
    The published profile carries its out-of-sample TTFT/TBT error (p50, p90) and the p90 of real /
    predicted TTFT, early rejection's margin (kvcache-centric with queue_wait_safety unset).
    Metrics: conductor_fit_ttft_prediction_error, conductor_fit_tbt_prediction_error (histograms),
    conductor_fit_ttft_error{quantile} (gauges).
    """
    s = settings_or_exit()
    with exit_on():
        cfg = FitConfig(window=window, min_rows=min_rows, refit_every=refit_every, threshold=threshold, model=model)
    require_servers(s, kafka=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_metrics("conductor-fit", s.bind_host, s.metrics_port)
    try:
        asyncio.run(run_fit_worker(s, cfg))
    except KeyboardInterrupt:
        pass


Before = Annotated[int, typer.Option(min=10, help="requests decided under the configured profile, then fitted on")]
After = Annotated[int, typer.Option(min=10, help="requests decided under the fitted profile")]
SloMs = Annotated[float | None, typer.Option(min=1.0, help="then send the after-phase requests again with this TTFT "
                                             "SLO and let every rejected one through once: rejection precision")]
Trace = Annotated[Path | None, typer.Option(help="trace JSONL [default: the bundled conversation trace]")]


Speed = Annotated[float, typer.Option(min=0.01, help="replay the trace this many times faster")]
Sample = Annotated[int, typer.Option(min=1, help="one conversation in SAMPLE")]


def bench_fit(before: Before = 80, after: After = 80, slo_ms: SloMs = None, engines: Annotated[int, typer.Option(
        min=1, max=4, help="aggregated vLLM engines")] = 2, speed: Speed = 3.0, sample: Sample = 6,
        trace: Trace = None, json_out: JsonLine = False) -> None:
    """TTFT/TBT prediction error on real vLLM engines before and after the fit (`conductor fit`'s).

    Fresh vLLM CPU engines (the kit: scripts/vllm-kit) behind a whole cluster; the conversation
    trace's slice as text. Prints the errors before and after, the fitted coefficients, the model
    forms compared out of sample (parametric, log-linear, piecewise-linear) and, with --slo-ms,
    early rejection's precision.
    """
    from conductor.harness.bench.fit_vllm import FitBenchOptions, run_fit_bench  # the harness extra's client

    s = settings_or_exit()
    with exit_on():
        out = run_fit_bench(s, FitBenchOptions(before=before, after=after, slo_ms=slo_ms, engines=engines,
                                               speed=speed, sample=sample, duration_s=120.0, trace=trace))
    print_result(out, json_out)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("fit")(fit)
    groups["bench"].command("fit")(bench_fit)
