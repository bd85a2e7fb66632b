"""Load from the engine's own Prometheus endpoint: vLLM's (or SGLang's) ``/metrics`` → heartbeats.

:func:`parse_load` is pure (text in, :class:`EngineLoad` out, parsed with
prometheus_client's own text parser); :func:`heartbeat_of` turns a load into the
heartbeat the view folds; :class:`MetricsScraper` does the HTTP.

| heartbeat field | vLLM | SGLang |
|---|---|---|
| ``queue_depth`` | ``vllm:num_requests_waiting`` | ``sglang:num_queue_reqs`` |
| ``running_requests``, ``batch_size`` | ``vllm:num_requests_running`` | ``sglang:num_running_reqs`` |
| ``total_kv_blocks`` | ``vllm:cache_config_info{num_gpu_blocks}`` | ``sglang:max_total_num_tokens`` / block size |
| ``free_kv_blocks`` | total x (1 - ``vllm:kv_cache_usage_perc``) (``gpu_cache_usage_perc`` before v0.10) | total x (1 - ``sglang:token_usage``) |
| ``queued_prefill_tokens`` | (waiting [+ running on a prefill node]) x mean prompt (``prompt_tokens_total`` / ``request_success_total``) | same with ``sglang:prompt_tokens_total`` / ``sglang:num_requests_total`` |
| ``decode_context_tokens`` | used blocks x block size | used tokens |
| restart signal | ``process_start_time_seconds`` | ``process_start_time_seconds`` |

With data parallelism vLLM labels each rank's series ``engine="<rank>"``; ``rank`` picks one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from schemas import Heartbeat, Role, Tier

log = logging.getLogger(__name__)

MAX_METRICS_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one scrape says about one engine (or one DP rank of it)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    """Fraction of the GPU KV cache in use, 0..1."""
    total_blocks: int | None = None
    cpu_blocks: int | None = None
    block_size: int | None = None
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished: float = 0.0
    start_time_s: float | None = None
    """``process_start_time_seconds``: a different value means a new engine process."""
    prefix_hit_tokens: float | None = None
    """Prompt tokens the engine found in its prefix cache, since it started (vLLM's
    ``prefix_cache_hits_total``): the reuse it realised, against what decisions predicted."""
    prefix_query_tokens: float | None = None
    """Prompt tokens it looked up in its prefix cache (``prefix_cache_queries_total``)."""

    @property
    def mean_prompt_tokens(self) -> float | None:
        return self.prompt_tokens / self.finished if self.finished > 0 else None


class MetricsError(ValueError):
    """A scrape that did not yield an engine's load (bad text, no known metric)."""


_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_PREEMPT = ("vllm:num_preemptions_total", "vllm:num_preemptions", "sglang:num_retracted_reqs")
_PROMPT = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
_GEN = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
_DONE = ("vllm:request_success_total", "sglang:num_requests_total")
_HITS = ("vllm:prefix_cache_hits_total",)
_QUERIES = ("vllm:prefix_cache_queries_total",)


_WANTED = tuple(
    n + ("{" if i == 0 else " ")
    for n in (*_RUNNING, *_WAITING, *_USAGE, *_PREEMPT, *_PROMPT, *_GEN, *_DONE, *_HITS, *_QUERIES,
              "vllm:cache_config_info",
              "sglang:max_total_num_tokens", "process_start_time_seconds")
    for i in range(2)
)


def _wanted_lines(text: str) -> str:
    """Only the samples read below: a vLLM page is mostly histograms, which the parser would spend its time on."""
    return "\n".join(line for line in text.splitlines() if line.startswith(_WANTED)) + "\n"


def _rank_of(labels: dict[str, str]) -> str | None:
    return labels.get("engine", labels.get("dp_rank"))


def parse_load(text: str, *, rank: int | None = None, sglang_page_size: int = 1) -> EngineLoad:
    """Read an engine's load from its ``/metrics`` text; raise :class:`MetricsError` if there is none.

    ``rank`` keeps only the series of that data-parallel rank (label ``engine`` or
    ``dp_rank``); series without a rank label belong to every rank. Several series of
    one name (other label values) add up.
    """
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"metrics page of {len(text)} bytes")
    sums: dict[str, float] = {}
    info: dict[str, str] = {}
    try:
        for fam in text_string_to_metric_families(_wanted_lines(text)):
            for s in fam.samples:
                r = _rank_of(s.labels)
                if rank is not None and r is not None and r != str(rank):
                    continue
                if s.name == "vllm:cache_config_info":
                    info = dict(s.labels)
                    continue
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    except (ValueError, TypeError, IndexError) as e:  # what the parser raises on bad text
        raise MetricsError(f"unparsable metrics: {type(e).__name__}: {e}"[:300]) from None

    def first(names: tuple[str, ...]) -> float | None:
        for n in names:
            if n in sums:
                return sums[n]
        return None

    running, waiting = first(_RUNNING), first(_WAITING)
    if running is None and waiting is None:
        raise MetricsError("no vllm:num_requests_* or sglang:num_*_reqs metric: not an engine's /metrics")

    def as_int(v: str | None) -> int | None:
        try:
            return int(float(v)) if v not in (None, "", "None") else None
        except ValueError:
            return None

    total, bs = as_int(info.get("num_gpu_blocks")), as_int(info.get("block_size"))
    if total is None and "sglang:max_total_num_tokens" in sums:
        bs = sglang_page_size
        total = int(sums["sglang:max_total_num_tokens"]) // max(1, sglang_page_size)
    usage = first(_USAGE)
    return EngineLoad(
        running=max(0, int(running or 0)),
        waiting=max(0, int(waiting or 0)),
        kv_usage=None if usage is None else min(1.0, max(0.0, usage)),
        total_blocks=total,
        cpu_blocks=as_int(info.get("num_cpu_blocks")),
        block_size=bs,
        preemptions=first(_PREEMPT) or 0.0,
        prompt_tokens=first(_PROMPT) or 0.0,
        generation_tokens=first(_GEN) or 0.0,
        finished=first(_DONE) or 0.0,
        start_time_s=sums.get("process_start_time_seconds"),
        prefix_hit_tokens=first(_HITS),
        prefix_query_tokens=first(_QUERIES),
    )


