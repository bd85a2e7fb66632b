"""The router's cluster picture kept from read to read, so a decision costs what changed.

:func:`~conductor.routing.snapshot.build_cluster` turns one view read into every live
instance, reservations added: work in proportion to the cluster, on every request. A
:class:`ClusterIndex` keeps that picture between reads and redoes only the nodes that moved
since the last one:

- nodes whose state the read hands out anew (the reader gives back the same ``NodeState``
  object for a node nothing was written to, so "changed" is an identity test);
- nodes with reservations made since (``touch``: this router's and the other replicas');
- nodes whose heartbeat has just aged past the TTL (a heap of deadlines), and nodes whose
  oldest counted reservation has just expired (the deadline ``pending_one`` returns).

Beside every live instance (its prefix empty) it keeps the prefill-capable ones in order of
queue wait and the decode-capable ones in order of decode load, which is what lets
``kvcache-centric`` look at the holders of the request's prefix and the few shortest queues
instead of at every instance (:class:`IndexView`, ``KvCacheCentric.decide``). Per request
:meth:`ClusterIndex.snapshot` adds the request's prefix holders, so the snapshot equals
``build_cluster`` of the same read and reservations, instance for instance
(``tests/property/test_cluster_index.py`` checks it over random sequences of reads).

Pure: no I/O and no clock (time is the read's ``now_ms``).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterable

from conductor.costmodel.costs import Costs, decode_load
from conductor.costmodel.profiles import ModelProfile
from conductor.routing.snapshot import (
    NO_PREFIX,
    ClusterSnapshot,
    IndexView,
    Instance,
    LazyInstances,
    PendingLoad,
    indexes_by,
    instance,
)
from state.view import NodeState, ViewSnapshot

PendingOne = Callable[[str, int, int], tuple["PendingLoad | None", "int | None"]]
"""``(node, since_ms, now_ms) -> (what is reserved on it after max(since, now - ttl), the
time at which that next changes without a new reservation or None)``:
``state.reservations.InMemoryReservations.pending_one``."""

OwnExtra = Callable[[NodeState, int], "PendingLoad | None"]
"""``(node's state, now_ms) -> what Conductor's own in-flight work adds to its heartbeat``:
:meth:`conductor.routing.own_load.OwnLoads.extra`, used instead of the reservations when given
(its changes come through :meth:`ClusterIndex.touch`)."""

Shape = tuple[int, int, int]
_Holders = tuple[dict[str, Shape], tuple[str, ...], tuple[Shape, ...], dict[Shape, tuple[int, ...]],
                 dict[str | None, tuple[int, ...]], frozenset[Shape]]
MEMO_SIZE = 1024
"""Prefix answers whose holders a :class:`ClusterIndex` remembers (as many as a reader's
:class:`state.keys.PrefixWalk` does)."""

_INF = float("inf")
PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")


class ClusterIndex:
    """Every live instance of one filter (model, excluded nodes), kept up to date read by read."""

    def __init__(self, profile: ModelProfile, *, block_size: int, ttl_s: float, model: str | None = None,
                 exclude: Collection[str] = ()) -> None:
        self.profile = profile
        self._costs = Costs(profile)
        """The policies' estimates (queue wait), so the waits kept here are the ones they compute."""
        self.block_size = block_size
        self.ttl_ms = ttl_s * 1000
        self.ttl_s = ttl_s
        self.model = model
        self.exclude = frozenset(exclude)
        self._nodes: tuple[NodeState, ...] | None = None
        self._now = 0
        self._state: dict[str, NodeState] = {}
        self._inst: dict[str, Instance] = {}  # live and eligible nodes only
        self._order: list[str] = []
        self._pos: dict[str, int] = {}
        self._rank: dict[str, int] = {}
        """node → its place among the live nodes in node-id order (for ties picked in that order)."""
        self._base: list[Instance] = []
        self._waits: list[tuple[float, str]] = []
        self._wait_of: dict[str, float] = {}
        self._loads: list[tuple[float, str, int, int, int]] = []
        self._load_ranks: list[int] = []  # beside _loads: each node's id rank
        self._load_room: list[float] = []  # beside _loads: free KV blocks, inf when the total is unknown
        self._by_rank: list[str] = []
        self._negative_contexts = 0
        """Decode entries whose context is below zero (never from a heartbeat; the band then
        cannot be read off the loads)."""
        self._load_of: dict[str, float] = {}
        self._both: set[str] = set()
        self._moved = 0
        """Counts live nodes seen changing rack or role (what the holders memo depends on
        beside the node order)."""
        self._deaths: list[tuple[int, str]] = []
        """(last heartbeat, node) of live nodes, oldest first: a node dies once now passes it by the TTL."""
        self._deadline: dict[str, int] = {}
        self._expiries: list[tuple[int, str]] = []
        """(time, node): when a node's counted reservations next change by expiring."""
        self._expiry: dict[str, int] = {}
        self._touched: set[str] = set()
        self._with_prefix: dict[tuple[str, tuple[int, int, int]], tuple[Instance, Instance]] = {}
        self._holders_memo: dict[int, tuple[dict[str, Shape], dict[str, int], int, _Holders]] = {}
        self.rebuilds = 0
        """Whole rebuilds so far (the first read, the node set changing, the clock going back)."""
        self.refreshed = 0
        """Single nodes redone so far."""

    def touch(self, nodes: Iterable[str]) -> None:
        """Nodes whose reservations changed; redone at the next :meth:`update`."""
        self._touched.update(nodes)

    def eligible(self, n: NodeState) -> bool:
        return (self.model is None or n.model == self.model or n.role == "store") and n.node_id not in self.exclude

    # --- keeping it up to date ------------------------------------------------------

    def update(self, view: ViewSnapshot, pending_one: PendingOne, own: OwnExtra | None = None) -> None:
        """Bring the index to ``view`` (and the reservations ``pending_one`` answers for; with
        ``own``, Conductor's own in-flight work instead, whose changed nodes the caller touches)."""
        if own is not None:
            pending_one = _own_as_pending(own, self._state)
        nodes, now = view.nodes, view.now_ms
        old = self._nodes
        if old is None or now < self._now or len(nodes) != len(old):
            self._rebuild(view, pending_one)
            return
        redo: set[str] = set(self._touched)
        self._touched.clear()
        if nodes is not old:
            for n, o in zip(nodes, old):
                if n is not o:
                    if n.node_id != o.node_id:  # the node set changed
                        self._rebuild(view, pending_one)
                        return
                    self._state[n.node_id] = n
                    redo.add(n.node_id)
            self._nodes = nodes
        self._now = now
        deaths, ttl_ms = self._deaths, self.ttl_ms
        while deaths and now - deaths[0][0] > ttl_ms:  # heartbeats aged past the TTL
            redo.add(heapq.heappop(deaths)[1])
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:  # a reservation expired
            redo.add(heapq.heappop(expiries)[1])
        order_moved = False
        for node in redo:
            st = self._state.get(node)
            if st is not None:
                order_moved |= self._redo(st, now, pending_one)
        if order_moved:
            self._reorder()

    def _rebuild(self, view: ViewSnapshot, pending_one: PendingOne) -> None:
        self.rebuilds += 1
        self._nodes, self._now = view.nodes, view.now_ms
        self._state.clear()  # in place: an ``own`` reader made in update holds this dict
        self._state.update((n.node_id, n) for n in view.nodes)
        self._inst.clear()
        self._waits.clear()
        self._wait_of.clear()
        self._loads.clear()
        self._load_ranks.clear()
        self._load_room.clear()
        self._negative_contexts = 0
        self._both.clear()
        self._load_of.clear()
        self._deaths.clear()
        self._deadline.clear()
        self._expiries.clear()
        self._expiry.clear()
        self._touched.clear()
        for n in view.nodes:
            self._redo(n, view.now_ms, pending_one)
        self._reorder()

    def _redo(self, st: NodeState, now: int, pending_one: PendingOne) -> bool:
        """Recompute one node; True when it joined or left the live set."""
        self.refreshed += 1
        node = st.node_id
        was = node in self._inst
        if not (st.is_live(now, self.ttl_s) and self.eligible(st)):
            if was:
                self._drop(node)
            return was
        hb = st.last_heartbeat_ms
        if self._deadline.get(node) != hb:  # one entry per heartbeat seen, checked against now
            self._deadline[node] = hb
            heapq.heappush(self._deaths, (hb, node))
        load, changes_at = pending_one(node, hb, now)
        if changes_at is not None and self._expiry.get(node) != changes_at:
            self._expiry[node] = changes_at
            heapq.heappush(self._expiries, (changes_at, node))
        inst = instance(st, NO_PREFIX, load)
        prev = self._inst.get(node)
        if prev == inst:
            return False
        if was:
            self._drop(node)
        self._inst[node] = inst
        if inst.role == "both":
            self._both.add(node)
        if prev is not None and (prev.rack != inst.rack or prev.role != inst.role):
            self._moved += 1
        if inst.role in PREFILL_ROLES:
            w = self._costs.queue_wait_s(inst)
            self._wait_of[node] = w
            bisect.insort(self._waits, (w, node))
        if inst.role in DECODE_ROLES:
            k = decode_load(self.profile, inst)
            self._load_of[node] = k
            entry = (k, node, inst.free_kv_blocks, inst.total_kv_blocks, inst.decode_context_tokens)
            at = bisect.bisect_left(self._loads, entry)
            self._loads.insert(at, entry)
            self._load_ranks.insert(at, self._rank.get(node, -1))  # a node joining: set by _reorder
            self._load_room.insert(at, inst.free_kv_blocks if inst.total_kv_blocks > 0 else _INF)
            self._negative_contexts += inst.decode_context_tokens < 0
        pos = self._pos.get(node)
        if pos is not None and was:
            self._base[pos] = inst
            return False
        return True

    def _drop(self, node: str) -> None:
        del self._inst[node]
        self._both.discard(node)
        w = self._wait_of.pop(node, None)
        if w is not None:
            del self._waits[bisect.bisect_left(self._waits, (w, node))]
        k = self._load_of.pop(node, None)
        if k is not None:
            at = bisect.bisect_left(self._loads, (k, node))  # (k, node) sorts just before its entry
            self._negative_contexts -= self._loads[at][4] < 0
            del self._loads[at]
            del self._load_ranks[at]
            del self._load_room[at]

    def _reorder(self) -> None:
        """The live instances in the read's node order (what ``build_cluster`` lists)."""
        assert self._nodes is not None
        inst = self._inst
        self._order = [n.node_id for n in self._nodes if n.node_id in inst]
        self._pos = {node: i for i, node in enumerate(self._order)}
        self._by_rank = sorted(self._order)
        rank = self._rank = {node: i for i, node in enumerate(self._by_rank)}
        self._load_ranks = [rank[e[1]] for e in self._loads]
        self._base = [inst[node] for node in self._order]

    # --- one request --------------------------------------------------------------------

    def snapshot(self, view: ViewSnapshot, age_ms: float = 0.0) -> ClusterSnapshot:
        """The policy's picture of ``view`` (after :meth:`update` with it): ``build_cluster``'s
        instances (made only if a policy asks for them), plus an :class:`IndexView`."""
        pos = self._pos
        prefix, order, shapes, groups, racks, prefill_shapes = self._holders_of(view.prefix)
        base = self._inst
        ix = IndexView(
            profile=self.profile,
            holders=tuple(map(base.__getitem__, order)),
            shapes=shapes,
            groups=groups,
            prefix=prefix,
            base=base,
            waits=self._waits,
            wait_of=self._wait_of,
            decode_loads=self._loads,
            decode_ranks=self._load_ranks,
            decode_room=self._load_room,
            by_rank=self._by_rank,
            prefill_count=len(self._waits),
            decode_count=len(self._loads),
            decode_negative_contexts=self._negative_contexts,
            with_prefix=self._holder,
            id_rank=self._rank,
            rack_holders=racks,
            prefill_shapes=prefill_shapes,
            both_count=len(self._both),
        )
        every = self._base

        def instances() -> tuple[Instance, ...]:
            insts = every.copy()
            for node, p in prefix.items():
                insts[pos[node]] = self._holder(node, p)
            return tuple(insts)

        return ClusterSnapshot(LazyInstances(instances), self.block_size, dict(view.watermark), age_ms,
                               index=ix)

    def _holders_of(self, found: dict[str, tuple[int, int, int]]) -> _Holders:
        """The live holders of a read's prefix answer, in node order: (node → prefix, the
        nodes, their prefixes, prefix → indexes of its holders, rack → indexes of its holders,
        the prefixes a prefill-capable holder has). Remembered per answer object while the node
        order stands and no live node changes rack or role: a reader's
        :class:`state.keys.PrefixWalk` hands out the same answer for a hot chain read again, so
        its holders are sorted once."""
        pos = self._pos
        memo = self._holders_memo
        hit = memo.pop(id(found), None)
        if hit is not None and hit[0] is found and hit[1] is pos and hit[2] == self._moved:
            memo[id(found)] = hit  # most recently used last
            return hit[3]
        prefix = {node: p for node, p in found.items() if node in pos and p != NO_PREFIX}
        order = sorted(prefix, key=pos.__getitem__)
        shapes = tuple(map(prefix.__getitem__, order))
        groups = indexes_by(shapes)
        base = self._inst
        racks = indexes_by(base[node].rack for node in order)
        prefill_shapes = frozenset(shape for shape, idx in groups.items()
                                   if any(base[order[i]].role in PREFILL_ROLES for i in idx))
        # Kept long: tuples of ints, which the garbage collector stops tracking (a full
        # collection then does not walk every remembered holder list).
        out = (prefix, tuple(order), shapes, {k: tuple(v) for k, v in groups.items()},
               {k: tuple(v) for k, v in racks.items()}, prefill_shapes)
        while len(memo) >= MEMO_SIZE:
            del memo[next(iter(memo))]  # the least recently used
        memo[id(found)] = (found, pos, self._moved, out)
        return out

    def _holder(self, node: str, prefix: tuple[int, int, int]) -> Instance:
        """``node``'s instance holding ``prefix`` of the chain."""
        base = self._inst[node]
        memo = self._with_prefix
        hit = memo.get((node, prefix))
        if hit is not None and hit[0] is base:
            return hit[1]
        if len(memo) > 65_536:
            memo.clear()
        inst = Instance(base.node_id, base.role, prefix, base.queued_prefill_tokens, base.queued_requests,
                        base.running_requests, base.batch_size, base.decode_context_tokens,
                        base.free_kv_blocks, base.total_kv_blocks, base.rack, base.zone, base.handoff, base.endpoint,
                        base.dp_rank, base.bootstrap_port, base.resident_blocks)
        memo[(node, prefix)] = (base, inst)
        return inst


def _own_as_pending(own: OwnExtra, state: dict[str, NodeState]) -> PendingOne:
    """``own`` in the form the index asks the reservations in: a node's extra over the state the
    index holds for it, changing only when the caller says so (no expiry of its own)."""

    def pending_one(node: str, since_ms: int, now_ms: int) -> tuple[PendingLoad | None, int | None]:
        st = state.get(node)
        return (None if st is None else own(st, now_ms)), None

    return pending_one
