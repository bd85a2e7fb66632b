"""Real engines' frames through a real ZMQ PUB + replay ROUTER: keys, tiers, hybrid groups, restarts, DP, load.

Every frame is the msgpack of the engines' own msgspec structs (``engine_structs``):
vLLM's array form (<= 0.23), its map form (>= 0.26) and SGLang's three (signed hashes; a
salted store's metadata map, 0.5.18-0.5.19; tagged maps with cache_salt and session_id, >= 0.5.20). The
publisher numbers batches from 0 in each process and keeps a bounded replay buffer,
as vLLM's ``ZmqEventPublisher`` does.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig, rank_configs
from conductor.bridge.translate import MIN_TRACKED
from schemas import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Envelope,
    Heartbeat,
    MmItem,
    RoutingRequest,
    chain_keys,
    request_chain_keys,
)

sys.path.insert(0, str(Path(__file__).parent))
from engine_structs import SGLANG, SGLANG_MAP, SGLANG_META, V023, V026

BS = 16
TOKENS = list(range(7000, 7000 + BS * 12))


class Out:
    def __init__(self) -> None:
        self.envs: list[Envelope] = []
        self.heartbeats: list[Envelope] = []

    async def sink(self, envs: list[Envelope]) -> None:
        self.envs.extend(envs)

    async def hb(self, envs: list[Envelope]) -> None:
        self.heartbeats.extend(envs)

    def last_epoch(self) -> int:
        return self.envs[-1].epoch

    def view(self, epoch: int | None = None) -> dict[str, set[int]]:
        """The node's blocks per tier after folding the records of ``epoch`` (default: the last)."""
        epoch = self.last_epoch() if epoch is None else epoch
        tiers: dict[str, set[int]] = {}
        for e in self.envs:
            if e.epoch != epoch:
                continue
            b = e.body
            if isinstance(b, AllBlocksCleared):
                tiers.clear()
            elif isinstance(b, BlocksStored):
                tiers.setdefault(b.tier, set()).update(b.block_keys or ())
            elif isinstance(b, BlocksRemoved):
                tiers.setdefault(b.tier, set()).difference_update(b.block_keys)
        return tiers


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (DP rank r uses base + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    raise RuntimeError("no free port pair")


class Engine:
    """One engine process: its publisher (seq from 0, bounded buffer) on fixed ports."""

    def __init__(self, zmq: str = "tcp://127.0.0.1:0", replay: str | None = "tcp://127.0.0.1:0",
                 buffer_steps: int = 10_000) -> None:
        self.pub = EventPublisher(zmq, replay, buffer_steps=buffer_steps, topic="")
        self.pub.start()

    async def send(self, payload: bytes) -> int:
        return await self.pub.publish_payload(payload)

    async def stop(self) -> None:
        await self.pub.close()


async def follow(engine: Engine, out: Out, **kw: object) -> tuple[Bridge, asyncio.Event, asyncio.Task[None]]:
    cfg = BridgeConfig(node_id="n0", role="prefill", zmq_endpoint=engine.pub.endpoint,
                       replay_endpoint=engine.pub.replay_endpoint, replay_timeout_s=1.0,
                       **{"heartbeat_s": None, **kw})  # type: ignore[arg-type]
    bridge = Bridge(cfg, out.sink, out.hb)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 10)
    await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the PUB
    return bridge, stop, task


async def finish(stop: asyncio.Event, task: asyncio.Task[None], *engines: Engine) -> None:
    stop.set()
    await asyncio.wait_for(task, 10)
    for e in engines:
        await e.stop()


def blk(i: int) -> list[int]:
    return TOKENS[i * BS : (i + 1) * BS]


# --- block keys: array form, map form with LoRA / multimodal / cache salt, SGLang ---------------------


