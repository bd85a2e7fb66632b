"""What a router knows at decision time that the view does not show yet (issue 34).

A :class:`DecisionTime` holds, for one :class:`~conductor.routing.router.Router`:

- the **pending blocks** (:mod:`state.pending`): each placement's chain on its instances, read
  back as reusable by the decisions that follow, before the engine's KV events say so;
- the **in-flight ledger** (:mod:`state.inflight`) as the picture counts it
  (:class:`~conductor.routing.own_load.OwnLoads`): each placement's uncached tokens and decoding
  sequence, released at the first token and at the end;
- the **sessions**: a session key -> the instance it was placed on last, by this router or by
  any other that shares the pending blocks' log (a conversation's turns may reach different
  gateway processes);
- the **decision clock**: a decision never reads before the one it follows.

Its interface is what the router calls in the step between a view read and the decision's
record (no await in between, so the next decision, whichever router makes it, sees this one):
:meth:`DecisionTime.at_decision` (the read as the decision sees it), :meth:`DecisionTime.record`
(what a placement holds), :meth:`DecisionTime.fields` (what its record says about both), and
:meth:`DecisionTime.end` (a request's work and blocks released). Without stores (the simulator,
the tests that pass none) every call is the identity or a no-op.

**Confirmation on read.** The router reads the view for every decision, so that is where a
pending block meets the engine's own report: each instance's HBM prefix of the chain that the
view now shows ends the placements pending for those blocks there (``confirm_held``; nothing
is published: every router reads the view itself). From then on the view alone answers for
them, so an eviction the engine reports later is believed at once instead of a TTL later.

**Copies of a pending prefix.** A pending block is counted as in its instance's HBM for that
instance's own reuse (a request that follows queues behind the one placing it), but another
instance cannot copy it before the holder's prefill has made it: the picture carries, for each
instance that pending blocks extend, the prefix other instances may copy (what the view
confirms; :attr:`~conductor.routing.snapshot.ClusterSnapshot.copyable`); ``kvcache-centric``
copies the rest only after the holder's queue wait (``prefill_plan.PendingCopy``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conductor.routing.own_load import OwnLoads
from conductor.routing.snapshot import NO_PREFIX, Shape
from conductor.settings import Settings
from conductor.topology import Topology
from schemas import RoutingDecision, RoutingRequest
from state.inflight import InflightLedger, InMemoryInflight
from state.pending import InMemoryPendingBlocks, PendingStore
from state.shared_log import EventSeq, RedisInflight, RedisPendingBlocks, SharedLog
from state.view import NodeState, ViewSnapshot

MAX_SESSIONS = 100_000
"""Sessions a router remembers the instance of (the least recently decided forgotten first)."""


def releases_its_work(req: RoutingRequest) -> bool:
    """Whether a decision for ``req`` is charged to the in-flight ledger: only when someone will
    release the charge at its first token and end (a gateway: decided where it arrived, or through
    the log saying so). Another producer's request would hold its charge for the whole lease; its
    work shows in the engines' heartbeats instead."""
    return req.releases or req.decided_by is not None


def kv_event_capacity(node: NodeState, default_blocks: int) -> int | None:
    """The pending store's capacity for ``node`` (``PendingStore.set_capacity``): None when it
    publishes KV events (the view knows its cache from them), else its cache size in blocks: its
    heartbeats' total KV blocks, or ``default_blocks`` (``pending_lru_blocks``) when they say none.

    The hook for engines without KV events: a node says so through its state's ``kv_events``
    (False), which the bridge's ``--no-events`` mode sets; None (older heartbeats) publishes them."""
    if node.publishes_kv_events:
        return None
    return node.total_kv_blocks if node.total_kv_blocks > 0 else default_blocks


@dataclass(frozen=True, slots=True)
class Seen:
    """A view read as a decision sees it."""

    snap: ViewSnapshot
    """The read, each instance's prefix of the chain extended by its pending blocks."""
    at_ms: int
    """The decision's time on the view's clock (``view_now_ms``)."""
    copyable: dict[str, Shape] | None = None
    """Per instance whose prefix pending blocks extended: the prefix another instance may copy
    from it (what the view confirms); None: no pending block extended any."""


def _local_pending(store: PendingStore | None) -> InMemoryPendingBlocks | None:
    """The in-process record behind ``store`` (a shared one keeps a copy of the log)."""
    if isinstance(store, RedisPendingBlocks):
        return store.local
    return store if isinstance(store, InMemoryPendingBlocks) else None


def _pending_ttl_ms(store: PendingStore | None, settings: Settings) -> int:
    """The TTL ``store`` counts placements for (the settings' for a store that does not say)."""
    local = _local_pending(store)
    return local.ttl_ms if local is not None else max(int(settings.pending_ttl_s * 1000), 1)


def _lease_ms(ledger: InflightLedger | None, settings: Settings) -> int:
    """The lease ``ledger`` ends unreleased charges after (the settings' for one that does not say)."""
    if isinstance(ledger, InMemoryInflight):
        return ledger.lease_ms
    if isinstance(ledger, RedisInflight):
        return ledger.local.lease_ms
    return max(int(settings.inflight_lease_s * 1000), 1)