def heartbeat_of(load: EngineLoad, *, role: Role, model: str, interval_s: float,
                 default_prompt_tokens: int = 0) -> Heartbeat:
    """The heartbeat a node with this load publishes."""
    mean_prompt = load.mean_prompt_tokens or default_prompt_tokens
    # A prefill node's running requests are prefills still to finish; a decode node's are decoding.
    pending = load.waiting + (load.running if role == "prefill" else 0)
    total = load.total_blocks or 0
    used = round(total * load.kv_usage) if load.kv_usage is not None else 0
    tiers: dict[Tier, int] = {"hbm": total} if total else {}
    if load.cpu_blocks:
        tiers["dram"] = load.cpu_blocks
    return Heartbeat(
        role=role,
        model=model,
        queue_depth=load.waiting,
        queued_prefill_tokens=int(pending * mean_prompt),
        running_requests=load.running,
        batch_size=load.running,
        decode_context_tokens=used * (load.block_size or 0) if role != "prefill" else 0,
        free_kv_blocks=max(0, total - used),
        total_kv_blocks=total,
        tier_capacity=tiers,
        interval_s=interval_s,
    )


class EngineUnreachable(Exception):
    """The engine's HTTP server did not answer (not up yet, or gone): ask again later."""


def bootstrap_port_of(server_info: object) -> int | None:
    """SGLang's ``/server_info``: a prefill server's ``disaggregation_bootstrap_port`` (None: not an
    SGLang prefill server)."""
    if not isinstance(server_info, dict) or server_info.get("disaggregation_mode") != "prefill":
        return None
    port = server_info.get("disaggregation_bootstrap_port")
    return port if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535 else None


async def fetch_bootstrap_port(base_url: str, *, timeout_s: float = 2.0) -> int | None:
    """The bootstrap port the SGLang prefill server at ``base_url`` serves (its
    ``--disaggregation-bootstrap-port``, 8998 unless set), from ``/server_info`` (``/get_server_info``
    before SGLang 0.5); None when the engine answers without one (vLLM has neither path). Raises
    :class:`EngineUnreachable` when it does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            for path in ("/server_info", "/get_server_info"):
                async with session.get(base_url.rstrip("/") + path) as resp:
                    if resp.status != 200:
                        continue
                    try:
                        return bootstrap_port_of(await resp.json(content_type=None))
                    except ValueError:  # not JSON: not SGLang's
                        return None
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise EngineUnreachable(f"{type(e).__name__}: {e}"[:200]) from None
    return None


class MetricsScraper:
    """GETs one engine's ``/metrics``; :meth:`scrape` returns its load or None when unreachable."""

    def __init__(self, url: str, *, rank: int | None = None, timeout_s: float = 1.0) -> None:
        self.url = url
        self.rank = rank
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.failures = 0
        self.reachable: bool | None = None
        self.last_error = ""
        self.cpu_s = 0.0
        """Process CPU time spent scraping and parsing (for the benchmark)."""
        self.scrapes = 0

    async def scrape(self) -> EngineLoad | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        t0 = time.process_time()
        try:
            async with self._session.get(self.url) as resp:
                if resp.status != 200:
                    raise MetricsError(f"HTTP {resp.status}")
                body = await resp.content.read(MAX_METRICS_BYTES + 1)
            load = parse_load(body.decode("utf-8", "replace"), rank=self.rank)
        except (aiohttp.ClientError, TimeoutError, OSError, MetricsError) as e:
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]
            if self.reachable is not False:
                log.warning("engine metrics %s unreachable (%s): no heartbeats until it answers",
                            self.url, self.last_error)
            self.reachable = False
            return None
        finally:
            self.cpu_s += time.process_time() - t0
            self.scrapes += 1
        if self.reachable is False:
            log.info("engine metrics %s answer again", self.url)
        self.reachable = True
        return load

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
