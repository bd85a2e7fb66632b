"""``conductor bench route``: full routing decisions against a synthetic view in Redis.

A prefix-sharing workload (tenant system prompt → shared document → own question, Zipf
popularity) fills a view of ~``target_blocks`` blocks over a synthetic cluster; then one
:class:`conductor.routing.router.Router` with the production Redis stores times
``decisions`` decisions while heartbeats keep changing node state.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from conductor.routing.policies import Decision, Policy
from conductor.routing.policies.base import StagedPolicy
from conductor.routing.policies.stages import DECIDE, Mark
from conductor.routing.router import Router
from conductor.routing.snapshot import ClusterSnapshot, PolicyRequest
from conductor.routing.stores import redis_stores
from conductor.stats import percentile
from schemas import Heartbeat, Role, RoutingDecision, RoutingRequest, envelope
from state.fold import AddBlocks
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.tracking import DEFAULT_CACHE_KEYS, TrackingSnapshotReader

# --- the benchmark's synthetic cluster ------------------------------------------------------


class PrefixWorkload:
    """Prompts with realistic prefix sharing: tenant system prompt → shared document → own question.

    Tenants and documents are drawn Zipf-like, so a few prefixes are hot and most are
    cold. Block keys are random 64-bit integers (unique with overwhelming probability).
    """

    def __init__(self, rng: random.Random, *, tenants: int = 40, docs_per_tenant: int = 60,
                 chain_blocks: int = 128, zipf_s: float = 1.1) -> None:
        self.rng = rng
        self.chain_blocks = chain_blocks
        r = rng.getrandbits
        self.system = [[r(64) for _ in range(rng.randint(4, 24))] for _ in range(tenants)]
        self.docs = [[[r(64) for _ in range(rng.randint(16, 64))] for _ in range(docs_per_tenant)]
                     for _ in range(tenants)]
        self._tw = _zipf_cum(tenants, zipf_s)
        self._dw = _zipf_cum(docs_per_tenant, zipf_s)

    def request(self) -> tuple[int, list[int], int]:
        """(tenant, chain, shared prefix length in blocks) of one new prompt."""
        rng = self.rng
        t = rng.choices(range(len(self.system)), cum_weights=self._tw)[0]
        d = rng.choices(range(len(self.docs[t])), cum_weights=self._dw)[0]
        prefix = self.system[t] + self.docs[t][d]
        prefix = prefix[: self.chain_blocks - 8]
        suffix = [rng.getrandbits(64) for _ in range(self.chain_blocks - len(prefix))]
        return t, prefix + suffix, len(prefix)


def _zipf_cum(n: int, s: float) -> list[float]:
    acc, out = 0.0, []
    for i in range(n):
        acc += 1.0 / (i + 1) ** s
        out.append(acc)
    return out


def cluster_shape(instances: int) -> tuple[int, int, int, int]:
    """(prefill, decode, store, racks) of an ``instances``-node cluster in the proportions of
    the 32-node default (16 prefill, 12 decode, 4 store in 4 racks; a rack per ~8 nodes)."""
    if instances < 3:
        raise ValueError("a cluster needs at least 3 instances (prefill, decode, store)")
    prefill = max(1, instances // 2)
    decode = max(1, instances * 3 // 8)
    store = max(1, instances - prefill - decode)
    return instances - decode - store, decode, store, max(1, instances // 8)


Node = tuple[str, Role, str]
"""(node id, role, rack) of a synthetic instance."""


def cluster_nodes(prefill: int, decode: int, store: int, racks: int) -> list[Node]:
    """(node id, role, rack) of a synthetic cluster, spread round-robin over racks."""
    counts: list[tuple[Role, int]] = [("prefill", prefill), ("decode", decode), ("store", store)]
    nodes = [(f"{role}-{i:02d}", role) for role, n in counts for i in range(n)]
    return [(n, role, f"rack-{k % racks}") for k, (n, role) in enumerate(nodes)]


async def load_synthetic_view(store: Any, work: PrefixWorkload, nodes: list[Node],
                              target_blocks: int, rng: random.Random) -> int:
    """Fill ``store`` with served-request history until ~``target_blocks`` distinct keys; return the count."""

    prefills = [n for n, role, _ in nodes if role == "prefill"]
    stores = [n for n, role, _ in nodes if role == "store"]
    held: dict[str, list[set[int]]] = {n: [set(), set(), set()] for n, _, _ in nodes}
    distinct: set[int] = set()
    served = 0
    while len(distinct) < target_blocks:
        t, chain, _ = work.request()
        # Affinity: a tenant mostly lands on "its" two prefill nodes, sometimes anywhere.
        node = prefills[(t * 2 + rng.randrange(2)) % len(prefills)] if rng.random() < 0.7 else rng.choice(prefills)
        tier = 0 if served % 3 else 1  # a third of the history has been offloaded to DRAM
        held[node][tier].update(chain)
        distinct.update(chain)
        served += 1
    for i, s in enumerate(stores):  # the shared pool keeps documents of every other tenant
        for t in range(i % 2, len(work.system), 2):
            held[s][1].update(work.system[t])
            for doc in work.docs[t]:
                held[s][2].update(work.system[t] + doc)
    for node, tiers in held.items():
        for tier, keys in enumerate(tiers):
            if keys:
                await store.apply_groups([(None, [AddBlocks(node, tier, tuple(keys))])])
        distinct.update(*tiers)
    return len(distinct)


async def publish_heartbeats(store: Any, nodes: list[Node], rng: random.Random, seq: int | dict[str, int],
                             now_ms: int) -> None:
    """One heartbeat per node with a plausible load (producer seq ``seq``, or per node)."""

    recs = []
    for node, role, rack in nodes:
        q = seq if isinstance(seq, int) else seq[node]
        if role == "prefill":
            depth = rng.randint(0, 6)
            hb = Heartbeat(role=role, queue_depth=depth, queued_prefill_tokens=depth * rng.randint(500, 4000),
                           running_requests=min(depth, 1), rack=rack)
        elif role == "decode":
            batch = rng.randint(8, 64)
            hb = Heartbeat(role=role, batch_size=batch, running_requests=batch,
                           decode_context_tokens=batch * rng.randint(1000, 6000), free_kv_blocks=rng.randint(20_000, 60_000),
                           total_kv_blocks=80_000, rack=rack)
        else:
            hb = Heartbeat(role=role, rack=rack)
        recs.append((envelope(hb, producer_id=node, producer_seq=q, ts_ms=now_ms), None))
    await store.apply(recs)


def _heartbeat_process(settings: Any, nodes: list[Node], rate: float, seed: int,
                       stop: Any) -> None:
    """Engines reporting: ``rate`` node heartbeats per second, round-robin over ``nodes``,
    written by a writer of its own (in its own process, as a stream worker would)."""

    async def run() -> None:
        store = RedisViewStore.connect(settings.redis(), settings.view_namespace)
        rng = random.Random(seed)
        seqs = {n: 2 for n, _, _ in nodes}
        tick, owed, at = 0.05, 0.0, 0
        last = time.perf_counter()
        try:
            while not stop.is_set():
                await asyncio.sleep(tick)
                now = time.perf_counter()
                owed += rate * (now - last)
                last = now
                k = int(owed)
                if k <= 0:
                    continue
                owed -= k
                batch = [nodes[(at + j) % len(nodes)] for j in range(k)]
                at = (at + k) % len(nodes)
                await publish_heartbeats(store, batch, rng, seqs, int(time.time() * 1000))
                for n, _, _ in batch:
                    seqs[n] += 1
        finally:
            await store.close()

    asyncio.run(run())


async def _view_memory(store: RedisViewStore) -> int:
    """Redis ``used_memory`` once keys unlinked by an earlier clear are freed."""
    for _ in range(600):
        info = await store.server_info("memory")
        if not int(info.get("lazyfree_pending_objects", 0)):
            break
        await asyncio.sleep(0.05)
    return int(info["used_memory"])


async def run_route_bench(settings: Any, *, decisions: int, target_blocks: int, seed: int,
                          instances: int = 32, heartbeat_rate: float | None = None, concurrency: int = 1,
                          progress: Any = None, reader: str = "raw",
                          cache_keys: int = DEFAULT_CACHE_KEYS, distinct_prompts: int = 0) -> dict[str, Any]:
    """Build an ``instances``-node view in Redis, then time ``decisions`` full routing
    decisions while another process writes ``heartbeat_rate`` node heartbeats per second
    (default: every node once a second); beside each decision, one pipelined MGET of the
    request's 128 block keys on the same kind of connection (the baseline).

    ``reader``: ``raw`` (the router's reader) or ``tracking`` (the client-side caching
    reader of :mod:`state.tracking`, ``cache_keys`` block entries). ``distinct_prompts``: 0,
    every timed prompt is new (its question part never read before); N, the timed prompts are
    drawn from N prompts, each decided once in the warm-up (a warm cache: what a tracking
    reader answers with no round trip)."""

    if reader not in ("raw", "tracking"):
        raise ValueError(f"reader must be raw or tracking, not {reader!r}")
    rng = random.Random(seed)
    nodes = cluster_nodes(*cluster_shape(instances))
    rate = float(instances if heartbeat_rate is None else heartbeat_rate)
    view, resv = _view_reader(settings, reader, cache_keys)
    # Bulk writes through a writer of their own: the router's client has 0.5 s timeouts.
    writer = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    work = PrefixWorkload(rng)
    loaded = await _load_view(writer, resv, work, nodes, target_blocks, rng)
    if progress:
        progress(f"view loaded: {len(nodes)} instances, {loaded.blocks} blocks in {loaded.load_s:.1f}s "
                 f"({loaded.bytes_per_block:.1f} B per block)")

    router = Router(settings, view, resv)
    await router.start()
    run = _RouteRun(settings, router, work, rng, distinct_prompts)
    gc.collect()
    gc.freeze()  # the synthetic workload's millions of keys are not garbage: keep GC off them
    try:
        with _heartbeats(settings, nodes, rate, seed + 1):
            await run.warm_up(min(200, decisions))
            timings = await run.measure(decisions, concurrency)
    finally:
        await router.close()
        await run.baseline.close()
        gc.unfreeze()
    tracked = int((await writer.server_info("stats")).get("tracking_total_keys", 0))
    await writer.clear()
    await resv.clear()
    await writer.close()
    await view.close()
    return _result(run, timings, loaded, instances=len(nodes), decisions=decisions, concurrency=concurrency,
                   rate=rate, reader=reader, cache_keys=cache_keys, distinct_prompts=distinct_prompts,
                   tracked=tracked)


def _view_reader(settings: Any, reader: str, cache_keys: int) -> tuple[Any, Any]:
    """The router's view reader (``raw`` or ``tracking``) and reservations, on the settings' Redis."""
    view, resv = redis_stores(settings)
    if reader == "tracking":
        view = TrackingSnapshotReader(settings.redis().connection_url(), settings.view_namespace, cache_keys=cache_keys,
                                      store=view.view if isinstance(view, RawSnapshotReader) else view)
    return view, resv


@dataclass(frozen=True)
class _Loaded:
    blocks: int
    bytes_per_block: float
    """Redis ``used_memory`` growth over the bulk load, per block."""
    load_s: float


async def _load_view(writer: RedisViewStore, resv: Any, work: PrefixWorkload, nodes: list[Node],
                     target_blocks: int, rng: random.Random) -> _Loaded:
    """Empty the view and the reservations, then load the workload's history and one heartbeat per node."""
    await writer.clear()
    await resv.clear()
    mem0 = await _view_memory(writer)
    t0 = time.perf_counter()
    blocks = await load_synthetic_view(writer, work, nodes, target_blocks, rng)
    bytes_per_block = (await _view_memory(writer) - mem0) / max(blocks, 1)
    await publish_heartbeats(writer, nodes, rng, 1, int(time.time() * 1000))
    return _Loaded(blocks, bytes_per_block, time.perf_counter() - t0)


