"""Conductor against real vLLM 0.32 engines (CPU build, tiny Llama, dummy weights): metrics, events, P/D.

What the bridge reads from a real ``/metrics`` page, what it makes of a real engine's ZMQ events
(through the session's embedded Kafka and a `conductor worker` into the Redis view, keyed as
Conductor keys the prompt), the NIXL hand-off between a real prefill and decode engine, and a
real restart seen by the bridge. Counters are read as differences: the engines are shared.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.bridge.scrape import MetricsScraper, heartbeat_of, parse_load
from conductor.harness.vllm_kit import BLOCK_SIZE, VllmEngine
from conductor.settings import Settings
from schemas import BlocksStored, Envelope, chain_keys
from state.redis_view import RedisViewStore
from streams.kafka import producer
from streams.topics import topics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


# --- helpers ------------------------------------------------------------------------------------


async def metrics_text(http: httpx.AsyncClient, engine: VllmEngine) -> str:
    r = await http.get(engine.metrics_url)
    r.raise_for_status()
    return r.text


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def tokenize(http: httpx.AsyncClient, engine: VllmEngine, prompt: str) -> list[int]:
    r = await http.post(f"{engine.url}/tokenize", json={"model": engine.model, "prompt": prompt})
    r.raise_for_status()
    return list(r.json()["tokens"])


async def complete(http: httpx.AsyncClient, engine: VllmEngine, prompt: str | list[int], max_tokens: int = 1,
                   **extra: Any) -> dict[str, Any]:
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    r = await http.post(f"{engine.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def until(what: str, probe: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def aligned_prompt(tokens: list[int], blocks: int) -> list[int]:
    """The first ``blocks`` full blocks of ``tokens`` (a prompt that ends on a block boundary)."""
    assert len(tokens) >= blocks * BLOCK_SIZE, "prompt text too short"
    return tokens[: blocks * BLOCK_SIZE]


class Collected:
    def __init__(self) -> None:
        self.envs: list[Envelope] = []

    async def sink(self, envs: list[Envelope]) -> None:
        self.envs.extend(envs)

    def stored(self) -> set[int]:
        return {k for e in self.envs if isinstance(e.body, BlocksStored) for k in e.body.block_keys or ()}


# --- /metrics: the names the bridge reads ---------------------------------------------------------


async def test_real_metrics_page_gives_the_bridge_a_sane_load(vllm_aggregated: VllmEngine, http: httpx.AsyncClient,
                                                              unique_text: str) -> None:
    eng = vllm_aggregated
    text = await metrics_text(http, eng)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:request_success_total", "process_start_time_seconds"):
        assert f"\n{name}" in text, f"{name} is not on vLLM's page"
    load = parse_load(text)
    assert load.total_blocks and load.total_blocks > 0  # vllm:cache_config_info{num_gpu_blocks}
    assert load.block_size == BLOCK_SIZE
    assert load.cpu_blocks is None  # num_cpu_blocks="None" on a CPU build without offload
    assert load.kv_usage is not None and 0.0 <= load.kv_usage <= 1.0
    assert load.running >= 0 and load.waiting >= 0
    assert load.start_time_s and load.start_time_s < time.time()
    hb = heartbeat_of(load, role="both", model=eng.model, interval_s=1.0)
    assert hb.total_kv_blocks == load.total_blocks and 0 < hb.free_kv_blocks <= hb.total_kv_blocks
    assert hb.tier_capacity == {"hbm": load.total_blocks}

    # One prompt twice: the counters the load (and the realised reuse) are read from move as vLLM says.
    tokens = aligned_prompt(await tokenize(http, eng, unique_text * 12), 3)
    await complete(http, eng, tokens)
    await complete(http, eng, tokens)
    after_text = await metrics_text(http, eng)
    after = parse_load(after_text)
    assert after.finished - load.finished == 2  # request_success_total, summed over finished_reason
    assert after.prompt_tokens - load.prompt_tokens == 2 * len(tokens)  # cached tokens count as prompt tokens
    hits = metric(after_text, "vllm:prefix_cache_hits_total") - metric(text, "vllm:prefix_cache_hits_total")
    # The repeat hits every full block but the last: vLLM computes at least the prompt's last token.
    assert hits == len(tokens) - BLOCK_SIZE
    assert after.start_time_s == load.start_time_s

    # The bridge's own HTTP scraper reads the same page.
    scraper = MetricsScraper(eng.metrics_url, timeout_s=5.0)
    try:
        scraped = await scraper.scrape()
    finally:
        await scraper.close()
    assert scraped is not None and scraped.total_blocks == load.total_blocks and scraper.reachable


# --- ZMQ events → bridge → Kafka → worker → Redis view ---------------------------------------------


async def follow(engine: VllmEngine, settings: Settings, node_id: str) -> tuple[Bridge, asyncio.Event, asyncio.Task[None], Any]:
    """A `conductor bridge` for ``engine`` in this process: events and scraped heartbeats onto the test's topics."""
    tps = topics(settings.topic_config())
    prod = producer(settings.kafka())
    await prod.start()
    cfg = BridgeConfig(node_id=node_id, role="both", zmq_endpoint=engine.zmq, replay_endpoint=engine.replay,
                       block_size=BLOCK_SIZE, heartbeat_s=0.5, metrics_url=engine.metrics_url, model=engine.model)
    bridge = Bridge(cfg, kafka_sink(prod, tps.kv_events.name), kafka_sink(prod, tps.heartbeats.name))
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 30)
    await asyncio.sleep(0.3)  # the SUB socket's subscription reaches vLLM's PUB
    return bridge, stop, task, prod


