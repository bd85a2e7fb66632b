"""The simulator's path from KV events to what the policy sees: the production one.

Nodes publish :class:`schemas.Envelope` records exactly as engines do, into the
in-memory view (``state.memory``, which folds them with ``state.fold``):

* stored/removed blocks are delivered ``delay_ms`` after they were produced, so
  policies decide on a block index that lags the caches as a real one does;
* heartbeats carry a node's load (queue, batch, KV use) and are applied at once: the
  simulator reports a node's load whenever it changed before a decision, which stands
  for a heartbeat plus the router's reservations in production (where the load a
  heartbeat has not shown yet is reserved by the decisions that made it).

The router's own conversion (``conductor.routing.snapshot.build_cluster``) then turns
that view into the policy's snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from conductor.harness.sim.errors import SimulationError
from schemas import BlocksMigrated, BlocksRemoved, BlocksStored, Envelope, Heartbeat, Role, Tier, envelope
from schemas.records import Record
from state.memory import InMemoryViewStore
from state.view import ViewSnapshot

CLOCK_ORIGIN_MS = 1_000
"""The view timestamp of simulated time 0 (a heartbeat stamped 0 would read as "never")."""


def view_ms(now_s: float) -> int:
    """Simulated seconds as the view's clock."""
    return int(now_s * 1000.0) + CLOCK_ORIGIN_MS


class DelayedView:
    """An in-memory view fed by the simulated nodes' KV events after a propagation delay."""

    def __init__(self, delay_ms: float, block_size: int) -> None:
        self.delay_ms = delay_ms
        self.block_size = block_size
        self.store = InMemoryViewStore()
        self._seq: dict[str, int] = {}
        self._hb: dict[str, tuple[int, tuple[object, ...]]] = {}  # node → (heartbeat seq, what the last one said)
        self._pending: deque[tuple[float, Envelope]] = deque()
        self.published = 0
        self.applied = 0
        self.heartbeats = 0

    def _publish(self, node: str, body: Record, now_s: float) -> None:
        seq = self._seq.get(node, -1) + 1
        self._seq[node] = seq
        ts_ms = now_s * 1000.0
        env = envelope(body, producer_id=node, producer_seq=seq, ts_ms=view_ms(now_s), event_id=f"{node}:{seq}")
        # The delay is constant, so delivery order is production order: a FIFO suffices.
        self._pending.append((ts_ms + self.delay_ms, env))
        self.published += 1

    def heartbeat(self, node: str, role: Role, now_s: float, *, rack: str | None, total_kv_blocks: int,
                  zone: str | None = None,
                  free_kv_blocks: int | None = None, queue_depth: int = 0, queued_prefill_tokens: int = 0,
                  running_requests: int = 0, batch_size: int = 0, decode_context_tokens: int = 0) -> None:
        """Apply ``node``'s heartbeat (its load now) to the view, unless it says what the last one did."""
        free = total_kv_blocks if free_kv_blocks is None else free_kv_blocks
        said = (role, rack, zone, total_kv_blocks, free, queue_depth, queued_prefill_tokens, running_requests, batch_size,
                decode_context_tokens)
        seq, last = self._hb.get(node, (-1, None))
        if said == last:
            return
        seq += 1
        self._hb[node] = (seq, said)
        hb = Heartbeat(
            role=role, rack=rack, zone=zone, total_kv_blocks=total_kv_blocks, free_kv_blocks=free,
            queue_depth=queue_depth, queued_prefill_tokens=queued_prefill_tokens,
            running_requests=running_requests, batch_size=batch_size, decode_context_tokens=decode_context_tokens,
        )
        env = envelope(hb, producer_id=node, producer_seq=seq, ts_ms=view_ms(now_s), event_id=f"{node}:hb:{seq}")
        outcome = self.store.apply_sync(env)
        if outcome != "applied":
            raise SimulationError(f"the view did not apply {env!r}: {outcome}")
        self.heartbeats += 1

    def stored(self, node: str, tier: Tier, keys: Sequence[int], now_s: float) -> None:
        if keys:
            self._publish(node, BlocksStored(block_keys=list(keys), block_size=self.block_size, tier=tier), now_s)

    def removed(self, node: str, tier: Tier, keys: Sequence[int], now_s: float) -> None:
        if keys:
            self._publish(node, BlocksRemoved(block_keys=list(keys), tier=tier), now_s)

    def migrated(self, node: str, event: BlocksMigrated, now_s: float) -> None:
        """``node``'s proof that it carried out a KV command (see schemas/README.md)."""
        self._publish(node, event, now_s)

    def deliver(self, now_s: float) -> None:
        """Apply every record whose delivery time has come."""
        now_ms = now_s * 1000.0
        pending = self._pending
        apply = self.store.apply_sync
        while pending and pending[0][0] <= now_ms:
            _, env = pending.popleft()
            outcome = apply(env)
            if outcome != "applied":
                raise SimulationError(f"the view did not apply {env!r}: {outcome}")
            self.applied += 1

    def snapshot(self, chain: Sequence[int], now_s: float) -> ViewSnapshot:
        self.deliver(now_s)
        return self.store.snapshot_sync(chain, view_ms(now_s))