async def test_vllm_array_form_blocks_match_a_request_for_the_same_tokens() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    await eng.send(V023.encode(1.0, [V023.Stored([11, 12], None, TOKENS[: 2 * BS], BS, None, "GPU")]))
    await eng.send(V023.encode(1.1, [V023.Stored([13], 12, blk(2), BS, None, None), V023.Removed([12], "GPU")]))
    await until(lambda: bridge.counts["batches"] == 2)
    req = RoutingRequest(request_id="r", token_ids=TOKENS[: 3 * BS], prompt_tokens=3 * BS)
    k = request_chain_keys(req, BS)
    assert out.view()["hbm"] == {k[0], k[2]}
    await finish(stop, task, eng)


async def test_vllm_map_form_lora_multimodal_and_cache_salt_keys_match_the_request() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    # What vLLM >= 0.26 reports for a LoRA request with one image at tokens 10..29 and a cache salt:
    # each block's extra keys in vLLM's order (LoRA name, multimodal ids, the salt on block 0 only).
    extra = [("sql-lora", "img-1", "tenant-a"), ("sql-lora", "img-1"), ("sql-lora",)]
    await eng.send(V026.encode(1.0, [V026.Stored([21, 22, 23], None, TOKENS[: 3 * BS], BS, 7, "GPU", "sql-lora",
                                                 extra_keys=extra)], 0))
    await until(lambda: bridge.counts["batches"] == 1)
    req = RoutingRequest(request_id="r", token_ids=TOKENS[: 3 * BS], prompt_tokens=3 * BS, lora_name="sql-lora",
                         mm_items=[MmItem(identifier="img-1", offset=10, length=20)], cache_salt="tenant-a")
    assert out.view()["hbm"] == set(request_chain_keys(req, BS))
    # Without the adapter, or with another salt, nothing matches.
    assert not out.view()["hbm"] & set(chain_keys(TOKENS[: 3 * BS], BS))
    other = req.model_copy(update={"cache_salt": "tenant-b"})
    assert not out.view()["hbm"] & set(request_chain_keys(other, BS))
    await finish(stop, task, eng)


async def test_vllm_lora_without_extra_keys_matches_the_request_too() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    await eng.send(V026.encode(1.0, [V026.Stored([31, 32], None, TOKENS[: 2 * BS], BS, 1, "GPU", "sql-lora")]))
    await until(lambda: bridge.counts["batches"] == 1)
    req = RoutingRequest(request_id="r", token_ids=TOKENS[: 2 * BS], prompt_tokens=2 * BS, lora_name="sql-lora")
    assert out.view()["hbm"] == set(request_chain_keys(req, BS))
    await finish(stop, task, eng)


async def test_sglang_signed_hashes_and_hicache_tiers() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    h0, h1 = -(1 << 63), -2
    await eng.send(SGLANG.encode(1.0, [SGLANG.Stored([h0, h1], None, TOKENS[: 2 * BS], BS, None, "GPU")], 0))
    # HiCache: host copy (CPU_PINNED), then the storage backend (EXTERNAL), then GPU eviction.
    await eng.send(SGLANG.encode(1.1, [SGLANG.Stored([h0, h1], None, TOKENS[: 2 * BS], BS, None, "CPU_PINNED")], 0))
    await eng.send(SGLANG.encode(1.2, [SGLANG.Stored([h0], None, blk(0), BS, None, "EXTERNAL"),
                                       SGLANG.Removed([h1], "GPU")], 0))
    await until(lambda: bridge.counts["batches"] == 3)
    k = chain_keys(TOKENS[: 2 * BS], BS)
    assert out.view() == {"hbm": {k[0]}, "dram": {k[0], k[1]}, "ssd": {k[0]}}
    await finish(stop, task, eng)


