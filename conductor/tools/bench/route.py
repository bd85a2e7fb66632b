"""``conductor bench route``: full routing decisions against a synthetic view in Redis.

A prefix-sharing workload (tenant system prompt → shared document → own question, Zipf
popularity) fills a view of ~``target_blocks`` blocks over a synthetic cluster; then one
:class:`conductor.routing.router.Router` with the production Redis stores times
``decisions`` decisions while heartbeats keep changing node state.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from collections import Counter
from typing import Any

from conductor.routing.router import Router, redis_stores
from conductor.tools.bench import percentile
from schemas import Heartbeat, RoutingDecision, RoutingRequest, envelope
from state.fold import AddBlocks

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


def cluster_nodes(prefill: int, decode: int, store: int, racks: int) -> list[tuple[str, str, str]]:
    """(node id, role, rack) of a synthetic cluster, spread round-robin over racks."""
    nodes = [(f"prefill-{i:02d}", "prefill") for i in range(prefill)]
    nodes += [(f"decode-{i:02d}", "decode") for i in range(decode)]
    nodes += [(f"store-{i:02d}", "store") for i in range(store)]
    return [(n, role, f"rack-{k % racks}") for k, (n, role) in enumerate(nodes)]


async def load_synthetic_view(store: Any, work: PrefixWorkload, nodes: list[tuple[str, str, str]],
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


async def publish_heartbeats(store: Any, nodes: list[tuple[str, str, str]], rng: random.Random, seq: int,
                             now_ms: int) -> None:
    """One heartbeat per node with a plausible load (producer seq ``seq``)."""

    recs = []
    for node, role, rack in nodes:
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
        recs.append((envelope(hb, producer_id=node, producer_seq=seq, ts_ms=now_ms), None))
    await store.apply(recs)


async def run_route_bench(settings: Any, *, decisions: int, target_blocks: int, seed: int,
                          heartbeat_every_s: float = 0.5, concurrency: int = 1,
                          progress: Any = None) -> dict[str, Any]:
    """Build a 32-instance view in Redis, then time ``decisions`` full routing decisions."""


    rng = random.Random(seed)
    nodes = cluster_nodes(16, 12, 4, racks=4)
    view, resv = redis_stores(settings)
    await view.clear()
    await resv.clear()
    work = PrefixWorkload(rng)
    t0 = time.perf_counter()
    blocks = await load_synthetic_view(view, work, nodes, target_blocks, rng)
    hb_seq = 1
    await publish_heartbeats(view, nodes, rng, hb_seq, int(time.time() * 1000))
    load_s = time.perf_counter() - t0
    if progress:
        progress(f"view loaded: {len(nodes)} instances, {blocks} blocks in {load_s:.1f}s")

    router = Router(settings, view, resv)
    await router.start()
    gc.collect()
    gc.freeze()  # the synthetic workload's millions of keys are not garbage: keep GC off them
    policy_ms: list[float] = []
    inner = router.policy

    class Timed:  # times the pure part apart from the reads
        name, params = inner.name, inner.params

        def decide(self, req: Any, snap: Any, r: random.Random) -> Any:
            t = time.perf_counter()
            out = inner.decide(req, snap, r)
            policy_ms.append((time.perf_counter() - t) * 1000.0)
            return out

    router.policy = Timed()  # type: ignore[assignment]
    bs = settings.block_size

    def make(i: int) -> RoutingRequest:
        _, chain, _ = work.request()
        return RoutingRequest(request_id=f"bench-{i}", block_keys=chain, prompt_tokens=len(chain) * bs,
                              expected_output_tokens=rng.randint(64, 512))

    for i in range(min(200, decisions)):  # warm-up: connections, script loads, caches
        await router.route(make(-i - 1))
    policy_ms.clear()
    reqs = [make(i) for i in range(decisions)]
    lat: list[float] = []
    reuse: list[float] = []
    outcomes: Counter[str] = Counter()
    queue = list(reversed(reqs))
    hb = {"seq": hb_seq, "next": time.perf_counter() + heartbeat_every_s, "paused": 0.0}

    async def lane() -> None:
        while queue:
            now = time.perf_counter()
            if now >= hb["next"]:  # engines report: reservations of the past interval are released
                hb["next"] = now + heartbeat_every_s
                hb["seq"] += 1
                await publish_heartbeats(view, nodes, rng, hb["seq"], int(time.time() * 1000))
                hb["paused"] += time.perf_counter() - now
            req = queue.pop()
            t = time.perf_counter()
            out = await router.route(req)
            lat.append((time.perf_counter() - t) * 1000.0)
            if isinstance(out, RoutingDecision):
                outcomes["placed"] += 1
                reuse.append(out.reused_tokens / req.prompt_tokens)
            else:
                outcomes[out.reason] += 1

    t_run = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    busy = time.perf_counter() - t_run - hb["paused"]
    await router.close()
    gc.unfreeze()
    await view.clear()
    await resv.clear()
    await view.close()
    return {
        "bench": "route",
        "policy": inner.name,
        "instances": len(nodes),
        "blocks": blocks,
        "chain_blocks": work.chain_blocks,
        "decisions": decisions,
        "concurrency": concurrency,
        "decision_ms_p50": round(percentile(lat, 0.50), 4),
        "decision_ms_p99": round(percentile(lat, 0.99), 4),
        "decision_ms_max": round(max(lat), 4),
        "policy_ms_p50": round(percentile(policy_ms, 0.50), 4),
        "policy_ms_p99": round(percentile(policy_ms, 0.99), 4),
        "decisions_per_s": round(decisions / busy, 1),
        "reused_prefix_ratio_mean": round(statistics.fmean(reuse), 4) if reuse else 0.0,
        "outcomes": dict(outcomes),
        "view_load_s": round(load_s, 2),
        "note": "decision = view read + reservation read + policy + reservation record; one process; "
                "decisions_per_s = decisions / wall time with CONCURRENCY requests in flight",
    }
