"""``conductor bench pool``: put/get latency of the shared KV pool (Mooncake Store) through Conductor's client.

Mounts a segment large enough for ``count`` objects of ``size`` bytes, puts them one by one,
gets them back, removes them, and reports the p50/p99 milliseconds of each call; then the same
through a second client that mounts no memory (``remote_*``: the bytes cross the transfer
engine over TCP, as between two engines' processes).
"""

from __future__ import annotations

from conductor.harness.engine.pool import LocalMaster, MooncakePool, measure_latency


def run_pool_bench(master: str | None, *, size: int, count: int) -> dict[str, object]:
    """Time the pool at ``master`` (``HOST:PORT``; ``None``: a master of our own on loopback).
    Raises :class:`~conductor.harness.engine.pool.PoolError` when the pool cannot be used."""
    own = LocalMaster() if master is None else None
    try:
        address = own.start() if own is not None else master
        assert address is not None
        pool = MooncakePool.connect(address, block_size_bytes=size, segment_bytes=max(64 << 20, 2 * size * count))
        # A client that mounts no memory: its objects live in the first one's segment.
        remote = MooncakePool.connect(address, block_size_bytes=size, segment_bytes=0)
        try:
            out: dict[str, object] = {"bench": "pool", "master": address,
                                      **measure_latency(pool, size=size, count=count)}
            out.update({f"remote_{k}": v for k, v in measure_latency(remote, size=size, count=count).items()
                        if k not in ("size_bytes", "count")})
        finally:
            remote.close()
            pool.close()
    finally:
        if own is not None:
            own.stop()
    return out
