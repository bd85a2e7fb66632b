"""``conductor bench fit``: the cost model fitted from real vLLM engines' outcomes, before and after.

One cluster (stream worker, router, a bridge per engine, gateway) in front of fresh real vLLM
CPU engines (the kit's tiny model, aggregated, prefix caching on). Three phases over the
conversation trace's slice, rendered as text as ``bench live --engines vllm`` does:

1. **before**: the first part of the slice under the configured (hand-set) profile; every
   request's gateway outcome read back from ``request-outcomes``;
2. **fit**: :class:`~conductor.costmodel.fitting.CostFitter` takes those outcomes (as ``conductor
   fit`` does) and its ``set_profile`` is published on ``control``; the model forms are compared
   on the same samples, out of sample (5 folds): the profile's parametric form against a
   log-linear and a piecewise-linear one;
3. **after**: the rest of the slice, decided under the fitted profile, with the fitter running
   as ``conductor fit`` runs (:func:`~conductor.routing.fit_worker.run_fit_worker`: it refits
   on its sliding window and publishes when the fit moves);
4. **rejection** (``--slo-ms``): the after phase's requests again with a TTFT SLO; each rejected
   request is then sent once more without the SLO (one at a time, the sample let through), and
   the share that missed the SLO anyway is early rejection's precision.

TTFT prediction error is ``|predicted - real| / real`` where real is the gateway's TTFT less its
routing (``ttft_s - decided_s``: what the decision predicts).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai

from conductor.costmodel.fitting import CostFitter, FitConfig, sample_of
from conductor.costmodel.profiles import (
    ModelProfile,
    OutcomeSample,
    fit_outcomes,
    load_profile,
    predict_ttft,
    prediction_errors,
)
from conductor.harness.bench.live import quiet_clients, read_outcome_records, read_outcomes, servers, trace_slice
from conductor.harness.bench.live_vllm import MODEL, VllmLiveError, VllmLiveOptions, vllm_prompt
from conductor.harness.demo import DemoRequest
from conductor.harness.devstack import free_port
from conductor.harness.settings import load_harness_settings
from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.harness.vllm_kit import VllmEngine, kit_available, kit_dir, start_engines, tiny_model_dir
from conductor.routing.control_log import control_records, publish_control
from conductor.routing.fit_worker import run_fit_worker
from conductor.settings import Settings
from conductor.stats import percentile


@dataclass(frozen=True)
class FitBenchOptions:
    duration_s: float = 60.0
    speed: float = 10.0
    sample: int = 4
    trace: Path | None = None
    engines: int = 2
    before: int = 60
    """Requests decided under the configured profile (the rest of the slice: after the fit)."""
    after: int = 60
    max_output_tokens: int = 8
    slo_ms: float | None = None
    """Run the rejection phase with this TTFT SLO (ms)."""
    seed: int = 0
    window: int = 200
    refit_every: int = 20
    threshold: float = 0.10


def _dump(path: Path, groups: dict[str, Sequence[OutcomeSample]]) -> None:
    """The samples as JSON lines (for fitting other model forms offline)."""
    with open(path, "w") as f:
        for phase, samples in groups.items():
            f.writelines(json.dumps({"phase": phase, **asdict(smp)}) + "\n" for smp in samples)


async def _ask(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, rid: str,
               hdrs: dict[str, str]) -> tuple[str, float | None, int]:
    """(rid, client TTFT or None, HTTP status)."""
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 extra_headers={"x-request-id": rid, **hdrs})
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
        return rid, first, 200
    except openai.APIStatusError as e:
        return rid, None, e.status_code


async def _replay(c: VllmGatewayCluster, reqs: Sequence[DemoRequest], opts: FitBenchOptions, tag: str,
                  hdrs: dict[str, str] | None = None) -> list[tuple[str, float | None, int]]:
    """The requests at their trace times (from the first one's); (gateway request id, client TTFT, status)."""
    client = openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=300)
    live = VllmLiveOptions(seed=opts.seed)
    t0 = time.monotonic()
    start = reqs[0].arrival_s if reqs else 0.0
    tasks = []
    try:
        for r in reqs:
            delay = t0 + r.arrival_s - start - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out = max(2, min(r.output_length, opts.max_output_tokens))
            rid = f"{tag}-{r.index}-{uuid.uuid4().hex[:6]}"
            tasks.append(asyncio.create_task(_ask(client, vllm_prompt(r, live), out, rid, hdrs or {})))
        done = await asyncio.gather(*tasks)
    finally:
        await client.close()
    return [(f"{c.gateway_id}-{rid}", ttft, status) for rid, ttft, status in done]


