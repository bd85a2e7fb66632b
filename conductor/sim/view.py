"""The simulator's path from KV events to what the policy sees: the production one.

Nodes publish :class:`schemas.Envelope` records (stored/removed blocks, heartbeats)
exactly as engines do; each is delivered to the in-memory view (``state.memory``,
which folds it with ``state.fold``) ``delay_ms`` after it was produced, so policies
decide on a view that lags the caches as a real one does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from conductor.sim.errors import SimulationError
from schemas import BlocksRemoved, BlocksStored, Heartbeat, envelope
from state.memory import InMemoryViewStore
from state.view import ViewSnapshot

_TIERS = ("hbm", "dram", "ssd")


class DelayedView:
    """An in-memory view fed by the simulated nodes' KV events after a propagation delay."""

    def __init__(self, delay_ms: float, block_size: int) -> None:
        self.delay_ms = delay_ms
        self.block_size = block_size
        self.store = InMemoryViewStore()
        self._seq: dict[str, int] = {}
        self._pending: deque[tuple[float, object]] = deque()
        self.published = 0
        self.applied = 0

    def _publish(self, node: str, body: object, now_s: float) -> None:
        seq = self._seq.get(node, -1) + 1
        self._seq[node] = seq
        ts_ms = now_s * 1000.0
        env = envelope(body, producer_id=node, producer_seq=seq, ts_ms=int(ts_ms), event_id=f"{node}:{seq}")  # type: ignore[arg-type]
        # The delay is constant, so delivery order is production order: a FIFO suffices.
        self._pending.append((ts_ms + self.delay_ms, env))
        self.published += 1

    def heartbeat(self, node: str, role: str, now_s: float, *, rack: str | None, total_kv_blocks: int) -> None:
        hb = Heartbeat(role=role, rack=rack, total_kv_blocks=total_kv_blocks, free_kv_blocks=total_kv_blocks)  # type: ignore[arg-type]
        self._publish(node, hb, now_s)

    def stored(self, node: str, tier: str, keys: Sequence[int], now_s: float) -> None:
        if keys:
            self._publish(node, BlocksStored(block_keys=list(keys), block_size=self.block_size, tier=tier), now_s)  # type: ignore[arg-type]

    def removed(self, node: str, tier: str, keys: Sequence[int], now_s: float) -> None:
        if keys:
            self._publish(node, BlocksRemoved(block_keys=list(keys), tier=tier), now_s)  # type: ignore[arg-type]

    def deliver(self, now_s: float) -> None:
        """Apply every record whose delivery time has come."""
        now_ms = now_s * 1000.0
        pending = self._pending
        apply = self.store.apply_sync
        while pending and pending[0][0] <= now_ms:
            _, env = pending.popleft()
            outcome = apply(env)  # type: ignore[arg-type]
            if outcome != "applied":
                raise SimulationError(f"the view did not apply {env!r}: {outcome}")
            self.applied += 1

    def snapshot(self, chain: Sequence[int], now_s: float) -> ViewSnapshot:
        self.deliver(now_s)
        return self.store.snapshot_sync(chain, int(now_s * 1000.0))