async def test_sglang_salted_stores_with_metadata_match_the_salted_request() -> None:
    """SGLang 0.5.18-0.5.19: a salted request's store carries a metadata map after medium."""
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    h = [-(1 << 62) - i for i in range(4)]
    await eng.send(SGLANG_META.encode(1.0, [
        SGLANG_META.Stored(h[:2], None, TOKENS[: 2 * BS], BS, None, "GPU", cache_salt="tenant-a"),
        SGLANG_META.Stored(h[2:3], h[1], blk(2), BS, None, "GPU", cache_salt="tenant-a"),
        SGLANG_META.Stored(h[3:], None, blk(5), BS, None, None),  # an unsalted request's
    ], 0))
    await until(lambda: bridge.counts["batches"] == 1)
    salted = RoutingRequest(request_id="r", token_ids=TOKENS[: 3 * BS], prompt_tokens=3 * BS, cache_salt="tenant-a")
    assert out.view()["hbm"] == set(request_chain_keys(salted, BS)) | {chain_keys(blk(5), BS)[0]}
    assert not out.view()["hbm"] & set(chain_keys(TOKENS[: 3 * BS], BS))  # an unsalted request reuses nothing
    assert bridge.translator.counts["bad_event"] == 0
    await finish(stop, task, eng)


async def test_sglang_map_form_salt_session_and_lora_name() -> None:
    """SGLang >= 0.5.20: tagged maps with cache_salt, session_id and (0.5.22) lora_name after medium."""
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    await eng.send(SGLANG_MAP.encode(1.0, [
        SGLANG_MAP.Stored([-5, -6], None, TOKENS[: 2 * BS], BS, 3, "GPU", cache_salt="tenant-a", session_id="s-1",
                          lora_name="sql-lora"),
        # Another session storing the same salted blocks on the host tier: the same keys (session_id is attribution).
        SGLANG_MAP.Stored([-5, -6], None, TOKENS[: 2 * BS], BS, 3, "CPU_PINNED", cache_salt="tenant-a",
                          session_id="s-2", lora_name="sql-lora"),
        SGLANG_MAP.Removed([-6], "GPU"),
    ], 0))
    await until(lambda: bridge.counts["batches"] == 1)
    req = RoutingRequest(request_id="r", token_ids=TOKENS[: 2 * BS], prompt_tokens=2 * BS, cache_salt="tenant-a",
                         lora_name="sql-lora")
    k = request_chain_keys(req, BS)
    assert out.view() == {"hbm": {k[0]}, "dram": set(k)}
    other = req.model_copy(update={"cache_salt": "tenant-b"})
    assert not set(k) & set(request_chain_keys(other, BS))
    await finish(stop, task, eng)


# --- offload placeholders and hybrid groups ---------------------------------------------------


async def test_vllm_cpu_offload_placeholders_index_the_dram_tier() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    hashes = [41 + i for i in range(6)]
    await eng.send(V026.encode(1.0, [V026.Stored(hashes, None, TOKENS[: 6 * BS], BS, None, "GPU", None)]))
    # The offloading connector: medium CPU, no tokens, block_size 0, the same hashes.
    await eng.send(V026.encode(1.1, [V026.Stored(hashes, None, [], 0, None, "CPU", None)]))
    await eng.send(V026.encode(1.2, [V026.Removed(hashes[:4], "GPU"), V026.Removed(hashes[5:], "CPU")]))
    await until(lambda: bridge.counts["batches"] == 3)
    k = chain_keys(TOKENS[: 6 * BS], BS)
    assert out.view() == {"hbm": set(k[4:]), "dram": set(k[:5])}
    await finish(stop, task, eng)


