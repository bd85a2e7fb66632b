"""``conductor bench live --peer sglang-router``: the same trace slice through Conductor and through a real peer.

Two runs, one after the other, each on fresh but identical emulated engines (2 prefill + 2
decode by default, the same options, the same seed, the same time scale):

- **conductor**: a stream worker, a router (``CONDUCTOR_POLICY``) and ``conductor gateway``
  with the SGLang hand-off (``--engine-protocol sglang``); the engines' KV events reach the
  view through bridges, as in ``conductor demo``.
- **peer**: the SGLang router (``sglang-router``, the ``peer`` extra) in P/D mode
  (``--pd-disaggregation``, ``--prefill URL BOOTSTRAP_PORT``, ``--decode URL``) with its
  cache-aware policy for both prefill and decode. It routes on its own: no Kafka, no view.

Both get the same requests at the same times: the Mooncake trace slice of ``conductor demo``
(``load_slice``: same speed, same sampling), each sent by the official ``openai`` client as a
streamed completion. The prompt is TEXT, since the SGLang router's cache-aware policy matches
request text in a radix tree of characters: each trace block (``hash_id``, 512 tokens) is
rendered as 512 fixed pseudo-words, and the emulated engines' tokenizer makes one token per
word, so requests share exactly the token prefixes (and block keys) the trace says they share,
and the same character prefixes.

Per side: TTFT p50/p90 as the client saw it, in model time (the demo's accounting: what the
engines emulated, from their reports, counts at model time; everything else as it really
took), reuse (cached tokens the prefill engines reported / prompt tokens), rejections
(HTTP 429/503) and other errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from conductor.costmodel.fitting import prediction_error_summary
from conductor.errors import ConductorError
from conductor.harness.cpu import CpuMeter
from conductor.harness.demo import TRACE_BLOCK_TOKENS, DemoRequest, RunStats, ask_completion, default_trace, load_slice
from conductor.harness.devstack import EmbeddedStack, free_port
from conductor.harness.gateway_cluster import GatewayCluster, SglangRouterCluster, sglang_router_missing
from conductor.settings import Settings
from conductor.stats import percentile
from schemas import RequestOutcome, decode
from streams.kafka import consumer
from streams.topics import topics

log = logging.getLogger(__name__)

PEERS = ("sglang-router",)
REJECTION_STATUSES = ("429", "503")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TRAILING_INDEX = re.compile(r"-(\d+)(?:\.r\d+)?$")
"""The trace index at the end of a request id (``...-conductor-17``, ``peer-17``; a retry's ``.r1``)."""


class LiveBenchError(ConductorError):
    pass


@dataclass(frozen=True)
class LiveOptions:
    duration_s: float = 30.0
    """Trace time replayed per side, in wall seconds (arrivals within it at ``speed``)."""
    speed: float = 10.0
    sample: int = 6
    trace: Path | None = None
    prefill: int = 2
    decode: int = 2
    block_size: int = 64
    kv_blocks: int = 16_384
    max_requests: int | None = None
    max_output_tokens: int | None = None
    drain_s: float = 60.0
    """After the last arrival, wait at most this long for the answers (then count the rest unanswered)."""
    peer: str = "sglang-router"
    peer_policy: str = "cache_aware"
    seed: int = 0
    peer_first: bool = False
    """Run the peer's side first (to see whether the order, i.e. the machine's load drifting, matters)."""


# --- the prompts ------------------------------------------------------------------------


@lru_cache(maxsize=65_536)
def block_words(hash_id: int, seed: int = 0) -> tuple[str, ...]:
    """The 512 pseudo-words that stand for trace block ``hash_id`` (deterministic, 4 letters each)."""
    raw = hashlib.shake_128(f"conductor-live/{seed}/{hash_id}".encode()).digest(4 * TRACE_BLOCK_TOKENS)
    return tuple("".join(LETTERS[b % 26] for b in raw[i : i + 4]) for i in range(0, len(raw), 4))


def text_prompt(hash_ids: tuple[int, ...], input_length: int, index: int, seed: int = 0) -> str:
    """``input_length`` words: the trace's blocks as fixed words, then a tail unique to request ``index``.

    One word is one token for the emulated engines, so two prompts share a token prefix (and KV
    blocks) exactly where the trace's ``hash_ids`` do, and the same characters up to there.
    """
    words: list[str] = []
    for h in hash_ids:
        if len(words) >= input_length:
            break
        words.extend(block_words(h, seed))
    if len(words) < input_length:
        need = input_length - len(words)
        raw = hashlib.shake_128(f"conductor-live/{seed}/request/{index}".encode()).digest(4 * need)
        # An upper-case first letter: no tail word equals a block word, so tails never look shared.
        words.extend(LETTERS[raw[i] % 26].upper() + "".join(LETTERS[b % 26] for b in raw[i + 1 : i + 4])
                     for i in range(0, len(raw), 4))
    return " ".join(words[:input_length])


# --- one side --------------------------------------------------------------------------


async def replay(base_url: str, stats: RunStats, requests: list[DemoRequest], *, side: str, engine_id_prefix: str,
                 seed: int, drain_s: float, max_output_tokens: int | None, api_key: str = "bench") -> float:
    """Send every request at its arrival time (streamed, the openai client); wait for the answers.

    Returns the wall seconds from the first send to the last answer. A request still unanswered
    ``drain_s`` after the last arrival is cancelled and counted as ``unanswered``.
    """
    import openai  # the harness extra's: imported when a run starts (cli/gateway.py imports this module for PEERS)

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300.0)
    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    try:
        for r in requests:
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = text_prompt(r.hash_ids, r.input_length, r.index, seed)
            client_id = f"{side}-{r.index}"
            out = max(1, min(r.output_length, max_output_tokens or r.output_length))
            stats.prompt_of[engine_id_prefix + client_id] = r.input_length
            tasks.append(asyncio.create_task(
                ask_completion(client, stats, engine_id_prefix + client_id, client_id, prompt, out)))
            stats.sent += 1
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
            for t in pending:
                t.cancel()
                stats.client_errors["unanswered"] += 1
            await asyncio.gather(*tasks, return_exceptions=True)
        return time.monotonic() - t0
    finally:
        await client.close()


