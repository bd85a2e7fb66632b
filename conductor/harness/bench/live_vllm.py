"""``conductor bench live --engines vllm``: one trace slice through Conductor and its peers, on real vLLM.

Three sides, one after the other, each in front of FRESH, identical real vLLM engines (the
CPU build and tiny random-weight model of ``scripts/vllm-kit``; every engine aggregated: role
``both``, prefix caching on, no KV connector, as most vLLM fleets run):

- **conductor**: stream worker, router (``CONDUCTOR_POLICY``), a ``conductor bridge`` per
  engine (KV events, ``/metrics`` load, the engine's URL announced) and ``conductor gateway``
  with no ``--engine`` (it finds the engines through the view);
- **peer**: ``sglang-router`` in its regular HTTP mode with ``cache_aware``;
- **round_robin**: ``sglang-router`` with ``round_robin`` (the baseline that ignores the cache);
- **conductor:POLICY**: Conductor's side with another of its policies (``conductor:sglang-style``:
  Conductor's path with the peer's rule, which separates the path from the policy).

Every side gets the same requests at the same times: the conversation trace slice of
``conductor demo``, as text (each trace block a fixed run of pseudo-words, so prompts share a
text and token prefix exactly where the trace's ``hash_ids`` do), each a streamed completion
sent by the official ``openai`` client. Per side: TTFT p50/p90 as the client saw it (wall
clock: these are real engines), the engines' OWN prefix-cache hit ratio (their
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` over the run), served
and rejected requests (a rejection is not a served request: both are reported), errors.

Rounds (``rounds``): every side once per round, the order rotating from round to round; a side's
fields are the median over its rounds, each round's own values under ``rounds``. CPU: the seconds
of everything but the engines and the client over the replay (Conductor's gateway, worker, router,
bridges, broker and Redis; the SGLang router for the peers), per process and per request
(:mod:`conductor.harness.cpu`). Regimes: ``engine_model`` ``tiny`` (a 1,500-token prefill ~25 ms)
or ``heavy`` (~300 ms or more on one core; by default with a KV cache small enough that the engines
evict, counted by their own ``vllm:kv_block_idle_before_evict_seconds``); ``pin_engines``: the
engines on those cores, everything else (this process, its children, the broker and Redis) on the
others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
from pydantic import BaseModel

from conductor.bridge.scrape import parse_load
from conductor.costmodel.fitting import prediction_error_summary
from conductor.costmodel.profiles import load_profile
from conductor.harness.bench.live import LiveBenchError, block_words, quiet_clients, read_outcomes, servers, trace_slice
from conductor.harness.calibrate import CalibrateConfig, SweepPlan, calibrate_engine, write_profile
from conductor.harness.cpu import CpuMeter, affinity
from conductor.harness.demo import DemoRequest, Processes
from conductor.harness.devstack import free_port
from conductor.harness.gateway_cluster import sglang_router_missing
from conductor.harness.settings import load_harness_settings
from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.harness.vllm_kit import (
    ENGINE_MODELS,
    VllmEngine,
    engine_model_dir,
    kit_available,
    kit_dir,
    start_engines,
)
from conductor.routing.policies import POLICIES
from conductor.settings import Settings, child_environment
from conductor.stats import percentile
from conductor.topology import Topology
from schemas import RoutingDecision, decode
from streams.kafka import consumer
from streams.topics import topics

log = logging.getLogger(__name__)

SIDES = ("conductor", "peer", "round_robin")
"""The sides run when none are named (the JSON's shape since the bench began)."""
PEER_SIDES = {"peer": "cache_aware", "round_robin": "round_robin"}
"""The SGLang router's sides and their policies."""
HEAVY_KV_CACHE_BYTES = 48 * 2**20
"""The heavy regime's KV cache per engine by default: 48 MiB, 32,768 tokens (1,024 blocks) of the heavy
model (1.5 KiB a token): room for 16 sequences of the slice's ~2,000 tokens at once, a third of the
~2,900 distinct blocks each of 2 engines sees in the default slice (5,784 in all), so the engines
evict during the replay (the kit's 1 GiB holds ~2 M tiny-model tokens and never does)."""
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
    rounds: int = 1
    """Every side this many times, the order rotating; a side's fields are the medians."""
    engine_model: str = "tiny"
    """``tiny`` or ``heavy`` (:data:`~conductor.harness.vllm_kit.ENGINE_MODELS`)."""
    engine_kv_cache_bytes: int | None = None
    """Each engine's KV cache; None: the kit's 1 GiB (tiny), :data:`HEAVY_KV_CACHE_BYTES` (heavy)."""
    pin_engines: tuple[int, ...] = ()
    """The cores the engines run on (everything else on the others); empty: no pinning."""
    calibrate: bool = False
    """Calibrate a fresh engine of the same kind first (``conductor profile calibrate``'s sweep, one
    repeat) and run Conductor's sides on that profile instead of the configured one."""
    peer_policy: str = PEER_SIDES["peer"]
    """The SGLang router's policy on the ``peer`` side (``round_robin`` keeps its own)."""
    peer_args: tuple[str, ...] = ()
    """More arguments of the SGLang router on its sides (its thresholds, say: :func:`parse_peer_args`)."""

    def kv_cache_bytes(self) -> int | None:
        if self.engine_kv_cache_bytes is not None:
            return self.engine_kv_cache_bytes
        return HEAVY_KV_CACHE_BYTES if self.engine_model == "heavy" else None

    def capacity_groups(self) -> dict[str, list[str]]:
        """The engines pinned to the same cores as one capacity group (none unpinned or alone)."""
        if not self.pin_engines or self.engines < 2:
            return {}
        return shared_cores_groups([f"vllm-{i}" for i in range(self.engines)], self.pin_engines)


def parse_sides(text: str) -> tuple[str, ...]:
    """``conductor,conductor:POLICY,peer,round_robin`` (any subset, in the order to run) as a tuple;
    ValueError naming what is wrong."""
    sides = tuple(x.strip() for x in text.split(",") if x.strip())
    if not sides:
        raise ValueError("--sides names no side")
    for side in sides:
        if side.startswith("conductor:"):
            policy = side.split(":", 1)[1]
            if policy not in POLICIES:
                raise ValueError(f"--sides: no Conductor policy {policy!r} (one of {', '.join(sorted(POLICIES))})")
        elif side != "conductor" and side not in PEER_SIDES:
            raise ValueError(f"--sides: {side!r} is not conductor, conductor:POLICY, peer or round_robin")
    if len(set(sides)) != len(sides):
        raise ValueError("--sides names a side twice")
    return sides


PEER_ARGS_SET = ("--host", "--port", "--policy", "--worker-urls", "--prometheus-host", "--prometheus-port",
                 "--pd-disaggregation", "--prefill", "--decode")
"""The SGLang router's arguments the bench sets itself (the engines, the ports, the policy)."""


def parse_peer_args(text: str) -> tuple[str, ...]:
    """``--peer-args`` (shell words, e.g. ``--cache-threshold 0.3 --balance-abs-threshold 16``) as a
    tuple; ValueError naming an argument the bench sets itself or text that is not shell words."""
    try:
        words = tuple(shlex.split(text))
    except ValueError as e:
        raise ValueError(f"--peer-args: {e}") from None
    for w in words:
        flag = w.split("=", 1)[0]
        if flag in PEER_ARGS_SET:
            raise ValueError(f"--peer-args: {flag} is set by the bench (the engines, ports and policy: use "
                             "--peer-policy for the policy)")
    return words


def parse_cpus(text: str) -> tuple[int, ...]:
    """A core list as ``taskset -c`` writes it (``1``, ``0-3``, ``1,3``) as sorted core numbers; ValueError."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--pin-engines: {text!r} is not a core list (e.g. 1, 0-3, 1,3)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError("--pin-engines names no core")
    return tuple(sorted(cpus))


def pinning(engines: Sequence[int], available: Sequence[int] | None) -> dict[str, Any]:
    """Which cores each group gets: the engines those asked for, everything else the rest of the
    cores this process may use (all of them, ``shared``, when none is left); VllmLiveError when the
    machine lacks a core asked for."""
    if available is None:
        raise VllmLiveError("--pin-engines: this platform does not let a process choose its cores")
    missing = sorted(set(engines) - set(available))
    if missing:
        raise VllmLiveError(f"--pin-engines: core(s) {missing} are not among this process's cores {list(available)}")
    others = [c for c in available if c not in set(engines)]
    return {"engines": list(engines), "others": others or list(available), "shared": not others}


def write_jsonl(path: Path, records: Iterable[BaseModel]) -> None:
    """One JSON object per line, each record's fields."""
    with path.open("w") as f:
        for r in records:
            f.write(r.model_dump_json() + "\n")


def shared_cores_groups(nodes: Sequence[str], cores: Sequence[int]) -> dict[str, list[str]]:
    """``nodes`` (engines pinned to the same ``cores``) as one capacity group, named by the cores."""
    return {f"cores-{'-'.join(map(str, cores))}": list(nodes)}


def shared_cores_topology(path: Path, nodes: Sequence[str], cores: Sequence[int]) -> Path:
    """Write a topology whose one capacity group is ``nodes`` (engines pinned to the same
    ``cores``: they share that capacity); return ``path``. Its links are nominal: aggregated
    engines move no KV between them."""
    link = {"bandwidth_gbps": 100.0, "transport": "tcp"}
    topo = Topology.model_validate({
        "name": "bench-live-shared-cores",
        "description": f"{len(nodes)} engines pinned to cores {','.join(map(str, cores))}",
        "links": {"same_rack": link, "cross_rack": link},
        "capacity_groups": shared_cores_groups(nodes, cores),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(topo.model_dump_json(indent=2))
    return path


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


EVICTED = "vllm:kv_block_idle_before_evict_seconds_count"
"""The engines' count of evicted blocks (with ``--kv-cache-metrics``: :attr:`VllmEngine.kv_cache_bytes` set)."""
PREFILL_S = "vllm:request_prefill_time_seconds"
COMPUTED = "vllm:request_prefill_kv_computed_tokens"
"""Per request, the engine's own prefill seconds and the prompt tokens it computed (not read from its cache)."""
ENGINE_TTFT_S = "vllm:time_to_first_token_seconds"
QUEUE_S = "vllm:request_queue_time_seconds"
"""Per request, the engine's own time to first token (from the request reaching its server to the
first token leaving its engine core) and the part of it spent waiting to be scheduled: set beside the
client's TTFT, what the engines took and what the path before them added."""


def metric_total(metrics: str, name: str) -> float | None:
    """The sum over label sets of metric ``name`` (e.g. a histogram's ``_count``) in one ``/metrics``
    text; None when the engine does not report it."""
    found = None
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            found = (found or 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def evicted_blocks(metrics: str) -> float | None:
    """Blocks evicted so far by one engine, from its ``/metrics`` text (None when it does not count them)."""
    return metric_total(metrics, EVICTED)


@dataclass(frozen=True)
class EngineCounters:
    """The engines' own counters, summed over them (None: not reported)."""

    hit_tokens: float = 0.0
    query_tokens: float = 0.0
    evicted_blocks: float | None = None
    prefill_s: float | None = None
    prefills: float | None = None
    computed_tokens: float | None = None
    ttft_s: float | None = None
    ttfts: float | None = None
    queue_s: float | None = None
    queues: float | None = None


def _add(a: float | None, b: float | None) -> float | None:
    return a if b is None else (b if a is None else a + b)


async def prefix_counters(urls: Sequence[str]) -> EngineCounters:
    """The engines' prefix-cache hits and queries (read as the bridge reads them), evictions and
    prefill times, summed over their ``/metrics``."""
    total = EngineCounters()
    async with httpx.AsyncClient(timeout=10.0) as http:
        for u in urls:
            text = (await http.get(f"{u}/metrics")).text
            load = parse_load(text)
            total = EngineCounters(
                hit_tokens=total.hit_tokens + (load.prefix_hit_tokens or 0.0),
                query_tokens=total.query_tokens + (load.prefix_query_tokens or 0.0),
                evicted_blocks=_add(total.evicted_blocks, evicted_blocks(text)),
                prefill_s=_add(total.prefill_s, metric_total(text, PREFILL_S + "_sum")),
                prefills=_add(total.prefills, metric_total(text, PREFILL_S + "_count")),
                computed_tokens=_add(total.computed_tokens, metric_total(text, COMPUTED + "_sum")),
                ttft_s=_add(total.ttft_s, metric_total(text, ENGINE_TTFT_S + "_sum")),
                ttfts=_add(total.ttfts, metric_total(text, ENGINE_TTFT_S + "_count")),
                queue_s=_add(total.queue_s, metric_total(text, QUEUE_S + "_sum")),
                queues=_add(total.queues, metric_total(text, QUEUE_S + "_count")))
    return total


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def summary(stats: SideStats, before: EngineCounters, after: EngineCounters, wall_s: float) -> dict[str, Any]:
    hits, queries = after.hit_tokens - before.hit_tokens, after.query_tokens - before.query_tokens
    evicted = _diff(before.evicted_blocks, after.evicted_blocks)
    prefill_s, prefills = _diff(before.prefill_s, after.prefill_s), _diff(before.prefills, after.prefills)
    computed = _diff(before.computed_tokens, after.computed_tokens)

    def mean(total_s: float | None, n: float | None) -> float | None:
        return round(total_s / n, 4) if total_s is not None and n else None
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
        "ttft_mean_s": round(sum(stats.ttft) / len(stats.ttft), 4) if stats.ttft else None,
        "engine_prefix_hit_ratio": round(hits / queries, 4) if queries > 0 else None,
        "engine_prefix_hit_tokens": int(hits),
        "engine_prefix_query_tokens": int(queries),
        "wall_s": round(wall_s, 1),
        "engine_evicted_blocks": None if evicted is None else int(evicted),
        # The engines' own prefill: seconds a request's prefill took once scheduled (batched with others),
        # and the prompt tokens it computed; what says which regime (tiny, heavy) the run was in.
        "engine_prefill_s_mean": mean(prefill_s, prefills),
        "engine_computed_tokens_mean": round(computed / prefills, 1) if computed is not None and prefills else None,
        # The engines' own TTFT and queue wait, means over the replay: the client's TTFT less these is
        # what the path in front of the engines (router, network, the engines' HTTP servers' wait) added.
        "engine_ttft_s_mean": mean(_diff(before.ttft_s, after.ttft_s), _diff(before.ttfts, after.ttfts)),
        "engine_queue_s_mean": mean(_diff(before.queue_s, after.queue_s), _diff(before.queues, after.queues)),
    }


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def holder_reason(why: str) -> str:
    """A decision's ``left_holder`` text as a reason to count by: its numbers (times, margins, the
    digits of node ids) masked, so that one rule's decisions count together."""
    return _NUMBER.sub("N", why)


def left_holder_counts(decisions: Sequence[RoutingDecision]) -> dict[str, Any]:
    """How many decisions left the instance that held the request's longest prefix, by reason
    (:func:`holder_reason`), with one such decision's own words.

    Read from each decision's ``left_holder`` (why a holder was left; None when it was not);
    decisions whose schema has no such field give null counts, not zeros."""
    if "left_holder" not in RoutingDecision.model_fields:
        return {"decisions": len(decisions), "left_holder_decisions": None, "left_holder_by_reason": None,
                "left_holder_example": None}
    reasons: Counter[str] = Counter()
    example = None
    for d in decisions:
        why = getattr(d, "left_holder", None)
        if not why:
            continue
        example = example or str(why)
        reasons[holder_reason(str(why))] += 1
    return {"decisions": len(decisions), "left_holder_decisions": sum(reasons.values()),
            "left_holder_by_reason": dict(sorted(reasons.items())), "left_holder_example": example}


async def read_decisions(settings: Settings, idle_s: float = 2.0, wait_s: float = 30.0) -> list[RoutingDecision]:
    """Every routing decision on ``settings``' dispatch topic (until ``idle_s`` without a new record)."""
    cons = consumer(settings.kafka(), topics(settings.topic_config()).dispatch.name, group_id=None,
                    fetch_max_wait_ms=50)
    await cons.start()
    found: list[RoutingDecision] = []
    try:
        deadline, last = time.monotonic() + wait_s, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle_s:
            for recs in (await cons.getmany(timeout_ms=200)).values():
                for r in recs:
                    last = time.monotonic()
                    with contextlib.suppress(ValueError):  # a record of another kind or version: not a decision
                        body = decode(r.value).body
                        if isinstance(body, RoutingDecision):
                            found.append(body)
    finally:
        await cons.stop()
    return found


async def _fresh_engines(opts: VllmLiveOptions, kit: Path, log_dir: Path) -> list[VllmEngine]:
    cpus = frozenset(opts.pin_engines) or None
    engines = [VllmEngine(engine_model_dir(opts.engine_model, kit), log_dir, name=f"vllm-{i}", served_name=MODEL,
                          kit=kit, block_size=BLOCK_SIZE, max_model_len=opts.max_model_len, start_timeout_s=600.0,
                          cpus=cpus, kv_cache_bytes=opts.kv_cache_bytes())
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
            if opts.capacity_groups():
                # Every engine runs on the same pinned cores: one capacity, as an operator would declare it.
                settings = settings.model_copy(update={"topology_file": shared_cores_topology(
                    side_dir / "topology.json", [f"vllm-{i}" for i in range(opts.engines)], opts.pin_engines)})
            nodes = [VllmNode(f"vllm-{i}", "both", e) for i, e in enumerate(engines)]
            # The gateway decides colocated (its default): no router process, as such a deployment runs.
            async with VllmGatewayCluster(settings, side_dir, nodes=nodes, model=MODEL, router=False) as c:
                # Everything but the engines (not in procs) and this process (the client).
                stats, wall, cpu, before, after = await _measured_replay(
                    c.gateway_url, c.control_pids(), engines, requests, opts, name, api_key=c.api_key)
                # What each decision predicted against what its request took (gateway TTFT less routing).
                outcomes = await read_outcomes(settings, wait_s=15.0)
                errors = prediction_error_summary(outcomes.values())
                decisions = await read_decisions(settings)
                left = left_holder_counts(decisions)
                # Kept beside the logs: what each request was predicted and took, to read after the stack is gone.
                write_jsonl(side_dir / "decisions.jsonl", decisions)
                write_jsonl(side_dir / "outcomes.jsonl", outcomes.values())
            return {"router": "conductor", "policy": settings.policy, **summary(stats, before, after, wall), **errors,
                    **cpu, **left}
        policy = opts.peer_policy if name == "peer" else PEER_SIDES[name]
        procs = Processes(side_dir, cwd=None)
        port = free_port(settings.bind_host)
        args = ["--host", settings.bind_host, "--port", str(port), "--policy", policy, "--worker-urls", *urls,
                "--prometheus-host", settings.bind_host, "--prometheus-port", str(free_port(settings.bind_host)),
                "--log-level", "warn", *opts.peer_args]
        router = await procs.start("sglang-router", args, child_environment(settings),
                                   program=[sys.executable, "-m", "sglang_router.launch_router"])
        base = f"http://{settings.bind_host}:{port}"
        try:
            await _router_ready(base, procs)
            stats, wall, cpu, before, after = await _measured_replay(
                base, {"sglang-router": router.pid}, engines, requests, opts, name)
        finally:
            await procs.stop()
        return {"router": "sglang-router", "policy": policy, **summary(stats, before, after, wall), **cpu}
    finally:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)


async def _measured_replay(url: str, control: dict[str, int | None], engines: Sequence[VllmEngine],
                           requests: Sequence[DemoRequest], opts: VllmLiveOptions, name: str,
                           api_key: str = "bench") -> tuple[SideStats, float, dict[str, Any], EngineCounters,
                                                            EngineCounters]:
    """The replay through ``url``: its stats, wall seconds, the CPU of the ``control`` processes
    (``control_cpu_*``) and of the engines, server and engine core (``engine_cpu_*``: what a
    router's traffic and polling cost them), and the engines' prefix counters before and after."""
    urls = [e.url for e in engines]
    meter = CpuMeter(control)
    engines_meter = CpuMeter({e.name: e.proc.pid if e.proc is not None else None for e in engines})
    before = await prefix_counters(urls)
    meter.start()
    engines_meter.start()
    t0 = time.monotonic()
    stats = await replay(url, requests, opts, name, api_key=api_key)
    wall = time.monotonic() - t0
    cpu = {**meter.report(stats.sent), **engines_meter.report(stats.sent, prefix="engine_")}
    return stats, wall, cpu, before, await prefix_counters(urls)


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


async def _calibrated(settings: Settings, opts: VllmLiveOptions, kit: Path, log_dir: Path,
                      out: Path) -> dict[str, Any]:
    """Calibrate one fresh engine like the sides' (pinned alike) and write its profile to ``out``;
    the calibration's summary (its fit and its error on the sweep)."""
    engines = await _fresh_engines(replace(opts, engines=1), kit, log_dir / "calibrate")
    try:
        plan = SweepPlan(repeats=1, block_size=BLOCK_SIZE)
        config = CalibrateConfig(engine=engines[0].url, plan=plan, base=load_profile(settings.model_profile),
                                 model=MODEL, name=f"{settings.model_profile}-{opts.engine_model}-calibrated")
        cal = await calibrate_engine(config)
    finally:
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
    write_profile(cal.profile, out)
    return cal.summary() | {"out": str(out)}


def round_orders(sides: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the sides in each round: rotated by one from round to round, so that each side
    runs first (and last) as often as the others over ``len(sides)`` rounds."""
    n = len(sides)
    return [[*sides[r % n:], *sides[:r % n]] for r in range(rounds)]


def median_over_rounds(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One side's rounds as one object with the same fields: a number is the median over the rounds
    that have it (an integer stays one where the median is whole), a mapping of numbers is taken key
    by key (a key missing from a round counts 0 there: counts, seconds), anything else is the first
    round's."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        out[k] = _median([r.get(k) for r in rows])
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(_is_number(v) for v in present):
        m = percentile(present, 50)
        assert m is not None
        if all(isinstance(v, int) for v in present) and m.is_integer():
            return int(m)
        return round(m, 4)
    if all(isinstance(v, dict) for v in present) and all(_is_number(x) for v in present for x in v.values()):
        keys = dict.fromkeys(k for v in present for k in v)
        return {k: _median([v.get(k, 0) for v in present]) for k in keys}
    return present[0]


def _run_sides(settings: Settings, opts: VllmLiveOptions, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every side of ``opts.sides`` on fresh real engines, ``opts.rounds`` times: (side → its medians
    and its rounds, what the run was)."""
    kit = kit_dir(load_harness_settings())
    why = kit_available(kit)
    if why:
        raise VllmLiveError(why)
    if opts.engine_model not in ENGINE_MODELS:
        raise VllmLiveError(f"--engine-model must be one of {', '.join(ENGINE_MODELS)}, not {opts.engine_model!r}")
    if set(PEER_SIDES) & set(opts.sides):
        why = sglang_router_missing()
        if why:
            raise VllmLiveError(why)
    pins = pinning(opts.pin_engines, affinity()) if opts.pin_engines else None
    trace, requests = trace_slice(opts.trace, opts.speed, opts.sample, opts.duration_s, opts.max_requests,
                                  VllmLiveError)
    quiet_clients()
    data_dir = (Path(settings.data_dir) / what).resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t_all = time.monotonic()
    orders = round_orders(opts.sides, max(1, opts.rounds))
    rows: dict[str, list[dict[str, Any]]] = {side: [] for side in opts.sides}
    calibration: dict[str, Any] | None = None
    mine = affinity()
    try:
        if pins is not None:
            # This process and all it starts from here on (broker, Redis, Conductor, the peer) off the
            # engines' cores; each engine sets its own cores as it starts.
            os.sched_setaffinity(0, pins["others"])
        with servers(settings, data_dir) as base:
            if opts.calibrate and any(side.startswith("conductor") for side in opts.sides):
                log.info("%s on real vLLM: calibrating a fresh %s engine first", what, opts.engine_model)
                calibration = asyncio.run(_calibrated(base, opts, kit, log_dir, log_dir / "profile-calibrated.json"))
                base = base.model_copy(update={"model_profile": calibration["out"]})
            for r, order in enumerate(orders):
                for side in order:
                    i = opts.sides.index(side)
                    tag = f"{os.getpid():x}{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"
                    s = base.model_copy(update={"topic_prefix": f"vllm{i}r{r}-{tag}.",
                                                "view_namespace": f"vllm{i}r{r}-{tag}",
                                                "block_size": BLOCK_SIZE, "seed": opts.seed, "metrics_port": 0,
                                                "web_port": free_port(base.bind_host)})
                    log.info("%s on real vLLM: round %d/%d, side %s, %d fresh engines", what, r + 1, len(orders),
                             side, opts.engines)
                    rows[side].append(asyncio.run(_side(side, s, opts, requests, kit, log_dir / f"round-{r}")))
    finally:
        if pins is not None and mine is not None:
            os.sched_setaffinity(0, mine)
    out = {side: {**median_over_rounds(rs), "rounds": rs} for side, rs in rows.items()}
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
        "rounds": len(orders),
        "round_orders": orders,
        "engine_model": opts.engine_model,
        "engine_kv_cache_bytes": opts.kv_cache_bytes(),
        "pinning": pins,
        "capacity_groups": opts.capacity_groups(),
        "model_profile": calibration["out"] if calibration is not None else settings.model_profile,
        "calibration": calibration,
    }
    return out, run


def run_vllm_live_bench(settings: Settings, opts: VllmLiveOptions) -> dict[str, Any]:
    """``bench live --engines vllm``: one result dict with an object per side (by default ``conductor``,
    ``peer`` and ``round_robin``)."""
    out, run = _run_sides(settings, opts, "bench-live-vllm")
    result: dict[str, Any] = {"bench": "live", "peer_name": "sglang-router", "peer_mode": "regular", **run, **out}
    if "peer" in out:
        result["peer_side"] = out["peer"]
    return result


def run_vllm_demo(settings: Settings, opts: VllmLiveOptions, policy: str, baseline: str) -> dict[str, Any]:
    """``conductor demo --engines vllm``: the demo's slice through Conductor with ``policy``, then with
    ``baseline``, each on fresh real engines; the demo's headline fields from real engines."""
    sides = (f"conductor:{policy}", f"conductor:{baseline}")
    out, run = _run_sides(settings, dataclasses.replace(opts, sides=sides, rounds=1), "demo-vllm")
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


__all__ = [
    "HEAVY_KV_CACHE_BYTES",
    "PEER_SIDES",
    "SIDES",
    "VllmLiveError",
    "VllmLiveOptions",
    "evicted_blocks",
    "holder_reason",
    "left_holder_counts",
    "median_over_rounds",
    "metric_total",
    "parse_cpus",
    "parse_peer_args",
    "parse_sides",
    "pinning",
    "round_orders",
    "run_vllm_demo",
    "run_vllm_live_bench",
    "shared_cores_groups",
    "shared_cores_topology",
    "vllm_prompt",
]
