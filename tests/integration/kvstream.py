"""Helpers shared by the integration tests: a random KV-event stream, a catch-up wait, a topic reader."""

from __future__ import annotations

import asyncio
import time

from conductor.harness.chaos import TruthEngines
from schemas import decode
from streams.kafka import consumer


class KvStream(TruthEngines):
    """Engines storing random blocks and evicting their oldest, each node's sequence in order
    (nodes ``n0``, ``n1``...; a fixed stamp, so runs are byte for byte the same).

    Every ``take`` goes on where the last one stopped, so a stream can be published in parts.
    """

    def __init__(self, seed: int, *, nodes: int = 4, max_store: int = 40, max_remove: int = 20) -> None:
        super().__init__(seed, nodes=nodes, max_store=max_store, max_remove=max_remove, node_prefix="n",
                         clock_ms=lambda: 1)


async def caught_up(store, worker, sent: int, timeout_s: float = 90) -> None:
    """Wait until the view's fences cover ``sent`` records (offsets from 0 per partition)."""
    deadline = time.monotonic() + timeout_s
    while True:
        wm = await store.watermark()
        if sum(wm.values()) + len(wm) >= sent:
            return
        assert worker.poll() is None, "the worker died"
        assert time.monotonic() < deadline, f"not caught up: {wm}"
        await asyncio.sleep(0.05)


async def read_all(settings, topic: str, want: int = 1, wait_s: float = 10.0) -> list:  # type: ignore[no-untyped-def,type-arg]
    """The bodies of ``topic`` from its start, until ``want`` of them or ``wait_s``."""
    cons = consumer(settings.kafka(), topic, group_id=None, fetch_max_wait_ms=50)
    await cons.start()
    out: list = []  # type: ignore[type-arg]
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(out) < want:
            for recs in (await cons.getmany(timeout_ms=200)).values():
                out += [decode(r.value).body for r in recs]
    finally:
        await cons.stop()
    return out