async def test_hybrid_sliding_window_removals_keep_the_full_attention_prefix() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    hashes = [51, 52, 53, 54]
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    swa = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 2 * BS}
    await eng.send(V026.encode(1.0, [
        V026.Stored(hashes, None, TOKENS[: 4 * BS], BS, None, "GPU", None, **full),
        V026.Stored(hashes, None, TOKENS[: 4 * BS], BS, None, "GPU", None, **swa),
    ]))
    # The sliding-window group frees what fell out of its window: the prefix is still reusable.
    await eng.send(V026.encode(1.1, [V026.Removed(hashes[:2], "GPU", group_idx=1)]))
    await until(lambda: bridge.counts["batches"] == 2)
    k = chain_keys(TOKENS[: 4 * BS], BS)
    assert out.view()["hbm"] == set(k)
    # The full-attention group evicting a block removes it.
    await eng.send(V026.encode(1.2, [V026.Removed(hashes[3:], "GPU", group_idx=0)]))
    await until(lambda: bridge.counts["batches"] == 3)
    assert out.view()["hbm"] == set(k[:3])
    await finish(stop, task, eng)


async def test_a_store_without_group_idx_after_group_0_stores_is_indexed() -> None:
    """vLLM >= 0.26 names group 0 on its GPU stores; a storage connector's store of the same blocks
    names none: that is the engine's only group, so the blocks are on that tier too."""
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    hashes = [61, 62, 63]
    await eng.send(V026.encode(1.0, [V026.Stored(hashes, None, TOKENS[: 3 * BS], BS, None, "GPU", None, group_idx=0)]))
    await eng.send(V026.encode(1.1, [V026.Stored(hashes, None, TOKENS[: 3 * BS], BS, None, "STORAGE", None)]))
    # A removal in the array form (no group) takes a block out of HBM whichever form stored it.
    await eng.send(V023.encode(1.2, [V023.Removed([63], "GPU")]))
    await until(lambda: bridge.counts["batches"] == 3)
    k = chain_keys(TOKENS[: 3 * BS], BS)
    assert out.view() == {"hbm": set(k[:2]), "ssd": set(k)}
    assert bridge.translator.counts["unknown_removed"] == 0
    await finish(stop, task, eng)


async def test_a_stream_mixing_both_forms_indexes_every_block() -> None:
    """Batches alternate vLLM's map form (group 0) and its array form (no group): every block of both
    is indexed, and each form's removals apply to blocks the other stored."""
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    parent = None
    for i in range(12):
        h = 700 + i
        if i % 2 == 0:
            await eng.send(V026.encode(1.0, [V026.Stored([h], parent, blk(i), BS, None, "GPU", None, group_idx=0)]))
        else:
            await eng.send(V023.encode(1.0, [V023.Stored([h], parent, blk(i), BS, None, "GPU")]))
        parent = h
    k = chain_keys(TOKENS[: 12 * BS], BS)
    await until(lambda: bridge.counts["batches"] == 12)
    assert out.view() == {"hbm": set(k)}
    # The last two blocks: one stored by each form, each removed by the other form.
    await eng.send(V023.encode(2.0, [V023.Removed([710], "GPU")]))
    await eng.send(V026.encode(2.1, [V026.Removed([711], "GPU", group_idx=0)]))
    await until(lambda: bridge.counts["batches"] == 14)
    assert out.view() == {"hbm": set(k[:10])}
    assert bridge.translator.counts["unknown_removed"] == 0
    await finish(stop, task, eng)


async def test_past_its_memory_bound_the_bridge_forgets_the_oldest_blocks_and_the_view_follows() -> None:
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out, max_tracked_blocks=4)
    epoch = out.last_epoch()
    for i in range(6):
        await eng.send(V026.encode(1.0, [V026.Stored([800 + i], None if i == 0 else 799 + i, blk(i), BS, None,
                                                     "GPU", None)]))
    await until(lambda: bridge.counts["batches"] == 6)
    k = chain_keys(TOKENS[: 6 * BS], BS)
    # No new epoch (the node is not cleared): the two oldest blocks left the map and the view.
    assert out.last_epoch() == epoch and out.view() == {"hbm": set(k[2:])}
    assert bridge.translator.counts["hashes_evicted"] == 2 and len(bridge.translator) == 4
    # The engine evicts a forgotten block at last: counted, dropped, the view unchanged.
    await eng.send(V023.encode(2.0, [V023.Removed([800], "GPU"), V023.Removed([805], "GPU")]))
    await until(lambda: bridge.counts["batches"] == 7)
    assert out.view() == {"hbm": set(k[2:5])}
    assert bridge.translator.counts["unknown_removed"] == 1
    await finish(stop, task, eng)