async def unfollow(stop: asyncio.Event, task: asyncio.Task[None], prod: Any) -> None:
    stop.set()
    await asyncio.wait_for(task, 15)
    await prod.stop()


async def prefix_in_view(view: RedisViewStore, node: str, chain: list[int]) -> int:
    return (await view.snapshot(chain)).prefix.get(node, (0, 0, 0))[0]


async def test_bridge_follows_a_real_engine_into_the_view_then_its_restart(
    vllm_aggregated: VllmEngine, vllm_settings: Settings, view_worker: RedisViewStore, http: httpx.AsyncClient,
    unique_text: str,
) -> None:
    eng, view, node = vllm_aggregated, view_worker, "vllm-agg"
    bridge, stop, task, prod = await follow(eng, vllm_settings, node)
    try:
        total = parse_load(await metrics_text(http, eng)).total_blocks

        async def live() -> Any:
            now = time.time_ns() // 1_000_000
            states = {n.node_id: n for n in await view.nodes()}
            n = states.get(node)
            return n if n and n.is_live(now, vllm_settings.heartbeat_ttl_s) and n.total_kv_blocks == total else None

        state = await until("the engine live in the view with its scraped load", live)
        assert state.role == "both" and 0 < state.free_kv_blocks <= state.total_kv_blocks

        # A text prompt: the engine tokenizes it; Conductor keys the same ids (full blocks only).
        text = unique_text * 12
        tokens = await tokenize(http, eng, text)
        chain = chain_keys(tokens, BLOCK_SIZE)
        assert len(chain) >= 3
        hits0 = metric(await metrics_text(http, eng), "vllm:prefix_cache_hits_total")
        await complete(http, eng, text)

        async def whole_prefix() -> bool:
            return await prefix_in_view(view, node, chain) == len(chain)

        await until("the prompt's blocks in the view, under Conductor's keys", whole_prefix)
        assert bridge.translator.counts["orphan_blocks"] == 0 and bridge.translator.counts["bad_event"] == 0
        assert bridge.counts["bad_batch"] == 0 and bridge.counts["gaps_unfilled"] == 0
        # The same prompt again: the engine's own counter says it reused what the view says it holds.
        await complete(http, eng, text)
        hits = metric(await metrics_text(http, eng), "vllm:prefix_cache_hits_total") - hits0
        assert hits == (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but a last token's

        # A real restart (same ports, a new process with an empty cache): the bridge opens a new epoch
        # and the view drops the dead process's blocks — no phantom cache.
        epochs = bridge.counts["epoch_restart"]
        await eng.restart()
        await until("the bridge to notice the restart", lambda: asyncio.sleep(0, bridge.counts["epoch_restart"] > epochs),
                    timeout=30)

        async def gone() -> bool:
            return await prefix_in_view(view, node, chain) == 0

        await until("the old blocks out of the view", gone)
        await until("the restarted engine live again", live)
        await complete(http, eng, text)
        await until("the prompt's blocks back, from the new process's events", whole_prefix)
    finally:
        await unfollow(stop, task, prod)


# --- P/D over NIXL, by hand --------------------------------------------------------------------------


async def test_pd_hand_off_over_nixl(vllm_pd: tuple[VllmEngine, VllmEngine], http: httpx.AsyncClient,
                                     unique_text: str) -> None:
    p, d = vllm_pd
    tokens = aligned_prompt(await tokenize(http, p, unique_text * 12), 3)
    chain = chain_keys(tokens, BLOCK_SIZE)
    # The decode engine's own events, through a bridge with an in-memory sink.
    out = Collected()
    bridge = Bridge(BridgeConfig(node_id="vllm-d", role="decode", zmq_endpoint=d.zmq, replay_endpoint=d.replay,
                                 block_size=BLOCK_SIZE, heartbeat_s=None), out.sink)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    try:
        await asyncio.wait_for(bridge.ready.wait(), 30)
        await asyncio.sleep(0.3)
        p0, d0 = await metrics_text(http, p), await metrics_text(http, d)

        pre = await complete(http, p, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = pre["kv_transfer_params"]
        assert params and params["do_remote_prefill"] is True and params["remote_block_ids"], params
        assert params["remote_engine_id"] and params["remote_port"]
        dec = await complete(http, d, tokens, max_tokens=4, kv_transfer_params=params)
        assert dec["usage"]["completion_tokens"] == 4

        p1, d1 = await metrics_text(http, p), await metrics_text(http, d)
        assert metric(d1, "vllm:nixl_xfer_time_seconds_count") - metric(d0, "vllm:nixl_xfer_time_seconds_count") == 1
        assert metric(d1, "vllm:nixl_num_failed_transfers_total") == metric(d0, "vllm:nixl_num_failed_transfers_total")
        assert metric(d1, "vllm:nixl_bytes_transferred_sum") > metric(d0, "vllm:nixl_bytes_transferred_sum")
        # D computed nothing: every prompt token came over NIXL, none from D's own prefix cache.
        pulled = (metric(d1, "vllm:external_prefix_cache_hits_total")
                  - metric(d0, "vllm:external_prefix_cache_hits_total"))
        assert pulled == len(tokens)
        assert metric(d1, "vllm:prefix_cache_hits_total") == metric(d0, "vllm:prefix_cache_hits_total")
        src = "vllm:prompt_tokens_by_source_total"
        assert (metric(d1, src, source="external_kv_transfer") - metric(d0, src, source="external_kv_transfer")
                == len(tokens))
        assert metric(d1, src, source="local_compute") == metric(d0, src, source="local_compute")
        # P computed the prompt; the pull does not show on P's NIXL transfer counter.
        assert metric(p1, "vllm:nixl_xfer_time_seconds_count") == metric(p0, "vllm:nixl_xfer_time_seconds_count")
        assert metric(p1, src, source="local_compute") - metric(p0, src, source="local_compute") == len(tokens)

        # The pulled KV is cached on D, and D's own events say so: the view would show the copy on D.
        await until("D's events announcing the pulled blocks", lambda: asyncio.sleep(0, out.stored() >= set(chain)),
                    timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
