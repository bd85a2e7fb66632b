"""``conductor bench ingest``: the event pipeline measured end to end.

A synthetic cluster of engines (``SyntheticEngines``: per-node LRU caches, shared prompt
prefixes, vLLM-like batches — one stored record per prefill chunk of tens to hundreds of
16-token blocks, evictions in groups, periodic heartbeats) publishes to Kafka; a real
``conductor worker`` subprocess folds it into Redis; this process watches the view's
watermark (the applied offsets) to see when each record became visible.

Phase 1 (throughput): publish ``block_events`` block events as fast as the producer goes;
``block_events_per_s`` and ``records_per_s`` are totals over first publish → last visible.
Phase 2 (staleness): offer ``offered_rate`` block events/s for ``staleness_s`` seconds;
each record's publish → visible time gives ``staleness_ms_p50/p99`` (the watermark is
polled every ~2 ms, which bounds the resolution).
``view_bytes_per_block``: Redis ``used_memory`` growth over the run / block keys indexed.
``control_cpu_s`` (``_by_process``: worker, broker, Redis) and ``control_cpu_us_per_block_event``:
their CPU over phase 1 (:mod:`conductor.harness.cpu`); ``staleness_control_cpu_*`` the same over
phase 2 (per record, and ``_share``: of one core over the phase's wall time).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from conductor.harness.cpu import CpuMeter, cpu_report, server_pids
from conductor.harness.devstack import EmbeddedStack, free_port
from conductor.settings import child_environment
from conductor.stats import percentile
from schemas import BlocksRemoved, BlocksStored, Heartbeat, chain_from_precomputed, encode, envelope, headers
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.topics import Topics, topics


@dataclass(frozen=True)
class IngestBenchConfig:
    nodes: int = 16
    block_events: int = 1_000_000
    mean_blocks: int = 96
    offered_rate: int = 10_000
    staleness_s: float = 6.0
    seed: int = 0
    capacity_blocks: int = 12_000
    """Blocks a node caches before it evicts (in groups)."""
    heartbeat_every: int = 20
    """Records between two heartbeats of a node."""
    shared_prefixes: int = 64
    """Distinct shared prompt prefixes (system prompts, documents) across the cluster."""
    workers: int = 1
    """``conductor worker`` processes folding the stream (one consumer group: they split the
    partitions, and one folds while Redis runs another's write)."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    blocks: int
    """Block events the record carries (0 for heartbeats)."""


class SyntheticEngines:
    """Deterministic stream of KV events and heartbeats from ``nodes`` engines."""

    def __init__(self, cfg: IngestBenchConfig, kv_topic: str, hb_topic: str) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.kv_topic, self.hb_topic = kv_topic, hb_topic
        self.names = [f"prefill-{i}" for i in range(cfg.nodes)]
        self.seq = {n: 0 for n in self.names}
        self.hb_seq = {n: 0 for n in self.names}
        self.since_hb = {n: 0 for n in self.names}
        self.cache: dict[str, OrderedDict[int, None]] = {n: OrderedDict() for n in self.names}
        self.shared = [
            chain_from_precomputed(range(p * 10_000, p * 10_000 + self.rng.randint(8, 64)), namespace="bench")
            for p in range(cfg.shared_prefixes)
        ]
        self._next_id = 1 << 40

    def _fresh(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self._next_id += 1
            out.append(self.rng.getrandbits(64) ^ self._next_id)
        return out

    def next(self, now_ms: int) -> list[Outgoing]:
        """The next record(s) of a random node: a heartbeat when due, then one KV event."""
        rng, cfg = self.rng, self.cfg
        node = rng.choice(self.names)
        out: list[Outgoing] = []
        key = node.encode()
        self.since_hb[node] += 1
        cache = self.cache[node]
        if self.since_hb[node] >= cfg.heartbeat_every:
            self.since_hb[node] = 0
            hb = Heartbeat(role="prefill", queue_depth=rng.randint(0, 8), queued_prefill_tokens=rng.randint(0, 30_000),
                           free_kv_blocks=max(cfg.capacity_blocks - len(cache), 0), total_kv_blocks=cfg.capacity_blocks)
            env = envelope(hb, producer_id=node, producer_seq=self.hb_seq[node], ts_ms=now_ms)
            self.hb_seq[node] += 1
            out.append(Outgoing(self.hb_topic, key, encode(env), headers(env), 0))
        if len(cache) > cfg.capacity_blocks:
            group = rng.randint(32, 160)
            keys = [cache.popitem(last=False)[0] for _ in range(min(group, len(cache)))]
            body: Any = BlocksRemoved(block_keys=keys)
        else:
            n = max(1, int(rng.triangular(cfg.mean_blocks / 4, cfg.mean_blocks * 1.75, cfg.mean_blocks)))
            if rng.random() < 0.5:
                p = rng.choice(self.shared)
                keys = (p + self._fresh(max(n - len(p), 0)))[:n]
            else:
                keys = self._fresh(n)
            for k in keys:
                cache[k] = None
                cache.move_to_end(k)
            body = BlocksStored(block_keys=keys)
        env = envelope(body, producer_id=node, producer_seq=self.seq[node], ts_ms=now_ms)
        self.seq[node] += 1
        out.append(Outgoing(self.kv_topic, key, encode(env), headers(env), len(keys)))
        return out


async def run_ingest_bench(
    settings: Any, cfg: IngestBenchConfig, log: Callable[[str], None] | None = None
) -> dict[str, Any]:

    say = log or (lambda _m: None)
    stack = None
    tmp = tempfile.TemporaryDirectory(prefix="conductor-bench-")
    try:
        if not (settings.kafka_url and settings.redis_url):
            stack = EmbeddedStack(Path(tmp.name) / "stack", host=settings.bind_host)
            st = await asyncio.to_thread(stack.up)  # up() runs its own event loop
            settings = settings.model_copy(update={"kafka_url": st.kafka_url, "redis_url": st.redis_url, "profile": "embedded"})
            say(f"embedded stack up: {st.kafka_url} {st.redis_url}")
        run = await _IngestRun.start(settings, cfg, Path(tmp.name), say)
        try:
            await run.ready()
            meter = CpuMeter({**run.worker_pids(), **server_pids(settings.kafka_url, settings.redis_url)}).start()
            phase1 = await run.throughput()
            cpu = cpu_report(meter.used(), phase1.blocks)
            meter2 = CpuMeter(meter.pids).start()
            stale = await run.staleness()
            cpu2 = meter2.report(len(stale), prefix="staleness_control_")
            stale_wall_s = meter2.wall_s
            mem1 = await run.store.memory_bytes()
            n_blocks = await run.store.block_count()
        finally:
            await run.close()
        return {
            "block_events_per_s": round(phase1.blocks / phase1.seconds, 1),
            "records_per_s": round(phase1.records / phase1.seconds, 1),
            "blocks_per_record": round(phase1.blocks / max(phase1.kv_records, 1), 1),
            "staleness_ms_p50": round(percentile(stale, 50, empty=0.0) * 1000, 2),
            "staleness_ms_p99": round(percentile(stale, 99, empty=0.0) * 1000, 2),
            "view_bytes_per_block": round((mem1 - run.mem0) / max(n_blocks, 1), 1),
            "offered_block_events_per_s": cfg.offered_rate,
            "staleness_samples": len(stale),
            "phase1_records": phase1.records,
            "phase1_block_events": phase1.blocks,
            "phase1_seconds": round(phase1.seconds, 3),
            "indexed_blocks": n_blocks,
            "nodes": cfg.nodes,
            "workers": cfg.workers,
            "embedded": stack is not None,
            # Phase 1's control-plane CPU (worker, broker, Redis; the synthetic engines are this process).
            "control_cpu_s": cpu["control_cpu_s"],
            "control_cpu_s_by_process": cpu["control_cpu_s_by_process"],
            "control_cpu_us_per_block_event": (None if cpu["control_cpu_s"] is None or not phase1.blocks
                                               else round(1e6 * cpu["control_cpu_s"] / phase1.blocks, 3)),
            # Phase 2's (a steady trickle of records: the regime of a live cluster's few requests a
            # second, where the cost per fetch, not per record, dominates).
            "staleness_control_cpu_s": cpu2["staleness_control_cpu_s"],
            "staleness_control_cpu_s_by_process": cpu2["staleness_control_cpu_s_by_process"],
            "staleness_control_cpu_ms_per_record": cpu2["staleness_control_cpu_ms_per_request"],
            "staleness_control_cpu_share": (None if cpu2["staleness_control_cpu_s"] is None or stale_wall_s <= 0
                                            else round(cpu2["staleness_control_cpu_s"] / stale_wall_s, 4)),
        }
    finally:
        if stack is not None:
            await asyncio.to_thread(stack.down)
        tmp.cleanup()


@dataclass(frozen=True, slots=True)
class _Throughput:
    records: int
    blocks: int
    """Block events published."""
    kv_records: int
    seconds: float
    """First publish → last record visible."""


class _IngestRun:
    """One run on topics and a view namespace of its own: the worker subprocess folding them, the
    producer and the synthetic engines publishing, the view watched."""

    def __init__(self, cfg: IngestBenchConfig, t: Topics, store: RedisViewStore, mem0: int,
                 workers: list[subprocess.Popen[bytes]], prod: AIOKafkaProducer, say: Callable[[str], None]) -> None:
        self.cfg, self.topics, self.store, self.mem0 = cfg, t, store, mem0
        self.workers, self.prod, self.say = workers, prod, say
        self.worker = workers[0]
        self.engines = SyntheticEngines(cfg, t.kv_events.name, t.heartbeats.name)

    @classmethod
    async def start(cls, settings: Any, cfg: IngestBenchConfig, tmp: Path, say: Callable[[str], None]) -> _IngestRun:
        """Create the run's topics, note the view's memory, start the worker (the producer starts in :meth:`ready`)."""
        tag = uuid.uuid4().hex[:8]
        s = settings.model_copy(
            update={"topic_prefix": f"bench{tag}.", "view_namespace": f"bench{tag}", "web_port": free_port(settings.bind_host)}
        )
        t = topics(s.topic_config())
        await ensure_topics(s.kafka(), t.all())
        store = RedisViewStore.connect(s.redis(), s.view_namespace)
        mem0 = await store.memory_bytes()
        workers = [start_worker_process(s.model_copy(update={"web_port": free_port(s.bind_host)}) if i else s,
                                        tmp / f"worker-{i}.log") for i in range(cfg.workers)]
        return cls(cfg, t, store, mem0, workers, producer(s.kafka()), say)

    def worker_pids(self) -> dict[str, int]:
        if len(self.workers) == 1:
            return {"worker": self.workers[0].pid}
        return {f"worker-{i}": w.pid for i, w in enumerate(self.workers)}

    async def ready(self) -> None:
        """Start the producer; ready = a probe on every partition of both topics is visible (a
        heartbeat, on ``kv-events`` a removal of nothing: neither folds to a block). With several
        workers the probes go twice, 3 s apart, so the group has settled after the workers' joins."""
        await self.prod.start()
        t_ready0 = time.monotonic()
        kv, hb = self.topics.kv_events.name, self.topics.heartbeats.name
        for r in range(1 if len(self.workers) == 1 else 2):
            if r:
                await asyncio.sleep(3.0)
            want: dict[str, int] = {}
            for name in (hb, kv):
                for part in sorted(await self.prod.partitions_for(name)):
                    body = BlocksRemoved(block_keys=[]) if name == kv else Heartbeat(role="store")
                    probe = envelope(body, producer_id=f"bench-probe-{r}-{part}", producer_seq=0,
                                     ts_ms=int(time.time() * 1000))
                    md = await self.prod.send_and_wait(name, encode(probe), key=b"bench-probe", headers=headers(probe),
                                                       partition=part)
                    want[f"{md.topic}:{md.partition}"] = md.offset
            await _wait_visible(self.store, want, 90.0, self.worker)
        self.say(f"{len(self.workers)} worker(s) ready in {time.monotonic() - t_ready0:.1f}s")

    async def throughput(self) -> _Throughput:
        """Phase 1: ``block_events`` block events published as fast as the producer goes, until all are visible."""
        records: list[Outgoing] = []
        blocks = 0
        now = int(time.time() * 1000)
        while blocks < self.cfg.block_events:
            for o in self.engines.next(now):
                records.append(o)
                blocks += o.blocks
        kv_records = sum(1 for o in records if o.blocks)
        self.say(f"phase 1: {len(records)} records, {blocks} block events")
        t0 = time.monotonic()
        futs = [await self.prod.send(o.topic, o.value, key=o.key, headers=o.headers) for o in records]
        mds = await asyncio.gather(*futs)
        t_pub = time.monotonic() - t0
        last: dict[str, int] = {}
        for m in mds:
            k = f"{m.topic}:{m.partition}"
            last[k] = max(last.get(k, -1), m.offset)
        await _wait_visible(self.store, last, 300.0, self.worker)
        t_all = time.monotonic() - t0
        self.say(f"phase 1: published in {t_pub:.2f}s, visible after {t_all:.2f}s")
        return _Throughput(len(records), blocks, kv_records, t_all)

    async def staleness(self) -> list[float]:
        """Phase 2: ``offered_rate`` block events/s for ``staleness_s``; each record's publish → visible seconds."""
        sent: dict[tuple[str, int], float] = {}
        timeline = WatermarkTimeline(self.store)
        await timeline.poll_once()
        stop = asyncio.Event()
        poller = asyncio.create_task(timeline.run(stop))
        try:
            await self._offer(sent)
            want: dict[str, int] = {}
            for k, off in sent:
                want[k] = max(want.get(k, -1), off)
            await _wait_visible(self.store, want, 60.0, self.worker)
            await timeline.poll_once()
        finally:
            stop.set()
            await poller
        stale = []
        for (k, off), t_send in sent.items():
            t_vis = timeline.visible_at(k, off)
            if t_vis is not None:
                stale.append(max(t_vis - t_send, 0.0))
        return stale

    async def _offer(self, sent: dict[tuple[str, int], float]) -> None:
        """Publish at the offered rate; each acknowledged record's send time goes into ``sent``."""
        cfg = self.cfg
        pending: list[asyncio.Future[Any]] = []
        t_start = time.monotonic()
        offered = 0
        while (elapsed := time.monotonic() - t_start) < cfg.staleness_s:
            due = cfg.offered_rate * elapsed
            if offered >= due:
                await asyncio.sleep(min((offered - due) / cfg.offered_rate, 0.01))
                continue
            for o in self.engines.next(int(time.time() * 1000)):
                t_send = time.monotonic()
                fut = await self.prod.send(o.topic, o.value, key=o.key, headers=o.headers)
                fut.add_done_callback(lambda f, t_send=t_send: _note(sent, f, t_send))
                pending.append(fut)
                offered += o.blocks
        await asyncio.gather(*pending)

    async def close(self) -> None:
        for w in self.workers:
            stop_worker_process(w)
        with contextlib.suppress(KafkaError):  # a failed last flush must not skip the clean-up
            await self.prod.stop()
        await self.store.clear()
        await self.store.close()


def _note(sent: dict[tuple[str, int], float], fut: Any, t_send: float) -> None:
    if not fut.cancelled() and fut.exception() is None:
        md = fut.result()
        sent[(f"{md.topic}:{md.partition}", md.offset)] = t_send


async def _wait_visible(store: Any, want: dict[str, int], timeout_s: float, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        wm = await store.watermark()
        if all(wm.get(k, -1) >= off for k, off in want.items()):
            return
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"view did not reach {want} within {timeout_s}s (at {wm})")
        await asyncio.sleep(0.002)


class WatermarkTimeline:
    """Polls the view's watermark and remembers when each partition's offset moved."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.changes: dict[str, list[tuple[int, float]]] = {}
        self.current: dict[str, int] = {}

    async def poll_once(self) -> None:
        wm = await self.store.watermark()
        now = time.monotonic()
        for k, off in wm.items():
            if off > self.current.get(k, -1):
                self.current[k] = off
                self.changes.setdefault(k, []).append((off, now))

    async def run(self, stop: asyncio.Event, interval_s: float = 0.002) -> None:
        while not stop.is_set():
            await self.poll_once()
            await asyncio.sleep(interval_s)

    def visible_at(self, key: str, offset: int) -> float | None:
        for off, t in self.changes.get(key, ()):
            if off >= offset:
                return t
        return None


def start_worker_process(s: Any, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``conductor worker`` in a subprocess, configured from ``s`` via CONDUCTOR_* variables."""
    env = child_environment(s)
    with open(log_path, "wb") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-c", "from conductor.cli import main; main()", "worker", "--loglevel", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )


def stop_worker_process(p: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker (Faust stops cleanly), SIGKILL it if it has not exited in 15 s."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