# --- restarts -------------------------------------------------------------------------------


async def _restart_case(new_batches: int) -> tuple[Out, int, list[int]]:
    """Old process: 3 batches. New process on the same ports: ``new_batches`` batches of other blocks."""
    eng, out = Engine(), Out()
    bridge, stop, task = await follow(eng, out)
    for i in range(3):
        await eng.send(V023.encode(1.0, [V023.Stored([100 + i], None if i == 0 else 99 + i, blk(i), BS, None, None)]))
    await until(lambda: bridge.counts["batches"] == 3)
    old_epoch = out.last_epoch()
    zmq, replay = eng.pub.endpoint, eng.pub.replay_endpoint
    await eng.stop()
    await asyncio.sleep(0.3)
    new = Engine(zmq, replay)
    base = 6
    for i in range(new_batches):
        parent = None if i == 0 else 200 + i - 1
        await new.send(V023.encode(2.0, [V023.Stored([200 + i], parent, blk(base + i), BS, None, None)]))
    keys = chain_keys(TOKENS[base * BS : (base + new_batches) * BS], BS)
    await until(lambda: out.last_epoch() > old_epoch and out.view().get("hbm", set()) == set(keys), 10)
    await finish(stop, task, new)
    return out, old_epoch, keys


async def test_restart_with_more_batches_than_the_old_process() -> None:
    out, _old_epoch, keys = await _restart_case(new_batches=6)
    assert out.view() == {"hbm": set(keys)}  # no block of the dead process left


async def test_idle_restart_clears_the_old_blocks() -> None:
    out, _old_epoch, _ = await _restart_case(new_batches=0)
    assert out.view().get("hbm", set()) == set()
    assert out.view() == {}


async def test_restart_after_the_replay_buffer_overflowed() -> None:
    """The new process's bounded buffer no longer holds its first batches: the view has what it still buffers."""
    eng, out = Engine(buffer_steps=4), Out()
    bridge, stop, task = await follow(eng, out)
    await eng.send(V023.encode(1.0, [V023.Stored([100], None, blk(0), BS, None, None)]))
    await until(lambda: bridge.counts["batches"] == 1)
    zmq, replay = eng.pub.endpoint, eng.pub.replay_endpoint
    await eng.stop()
    await asyncio.sleep(0.3)
    new = Engine(zmq, replay, buffer_steps=4)
    # Published before the bridge reconnects: not received live; seq 0..1 fall out of the buffer.
    for i in range(6):
        await new.pub.publish_payload(
            V023.encode(2.0, [V023.Stored([300 + i], None, blk(2 + i), BS, None, None)]), send=False)
    await until(lambda: bridge.counts["epoch_restart"] >= 1, 10)
    await until(lambda: len(out.view().get("hbm", ())) == 4)
    want = {chain_keys(blk(2 + i), BS)[0] for i in range(2, 6)}
    assert out.view() == {"hbm": want}
    await finish(stop, task, new)


# --- load from /metrics, unreachable engine, restart by process start time ----------------------------


class FakeVllmMetrics(Collector):
    def __init__(self) -> None:
        self.running, self.waiting, self.start = 3, 5, 1_700_000_000.0

    def collect(self):  # type: ignore[no-untyped-def]
        for name, v in (("vllm:num_requests_running", self.running), ("vllm:num_requests_waiting", self.waiting),
                        ("vllm:kv_cache_usage_perc", 0.25)):
            g = GaugeMetricFamily(name, name, labels=["engine", "model_name"])
            g.add_metric(["0", "m"], v)
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info", "i", labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(BS), "1000"], 1)
        yield info
        yield GaugeMetricFamily("process_start_time_seconds", "s", value=self.start)


