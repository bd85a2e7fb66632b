"""Test helpers shared by the pipeline tests: a random KV-event stream and a catch-up wait."""

from __future__ import annotations

import asyncio
import random
import time

from schemas import BlocksRemoved, BlocksStored, Envelope, envelope


class KvStream:
    """Engines storing random blocks and evicting their oldest, each node's sequence in order.

    Every ``take`` goes on where the last one stopped, so a stream can be published in parts.
    """

    def __init__(self, seed: int, *, nodes: int = 4, max_store: int = 40, max_remove: int = 20) -> None:
        self.rng = random.Random(seed)
        self.held: dict[str, list[int]] = {f"n{i}": [] for i in range(nodes)}
        self.seq = dict.fromkeys(self.held, 0)
        self.max_store, self.max_remove = max_store, max_remove

    def take(self, n: int) -> list[Envelope]:
        rng, out = self.rng, []
        for _ in range(n):
            node = rng.choice(sorted(self.held))
            held = self.held[node]
            if held and rng.random() < 0.3:
                body = BlocksRemoved(block_keys=[held.pop(0) for _ in range(min(len(held), rng.randint(1, self.max_remove)))])
            else:
                keys = [rng.getrandbits(63) for _ in range(rng.randint(1, self.max_store))]
                held += keys
                body = BlocksStored(block_keys=keys)
            out.append(envelope(body, producer_id=node, producer_seq=self.seq[node], ts_ms=1))
            self.seq[node] += 1
        return out


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
