"""``conductor bench live --engines vllm``: one trace slice through Conductor and its peers, on real vLLM.

Three sides, one after the other, each in front of FRESH, identical real vLLM engines (the
CPU build and tiny random-weight model of ``scripts/vllm-kit``; every engine aggregated: role
``both``, prefix caching on, no KV connector, as most vLLM fleets run):

- **conductor**: stream worker, router (``CONDUCTOR_POLICY``), a ``conductor bridge`` per
  engine (KV events, ``/metrics`` load, the engine's URL announced) and ``conductor gateway``
  with no ``--engine`` (it finds the engines through the view);
- **peer**: ``sglang-router`` in its regular HTTP mode with ``cache_aware``;
- **round_robin**: ``sglang-router`` with ``round_robin`` (the baseline that ignores the cache).

Every side gets the same requests at the same times: the conversation trace slice of
``conductor demo``, as text (each trace block a fixed run of pseudo-words, so prompts share a
text and token prefix exactly where the trace's ``hash_ids`` do), each a streamed completion
sent by the official ``openai`` client. Per side: TTFT p50/p90 as the client saw it (wall
clock: these are real engines), the engines' OWN prefix-cache hit ratio (their
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` over the run), served
and rejected requests (a rejection is not a served request: both are reported), errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from conductor.bridge.scrape import parse_load
from conductor.costmodel.fitting import prediction_error_summary
from conductor.harness.bench.live import LiveBenchError, block_words, quiet_clients, read_outcomes, servers, trace_slice
from conductor.harness.demo import DemoRequest, Processes
from conductor.harness.devstack import free_port
from conductor.harness.gateway_cluster import sglang_router_missing
from conductor.harness.settings import load_harness_settings
from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.harness.vllm_kit import VllmEngine, kit_available, kit_dir, start_engines, tiny_model_dir
from conductor.settings import Settings, child_environment
from conductor.stats import percentile

log = logging.getLogger(__name__)

SIDES = ("conductor", "peer", "round_robin")
MODEL = "tiny"
"""The name every engine serves the tiny model under (clients and bridges say it)."""
BLOCK_SIZE = 32


class VllmLiveError(LiveBenchError):
    pass


@dataclass(frozen=True)
class VllmLiveOptions:
    duration_s: float = 30.0
    speed: float = 10.0
    sample: int = 6
    trace: Path | None = None
    engines: int = 2
    max_requests: int | None = None
    max_output_tokens: int = 8
    words_per_block: int = 24
    """Pseudo-words rendering one 512-token trace block (the tiny model's context is short)."""
    max_prompt_words: int = 480
    drain_s: float = 120.0
    seed: int = 0
    sides: tuple[str, ...] = SIDES
    max_model_len: int = 4096


def vllm_prompt(r: DemoRequest, opts: VllmLiveOptions) -> str:
    """The trace request as text: ``words_per_block`` words per block of its ``hash_ids`` (the
    same words wherever a block recurs), then a tail of its own, capped at ``max_prompt_words``."""
    words: list[str] = []
    for h in r.hash_ids:
        words.extend(block_words(h, opts.seed)[: opts.words_per_block])
        if len(words) >= opts.max_prompt_words:
            break
    tail = max(4, min(opts.words_per_block, opts.max_prompt_words - len(words)))
    words.extend(w.upper() for w in block_words(10**9 + r.index, opts.seed)[:tail])
    return " ".join(words[: opts.max_prompt_words])


@dataclass
class SideStats:
    sent: int = 0
    ttft: list[float] = field(default_factory=list)
    """Client TTFT of each served request, wall-clock seconds."""
    statuses: Counter[str] = field(default_factory=Counter)
    """Requests by outcome: served, an HTTP status, or an error's name."""


async def _ask(client: openai.AsyncOpenAI, stats: SideStats, prompt: str, max_tokens: int, rid: str) -> None:
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 extra_headers={"x-request-id": rid})
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text is not None:
                first = time.perf_counter() - t0
        if first is not None:
            stats.ttft.append(first)
            stats.statuses["served"] += 1
        else:
            stats.statuses["empty"] += 1
    except openai.APIStatusError as e:
        stats.statuses[str(e.status_code)] += 1
    except (openai.APIError, ValueError) as e:
        stats.statuses[type(e).__name__] += 1


