"""``conductor bench gateway``: what the gateway adds over calling the chosen engines directly.

Starts a stream worker, a router, 2 prefill + 2 decode emulated engines with no compute
time (``time_scale`` 1e9: every model step is ~0 s), and a gateway (its default routing
unless ``gateway_args`` says otherwise). At each concurrency level:

1. **Paired**: that many streaming clients each send their requests one after the other, every
   prompt twice — through the gateway and straight to a prefill/decode pair (the vLLM hand-off
   done by the client itself), the order alternating from one request to the next. A request's
   overhead is its gateway time to first token minus its own direct one; the ``gateway_overhead_ms_*``
   fields are percentiles of those per-request differences (before, they were p(gateway) minus
   p(direct), which is no distribution of anything: its p99 could be below its p50).
2. **Throughput**: the same number of clients send the same number of requests through the
   gateway only: ``requests_per_s`` (one gateway process), and what it refused; the CPU of each
   control-plane process over this phase (``control_cpu_*``: gateway, router, worker, broker,
   Redis; :mod:`conductor.harness.cpu`), per served request.

A 429 (the gateway's backpressure, or an SLO rejection) is counted as ``throttled``, not as an
error; the client waits the ``Retry-After`` it was given before its next request. ``errors``
counts everything else that failed (any status other than 200 and 429, a stream with no token).
Routing time per request is read from the gateway's ``request_outcome`` records.

The clients are one aiohttp session (``client``: ``aiohttp``), since the ninth session: the load
generator shares the machine's cores with the gateway and the engines, and httpx cost it several
times more CPU per call, which the gateway then did not get (``client_cpu_ms_per_request``
says what the bench's own process spent). ``client="httpx"`` runs the earlier clients, to compare.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import httpx
from tokenizers import Tokenizer, models, pre_tokenizers

from conductor.gateway.handoff.vllm import vllm_decode_body, vllm_prefill_body
from conductor.harness.cpu import CpuMeter
from conductor.harness.devstack import EmbeddedStack
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings
from conductor.stats import percentile
from schemas import RequestOutcome, decode
from streams.kafka import consumer
from streams.topics import topics

ZERO_COMPUTE = 1e9
PAIRS = (("prefill-0", "decode-0"), ("prefill-1", "decode-1"))
"""The pairs the direct side calls, in turn (the gateway spreads over all four engines too)."""


def bench_tokenizer(path: Path) -> Path:
    """A ``tokenizer.json`` for the bench's prompts (its words, digits one by one), written to ``path``:
    the engines tokenize with it as real engines do with theirs, and so can the gateway."""
    words = ["[UNK]", "you", "are", "a", "helpful", "assistant", "question", *"0123456789"]
    tok = Tokenizer(models.WordLevel({w: 100 + i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.save(str(path))
    return path


PREFIX = "you are a helpful assistant "
"""The shared system prefix of every prompt (each word a token of the bench's tokenizer)."""
PREFIX_WORDS = len(PREFIX.split())


def _body(i: int, max_tokens: int, prompt_words: int | None = None) -> dict[str, Any]:
    # Shared system prefix + a per-request tail: realistic block sharing for the router.
    # ``prompt_words``: the prefix repeated to about that many words (default 80) before the tail.
    repeats = 16 if prompt_words is None else max(1, prompt_words // PREFIX_WORDS)
    return {"model": "default", "prompt": PREFIX * repeats + f"question {i} " * 8,
            "max_tokens": max_tokens, "stream": True}


class Throttled(Exception):
    """Answered 429 (backpressure or an SLO rejection): counted apart from errors."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"429, retry after {retry_after_s:g}s")
        self.retry_after_s = retry_after_s


CLIENTS = ("aiohttp", "httpx")
"""The load generator's HTTP clients (``client``): aiohttp, the default; httpx, the earlier one."""


def check_client(kind: str) -> str:
    """``kind`` when it names one of :data:`CLIENTS`, else ValueError."""
    if kind not in CLIENTS:
        raise ValueError(f"client must be aiohttp or httpx, not {kind!r}")
    return kind


def _throttled(headers: Any) -> Throttled:
    try:
        return Throttled(float(headers.get("retry-after") or 1))
    except ValueError:
        return Throttled(1.0)


def _has_token(chunk: bytes) -> bool:
    return b'"text": "' in chunk or b'"text":"' in chunk


class _Client:
    """The bench's HTTP client: a streamed completion's time to its first token, and a plain POST's
    JSON. On aiohttp (the default) or httpx (``kind``), one pool of up to 1,000 connections."""

    def __init__(self, kind: str, headers: dict[str, str]) -> None:
        self.kind = check_client(kind)
        self._headers = headers
        self._aio: aiohttp.ClientSession | None = None
        self._httpx: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        if self.kind == "aiohttp":
            self._aio = aiohttp.ClientSession(
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=60),
                connector=aiohttp.TCPConnector(limit=1000, force_close=False), trust_env=False)
        else:
            self._httpx = httpx.AsyncClient(
                timeout=60, headers=self._headers, trust_env=False,
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._aio is not None:
            await self._aio.close()
        if self._httpx is not None:
            await self._httpx.aclose()

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        if self._aio is not None:
            async with self._aio.post(url, json=body) as r:
                r.raise_for_status()
                return await r.json()
        assert self._httpx is not None
        resp = await self._httpx.post(url, json=body)
        resp.raise_for_status()
        return resp.json()

    async def stream_ttft(self, url: str, body: dict[str, Any]) -> float:
        """Seconds to the first chunk that carries a token; the rest of the stream read to its end."""
        t0 = time.perf_counter()
        ttft = None
        if self._aio is not None:
            async with self._aio.post(url, json=body) as r:
                if r.status == 429:
                    await r.read()
                    raise _throttled(r.headers)
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
                async for chunk in r.content.iter_any():
                    if ttft is None and _has_token(chunk):
                        ttft = time.perf_counter() - t0
        else:
            assert self._httpx is not None
            async with self._httpx.stream("POST", url, json=body) as resp:
                if resp.status_code == 429:
                    await resp.aread()
                    raise _throttled(resp.headers)
                if resp.status_code != 200:
                    await resp.aread()
                    raise RuntimeError(f"{resp.status_code}: {resp.text[:200]}")
                async for chunk in resp.aiter_raw():
                    if ttft is None and _has_token(chunk):
                        ttft = time.perf_counter() - t0
        if ttft is None:
            raise RuntimeError("no token")
        return ttft


async def _direct(client: _Client, p_url: str, d_url: str, body: dict[str, Any]) -> float:
    """The same hand-off a client would do itself against a known pair (no tokenize, no routing)."""
    t0 = time.perf_counter()
    answer = await client.post_json(p_url + "/v1/completions", vllm_prefill_body(body, chat=False))
    dbody = vllm_decode_body(body, answer["kv_transfer_params"])
    return (time.perf_counter() - t0) + await client.stream_ttft(d_url + "/v1/completions", dbody)


@dataclass
class _Tally:
    """One phase's results: TTFTs (s) by side, paired overheads (s), refusals and failures."""

    via: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    throttled: int = 0
    errors: int = 0
    errors_direct: int = 0
    """Of ``errors``, those of the direct side (the engines themselves failing, e.g. on a saturated machine)."""
    kinds: Counter[str] = field(default_factory=Counter)
    first_error: str = ""
    wall_s: float = 0.0

    def failed(self, e: Exception, *, direct: bool = False) -> None:
        self.errors += 1
        self.errors_direct += direct
        self.kinds[("direct " if direct else "gateway ") + _kind(e)] += 1
        self.first_error = self.first_error or f"{type(e).__name__}: {e}"[:300]


def _kind(e: Exception) -> str:
    """A failure's kind: the exception's type and, for an HTTP status, the status."""
    text = str(e)
    return f"{type(e).__name__} {text[:3]}" if text[:3].isdigit() else type(e).__name__


async def _clients(concurrency: int, requests: int, one: Callable[[int], Awaitable[None]]) -> float:
    """``concurrency`` clients sharing ``requests`` request numbers, each one after the other; the wall time."""
    next_i = iter(range(requests))

    async def client() -> None:
        for i in next_i:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def _load(concurrency: int, requests: int, one: Any) -> tuple[list[float], int, float]:
    """``one(i)``'s TTFTs over ``concurrency`` clients, failures counted (any kind): (TTFTs, errors, wall s)."""
    ttfts: list[float] = []
    errors = 0

    async def count(i: int) -> None:
        nonlocal errors
        try:
            ttfts.append(await one(i))
        except Exception:  # noqa: BLE001 - counted, the bench goes on
            errors += 1

    wall = await _clients(concurrency, requests, count)
    return ttfts, errors, wall


async def _paired(concurrency: int, requests: int, via: Callable[[int], Awaitable[float]],
                  direct: Callable[[int], Awaitable[float]]) -> _Tally:
    """Every request number both ways, the order alternating; a pair counts when both sides answered."""
    t = _Tally()

    async def one(i: int) -> None:
        g = d = None
        for side in ((via, direct) if i % 2 == 0 else (direct, via)):
            try:
                got = await side(i)
            except Throttled as e:
                t.throttled += 1
                await asyncio.sleep(e.retry_after_s)
                continue
            except Exception as e:  # noqa: BLE001 - counted, the bench goes on
                t.failed(e, direct=side is direct)
                continue
            if side is via:
                g = got
            else:
                d = got
        if g is not None:
            t.via.append(g)
        if d is not None:
            t.direct.append(d)
        if g is not None and d is not None:
            t.overhead.append(g - d)

    t.wall_s = await _clients(concurrency, requests, one)
    return t


async def _gateway_only(concurrency: int, requests: int, via: Callable[[int], Awaitable[float]]) -> _Tally:
    t = _Tally()

    async def one(i: int) -> None:
        try:
            t.via.append(await via(i))
        except Throttled as e:
            t.throttled += 1
            await asyncio.sleep(e.retry_after_s)
        except Exception as e:  # noqa: BLE001 - counted, the bench goes on
            t.failed(e)

    t.wall_s = await _clients(concurrency, requests, one)
    return t


def _cpu_s(pid: int) -> float | None:
    """A process's user + system CPU seconds (Linux ``/proc``); None where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_sum(pids: list[int]) -> float | None:
    """The CPU seconds of ``pids`` together (None when one cannot be read)."""
    total = 0.0
    for pid in pids:
        one = _cpu_s(pid)
        if one is None:
            return None
        total += one
    return total


def _from(side: Callable[[int], Awaitable[float]], base: int) -> Callable[[int], Awaitable[float]]:
    """``side`` on request numbers from ``base`` on."""
    async def shifted(i: int) -> float:
        return await side(base + i)
    return shifted


def _rounded(v: float | None, scale: float = 1.0) -> float | None:
    return None if v is None else round(scale * v, 2)


def _ms_or_none(xs: list[float], q: float) -> float | None:
    """The ``q`` percentile of ``xs`` (seconds) in milliseconds, to 0.01 ms; None for no samples."""
    return _rounded(percentile(xs, q), 1000)


def _level(conc: int, n: int, paired: _Tally, load: _Tally, routing: list[float],
           cpu_s: float | None, control: dict[str, Any], workers: int = 1,
           client_cpu_s: float | None = None) -> dict[str, Any]:
    return {
        "clients": conc, "requests": n,
        # The load generator's own CPU (this process) per request it sent in the throughput phase.
        "client_cpu_ms_per_request": round(1000 * client_cpu_s / n, 2) if client_cpu_s is not None and n else None,
        "gateway_overhead_ms_p50": _ms_or_none(paired.overhead, 50),
        "gateway_overhead_ms_p90": _ms_or_none(paired.overhead, 90),
        "gateway_overhead_ms_p99": _ms_or_none(paired.overhead, 99),
        "pairs": len(paired.overhead),
        "requests_per_s": round(len(load.via) / load.wall_s, 1) if load.wall_s else None,
        "gateway_processes": workers,
        "gateway_cpu_ms_per_request": round(1000 * cpu_s / len(load.via), 2) if cpu_s and load.via else None,
        "errors": paired.errors + load.errors, "throttled": paired.throttled + load.throttled,
        "errors_gateway": paired.errors - paired.errors_direct + load.errors,
        "errors_direct": paired.errors_direct,
        "error_kinds": dict(paired.kinds + load.kinds),
        "first_error": paired.first_error or load.first_error or None,
        "ttft_ms_p50_gateway": _ms_or_none(paired.via, 50), "ttft_ms_p99_gateway": _ms_or_none(paired.via, 99),
        "ttft_ms_p50_direct": _ms_or_none(paired.direct, 50), "ttft_ms_p99_direct": _ms_or_none(paired.direct, 99),
        "ttft_ms_p50_gateway_only": _ms_or_none(load.via, 50), "ttft_ms_p99_gateway_only": _ms_or_none(load.via, 99),
        "routing_ms_p50": _rounded(percentile(routing, 50)),
        "routing_ms_p99": _rounded(percentile(routing, 99)),
        **control,
    }


async def routing_ms_since(settings: Settings, since_ms: int) -> list[float]:
    """The gateways' ``routing_ms`` of every outcome at or after ``since_ms`` (read to the topic's end)."""
    cons = consumer(settings.kafka(), topics(settings.topic_config()).request_outcomes.name, group_id=None, fetch_max_wait_ms=50)
    await cons.start()
    out: list[float] = []
    try:
        idle = 0
        while idle < 3:
            got = await cons.getmany(timeout_ms=300)
            idle = 0 if got else idle + 1
            for recs in got.values():
                for r in recs:
                    env = decode(r.value)
                    if env.ts_ms >= since_ms and isinstance(env.body, RequestOutcome) and env.body.routing_ms:
                        out.append(env.body.routing_ms)
    finally:
        await cons.stop()
    return out


def run_gateway_bench(settings: Settings, *, levels: tuple[int, ...], requests_per_client: int,
                      max_tokens: int, gateway_args: list[str] | None = None,
                      local_tokenizer: bool = True, workers: int = 1,
                      prompt_words: int | None = None, client: str = "aiohttp") -> dict[str, Any]:
    """Run the bench (starting the embedded broker and Redis when no URLs are set); one result dict.
    ``gateway_args``: more ``conductor gateway`` options (e.g. ``--routing log``); ``local_tokenizer``:
    the engines and the gateway share a ``tokenizer.json`` (:func:`bench_tokenizer`), else the
    gateway asks an engine's ``/tokenize``; ``workers``: the gateway's ``--workers`` (its processes' CPU summed);
    ``prompt_words``: each prompt's length in words, about (None: the bench's usual ~100 tokens);
    ``client``: the load generator's HTTP client, ``aiohttp`` or ``httpx`` (the one before the ninth
    session)."""
    check_client(client)  # before anything starts
    stack = None
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-gw-"))
    if not (settings.kafka_url and settings.redis_url):
        stack = EmbeddedStack(tmp / "stack", host=settings.bind_host)
        st = stack.up(die_with_parent=True)
        settings = settings.model_copy(update={"kafka_url": st.kafka_url, "redis_url": st.redis_url,
                                               "profile": "embedded"})
    try:
        tok = bench_tokenizer(tmp / "tokenizer.json") if local_tokenizer else None
        return asyncio.run(_bench(settings, tmp, levels, requests_per_client, max_tokens, list(gateway_args or []), tok,
                                  workers, prompt_words, client))
    finally:
        if stack is not None:
            stack.down()


async def _bench(settings: Settings, tmp: Path, levels: tuple[int, ...], requests_per_client: int,
                 max_tokens: int, gateway_args: list[str], tokenizer: Path | None, workers: int = 1,
                 prompt_words: int | None = None, client_kind: str = "aiohttp") -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex[:8]
    s = settings.model_copy(update={"topic_prefix": f"bench-gw-{tag}.", "view_namespace": f"bgw{tag}",
                                    "metrics_port": 0, "data_dir": tmp / "data"})
    tok_args = ["--tokenizer", str(tokenizer)] if tokenizer is not None else []
    if workers > 1:
        gateway_args = [*gateway_args, "--workers", str(workers)]
    out: dict[str, Any] = {"prefill": 2, "decode": 2, "max_tokens": max_tokens, "prompt_words": prompt_words,
                           "gateway_args": gateway_args,
                           "gateway_workers": workers,
                           "tokenizer": "local" if tokenizer is not None else "engine", "client": client_kind,
                           "levels": {}}
    async with GatewayCluster(s, tmp / "logs", time_scale=ZERO_COMPUTE, gateway_args=[*tok_args, *gateway_args],
                              engine_args=tok_args) as c:
        client = _Client(client_kind, dict(c.auth_headers))  # the key goes to the engines too: they ignore it
        async with client:
            gw = c.gateway_url + "/v1/completions"
            gw_pids = [pid for pid in c.gateway_pids().values() if pid is not None]
            pairs = [(c.engine_urls[p], c.engine_urls[d]) for p, d in PAIRS]

            async def via(i: int) -> float:
                return await client.stream_ttft(gw, _body(i, max_tokens, prompt_words))

            async def direct(i: int) -> float:
                p_url, d_url = pairs[i % len(pairs)]
                return await _direct(client, p_url, d_url, _body(i, max_tokens, prompt_words))

            for i in range(20):  # warm up connections, caches and the router
                await via(i)
                await direct(i)
            base = 0
            for conc in levels:
                n = conc * requests_per_client
                since = time.time_ns() // 1_000_000
                paired = await _paired(conc, n, _from(via, base), _from(direct, base))
                routing = await routing_ms_since(s, since)
                cpu0 = _cpu_sum(gw_pids)
                meter = CpuMeter(c.control_pids()).start()
                own0 = time.process_time()
                load = await _gateway_only(conc, n, _from(via, base + n))
                own = time.process_time() - own0
                control = meter.report(len(load.via))
                cpu1 = _cpu_sum(gw_pids)
                cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                base += 2 * n  # fresh prompts for every phase: no phase reuses another's tails
                out["levels"][str(conc)] = _level(conc, n, paired, load, routing, cpu, control, workers, own)
    first = out["levels"][str(levels[0])]
    for k in ("gateway_overhead_ms_p50", "gateway_overhead_ms_p90", "gateway_overhead_ms_p99", "requests_per_s"):
        out[k] = first[k]  # the headline fields: the first (lowest) concurrency level
    out["errors"] = sum(v["errors"] for v in out["levels"].values())
    out["throttled"] = sum(v["throttled"] for v in out["levels"].values())
    out["errors_gateway"] = sum(v["errors_gateway"] for v in out["levels"].values())
    return out
