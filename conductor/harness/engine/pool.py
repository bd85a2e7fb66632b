"""The shared KV pool: a Mooncake Store client for the emulated engine (``conductor[mooncake]``).

The paper's DRAM/SSD pool is Mooncake Store: a master process (``mooncake_master``) places
objects in memory segments that the clients mount, and clients ``put``/``get``/``remove``
objects by name over TCP (or RDMA). Here one object is one KV block, named by Conductor's
block key (:func:`object_key`, the same for every engine, so any engine reads back what
another put), holding synthetic bytes of the model's real block size (:func:`block_bytes`).

The ``mooncake`` package is imported only when :meth:`MooncakePool.connect` is called, so
nothing else needs the extra. It is the ``mooncake-transfer-engine-non-cuda`` wheel (the
plain ``mooncake-transfer-engine`` one is a CUDA build), which needs Debian's
``libibverbs1`` even over TCP.

What the view learns of the pool comes from the writers: :class:`PoolIndex` turns each
put and each read that found a block missing into KV events for the pool's ``store`` node
(``BlocksMigrated`` into it, ``BlocksRemoved`` naming it), published on the writer's own
stream (producer ``{engine}@{pool}``, so many engines can write one pool without mixing
their sequence numbers), and heartbeats the ``store`` node so routers count it live.

Facts of the 0.3.13 store this relies on: a full pool answers ``-200`` to ``put`` (the
master also evicts on its own above its high watermark, which a later ``get`` finds out);
objects carry a lease (10 s by default, ``-default_kv_lease_ttl``) during which
``remove`` is refused unless forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conductor.stats import percentile
from schemas import BlocksMigrated, BlocksRemoved, Envelope, Heartbeat, Tier, envelope
from schemas.errors import ConductorError

log = logging.getLogger(__name__)

POOL_NODE = "kv-pool"
"""The default node id of the shared pool in the view (role ``store``)."""
POOL_TIER: Tier = "dram"
FULL = -200
"""What ``put`` answers when the pool has no room."""


class PoolError(ConductorError):
    """The pool could not be reached or refused an operation."""


class PoolUnavailable(PoolError):
    """The ``mooncake`` package (or a library it needs) is not installed."""


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise PoolUnavailable("the Mooncake Store client is not installed: pip install 'conductor[mooncake]' "
                              "(and apt-get install libibverbs1)")
    return Path(spec.origin).parent


def master_binary() -> Path:
    """Where the wheel puts ``mooncake_master`` (inside the ``mooncake`` package)."""
    path = _package_dir() / "mooncake_master"
    if not path.exists():
        raise PoolUnavailable(f"no mooncake_master in {path.parent}")
    return path


def master_command(rpc_port: int, metrics_port: int, *, host: str = "127.0.0.1",
                   lease_ms: int | None = None) -> list[str]:
    """The command line of a master on ``host:rpc_port`` (its HTTP metrics on ``metrics_port``:
    the default, 9003, would clash between two masters on one machine)."""
    cmd = [str(master_binary()), f"-rpc_address={host}", f"-rpc_port={rpc_port}", f"-metrics_port={metrics_port}"]
    if lease_ms is not None:
        cmd.append(f"-default_kv_lease_ttl={lease_ms}")
    return cmd


def object_key(block_key: int, model: str = "default") -> str:
    """The pool's name for a block: the model and Conductor's block key (token-derived, so every
    engine names the same prefix the same way)."""
    return f"conductor/{model}/{block_key:016x}"


def block_bytes(block_key: int, size: int) -> bytes:
    """Synthetic contents of one block: ``size`` bytes derived from its key (cheap to make,
    different per block, checkable on read)."""
    unit = block_key.to_bytes(8, "big")
    return (unit * (size // 8 + 1))[:size]


@dataclass
class MooncakePool:
    """One client of a Mooncake Store. Its calls block (run them in a thread from async code)."""

    store: Any
    master: str
    block_size_bytes: int
    capacity_blocks: int
    """Blocks this client's segment adds to the pool (what its ``store`` heartbeats report)."""
    model: str = "default"

    @classmethod
    def connect(cls, master: str, *, block_size_bytes: int, segment_bytes: int, buffer_bytes: int | None = None,
                local_host: str = "127.0.0.1", model: str = "default") -> MooncakePool:
        """Join the pool whose master listens on ``master`` (``host:port``), mounting a segment of
        ``segment_bytes`` of this process's memory into it."""
        _package_dir()
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise PoolError(f"the master's address must be HOST:PORT, not {master!r}")
        try:  # the client retries an absent master for ever: ask first
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError as e:
            raise PoolError(f"no Mooncake master answers at {master} ({e})") from None
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # typically libibverbs.so.1 missing
            raise PoolUnavailable(f"the Mooncake Store client does not load ({e}); apt-get install libibverbs1") from e
        store = MooncakeDistributedStore()
        buffer = buffer_bytes if buffer_bytes is not None else max(16 << 20, 2 * block_size_bytes)
        rc = store.setup(local_host, "P2PHANDSHAKE", segment_bytes, buffer, "tcp", "", master)
        if rc != 0:
            raise PoolError(f"could not join the Mooncake Store whose master is {master} (setup returned {rc})")
        return cls(store, master, block_size_bytes, max(1, segment_bytes // block_size_bytes), model)

    def put_blocks(self, keys: Sequence[int]) -> tuple[list[int], bool]:
        """Write ``keys``' blocks in order; return the keys written and whether the pool was full
        (writing stops at the first refusal)."""
        done: list[int] = []
        for key in keys:
            rc = self.store.put(object_key(key, self.model), block_bytes(key, self.block_size_bytes))
            if rc == FULL:
                return done, True
            if rc != 0:
                raise PoolError(f"put of block {key:016x} failed ({rc})")
            done.append(key)
        return done, False

    def read_prefix(self, keys: Sequence[int]) -> int:
        """Read ``keys``' blocks back in order; return how many leading ones the pool had
        (whole and with their contents)."""
        for i, key in enumerate(keys):
            data = self.store.get(object_key(key, self.model))
            if len(data) != self.block_size_bytes or data[:8] != key.to_bytes(8, "big"):
                return i
        return len(keys)

    def holds(self, keys: Sequence[int]) -> list[bool]:
        if not keys:
            return []
        return [rc == 1 for rc in self.store.batch_is_exist([object_key(k, self.model) for k in keys])]

    def remove_blocks(self, keys: Sequence[int]) -> list[int]:
        """Remove ``keys`` (forced: a fresh object's lease would refuse it); return those removed."""
        if not keys:
            return []
        codes = self.store.batch_remove([object_key(k, self.model) for k in keys], force=True)
        return [k for k, rc in zip(keys, codes) if rc == 0]

    def close(self) -> None:
        self.store.close()


@dataclass
class PoolIndex:
    """The KV events and heartbeats that tell the view what one writer did to the pool."""

    engine_node: str
    pool_node: str = POOL_NODE
    epoch: int = 0
    capacity_blocks: int = 0
    heartbeat_s: float = 1.0
    seq: int = field(default=0)
    hb_seq: int = field(default=0)

    @property
    def producer_id(self) -> str:
        return f"{self.engine_node}@{self.pool_node}"

    def _env(self, body: Any, ts_ms: int) -> Envelope:
        env = envelope(body, producer_id=self.producer_id, producer_seq=self.seq, epoch=self.epoch, ts_ms=ts_ms)
        self.seq += 1
        return env

    def stored(self, keys: Sequence[int], from_tier: Tier, ts_ms: int) -> Envelope:
        """``keys`` copied from this engine's ``from_tier`` into the pool."""
        return self._env(BlocksMigrated(mode="replicate", block_keys=list(keys), from_node=self.engine_node,
                                        from_tier=from_tier, to_node=self.pool_node, to_tier=POOL_TIER), ts_ms)

    def moved(self, keys: Sequence[int], from_tier: Tier, ts_ms: int) -> Envelope:
        """``keys`` moved from this engine's ``from_tier`` into the pool (a demotion)."""
        return self._env(BlocksMigrated(mode="migrate", block_keys=list(keys), from_node=self.engine_node,
                                        from_tier=from_tier, to_node=self.pool_node, to_tier=POOL_TIER), ts_ms)

    def removed(self, keys: Sequence[int], ts_ms: int) -> Envelope:
        """``keys`` this writer removed from the pool (an ``evict`` of a cooled prefix)."""
        return self._env(BlocksRemoved(block_keys=list(keys), tier=POOL_TIER, node=self.pool_node), ts_ms)

    def missing(self, keys: Sequence[int], ts_ms: int) -> Envelope:
        """``keys`` the view placed in the pool that a read did not find (evicted by the master)."""
        return self._env(BlocksRemoved(block_keys=list(keys), tier=POOL_TIER, node=self.pool_node), ts_ms)

    def heartbeat(self, ts_ms: int) -> Envelope:
        """The pool node's heartbeat (the newest writer's epoch wins in the view)."""
        hb = Heartbeat(role="store", total_kv_blocks=self.capacity_blocks,
                       tier_capacity={POOL_TIER: self.capacity_blocks}, interval_s=self.heartbeat_s)
        env = envelope(hb, producer_id=self.pool_node, producer_seq=self.hb_seq, epoch=self.epoch, ts_ms=ts_ms)
        self.hb_seq += 1
        return env


def measure_latency(pool: MooncakePool, *, size: int, count: int) -> dict[str, float]:
    """Put ``count`` objects of ``size`` bytes, get them back, remove them: milliseconds per call."""
    base = time.time_ns() & 0xFFFF_FFFF_0000
    data = block_bytes(base, size)
    puts, gets = [], []
    names = [f"conductor/bench/{base + i:016x}" for i in range(count)]
    for name in names:
        t = time.perf_counter()
        rc = pool.store.put(name, data)
        puts.append(time.perf_counter() - t)
        if rc != 0:
            raise PoolError(f"bench put failed ({rc}): is the segment smaller than {count} x {size} bytes?")
    for name in names:
        t = time.perf_counter()
        got = pool.store.get(name)
        gets.append(time.perf_counter() - t)
        if len(got) != size:
            raise PoolError(f"bench get returned {len(got)} bytes, not {size}")
    pool.store.batch_remove(names, force=True)

    def pct(xs: list[float], p: float) -> float:
        return round(1000 * percentile(xs, p, empty=0.0), 3)

    return {"size_bytes": size, "count": count, "put_ms_p50": round(1000 * statistics.median(puts), 3),
            "put_ms_p99": pct(puts, 99), "get_ms_p50": round(1000 * statistics.median(gets), 3),
            "get_ms_p99": pct(gets, 99), "put_gb_per_s": round(size / statistics.median(puts) / 1e9, 3),
            "get_gb_per_s": round(size / statistics.median(gets) / 1e9, 3)}


@dataclass
class PoolLink:
    """An engine's use of the pool: real puts and gets (in a thread), and the events and
    heartbeats that index them (through ``sink``, onto ``kv-events`` / ``heartbeats``)."""

    client: MooncakePool
    index: PoolIndex
    events: Callable[[list[Envelope]], Awaitable[Any]] | None = None
    heartbeats: Callable[[list[Envelope]], Awaitable[Any]] | None = None
    clock_ms: Callable[[], int] = field(default=lambda: time.time_ns() // 1_000_000)
    counts: Counter[str] = field(default_factory=Counter)
    held: dict[int, None] = field(default_factory=dict)
    """Keys this engine put and has not found missing since (what its executor counts as in the
    pool), oldest first, at most ``4 x capacity_blocks`` of them."""

    @property
    def node(self) -> str:
        return self.index.pool_node

    async def offload(self, keys: Sequence[int], from_tier: Tier, *, move: bool = False) -> list[int]:
        """Put ``keys``' blocks; publish what landed (as moved from ``from_tier`` when ``move``)."""
        if not keys:
            return []
        done, full = await asyncio.to_thread(self.client.put_blocks, list(keys))
        self.counts["blocks_put"] += len(done)
        if full:
            self.counts["pool_full"] += 1
            log.warning("the KV pool is full: %d of %d blocks not written", len(keys) - len(done), len(keys))
        for k in done:
            self.held.pop(k, None)
            self.held[k] = None
        for k in list(self.held)[: max(0, len(self.held) - 4 * self.client.capacity_blocks)]:
            del self.held[k]
        if done and self.events is not None:
            now = self.clock_ms()
            await self.events([self.index.moved(done, from_tier, now) if move else self.index.stored(done, from_tier, now)])
        return done

    async def present(self, keys: Sequence[int]) -> set[int]:
        """Which of ``keys`` the pool holds now (asked of the store: whoever put them)."""
        if not keys:
            return set()
        there = await asyncio.to_thread(self.client.holds, list(keys))
        return {k for k, h in zip(keys, there) if h}

    async def remove(self, keys: Sequence[int]) -> list[int]:
        """Remove ``keys``' blocks from the pool (forced: a lease does not keep a cooled prefix);
        publish those removed as the pool node's."""
        if not keys:
            return []
        gone = await asyncio.to_thread(self.client.remove_blocks, list(keys))
        self.counts["blocks_removed"] += len(gone)
        for k in gone:
            self.held.pop(k, None)
        if gone and self.events is not None:
            await self.events([self.index.removed(gone, self.clock_ms())])
        return gone

    async def read(self, keys: Sequence[int]) -> int:
        """Read ``keys``' blocks back; return how many leading ones were there. Blocks the pool
        no longer has (the master evicts on its own) are published as removed from it."""
        if not keys:
            return 0
        n = await asyncio.to_thread(self.client.read_prefix, list(keys))
        self.counts["blocks_read"] += n
        if n < len(keys):
            rest = list(keys[n:])
            there = await asyncio.to_thread(self.client.holds, rest)
            gone = [k for k, h in zip(rest, there) if not h]
            for k in gone:
                self.held.pop(k, None)
            self.counts["blocks_missing"] += len(gone)
            if gone and self.events is not None:
                await self.events([self.index.missing(gone, self.clock_ms())])
        return n

    async def run_heartbeats(self) -> None:
        while True:
            if self.heartbeats is not None:
                try:
                    await self.heartbeats([self.index.heartbeat(self.clock_ms())])
                except Exception as e:  # noqa: BLE001  (a broker hiccup must not stop the engine)
                    log.warning("pool heartbeat not published: %s", e)
            await asyncio.sleep(self.index.heartbeat_s)

    def close(self) -> None:
        self.client.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalMaster:
    """A ``mooncake_master`` of this process's own on free loopback ports (tests, the benchmark,
    a demo); :meth:`stop` ends it."""

    def __init__(self, *, host: str = "127.0.0.1", lease_ms: int | None = None, log_path: Path | None = None) -> None:
        self.host = host
        self.lease_ms = lease_ms
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the master and wait until it accepts connections; return its ``host:port``."""
        port = _free_port(self.host)
        cmd = master_command(port, _free_port(self.host), host=self.host, lease_ms=self.lease_ms)
        with contextlib.ExitStack() as files:  # the child writes to its own copy of the descriptor
            out = files.enter_context(open(self.log_path, "wb")) if self.log_path is not None else subprocess.DEVNULL
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise PoolError(f"mooncake_master exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                socket.create_connection((self.host, port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise PoolError(f"mooncake_master did not listen on {self.host}:{port} within {timeout_s} s") from None
                time.sleep(0.05)
        self.address = f"{self.host}:{port}"
        return self.address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