@contextlib.contextmanager
def _heartbeats(settings: Any, nodes: list[Node], rate: float, seed: int) -> Iterator[None]:
    """Heartbeats written by a process of its own at ``rate`` nodes per second (none at 0) for the block."""
    if rate <= 0:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    beater = ctx.Process(target=_heartbeat_process, args=(settings, nodes, rate, seed, stop), daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join(10)
        if beater.is_alive():
            beater.terminate()


class _TimedPolicy:
    """The router's policy with its pure part timed apart from the reads, and the prefix holders
    each decision saw (the policy's work follows them)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name, self.params = inner.name, inner.params
        self.policy_ms: list[float] = []
        self.holders: list[int] = []

    def decide(self, req: PolicyRequest, snap: ClusterSnapshot, r: random.Random) -> Decision:
        return self.decide_staged(req, snap, r, lambda _: None)

    def decide_staged(self, req: PolicyRequest, snap: ClusterSnapshot, r: random.Random, mark: Mark) -> Decision:
        """The inner policy's stages, as the router would see them without the wrapper."""
        t = time.perf_counter()
        if isinstance(self.inner, StagedPolicy):
            out = self.inner.decide_staged(req, snap, r, mark)
        else:
            out = self.inner.decide(req, snap, r)
            mark(DECIDE)
        self.policy_ms.append((time.perf_counter() - t) * 1000.0)
        ix = snap.index
        self.holders.append(len(ix.holders) if ix is not None
                            else sum(1 for i in snap.instances if i.prefix_blocks[2] > 0))
        return out


@dataclass
class _Timings:
    """What the timed decisions measured."""

    lat: list[float] = field(default_factory=list)
    """Milliseconds per decision."""
    base: list[float] = field(default_factory=list)
    """Milliseconds per baseline MGET."""
    reuse: list[float] = field(default_factory=list)
    """Per placement: the share of the prompt reused."""
    outcomes: Counter[str] = field(default_factory=Counter)
    busy_s: float = 0.0
    """Wall time of the decisions, the baseline MGETs taken out."""


class _RouteRun:
    """One run: the router with its policy timed, the baseline reader beside it, the prompts."""

    def __init__(self, settings: Any, router: Router, work: PrefixWorkload, rng: random.Random,
                 distinct_prompts: int) -> None:
        self.router, self.work, self.rng = router, work, rng
        self.baseline = RawSnapshotReader(settings.redis().connection_url(), settings.view_namespace)
        self.timed = _TimedPolicy(router.policy)
        router.policy = self.timed
        self.bs = settings.block_size
        self.pool = [work.request()[1] for _ in range(distinct_prompts)]

    def make(self, i: int) -> RoutingRequest:
        chain = self.pool[self.rng.randrange(len(self.pool))] if self.pool else self.work.request()[1]
        return RoutingRequest(request_id=f"bench-{i}", block_keys=chain, prompt_tokens=len(chain) * self.bs,
                              expected_output_tokens=self.rng.randint(64, 512))

    async def mget(self, chain: list[int]) -> float:
        t = time.perf_counter()
        await self.baseline._call(("MGET", *self.baseline.keys.blocks(chain)))
        return (time.perf_counter() - t) * 1000.0

    async def warm_up(self, n: int) -> None:
        """Connections, script loads, caches: ``n`` new prompts and every prompt of the pool once;
        then the counters start from zero (the timed reads only)."""
        warm = [self.make(-i - 1) for i in range(n)]
        warm += [RoutingRequest(request_id=f"bench-warm-{i}", block_keys=chain, prompt_tokens=len(chain) * self.bs,
                                expected_output_tokens=64) for i, chain in enumerate(self.pool)]
        for req in warm:
            await self.router.route(req)
            await self.mget(list(req.block_keys or ()))
        self.timed.policy_ms.clear()
        self.timed.holders.clear()
        stats = getattr(self.router.view, "stats", None)
        if stats is not None:
            stats.update(dict.fromkeys(stats, 0))

    async def measure(self, decisions: int, concurrency: int) -> _Timings:
        """``decisions`` decisions, ``concurrency`` in flight, each followed by its baseline MGET."""
        out = _Timings()
        queue = list(reversed([self.make(i) for i in range(decisions)]))
        paused = 0.0

        async def lane() -> None:
            nonlocal paused
            while queue:
                req = queue.pop()
                t = time.perf_counter()
                answer = await self.router.route(req)
                out.lat.append((time.perf_counter() - t) * 1000.0)
                ms = await self.mget(list(req.block_keys or ()))  # the baseline, interleaved: same noise
                out.base.append(ms)
                paused += ms / 1000.0
                if isinstance(answer, RoutingDecision):
                    out.outcomes["placed"] += 1
                    out.reuse.append(answer.reused_tokens / req.prompt_tokens)
                else:
                    out.outcomes[answer.reason] += 1

        t_run = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        out.busy_s = time.perf_counter() - t_run - paused / concurrency
        return out


def _result(run: _RouteRun, t: _Timings, loaded: _Loaded, *, instances: int, decisions: int, concurrency: int,
            rate: float, reader: str, cache_keys: int, distinct_prompts: int, tracked: int) -> dict[str, Any]:
    """The bench's JSON object."""
    view = run.router.view
    node_reads = dict(getattr(view, "node_reads", {}))
    cache = dict(getattr(view, "stats", {}))
    policy_ms, holders = run.timed.policy_ms, run.timed.holders
    d50, m50 = percentile(t.lat, 50, empty=0.0), percentile(t.base, 50, empty=0.0)
    d99, m99 = percentile(t.lat, 99, empty=0.0), percentile(t.base, 99, empty=0.0)
    return {
        "bench": "route",
        "policy": run.timed.name,
        "instances": instances,
        "blocks": loaded.blocks,
        "chain_blocks": run.work.chain_blocks,
        "decisions": decisions,
        "concurrency": concurrency,
        "heartbeat_rate": rate,
        "decision_ms_p50": round(d50, 4),
        "decision_ms_p99": round(d99, 4),
        "decision_ms_max": round(max(t.lat), 4),
        "policy_ms_p50": round(percentile(policy_ms, 50, empty=0.0), 4),
        "policy_ms_p99": round(percentile(policy_ms, 99, empty=0.0), 4),
        "prefix_holders_mean": round(statistics.fmean(holders), 1) if holders else 0.0,
        "decisions_per_s": round(decisions / t.busy_s, 1),
        "mget128_ms_p50": round(m50, 4),
        "mget128_ms_p99": round(m99, 4),
        "decision_over_mget_p50": round(d50 / m50, 3) if m50 else None,
        "decision_over_mget_p99": round(d99 / m99, 3) if m99 else None,
        "view_bytes_per_block": round(loaded.bytes_per_block, 1),
        "reused_prefix_ratio_mean": round(statistics.fmean(t.reuse), 4) if t.reuse else 0.0,
        "outcomes": dict(t.outcomes),
        "node_reads": node_reads,
        "view_load_s": round(loaded.load_s, 2),
        "reader": reader,
        "cache_keys": cache_keys if reader == "tracking" else 0,
        "cache_hit_ratio": round(cache["hits"] / max(1, cache["hits"] + cache["misses"]), 4) if cache else None,
        "keys_fetched_per_read": (round(cache["misses"] / max(1, cache["reads"]), 1) if cache
                                  else float(run.work.chain_blocks)),
        "cache_reads_redone": cache.get("retries", 0),
        "distinct_prompts": distinct_prompts,
        "cached_reads_ratio": round(cache.get("cached_reads", 0) / max(1, cache["reads"]), 4) if cache else None,
        "server_tracked_keys": tracked,
        "note": "decision = view read + reservation read + policy + reservation record; one process; "
                "decisions_per_s = decisions / wall time (without the baseline MGETs) with CONCURRENCY "
                "requests in flight; heartbeats written by a separate process at HEARTBEAT_RATE nodes/s; "
                "prefix_holders_mean = instances holding a prefix of the request's chain, per decision (the "
                "policy's work follows them); "
                "view_bytes_per_block = Redis used_memory growth over the bulk load / blocks; node_reads = how "
                "the view reads got the node states (unchanged, only the changed nodes, the whole hash); reader = raw (the router's) or tracking (client-side cache, "
                "CLIENT TRACKING): cache_hit_ratio = chain keys served from the cache / keys looked up, "
                "keys_fetched_per_read = keys in the read's MGET; cached_reads_ratio = reads answered from "
                "the cache with no round trip (at the last read's watermark); distinct_prompts = how many "
                "prompts the timed ones are drawn from (0: every prompt new); "
                "server_tracked_keys = keys Redis tracks for clients (INFO tracking_total_keys) at the end",
    }