async def read_outcome_records(settings: Settings, ids: Sequence[str] | None = None, wait_s: float = 30.0,
                               idle_s: float = 2.0) -> dict[str, tuple[RequestOutcome, int]]:
    """The gateway outcomes on ``settings``' topic with their envelopes' times (ms): of these request
    ids (as many as arrive within ``wait_s``), or every one there (until ``idle_s`` without a new one)."""
    cons = consumer(settings.kafka(), topics(settings.topic_config()).request_outcomes.name, group_id=None,
                    fetch_max_wait_ms=50)
    await cons.start()
    want = set(ids) if ids is not None else None
    found: dict[str, tuple[RequestOutcome, int]] = {}
    try:
        deadline = time.monotonic() + wait_s
        last = time.monotonic()
        while time.monotonic() < deadline and (want is None or not want <= set(found)):
            if want is None and time.monotonic() - last > idle_s:
                break
            for recs in (await cons.getmany(timeout_ms=200)).values():
                for r in recs:
                    env = decode(r.value)
                    b = env.body
                    if isinstance(b, RequestOutcome) and (want is None or b.request_id in want):
                        found[b.request_id] = (b, env.ts_ms)
                        last = time.monotonic()
    finally:
        await cons.stop()
    return found


async def read_outcomes(settings: Settings, ids: Sequence[str] | None = None, wait_s: float = 30.0,
                        idle_s: float = 2.0) -> dict[str, RequestOutcome]:
    """:func:`read_outcome_records` without the times."""
    return {k: o for k, (o, _) in (await read_outcome_records(settings, ids, wait_s, idle_s)).items()}