def _q(v: Sequence[float], p: float) -> float | None:
    x = percentile(v, p)
    return None if x is None else round(x, 4)


def error_summary(samples: Sequence[OutcomeSample]) -> dict[str, Any]:
    ttft, tbt = prediction_errors(samples)
    return {"samples": len(samples), "ttft_prediction_error_p50": _q(ttft, 50),
            "ttft_prediction_error_p90": _q(ttft, 90),
            "tbt_prediction_error_p50": _q(tbt, 50), "tbt_prediction_error_p90": _q(tbt, 90),
            "ttft_p50_s": _q([s.ttft_s for s in samples], 50), "ttft_p90_s": _q([s.ttft_s for s in samples], 90),
            "predicted_ttft_p50_s": _q([s.predicted_ttft_s or 0.0 for s in samples], 50)}


# --- the model forms compared ---------------------------------------------------------


def _features(samples: Sequence[OutcomeSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = np.array([float(s.prompt_tokens) for s in samples])
    c = np.array([float(min(s.reused_tokens, s.prompt_tokens - 1)) for s in samples])
    return n - c, c, np.array([s.queue_s for s in samples]), np.array([s.running for s in samples])


def _loglinear(train: Sequence[OutcomeSample], test: Sequence[OutcomeSample]) -> np.ndarray:
    """log TTFT linear in log(1 + new tokens), log(1 + cached tokens), log(1 + queue wait in ms),
    log(1 + running requests)."""
    def x(ss: Sequence[OutcomeSample]) -> np.ndarray:
        new, cached, q, run = _features(ss)
        return np.column_stack([np.ones_like(new), np.log1p(new), np.log1p(cached), np.log1p(q * 1000.0),
                                np.log1p(run)])
    coef, *_ = np.linalg.lstsq(x(train), np.log([s.ttft_s for s in train]), rcond=None)
    return np.asarray(np.exp(x(test) @ coef))


def _piecewise(train: Sequence[OutcomeSample], test: Sequence[OutcomeSample], knots: int = 4) -> np.ndarray:
    """TTFT piecewise linear in new tokens (hinges at the training quantiles) and in running requests,
    plus cached tokens and the queue wait, fitted on relative error."""
    new_tr = _features(train)[0]
    ks = np.quantile(new_tr, np.linspace(0, 1, knots + 1)[1:-1])

    def x(ss: Sequence[OutcomeSample]) -> np.ndarray:
        new, cached, q, run = _features(ss)
        return np.column_stack([np.ones_like(new), new, *[np.maximum(new - k, 0) for k in ks], cached, q, run,
                                np.maximum(run - 4, 0)])
    y = np.array([s.ttft_s for s in train])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x(train) * w[:, None], y * w, rcond=None)
    return np.asarray(np.maximum(x(test) @ coef, 1e-6))


def compare_forms(samples: Sequence[OutcomeSample], base: ModelProfile, folds: int = 5) -> dict[str, dict[str, float]]:
    """Out-of-sample TTFT relative error (p50, p90) of each model form on the same folds."""
    idx = np.arange(len(samples))
    errs: dict[str, list[float]] = {"parametric": [], "log_linear": [], "piecewise_linear": []}
    for k in range(folds):
        test_i = idx[k::folds]
        train = [samples[int(i)] for i in idx if i % folds != k]
        test = [samples[int(i)] for i in test_i]
        obs = np.array([s.ttft_s for s in test])
        fitted = fit_outcomes(train, base, folds=2).profile
        par = np.array([predict_ttft(fitted, s, base) for s in test])
        for name, pred in (("parametric", par), ("log_linear", _loglinear(train, test)),
                           ("piecewise_linear", _piecewise(train, test))):
            errs[name] += [float(v) for v in np.abs(pred - obs) / obs]
    return {k: {"p50": round(percentile(v, 50, empty=math.nan), 4), "p90": round(percentile(v, 90, empty=math.nan), 4)}
            for k, v in errs.items() if v}


# --- the run ---------------------------------------------------------------------------


async def _run(settings: Settings, opts: FitBenchOptions, reqs: list[DemoRequest], kit: Path, log_dir: Path
               ) -> dict[str, Any]:
    engines = [VllmEngine(tiny_model_dir(kit), log_dir, name=f"vllm-{i}", served_name=MODEL, kit=kit,
                          block_size=32, max_model_len=4096, start_timeout_s=600.0) for i in range(opts.engines)]
    await start_engines(*engines)
    base = load_profile(settings.model_profile)
    out: dict[str, Any] = {"profile": base.name}
    try:
        nodes = [VllmNode(f"vllm-{i}", "both", e) for i, e in enumerate(engines)]
        async with VllmGatewayCluster(settings, log_dir, nodes=nodes, model=MODEL) as c:
            before_reqs, after_reqs = reqs[: opts.before], reqs[opts.before: opts.before + opts.after]
            # before: the hand-set profile
            sent = await _replay(c, before_reqs, opts, "before")
            recs = await read_outcome_records(settings, [rid for rid, _, _ in sent])
            outs = {k: o for k, (o, _) in recs.items()}
            fitter = CostFitter(base, FitConfig(window=max(len(outs), 4), min_rows=max(min(len(outs), 30), 4),
                                                refit_every=10**6))
            for o, ts in recs.values():
                fitter.on_outcome(o, ts)
            samples = fitter.samples("*")  # with the running requests each met
            out["before"] = error_summary(samples)
            if len(samples) < 20:
                raise VllmLiveError(f"only {len(samples)} of {len(before_reqs)} requests were served with a "
                                    f"prediction; logs in {log_dir}")
            out["forms"] = compare_forms(samples, base)
            cmd = fitter.refit("*")
            if cmd is None:
                raise VllmLiveError("the fit did not move the profile (too few outcomes?)")
            offset = await publish_control(settings, cmd, producer_id="bench-fit")
            fitter.on_control(offset, cmd)
            fitted = fitter.published
            out["fitted"] = {k: v for k, v in fitted.model_dump().items()
                             if k in ("prefill_overhead_s", "a", "b", "queue_wait_scale", "running_wait_s",
                                      "step_overhead_s",
                                      "per_sequence_s", "hbm_bandwidth", "ttft_error_p50", "ttft_error_p90",
                                      "tbt_error_p50", "tbt_error_p90", "fit_rows")}
            out["control_offset"] = offset
            await asyncio.sleep(2.0)  # the router folds control within its poll
            # after: the fitted profile, refined online by the fitter as `conductor fit` runs it
            stop = asyncio.Event()
            worker = asyncio.create_task(run_fit_worker(settings, FitConfig(
                window=opts.window, min_rows=min(30, opts.window), refit_every=opts.refit_every,
                threshold=opts.threshold), stop=stop))
            await asyncio.sleep(2.0)
            try:
                sent = await _replay(c, after_reqs, opts, "after")
                outs_after = await read_outcomes(settings, [rid for rid, _, _ in sent])
            finally:
                stop.set()
                await asyncio.wait_for(worker, 30)
            after = [s for o in outs_after.values()
                     if (o.control_offset if o.control_offset is not None else -1) >= offset
                     and (s := sample_of(o, fitted)) is not None]
            out["after"] = error_summary(after)
            out["profiles_published"] = sum(1 for _, cmd in await control_records(settings)
                                            if cmd.action == "set_profile")
            _dump(log_dir / "samples.jsonl", {"before": samples, "after": after})
            if opts.slo_ms:
                out["rejection"] = await _rejection(c, settings, after_reqs, opts)
    finally:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
    return out


async def _rejection(c: VllmGatewayCluster, settings: Settings, reqs: Sequence[DemoRequest], opts: FitBenchOptions
                     ) -> dict[str, Any]:
    """The requests with a TTFT SLO; every rejected one let through afterwards (one at a time) to
    see whether it would have missed; the served ones' misses counted."""
    assert opts.slo_ms is not None
    slo_s = opts.slo_ms / 1000.0
    sent = await _replay(c, reqs, opts, "slo", {"x-conductor-ttft-slo-ms": f"{opts.slo_ms:g}"})
    by_rid = {f"{c.gateway_id}-slo-{r.index}": r for r in reqs}
    rejected = [rid for rid, _, status in sent if status in (429, 503)]
    served = [(rid, ttft) for rid, ttft, status in sent if status == 200 and ttft is not None]
    outs = await read_outcomes(settings, [rid for rid, _ in served])
    missed_served = sum(1 for rid, _ in served if rid in outs and (outs[rid].ttft_s or 0.0) > slo_s)
    # Let the rejected through with the same replay timing, so the load they meet is the one they
    # were rejected under (their own arrivals included).
    retry = [by_rid[rid.rsplit("-", 1)[0]] for rid in rejected if rid.rsplit("-", 1)[0] in by_rid]
    let = await _replay(c, retry, opts, "let") if retry else []
    let_outs = await read_outcomes(settings, [rid for rid, _, _ in let])
    would_miss = sum(1 for rid, _, _ in let if rid in let_outs and (let_outs[rid].ttft_s or math.inf) > slo_s)
    return {"slo_ms": opts.slo_ms, "requests": len(sent), "rejected": len(rejected), "served": len(served),
            "served_missed_slo": missed_served,
            "served_miss_share": round(missed_served / len(served), 4) if served else None,
            "rejected_let_through": len(let), "rejected_would_miss": would_miss,
            "rejection_precision": round(would_miss / len(let), 4) if let else None}


def run_fit_bench(settings: Settings, opts: FitBenchOptions) -> dict[str, Any]:
    kit = kit_dir(load_harness_settings())
    why = kit_available(kit)
    if why:
        raise VllmLiveError(why)
    trace, reqs = trace_slice(opts.trace, opts.speed, opts.sample, opts.duration_s, None, VllmLiveError)
    if len(reqs) < opts.before + 10:
        raise VllmLiveError(f"the slice has {len(reqs)} requests; need {opts.before} before the fit and some after "
                            "(raise --duration or lower --sample)")
    quiet_clients()
    data_dir = (Path(settings.data_dir) / "bench-fit").resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t0 = time.monotonic()
    with servers(settings, data_dir) as base:
        tag = f"{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"
        s = base.model_copy(update={"topic_prefix": f"fit-{tag}.", "view_namespace": f"fit-{tag}", "block_size": 32,
                                    "seed": opts.seed, "metrics_port": 0, "web_port": free_port(base.bind_host),
                                    "heartbeat_ttl_s": 30.0, "tbt_slo_ms": 10_000.0})
        out = asyncio.run(_run(s, opts, reqs, kit, log_dir))
    return {"bench": "fit", "engines": "vllm", "trace": trace.name, "requests": len(reqs),
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
            "logs": str(log_dir), "wall_s": round(time.monotonic() - t0, 1), **out}


__all__ = ["FitBenchOptions", "compare_forms", "error_summary", "run_fit_bench"]