async def test_scraped_load_heartbeats_unreachable_and_start_time_restart() -> None:
    metrics = FakeVllmMetrics()
    reg = CollectorRegistry()
    reg.register(metrics)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    eng, out = Engine(), Out()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        bridge, stop, task = await follow(eng, out, heartbeat_s=0.1, metrics_url=url)
        await eng.send(V023.encode(1.0, [V023.Stored([1], None, blk(0), BS, None, None)]))
        await until(lambda: len(out.heartbeats) >= 2 and bridge.counts["batches"] == 1)
        hb = out.heartbeats[-1].body
        assert isinstance(hb, Heartbeat)
        assert (hb.running_requests, hb.queue_depth, hb.total_kv_blocks, hb.free_kv_blocks) == (3, 5, 1000, 750)
        # The translator's memory bound follows the engine's capacity (at least the floor for a small one).
        assert bridge.translator.max_tracked == MIN_TRACKED
        # A new process behind the same endpoints (ZMQ never saw it go): its start time tells.
        epoch = out.last_epoch()
        metrics.start += 60
        await until(lambda: out.last_epoch() > epoch)
        # The new epoch opens with a clear, then the replay of what the (same) buffer still holds.
        await until(lambda: out.view() == {"hbm": {chain_keys(blk(0), BS)[0]}})
        # Unreachable: no heartbeats, counted.
        server.shutdown()
        server.server_close()
        await until(lambda: bridge.counts["scrape_failures"] >= 2)
        n = len(out.heartbeats)
        await asyncio.sleep(0.35)
        assert len(out.heartbeats) == n
        assert bridge.scraper is not None and bridge.scraper.reachable is False
        await finish(stop, task, eng)
    finally:
        server.server_close()


async def test_an_engine_without_kv_events_is_heartbeated_from_its_metrics_alone() -> None:
    """``--no-events``: the load and KV capacity from ``/metrics``, the heartbeats marked, no ZMQ
    socket; a restart seen on ``/metrics`` opens a new epoch (its clear), and nothing else reaches
    the node's kv-events stream."""
    metrics = FakeVllmMetrics()
    reg = CollectorRegistry()
    reg.register(metrics)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    out = Out()
    try:
        cfg = BridgeConfig(node_id="n0", role="both", zmq_endpoint=None, heartbeat_s=0.1, kv_events=False,
                           metrics_url=f"http://127.0.0.1:{server.server_port}/metrics")
        bridge = Bridge(cfg, out.sink, out.hb)
        stop = asyncio.Event()
        task = asyncio.create_task(bridge.run(stop))
        await until(lambda: len(out.heartbeats) >= 2)
        hb = out.heartbeats[-1].body
        assert isinstance(hb, Heartbeat)
        assert (hb.kv_events, hb.total_kv_blocks, hb.free_kv_blocks, hb.running_requests) == (False, 1000, 750, 3)
        assert hb.endpoint == f"http://127.0.0.1:{server.server_port}"
        metrics.start += 60
        await until(lambda: bridge.counts["restart_by_start_time"] == 1)
        assert [type(e.body) for e in out.envs] == [AllBlocksCleared, AllBlocksCleared]
        assert bridge._sub is None and bridge._dealer is None  # no ZMQ socket was opened
        stop.set()
        await asyncio.wait_for(task, 10)
    finally:
        server.shutdown()
        server.server_close()


