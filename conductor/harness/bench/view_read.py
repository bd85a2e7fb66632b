"""``conductor bench view-read``: the routing read's two possible layouts on a dedicated Valkey.

The store's pipelined ``MGET`` with the prefix walk client-side, against a server-side Lua
walk that stops at the first block nobody holds, and the router's readers (plain, and with
a warm client-side cache); latency, Redis server time per read (``commandstats``) and view
memory per block.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from conductor.harness.devstack import free_port, redis_binary
from conductor.harness.valkey_cluster import ValkeyCluster
from conductor.stats import percentile
from state.connect import open_client
from state.fold import AddBlocks
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.scripts import lua
from state.tracking import TrackingSnapshotReader


async def run_view_read_bench(
    nodes: int = 16, blocks_per_node: int = 200_000, chain_len: int = 512, reads: int = 300, seed: int = 0,
    host: str = "127.0.0.1", log: Callable[[str], None] | None = None, cluster: bool = False,
) -> dict[str, Any]:
    """Load a synthetic view into a dedicated Valkey and time the two ways to read a chain.

    ``mget``: the store's snapshot (one pipeline: TIME, MGET of the chain, HGETALL nodes and
    watermark; the prefix walk runs client-side). ``lua_walk``: a script GETs the chain
    server-side and stops at the first block nobody holds. Server time per read comes from
    Redis ``commandstats``. Memory is ``used_memory`` growth per block key.

    ``raw_reader``: the router's reader (``state.reader``: one MULTI/EXEC of TIME, the MGET,
    the node delta, the watermark, on a raw connection). ``tracking_warm``: the client-side
    caching reader (``state.tracking``) reading the same chain again with its points off, so
    every block entry comes from its cache and the transaction carries TIME, the node delta
    and the watermark. ``tracking_point``: the same reader as the router runs it, answering
    the warm chain at its last read's point, with no round trip while nothing is written.

    ``cluster``: the same on a 3-primary Valkey Cluster (``redis+cluster://``, redis-py's
    cluster client); server figures are of the primary holding the namespace's slot.
    """
    say = log or (lambda _m: None)
    valkey = await _Valkey.start(host, cluster)
    readers: list[Any] = []
    try:
        await valkey.ready()
        store = RedisViewStore(valkey.client, "cv")
        valkey.count_on(store.keys.generation)
        chain, loaded = await _load_view(store, valkey.admin, nodes, blocks_per_node, chain_len, seed)
        say(f"loaded {nodes * blocks_per_node} (node, block) entries into {loaded.keys} keys in {loaded.load_s:.1f}s")
        walk = valkey.client.register_script(lua("walk", "conductor.harness.bench"))
        chain_keys = store.keys.blocks(chain)
        raw = RawSnapshotReader(valkey.url, "cv")
        tracking = TrackingSnapshotReader(valkey.url, "cv", cache_keys=max(chain_len, 1000), point_max_age_s=0)
        pointed = TrackingSnapshotReader(valkey.url, "cv", cache_keys=max(chain_len, 1000))
        readers += [raw, tracking, pointed]
        options: dict[str, Callable[[], Awaitable[Any]]] = {
            "mget": lambda: store.snapshot(chain),
            "lua_walk": lambda: walk(keys=chain_keys),
            "raw_reader": lambda: raw.snapshot(chain),
            "tracking_warm": lambda: tracking.snapshot(chain),
            "tracking_point": lambda: pointed.snapshot(chain),
        }
        out: dict[str, Any] = {
            "redis": "cluster (3 primaries)" if cluster else "one server",
            "nodes": nodes, "blocks_per_node": blocks_per_node, "chain_len": chain_len,
            "load_entries_per_s": round(nodes * blocks_per_node / loaded.load_s, 1),
            "view_bytes_per_block": round(loaded.used_bytes / loaded.keys, 1),
            "view_bytes_per_node_block": round(loaded.used_bytes / (nodes * blocks_per_node), 1),
        }
        for name, fn in options.items():
            out.update(await _time_reads(name, fn, valkey.admin, reads))
        out["tracking_warm_cache_hit_ratio"] = round(tracking.cache_hit_ratio(), 4)
        out["tracking_point_reads_with_no_round_trip"] = round(pointed.stats["cached_reads"] / max(1, pointed.stats["reads"]), 4)
        return out
    finally:
        for r in readers:
            await r.close()
        await valkey.close()


class _Valkey:
    """The bench's own Valkey: one server, or a 3-primary cluster; ``admin`` is the connection
    whose server figures count."""

    def __init__(self, tmp: tempfile.TemporaryDirectory[str], client: Any, url: str, *,
                 proc: asyncio.subprocess.Process | None = None, vc: ValkeyCluster | None = None) -> None:
        self.tmp, self.client, self.url, self.proc, self.vc = tmp, client, url, proc, vc
        self.admin: Any = client

    @classmethod
    async def start(cls, host: str, cluster: bool) -> _Valkey:
        tmp = tempfile.TemporaryDirectory(prefix="conductor-view-read-")
        if cluster:
            vc = ValkeyCluster(Path(tmp.name), host=host).start()
            return cls(tmp, open_client(vc.url), vc.url, vc=vc)
        port = free_port(host)
        proc = await asyncio.create_subprocess_exec(
            redis_binary(), "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"redis://{host}:{port}"
        return cls(tmp, aioredis.from_url(url), url, proc=proc)

    async def ready(self) -> None:
        """Wait up to 10 s for it to answer."""
        deadline = time.monotonic() + 10
        while True:
            try:
                await self.client.ping()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def count_on(self, key: str) -> None:
        """On a cluster, take the server figures from the one primary of ``key``'s slot (the namespace's)."""
        if self.vc is not None:
            self.admin = aioredis.from_url(self.vc.owner_of(key).url)

    async def close(self) -> None:
        await self.client.aclose()
        if self.admin is not self.client:
            await self.admin.aclose()
        if self.proc is not None:
            self.proc.terminate()
            await self.proc.wait()
        if self.vc is not None:
            self.vc.stop()
        self.tmp.cleanup()


@dataclass(frozen=True, slots=True)
class _Loaded:
    load_s: float
    used_bytes: int
    """``used_memory`` growth over the load."""
    keys: int


async def _load_view(store: RedisViewStore, admin: Any, nodes: int, blocks_per_node: int, chain_len: int,
                     seed: int) -> tuple[list[int], _Loaded]:
    """``blocks_per_node`` random blocks on each node (random tiers), then a chain of ``chain_len``
    blocks all held by one node in HBM; the chain and what the load took."""
    mem0 = int((await admin.info("memory"))["used_memory"])
    rng = random.Random(seed)
    universe = [rng.getrandbits(64) for _ in range(max(blocks_per_node * 4, chain_len))]
    t0 = time.monotonic()
    batch = []
    for n in range(nodes):
        keys = rng.sample(universe, blocks_per_node)
        for i in range(0, blocks_per_node, 5000):
            batch.append((None, [AddBlocks(f"prefill-{n}", rng.choice((0, 0, 1, 2)), tuple(keys[i : i + 5000]))]))
    chain = universe[:chain_len]
    batch.append((None, [AddBlocks("prefill-0", 0, tuple(chain))]))
    await store.apply_groups(batch)
    load_s = time.monotonic() - t0
    used = int((await admin.info("memory"))["used_memory"]) - mem0
    return chain, _Loaded(load_s, used, await admin.dbsize())


async def _time_reads(name: str, fn: Callable[[], Awaitable[Any]], admin: Any, reads: int) -> dict[str, float]:
    """``reads`` timed calls of ``fn`` after one to warm it: latency p50/p99 (ms) and server time per read (us)."""
    await fn()  # load the script / warm the connection
    await admin.config_resetstat()
    lat = []
    for _ in range(reads):
        t1 = time.perf_counter()
        await fn()
        lat.append((time.perf_counter() - t1) * 1000)
    stats = await admin.info("commandstats")
    server_us = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_config") / reads
    return {
        f"{name}_ms_p50": round(percentile(lat, 50, empty=0.0), 3),
        f"{name}_ms_p99": round(percentile(lat, 99, empty=0.0), 3),
        f"{name}_server_us": round(server_us, 1),
    }