def side_summary(stats: RunStats, reports: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The side's figures: TTFT (model time), reuse, rejections and errors, per-instance prefills."""
    for row in reports:
        stats.on_report(row)
    sm = stats.summary()
    rejected = sum(n for code, n in stats.client_errors.items() if code in REJECTION_STATUSES)
    errors = sum(n for code, n in stats.client_errors.items() if code not in REJECTION_STATUSES)
    per_instance = {node: c["done"] for node, c in sorted(stats.per_node.items()) if c["done"]}
    return {
        "requests": stats.sent,
        "served": len(stats.client_ttft),
        "engine_prefix_hit_ratio": sm["reuse_ratio"],
        "rejected": rejected,
        "errors": errors,
        "errors_by_kind": dict(stats.client_errors),
        "reuse_ratio": sm["reuse_ratio"],
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "ttft_p50_s": sm["ttft_p50_s"],
        "ttft_p90_s": sm["ttft_p90_s"],
        "ttft_mean_s": sm["ttft_mean_s"],
        "client_ttft_wall_p50_s": sm["client_ttft_wall_p50_s"],
        "client_ttft_not_emulated_p50_s": sm["client_ttft_not_emulated_p50_s"],
        "gateway_routing_ms_p50": sm["gateway_routing_ms_p50"] if sm["gateway_routing_ms_p50"] else None,
        "tbt_p90_ms": sm["tbt_p90_ms"],
        "prefills_done": stats.prefills,
        "decodes_done": stats.decodes,
        "done_per_instance": per_instance,
        "wall_s": round(wall_s, 2),
        "_ttft_by_index": {int(m.group(1)): t for rid, t in stats.observed.items()
                           if (m := TRAILING_INDEX.search(rid)) is not None},
    }


def both_served(conductor: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """TTFT p50/p90 of each side over the requests both sides served (a rejection is no TTFT)."""
    a, b = conductor.pop("_ttft_by_index"), peer.pop("_ttft_by_index")
    common = sorted(set(a) & set(b))

    def pct(xs: list[float], p: float) -> float | None:
        v = percentile(xs, p)
        return None if v is None else round(v, 3)

    out: dict[str, Any] = {"both_served": len(common)}
    for name, side in (("conductor", a), ("peer", b)):
        xs = [side[i] for i in common]
        out[f"{name}_ttft_p50_s_both_served"] = pct(xs, 50)
        out[f"{name}_ttft_p90_s_both_served"] = pct(xs, 90)
    return out


async def _conductor_side(s: Settings, opts: LiveOptions, requests: list[DemoRequest], log_dir: Path) -> dict[str, Any]:
    stats = RunStats(s.policy, opts.speed)
    async with GatewayCluster(s, log_dir / "conductor", opts.prefill, opts.decode, time_scale=opts.speed,
                              protocol="sglang", report=True, bridges=True,
                              engine_args=["--kv-blocks", str(opts.kv_blocks)],
                              gateway_args=["--decision-timeout-s", "10"]) as c:
        await _settle(c)
        meter = CpuMeter(c.control_pids()).start()
        wall = await replay(c.gateway_url, stats, requests, side="conductor", engine_id_prefix=f"{c.gateway_id}-",
                            seed=opts.seed, drain_s=opts.drain_s, max_output_tokens=opts.max_output_tokens,
                            api_key=c.api_key)
        cpu = meter.report(stats.sent)
        await asyncio.sleep(0.5)  # the engines' last report lines
        out = side_summary(stats, c.reports, wall) | cpu
        # Each decision's prediction against its request's gateway TTFT less routing, in model time.
        out.update(prediction_error_summary((await read_outcomes(s, wait_s=15.0)).values(), time_scale=opts.speed))
    return {"router": "conductor", "policy": s.policy, "hand_off": "sglang bootstrap room (gateway)", **out}


async def _peer_side(s: Settings, opts: LiveOptions, requests: list[DemoRequest], log_dir: Path) -> dict[str, Any]:
    stats = RunStats(opts.peer_policy, opts.speed)
    async with SglangRouterCluster(s, log_dir / "peer", opts.prefill, opts.decode, time_scale=opts.speed,
                                   report=True, engine_args=["--kv-blocks", str(opts.kv_blocks)],
                                   policy=opts.peer_policy) as c:
        await _settle(c)
        meter = CpuMeter(c.control_pids()).start()
        wall = await replay(c.gateway_url, stats, requests, side="peer", engine_id_prefix="", seed=opts.seed,
                            drain_s=opts.drain_s, max_output_tokens=opts.max_output_tokens)
        cpu = meter.report(stats.sent)
        await asyncio.sleep(0.5)
        out = side_summary(stats, c.reports, wall) | cpu
    return {"router": opts.peer, "policy": opts.peer_policy, "hand_off": "sglang bootstrap room (router, PD mode)",
            **out}


async def _settle(c: GatewayCluster) -> None:
    # Engines print their ready line before their first report; nothing else to wait for. A
    # short pause lets the last process finish starting on a busy machine, on both sides alike.
    await asyncio.sleep(1.0)
    c.reports.clear()


def _side_settings(base: Settings, opts: LiveOptions, side: str) -> Settings:
    tag = f"{os.getpid():x}{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"
    return base.model_copy(update={"topic_prefix": f"live-{side}-{tag}.", "view_namespace": f"live-{side}-{tag}",
                                   "block_size": opts.block_size, "seed": opts.seed, "metrics_port": 0,
                                   "web_port": free_port(base.bind_host)})  # the stream worker's (Faust's) own


def trace_slice(trace: Path | None, speed: float, sample: int, duration_s: float, max_requests: int | None,
                error: type[ConductorError]) -> tuple[Path, list[DemoRequest]]:
    """The trace (default: the bundled one) and the demo's slice of it, or ``error`` saying what is wrong."""
    path = trace or default_trace()
    if not path.exists():
        raise error(f"trace not found: {path} (pass --trace PATH)")
    requests = load_slice(path, speed, sample, duration_s)
    if max_requests is not None:
        requests = requests[:max_requests]
    if not requests:
        raise error("the trace slice is empty: raise --duration or lower --sample")
    return path, requests


def quiet_clients() -> None:
    """One log line per HTTP request or Kafka reconnect is noise in a benchmark's output."""
    for name in ("aiokafka", "httpx", "httpx2", "openai", "conductor.bridge"):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def servers(settings: Settings, data_dir: Path) -> Iterator[Settings]:
    """``settings`` with a broker and a Redis: the ones it names, or an embedded stack started
    in ``data_dir`` (and stopped on the way out)."""
    if settings.kafka_url and settings.redis_url:
        yield settings
        return
    stack = EmbeddedStack(data_dir / "stack", host=settings.bind_host)
    st = stack.up(die_with_parent=True)
    try:
        yield settings.model_copy(update={"kafka_url": settings.kafka_url or st.kafka_url,
                                          "redis_url": settings.redis_url or st.redis_url,
                                          "profile": "embedded" if not settings.kafka_url else settings.profile})
    finally:
        stack.down()


def run_live_bench(settings: Settings, opts: LiveOptions) -> dict[str, Any]:
    """Run the slice through Conductor, then through the peer; one result dict."""
    if opts.peer not in PEERS:
        raise LiveBenchError(f"--peer must be one of {', '.join(PEERS)}, not {opts.peer!r}")
    why = sglang_router_missing()
    if why:
        raise LiveBenchError(why)
    trace, requests = trace_slice(opts.trace, opts.speed, opts.sample, opts.duration_s, opts.max_requests,
                                  LiveBenchError)
    quiet_clients()
    data_dir = (Path(settings.data_dir) / "bench-live").resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    t_all = time.monotonic()
    with servers(settings, data_dir) as base:
        sides = {"conductor": lambda: _conductor_side(_side_settings(base, opts, "conductor"), opts, requests, log_dir),
                 "peer": lambda: _peer_side(_side_settings(base, opts, "peer"), opts, requests, log_dir)}
        done = {name: asyncio.run(sides[name]()) for name in (("peer", "conductor") if opts.peer_first
                                                                else ("conductor", "peer"))}
        conductor, peer = done["conductor"], done["peer"]
    common = both_served(conductor, peer)
    return {
        "bench": "live",
        "engines": "emulated",
        "peer": peer,
        "peer_name": opts.peer,
        "peer_mode": "pd",
        "order": "peer first" if opts.peer_first else "conductor first",
        "requests": len(requests),
        "speed": opts.speed,
        "sample": opts.sample,
        "trace": trace.name,
        "instances": {"prefill": opts.prefill, "decode": opts.decode},
        "conductor": conductor,
        "peer_side": peer,
        **{f"conductor_{k}": conductor[k] for k in ("ttft_p50_s", "ttft_p90_s", "reuse_ratio", "rejected", "errors")},
        **{f"peer_{k}": peer[k] for k in ("ttft_p50_s", "ttft_p90_s", "reuse_ratio", "rejected", "errors")},
        **common,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()},
        "logs": str(log_dir),
        "wall_s": round(time.monotonic() - t_all, 1),
    }