async def replay(base_url: str, requests: Sequence[DemoRequest], opts: VllmLiveOptions, side: str,
                 api_key: str = "bench") -> SideStats:
    stats = SideStats()
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600.0)
    tasks = []
    t0 = time.monotonic()
    try:
        for r in requests:
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out = max(1, min(r.output_length, opts.max_output_tokens))
            tasks.append(asyncio.create_task(_ask(client, stats, vllm_prompt(r, opts), out, f"{side}-{r.index}")))
            stats.sent += 1
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=opts.drain_s)
            for t in pending:
                t.cancel()
                stats.statuses["unanswered"] += 1
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await client.close()
    return stats


async def prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the engines' own prefix caches, summed over their ``/metrics``
    (read as the bridge reads them)."""
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10.0) as http:
        for u in urls:
            load = parse_load((await http.get(f"{u}/metrics")).text)
            hits += load.prefix_hit_tokens or 0.0
            queries += load.prefix_query_tokens or 0.0
    return hits, queries


def summary(stats: SideStats, before: tuple[float, float], after: tuple[float, float], wall_s: float) -> dict[str, Any]:
    hits, queries = after[0] - before[0], after[1] - before[1]
    rejected = sum(n for k, n in stats.statuses.items() if k in ("429", "503"))
    served = stats.statuses.get("served", 0)

    def pct(p: float) -> float | None:
        v = percentile(stats.ttft, p)
        return None if v is None else round(v, 3)

    return {
        "requests": stats.sent,
        "served": served,
        "rejected": rejected,
        "errors": stats.sent - served - rejected,
        "statuses": dict(stats.statuses),
        "ttft_p50_s": pct(50),
        "ttft_p90_s": pct(90),
        "engine_prefix_hit_ratio": round(hits / queries, 4) if queries > 0 else None,
        "engine_prefix_hit_tokens": int(hits),
        "engine_prefix_query_tokens": int(queries),
        "wall_s": round(wall_s, 1),
    }


async def _fresh_engines(opts: VllmLiveOptions, kit: Path, log_dir: Path) -> list[VllmEngine]:
    engines = [VllmEngine(tiny_model_dir(kit), log_dir, name=f"vllm-{i}", served_name=MODEL, kit=kit,
                          block_size=BLOCK_SIZE, max_model_len=opts.max_model_len, start_timeout_s=600.0)
               for i in range(opts.engines)]
    await start_engines(*engines)
    return engines


async def _side(name: str, settings: Settings, opts: VllmLiveOptions, requests: Sequence[DemoRequest], kit: Path,
                log_dir: Path) -> dict[str, Any]:
    """One side on fresh engines: ``conductor`` (or ``conductor:POLICY``), ``peer`` or ``round_robin``."""
    side_dir = log_dir / name.replace(":", "-")
    engines = await _fresh_engines(opts, kit, side_dir)
    urls = [e.url for e in engines]
    try:
        if name.startswith("conductor"):
            if ":" in name:
                settings = settings.model_copy(update={"policy": name.split(":", 1)[1], "policy_params": {}})
            nodes = [VllmNode(f"vllm-{i}", "both", e) for i, e in enumerate(engines)]
            async with VllmGatewayCluster(settings, side_dir, nodes=nodes, model=MODEL) as c:
                before = await prefix_counters(urls)
                t0 = time.monotonic()
                stats = await replay(c.gateway_url, requests, opts, name, api_key=c.api_key)
                wall = time.monotonic() - t0
                after = await prefix_counters(urls)
                # What each decision predicted against what its request took (gateway TTFT less routing).
                errors = prediction_error_summary((await read_outcomes(settings, wait_s=15.0)).values())
            return {"router": "conductor", "policy": settings.policy, **summary(stats, before, after, wall), **errors}
        policy = "cache_aware" if name == "peer" else "round_robin"
        procs = Processes(side_dir, cwd=None)
        port = free_port(settings.bind_host)
        args = ["--host", settings.bind_host, "--port", str(port), "--policy", policy, "--worker-urls", *urls,
                "--prometheus-host", settings.bind_host, "--prometheus-port", str(free_port(settings.bind_host)),
                "--log-level", "warn"]
        await procs.start("sglang-router", args, child_environment(settings),
                          program=[sys.executable, "-m", "sglang_router.launch_router"])
        base = f"http://{settings.bind_host}:{port}"
        try:
            await _router_ready(base, procs)
            before = await prefix_counters(urls)
            t0 = time.monotonic()
            stats = await replay(base, requests, opts, name)
            wall = time.monotonic() - t0
            after = await prefix_counters(urls)
        finally:
            await procs.stop()
        return {"router": "sglang-router", "policy": policy, **summary(stats, before, after, wall)}
    finally:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)


async def _router_ready(base: str, procs: Processes, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{base}/health")).status_code == 200:
                    return
            if procs.dead():
                break
            await asyncio.sleep(0.5)
    raise VllmLiveError(f"sglang-router did not start:\n{procs.log_tail('sglang-router')}")


def _run_sides(settings: Settings, opts: VllmLiveOptions, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every side of ``opts.sides`` on fresh real engines: (side → summary, what the run was)."""
    kit = kit_dir(load_harness_settings())
    why = kit_available(kit)
    if why:
        raise VllmLiveError(why)
    if {"peer", "round_robin"} & set(opts.sides):
        why = sglang_router_missing()
        if why:
            raise VllmLiveError(why)
    trace, requests = trace_slice(opts.trace, opts.speed, opts.sample, opts.duration_s, opts.max_requests,
                                  VllmLiveError)
    quiet_clients()
    data_dir = (Path(settings.data_dir) / what).resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t_all = time.monotonic()
    out: dict[str, Any] = {}
    with servers(settings, data_dir) as base:
        for i, side in enumerate(opts.sides):
            tag = f"{os.getpid():x}{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"
            s = base.model_copy(update={"topic_prefix": f"vllm{i}-{tag}.", "view_namespace": f"vllm{i}-{tag}",
                                        "block_size": BLOCK_SIZE, "seed": opts.seed, "metrics_port": 0,
                                        "web_port": free_port(base.bind_host)})
            log.info("%s on real vLLM: side %s, %d fresh engines", what, side, opts.engines)
            out[side] = asyncio.run(_side(side, s, opts, requests, kit, log_dir))
    run = {
        "engines": "vllm",
        "requests": len(requests),
        "speed": opts.speed,
        "sample": opts.sample,
        "trace": trace.name,
        "instances": {"aggregated": opts.engines},
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "logs": str(log_dir),
        "wall_s": round(time.monotonic() - t_all, 1),
    }
    return out, run