class DecisionTime:
    """One router's decision-time stores and the rules it reads and writes them by. ``pending``
    and ``inflight`` None: decide as before (view and heartbeats plus reservations)."""

    def __init__(self, settings: Settings, topology: Topology | None, pending: PendingStore | None = None,
                 inflight: InflightLedger | None = None,
                 sessions: OrderedDict[str, str] | None = None) -> None:
        self.settings = settings
        self.pending = pending
        self.inflight = inflight
        self.own: OwnLoads | None = (
            None if inflight is None else
            OwnLoads(inflight, topology.grouping if topology is not None else None))
        """The ledger as the picture reads it (None: heartbeats plus reservations)."""
        self.pending_ttl_ms = _pending_ttl_ms(pending, settings)
        self.inflight_lease_ms = _lease_ms(inflight, settings)
        self.sessions: OrderedDict[str, str] = sessions if sessions is not None else OrderedDict()
        """Session key -> the prefill instance the session was placed on last (this router's
        decisions and, with shared pending blocks, every other router's, gateway's and picker's
        on the log; the least recently placed forgotten past :data:`MAX_SESSIONS`)."""
        self._session_at: dict[str, int] = {}
        """When each session was placed last (view's clock): an older placement read late loses."""
        if isinstance(pending, RedisPendingBlocks):
            pending.on_session = self._place_session
        self._decided_ms = 0
        self._capacity: dict[str, int | None] = {}
        """Capacity given to the pending store per node (only changes are passed on)."""
        self._capacity_nodes: Sequence[NodeState] | None = None
        shared = [store.log for store in (pending, inflight) if isinstance(store, RedisPendingBlocks | RedisInflight)]
        self._shared: list[SharedLog] = shared
        """The shared streams' ends of the stores (none: in-memory stores, nothing to number)."""
        self.events: EventSeq | None = shared[0].events if shared else None
        """This router's numbering of what it shares (both stores share one: ``decision_time_stores``)."""
        if len(shared) == 2 and shared[1].events is not shared[0].events:
            shared[1].events = shared[0].events  # one event per decision across both streams

    @property
    def active(self) -> bool:
        """Whether decisions read and write decision-time stores at all."""
        return self.pending is not None or self.inflight is not None

    @property
    def last_ms(self) -> int:
        """The last decision's time on the view's clock (0 before the first)."""
        return self._decided_ms

    def session_of(self, key: str | None) -> str | None:
        """The instance the session ``key`` was placed on last (None: no key, or not known here)."""
        return self.sessions.get(key) if key is not None else None

    # --- one decision ------------------------------------------------------------------------

    def at_decision(self, snap: ViewSnapshot, chain: Sequence[int], age_ms: float = 0.0,
                    degraded: bool = False) -> Seen:
        """The read as the decision sees it. Without stores, the read and its time. With them, the
        time is never before the previous decision's (reads overlap, so one may come back stamped a
        millisecond before the decision it follows: it is then taken as made at that decision's
        time); the pending blocks the view now shows are confirmed; and each instance's prefix of
        ``chain`` is extended by the blocks pending on it (counted as HBM: as confirmed, for the
        store's TTL at most), with what the view confirms kept as the prefix others may copy.
        Nodes without KV events get their capacity set from their heartbeats first."""
        at = snap.now_ms + int(age_ms)
        if not self.active:
            return Seen(snap, at)
        if at < self._decided_ms and not degraded:
            snap = ViewSnapshot(self._decided_ms, snap.nodes, snap.prefix, snap.watermark)
            at = self._decided_ms
        self._decided_ms = max(self._decided_ms, at)
        pending = self.pending
        if pending is None or not chain:
            return Seen(snap, at)
        self._set_capacities(pending, snap.nodes)
        held = {node: p[0] for node, p in snap.prefix.items() if p[0] > 0}
        local = _local_pending(pending)
        if held and local is not None:
            local.confirm_held(chain, held, at)
        extra = pending.prefixes(chain, at, held)
        if not extra:
            return Seen(snap, at)
        prefix = dict(snap.prefix)  # the read's answer may be shared (a reader's PrefixWalk)
        copyable: dict[str, Shape] = {}
        for node, pp in extra.items():
            confirmed = prefix.get(node, NO_PREFIX)
            hbm, dram, ssd = confirmed
            n = pp.length
            prefix[node] = (max(hbm, n), max(dram, n), max(ssd, n))
            copyable[node] = confirmed
        # In node order: holders of equal cost are tried in the prefix's order, and a set's order
        # (the pending store's, or a reader's) differs from process to process, so a live decision
        # and its re-derivation in `explain` would break a tie differently.
        prefix = {node: prefix[node] for node in sorted(prefix)}
        return Seen(ViewSnapshot(snap.now_ms, snap.nodes, prefix, snap.watermark), at,
                    {node: copyable[node] for node in sorted(copyable)})

    def record(self, req: RoutingRequest, chain: Sequence[int], d: RoutingDecision, at_ms: int) -> None:
        """What ``d`` places, at once: the session's instance; the chain's full blocks pending on
        its prefill instance (and, disaggregated, its decode instance, after the pull); its
        uncached prompt tokens and one decoding sequence charged to the ledger."""
        if req.session is not None:
            self._place_session(req.session, d.prefill_instance, at_ms)
        with self._event():  # the number fields() wrote on ``d`` (no other event in between)
            if req.session is not None and isinstance(self.pending, RedisPendingBlocks):
                self.pending.share_session(req.session, d.prefill_instance, at_ms)
            if self.pending is not None and chain:
                self.pending.record(d.request_id, {d.prefill_instance: chain, d.decode_instance: chain}, at_ms)
            if self.inflight is not None and releases_its_work(req):
                self.inflight.charge(d.request_id, d.prefill_instance, d.decode_instance,
                                     req.prompt_tokens - d.reused_tokens, req.prompt_tokens, at_ms)

    def fields(self) -> dict[str, Any]:
        """What a placement's record says about how it counted pending blocks and loads: the TTL
        and the lease, and, shared, what the router had applied of each stream (its cut) and the
        number its own operations will carry (:meth:`record` is called next, with no event between)."""
        out: dict[str, Any] = {}
        if self.pending is not None:
            out["pending_ttl_ms"] = self.pending_ttl_ms
            if isinstance(self.pending, RedisPendingBlocks):
                out["seen_pending"] = self.pending.log.cut()
        if self.inflight is not None:
            out["inflight_lease_ms"] = self.inflight_lease_ms
            if isinstance(self.inflight, RedisInflight):
                out["seen_inflight"] = self.inflight.log.cut()
        if self.events is not None:
            out["event"] = self.events.last + 1
            out["event_producer"] = self._shared[0].producer_id
        return out

    @property
    def producer_id(self) -> str | None:
        """This router's id on the shared streams (None: nothing shared)."""
        return self._shared[0].producer_id if self._shared else None

    def _place_session(self, key: str, node: str, at_ms: int) -> None:
        """``key`` was placed on ``node`` at ``at_ms`` (here, or by another router read from the
        log): remembered unless a later placement of it is known already."""
        if at_ms < self._session_at.get(key, at_ms):
            return
        self._session_at[key] = at_ms
        self.sessions[key] = node
        self.sessions.move_to_end(key)
        while len(self.sessions) > MAX_SESSIONS:
            old, _ = self.sessions.popitem(last=False)
            self._session_at.pop(old, None)

    def _event(self) -> contextlib.AbstractContextManager[int | None]:
        return self.events.event() if self.events is not None else contextlib.nullcontext(None)

    def first_token(self, request_id: str, at_ms: int) -> int | None:
        """``request_id``'s first token came back at ``at_ms``: its prefill work ends. Returns the
        release's event number when it is shared (None: not)."""
        if self.inflight is None:
            return None
        with self._event() as event:
            self.inflight.first_token(request_id, at_ms)
        return event

    def end(self, request_id: str, at_ms: int, failed: bool) -> int | None:
        """``request_id`` ended at ``at_ms``: its in-flight work ends, and, ``failed`` (an error, a
        cancel, or a decision never served), its pending blocks too (its engine will not hold
        them). Idempotent; an unknown request is a no-op. Returns the release's event number when
        it is shared (None: not)."""
        with self._event() as event:
            if self.inflight is not None:
                self.inflight.finish(request_id, at_ms)
            if failed and self.pending is not None:
                self.pending.release(request_id, at_ms)
        return event

    # --- life ---------------------------------------------------------------------------------

    async def start(self, now_ms: int) -> None:
        """Start following the shared pending blocks and ledger (a no-op for in-memory ones)."""
        if isinstance(self.pending, RedisPendingBlocks):
            await self.pending.start(now_ms)
        if isinstance(self.inflight, RedisInflight):
            await self.inflight.start(now_ms)

    async def close(self) -> None:
        """Share the last pending blocks and charges, and stop following."""
        if isinstance(self.pending, RedisPendingBlocks):
            await self.pending.close()
        if isinstance(self.inflight, RedisInflight):
            await self.inflight.close()

    def _set_capacities(self, pending: PendingStore, nodes: Sequence[NodeState]) -> None:
        """Tell the pending store which nodes publish no KV events, with their cache size."""
        if nodes is self._capacity_nodes:
            return
        self._capacity_nodes = nodes
        known = self._capacity
        for n in nodes:
            cap = kv_event_capacity(n, self.settings.pending_lru_blocks)
            if known.get(n.node_id, None) != cap or n.node_id not in known:
                known[n.node_id] = cap
                pending.set_capacity(n.node_id, cap)


__all__ = ["MAX_SESSIONS", "DecisionTime", "Seen", "kv_event_capacity", "releases_its_work"]