class FakeSglangServer:
    """An SGLang server's HTTP side: ``/metrics``, and ``/server_info`` unless it plays vLLM (404)."""

    def __init__(self, server_info: dict[str, object] | None) -> None:
        self.server_info = server_info
        self.asked: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\n")

        async def info(request: web.Request) -> web.Response:
            self.asked.append(request.path)
            return web.json_response(self.server_info) if self.server_info else web.Response(status=404)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/server_info", info)
        app.router.add_get("/get_server_info", info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.mark.parametrize("server_info,announced", [
    # SGLang's own answer for a prefill server started with its defaults (8998 unless
    # --disaggregation-bootstrap-port says otherwise).
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998, "port": 30000}, 8998),
    ({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 9123, "port": 30000}, 9123),
    # A vLLM engine has no /server_info: nothing announced, and it is not asked again.
    (None, None),
])
async def test_a_prefill_bridge_announces_the_bootstrap_port_its_engine_serves(
        server_info: dict[str, object] | None, announced: int | None) -> None:
    server = FakeSglangServer(server_info)
    await server.start()
    eng, out = Engine(), Out()
    try:
        _bridge, stop, task = await follow(eng, out, heartbeat_s=0.1, metrics_url=f"{server.url}/metrics")
        await until(lambda: len(out.heartbeats) >= 3)
        hb = out.heartbeats[-1].body
        assert isinstance(hb, Heartbeat) and hb.endpoint == server.url
        assert hb.bootstrap_port == announced
        assert len(server.asked) <= 2  # one answer is enough: /server_info (then /get_server_info on a 404)
        await finish(stop, task, eng)
    finally:
        await server.stop()


async def test_the_operators_bootstrap_port_is_not_second_guessed() -> None:
    server = FakeSglangServer({"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998})
    await server.start()
    eng, out = Engine(), Out()
    try:
        _bridge, stop, task = await follow(eng, out, heartbeat_s=0.1, metrics_url=f"{server.url}/metrics",
                                          bootstrap_port=7000)
        await until(lambda: len(out.heartbeats) >= 2)
        assert out.heartbeats[-1].body.bootstrap_port == 7000  # type: ignore[union-attr]
        assert server.asked == []
        await finish(stop, task, eng)
    finally:
        await server.stop()


# --- data parallelism ---------------------------------------------------------------------------


async def test_dp_ranks_are_nodes_of_their_own() -> None:
    zbase, rbase = free_port_pair(), free_port_pair()
    engines = [Engine(f"tcp://127.0.0.1:{zbase + r}", f"tcp://127.0.0.1:{rbase + r}") for r in range(2)]
    out = Out()
    cfgs = rank_configs(node_id="eng", dp_size=2, zmq_endpoint=f"tcp://127.0.0.1:{zbase}",
                        replay_endpoint=f"tcp://127.0.0.1:{rbase}", role="prefill", heartbeat_s=None,
                        block_size=BS)
    assert [c.node_id for c in cfgs] == ["eng-dp0", "eng-dp1"]
    bridges = [Bridge(c, out.sink) for c in cfgs]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(b.run(stop)) for b in bridges]
    for b in bridges:
        await asyncio.wait_for(b.ready.wait(), 10)
    await asyncio.sleep(0.3)
    for r, e in enumerate(engines):
        await e.send(V026.encode(1.0, [V026.Stored([400 + r], None, blk(r), BS, None, "GPU", None)], r))
    await until(lambda: all(b.counts["batches"] == 1 for b in bridges))
    by_node: dict[str, set[int]] = {}
    for env in out.envs:
        if isinstance(env.body, BlocksStored):
            by_node.setdefault(env.producer_id, set()).update(env.body.block_keys or ())
    assert by_node == {"eng-dp0": {chain_keys(blk(0), BS)[0]}, "eng-dp1": {chain_keys(blk(1), BS)[0]}}
    assert all(b.counts["dp_rank_mismatch"] == 0 for b in bridges)
    stop.set()
    await asyncio.gather(*tasks)
    for e in engines:
        await e.stop()


@pytest.mark.parametrize("rank,expected", [(0, (3, 1)), (1, (7, 2))])
def test_dp_metrics_are_read_per_rank(rank: int, expected: tuple[int, int]) -> None:
    from conductor.bridge.scrape import parse_load

    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 7\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2\n'
    )
    load = parse_load(text, rank=rank)
    assert (load.running, load.waiting) == expected