def run_vllm_live_bench(settings: Settings, opts: VllmLiveOptions) -> dict[str, Any]:
    """``bench live --engines vllm``: one result dict with a ``conductor``, a ``peer`` and a ``round_robin`` object."""
    out, run = _run_sides(settings, opts, "bench-live-vllm")
    result: dict[str, Any] = {"bench": "live", "peer_name": "sglang-router", "peer_mode": "regular", **run, **out}
    if "peer" in out:
        result["peer_side"] = out["peer"]
    return result


def run_vllm_demo(settings: Settings, opts: VllmLiveOptions, policy: str, baseline: str) -> dict[str, Any]:
    """``conductor demo --engines vllm``: the demo's slice through Conductor with ``policy``, then with
    ``baseline``, each on fresh real engines; the demo's headline fields from real engines."""
    sides = (f"conductor:{policy}", f"conductor:{baseline}")
    out, run = _run_sides(settings, dataclasses.replace(opts, sides=sides), "demo-vllm")
    a, b = out[sides[0]], out[sides[1]]
    return {
        "ok": a["served"] + a["rejected"] > 0 and b["served"] + b["rejected"] > 0,
        "policy": policy, "baseline_policy": baseline, **run,
        "served": a["served"], "rejected": a["rejected"], "errors": a["errors"],
        "reuse_ratio": a["engine_prefix_hit_ratio"], "ttft_p50_s": a["ttft_p50_s"], "ttft_p90_s": a["ttft_p90_s"],
        "ttft_prediction_error_p50": a.get("ttft_prediction_error_p50"),
        "ttft_prediction_error_p90": a.get("ttft_prediction_error_p90"),
        "baseline_ttft_prediction_error_p50": b.get("ttft_prediction_error_p50"),
        "baseline_ttft_prediction_error_p90": b.get("ttft_prediction_error_p90"),
        "baseline_served": b["served"], "baseline_rejected": b["rejected"], "baseline_errors": b["errors"],
        "baseline_reuse_ratio": b["engine_prefix_hit_ratio"], "baseline_ttft_p50_s": b["ttft_p50_s"],
        "baseline_ttft_p90_s": b["ttft_p90_s"],
        "runs": {policy: a, baseline: b},
    }


__all__ = ["SIDES", "VllmLiveError", "VllmLiveOptions", "run_vllm_demo", "run_vllm_live_bench", "vllm_prompt"]
