"""``conductor bench scrape``: what following an engine's load costs the bridge, per scrape.

Serves an engine's ``/metrics`` on loopback (the emulated engine's collector, optionally
padded with histograms to the size of a real vLLM page), then runs the bridge's own
scrape → parse → heartbeat → encode path ``scrapes`` times at ``interval_s`` and reports
the CPU time of the bridge's thread (the HTTP server runs in another thread and is not
counted) per scrape.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import generate_latest, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from conductor.bridge.scrape import MetricsScraper, heartbeat_of
from conductor.costmodel.profiles import load_profile
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.metrics import engine_registry
from schemas import encode, envelope

VLLM_HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    "iteration_tokens_total", "request_max_num_generation_tokens", "request_params_n",
    "request_params_max_tokens", "request_time_per_output_token_seconds",
)


class _Padding(Collector):
    """Histograms like the ones a vLLM page carries (≈ 20 buckets each), so the page has a real size."""

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for name in VLLM_HISTOGRAMS:
            h = HistogramMetricFamily(f"vllm:{name}", name, labels=["engine", "model_name"])
            bounds = [0.001 * 2**i for i in range(20)]
            h.add_metric(["0", "m"], [(str(b), float(i)) for i, b in enumerate(bounds)] + [("+Inf", 20.0)],
                         sum_value=123.0)
            yield h


class _NoPublisher:
    def start(self) -> None: ...


async def run_scrape_bench(settings: Any, *, scrapes: int, interval_s: float, vllm_size: bool) -> dict[str, Any]:
    eng = EmulatedEngine(EngineConfig("bench-0", "prefill", settings.block_size, kv_blocks=16_384),
                         load_profile(settings.model_profile), _NoPublisher())  # type: ignore[arg-type]
    eng.cache.insert(range(4000))
    reg = engine_registry(eng)
    if vllm_size:
        reg.register(_Padding())
    page_bytes = len(generate_latest(reg))
    server, _ = start_http_server(0, addr=settings.bind_host, registry=reg)
    scraper = MetricsScraper(f"http://{settings.bind_host}:{server.server_port}/metrics")
    cpu_ms: list[float] = []
    wall_ms: list[float] = []
    try:
        await scraper.scrape()  # connection set-up is not a steady-state cost
        for i in range(scrapes):
            t0, c0 = time.perf_counter(), time.thread_time()
            load = await scraper.scrape()
            assert load is not None
            hb = heartbeat_of(load, role="prefill", model="default", interval_s=interval_s)
            encode(envelope(hb, producer_id="bench-0", producer_seq=i + 1, ts_ms=time.time_ns() // 1_000_000))
            cpu_ms.append((time.thread_time() - c0) * 1000)
            wall_ms.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))
    finally:
        await scraper.close()
        server.shutdown()
        server.server_close()
    cpu_ms.sort()
    wall_ms.sort()
    return {
        "scrapes": scrapes,
        "interval_s": interval_s,
        "page_bytes": page_bytes,
        "cpu_ms_per_scrape_p50": round(statistics.median(cpu_ms), 3),
        "cpu_ms_per_scrape_p99": round(cpu_ms[min(len(cpu_ms) - 1, int(0.99 * len(cpu_ms)))], 3),
        "wall_ms_per_scrape_p50": round(statistics.median(wall_ms), 3),
        "cpu_share_at_interval": round(statistics.fmean(cpu_ms) / (interval_s * 1000), 5),
    }
