"""The emulated engine's Prometheus metrics, under the names vLLM serves on ``/metrics``.

So the bridge's scraper (``conductor.bridge.scrape``) reads an emulated engine exactly
as it reads a real vLLM: the same metric names, labels and units, computed at scrape
time from the engine's live state. Serve :func:`engine_registry`'s registry with
prometheus_client (``start_http_server`` or ``make_asgi_app``).

| name | type | from |
|---|---|---|
| ``vllm:num_requests_running`` | gauge | the request in prefill + sequences decoding |
| ``vllm:num_requests_waiting`` | gauge | queued prefills + decodes waiting to be admitted |
| ``vllm:kv_cache_usage_perc`` | gauge (0..1) | used / total HBM blocks |
| ``vllm:num_preemptions_total`` | counter | 0 (the emulation never preempts) |
| ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` | counter | tokens prefilled / decoded |
| ``vllm:request_success_total`` | counter | requests finished |
| ``vllm:cache_config_info`` | info gauge | labels ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks`` |
| ``process_start_time_seconds`` | gauge | when this engine started (a restart changes it) |
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from conductor.harness.engine.emulated import EmulatedEngine


class EngineCollector(Collector):
    """Reads an :class:`EmulatedEngine`'s state at every scrape."""

    def __init__(self, engine: EmulatedEngine, *, model_name: str = "default", engine_index: int = 0) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name, "engine": str(engine_index)}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.engine
        st = e.state
        prefilling = 1 if st.current_prefill_tokens else 0
        cap = e.cache.capacity
        yield self._gauge("vllm:num_requests_running", "Requests in model execution batches.",
                          len(st.decoding) + prefilling)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be processed.",
                          len(st.queue) + st.waiting_decode)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", len(e.cache) / cap if cap else 0.0)
        yield self._counter("vllm:num_preemptions", "Cumulative preemptions.", 0)
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", st.prompt_tokens_total)
        yield self._counter("vllm:generation_tokens", "Generation tokens processed.", st.generation_tokens_total)
        yield self._counter("vllm:request_success", "Finished requests.", st.done)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                                 labels=[*self.labels, "block_size", "num_gpu_blocks", "num_cpu_blocks"])
        info.add_metric([*self.labels.values(), str(e.config.block_size), str(cap),
                         str(e.dram.capacity if e.dram else 0)], 1.0)
        yield info
        yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch.",
                                value=e.started_s)


def engine_registry(engine: EmulatedEngine, *, model_name: str = "default") -> CollectorRegistry:
    """A registry holding only the engine's metrics (what its ``/metrics`` serves)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine, model_name=model_name))
    return reg
