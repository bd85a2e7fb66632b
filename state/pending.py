"""Pending blocks: what a decision just placed, known to every router before the engine says so.

A decision records, at once, the block hashes its prefill instance will hold (and, for a
disaggregated placement, the decode instance after the pull). Later decisions count a pending
block as reusable on that instance exactly as a confirmed one (the trust is the caller's to
state; this store only says what is pending). A pending block ends

- when the engine's own KV events confirm it (:meth:`InMemoryPendingBlocks.confirm`): from then
  on the view answers for it;
- when its request fails or is cancelled (``release``);
- ``ttl`` after the decision.

**The rule, and why it replays exactly.** Everything is a time-stamped operation (``Placed``,
``Released``, ``Confirmed``; times on the view's clock, passed in, never read here). A
placement of block ``b`` on node ``n`` at ``t0`` is pending at ``now`` iff
``t0 <= now < t0 + ttl``, no release of its request at ``tr`` with ``t0 <= tr <= now``, and
no confirmation of ``(n, b)`` at ``tc`` with ``t0 <= tc <= now``. That is a function of the
*set* of operations and ``now``, not of the order they arrived in, so two routers that got
the same operations agree, and ``explain`` re-derives the pending set from the log
(:func:`pending_from_log`). Because a pending block counts the same as a confirmed one, the
reuse a decision sees is ``confirmed ∪ pending`` and the moment a confirmation lands changes
nothing while the engine still holds the block: the only effect of confirming is that an
eviction the engine reports afterwards is believed at once, instead of ``ttl`` later. A
re-derivation given no confirmations can therefore differ only for a block evicted within
``ttl`` of being placed.

**Engines without KV events** (``set_capacity``): no confirmation will ever come, so a
placement that outlives its ``ttl`` unreleased *settles* into the instance's own record, an
LRU of ``capacity`` blocks (settling in time order, ``(t0, request, node, position)``: a block
placed again moves to the front; the least recently placed leave when full). That record is
the only reuse knowledge for such an instance; :meth:`~InMemoryPendingBlocks.prefixes`
answers from it and the pending placements together.

A query costs in proportion to the prompt and the instances holding its first blocks, not to
the cluster: the store indexes block -> instance -> placements.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

NEVER = 1 << 62
"""A time after every real one (an entry not released / not confirmed)."""


@dataclass(frozen=True, slots=True)
class Placed:
    """``node`` will hold ``blocks`` (a chain, in order) because of ``request_id``, decided at ``at_ms``."""

    request_id: str
    at_ms: int
    node: str
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Released:
    """``request_id`` failed or was cancelled at ``at_ms``: its placements made at or before then end."""

    request_id: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The engine of ``node`` reported ``blocks`` stored; seen at ``at_ms`` on the view's clock."""

    node: str
    at_ms: int
    blocks: tuple[int, ...]


PendingOp = Placed | Released | Confirmed


@dataclass(frozen=True, slots=True)
class PendingPrefix:
    """One instance's reusable prefix of a chain, counting its pending blocks: ``chain[:length]``,
    of which ``chain[start:length]`` are pending (or, for an instance without KV events, in
    its own record) and ``chain[:start]`` what the caller said was confirmed."""

    start: int
    length: int

    @property
    def pending(self) -> int:
        """How many blocks the pending record adds to the confirmed prefix."""
        return self.length - self.start


class PendingStore(Protocol):
    """The pending record a router reads and writes: in memory (:class:`InMemoryPendingBlocks`)
    or shared through Redis (:class:`state.shared_log.RedisPendingBlocks`). No call waits on I/O."""

    def record(self, request_id: str, placements: Mapping[str, Sequence[int]], at_ms: int) -> Any:
        """A decision made at ``at_ms`` places, on each node, the chain it will hold."""
        ...

    def release(self, request_id: str, at_ms: int) -> None:
        """``request_id`` failed or was cancelled at ``at_ms`` (idempotent; unknown: a no-op)."""
        ...

    def confirm(self, node: str, blocks: Sequence[int], at_ms: int) -> None:
        """The engine of ``node`` reported ``blocks`` stored, seen at ``at_ms``."""
        ...

    def set_capacity(self, node: str, blocks: int | None) -> None:
        """``node`` publishes no KV events and caches ``blocks`` blocks (None: it does publish)."""
        ...

    def prefixes(self, chain: Sequence[int], now_ms: int,
                 held: Mapping[str, int] | None = None) -> dict[str, PendingPrefix]:
        """Per instance, the prefix of ``chain`` reusable with its pending blocks counted."""
        ...

    def holds(self, node: str, block: int, now_ms: int) -> bool:
        """Whether ``block`` is pending on ``node`` (or in its LRU record) at ``now_ms``."""
        ...


@dataclass(slots=True, eq=False)
class _Group:
    """One ``Placed`` operation; ``released_at``: its earliest matching release; ``confirmed``:
    block -> its earliest matching confirmation (None: none yet, the common case)."""

    op: Placed
    released_at: int = NEVER
    confirmed: dict[int, int] | None = None


_NONE: dict[int, _Group] = {}
"""An empty placement map (read only) for a block with none."""


class InMemoryPendingBlocks:
    """The pending record of one process (tests, the simulator, explain, and each router's copy
    of the shared log). ``now`` passed to queries should not go backwards: expired placements
    are dropped (and settled into the LRU records) when a later time is seen.

    A query finds the instances a chain may start on from the placements' first blocks (block
    hashes are chained, each covering its parent, so a chain's first block is the first block
    of every placement that holds it) and from ``held``; then it walks each one's placements."""

    def __init__(self, ttl_ms: int, capacity: Mapping[str, int] | None = None) -> None:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        self.ttl_ms = ttl_ms
        self._now = -NEVER
        self._groups: dict[tuple[str, str, int], _Group] = {}
        self._by_request: dict[str, set[tuple[str, str, int]]] = {}
        self._on: dict[str, dict[int, dict[int, _Group]]] = {}
        """node -> block -> the placements on it holding the block, in the order they were placed
        (keyed by ``id``: an expired one leaves in O(1); a list made each expiry a scan of every
        placement on a shared prefix, quadratic in the cluster's rate)."""
        self._starts: dict[int, dict[str, int]] = {}
        """first block of a placement -> node -> how many placements there start with it."""
        self._expiry: list[tuple[int, str, str, tuple[str, str, int]]] = []
        # releases and confirmations kept 2 x ttl for placements that arrive after them (another
        # replica's record reaching this one late)
        self._releases: dict[str, list[int]] = {}
        self._confirms: dict[tuple[str, int], list[int]] = {}
        self._marks: deque[tuple[int, str, Any]] = deque()
        self._done: set[tuple[str, str, int]] = set()
        """Placements expired in the last ``2 x ttl`` (a repeat of one stays a no-op)."""
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._lru_holders: dict[int, set[str]] = {}
        for node, cap in (capacity or {}).items():
            self.set_capacity(node, cap)

    # --- writing --------------------------------------------------------------------------

    def record(self, request_id: str, placements: Mapping[str, Sequence[int]], at_ms: int) -> list[Placed]:
        """Record a decision's placements (node -> the chain it will hold, from the chain's first
        block or from where the view's confirmed prefix ends) made at ``at_ms``; returns the
        operations applied (what a shared store publishes)."""
        ops = [Placed(request_id, at_ms, node, tuple(blocks)) for node, blocks in placements.items() if blocks]
        for op in ops:
            self.apply(op)
        return ops

    def release(self, request_id: str, at_ms: int) -> None:
        """``request_id`` failed or was cancelled: its placements up to ``at_ms`` end (idempotent;
        an unknown request is a no-op)."""
        self.apply(Released(request_id, at_ms))

    def confirm(self, node: str, blocks: Sequence[int], at_ms: int) -> None:
        """The engine of ``node`` reported ``blocks`` stored (seen at ``at_ms``): their pending
        placements made at or before then end. Ignored for an instance without KV events."""
        self.apply(Confirmed(node, at_ms, tuple(blocks)))

    def confirm_held(self, chain: Sequence[int], held: Mapping[str, int], at_ms: int) -> list[Confirmed]:
        """What a view read shows, applied: per instance in ``held``, the first ``held[node]``
        blocks of ``chain`` are in its cache (seen at ``at_ms``), so its placements pending for
        them end (:meth:`confirm`). Only blocks some counting placement still waits for are
        confirmed, so a read that shows nothing new writes nothing. Returns the operations applied
        (empty for instances without KV events, or without placements)."""
        out: list[Confirmed] = []
        on_nodes = self._on
        if not on_nodes:
            return out
        if at_ms > self._now:
            self.expire(at_ms)
        for node in sorted(held):
            on = on_nodes.get(node)
            if not on or node in self._capacity:
                continue
            new = []
            for b in chain[:held[node]]:
                for g in on.get(b, _NONE).values():
                    if self._counts(g, b, at_ms, True):
                        new.append(b)
                        break
            if new:
                op = Confirmed(node, at_ms, tuple(new))
                self._confirm(op)
                out.append(op)
        return out

    def apply(self, op: PendingOp) -> None:
        """Apply one operation, whatever order operations come in (a repeat is a no-op)."""
        if isinstance(op, Placed):
            self._place(op)
        elif isinstance(op, Released):
            self._release(op)
        else:
            self._confirm(op)

    def set_capacity(self, node: str, blocks: int | None) -> None:
        """Mark ``node`` as an engine without KV events whose cache holds ``blocks`` blocks (its
        record is trimmed to that); None: it publishes events again (its record is dropped)."""
        if blocks is None:
            self._capacity.pop(node, None)
            for b in self._lru.pop(node, OrderedDict()):
                self._drop_holder(b, node)
            return
        if blocks < 0:
            raise ValueError("capacity must be >= 0 blocks")
        self._capacity[node] = blocks
        self._trim(node)

    # --- reading --------------------------------------------------------------------------

    def prefixes(self, chain: Sequence[int], now_ms: int,
                 held: Mapping[str, int] | None = None) -> dict[str, PendingPrefix]:
        """Per instance whose reusable prefix of ``chain`` the pending record extends: that
        prefix. ``held``: per instance, the prefix the view confirms (its blocks count as held;
        the pending walk continues from there). Instances the record adds nothing to are absent."""
        if now_ms > self._now:
            self.expire(now_ms)
        out: dict[str, PendingPrefix] = {}
        n = len(chain)
        if not n:
            return out
        first = chain[0]
        candidates = set(self._starts.get(first, ()))
        candidates.update(self._lru_holders.get(first, ()))
        chain = tuple(chain)  # compared with placements' tuples slice by slice
        if held:
            candidates.difference_update(held)  # their walk starts where the view's prefix ends
            candidates.update(node for node, h in held.items() if h < n)
        else:
            held = {}
        for node in sorted(candidates):  # one order in every process (a set's is not)
            start = min(max(held.get(node, 0), 0), n)
            end = self._walk(node, chain, start, now_ms)
            if end > start:
                out[node] = PendingPrefix(start, end)
        return out

    def holds(self, node: str, block: int, now_ms: int) -> bool:
        """Whether ``block`` is pending on ``node`` at ``now_ms`` (or in its LRU record)."""
        if now_ms > self._now:
            self.expire(now_ms)
        lru = self._lru.get(node)
        if lru is not None and block in lru:
            return True
        groups = self._on.get(node, {}).get(block)
        evented = node not in self._capacity
        return bool(groups) and any(self._counts(g, block, now_ms, evented) for g in (groups or _NONE).values())

    def record_of(self, node: str) -> list[int]:
        """An instance's settled LRU record, least recently placed first (empty for an instance
        with KV events)."""
        return list(self._lru.get(node, ()))

    def pending_requests(self) -> set[str]:
        """The requests with a placement not yet expired (for tests and metrics)."""
        return set(self._by_request)

    # --- time -----------------------------------------------------------------------------

    def expire(self, now_ms: int) -> None:
        """Drop the placements past their ``ttl`` at ``now_ms``, settling those of instances
        without KV events into their LRU record, in time order."""
        if now_ms <= self._now:
            return
        self._now = now_ms
        ttl = self.ttl_ms
        heap = self._expiry
        while heap and heap[0][0] + ttl <= now_ms:
            key = heapq.heappop(heap)[3]
            group = self._groups.pop(key)
            rid = group.op.request_id
            keys = self._by_request.get(rid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_request[rid]
            self._unindex(group)
            self._settle(group)
            self._done.add(key)
            self._marks.append((key[2] + ttl, "done", key))
        marks = self._marks
        while marks and marks[0][0] + 2 * ttl <= now_ms:
            t, kind, what = marks.popleft()
            if kind == "done":
                self._done.discard(what)
                continue
            table: dict[Any, list[int]] = self._releases if kind == "released" else self._confirms
            times = table.get(what)
            if times is None:
                continue
            if t in times:
                times.remove(t)
            if not times:
                del table[what]

    # --- inside ---------------------------------------------------------------------------

    def _counts(self, g: _Group, block: int, now_ms: int, evented: bool) -> bool:
        """Whether placement ``g`` makes ``block`` pending at ``now_ms``."""
        t0 = g.op.at_ms
        if not (t0 <= now_ms < t0 + self.ttl_ms and g.released_at > now_ms):
            return False
        return not evented or g.confirmed is None or g.confirmed.get(block, NEVER) > now_ms

    def _walk(self, node: str, chain: tuple[int, ...], i: int, now_ms: int) -> int:
        """Where ``node``'s run of pending blocks of ``chain`` from ``i`` ends: one placement is
        followed while it goes on matching the chain (the common case: a placement is a slice
        of the same chain), another looked up where it stops."""
        on = self._on.get(node, {})
        lru = self._lru.get(node)
        evented = node not in self._capacity
        n = len(chain)
        while i < n:
            b = chain[i]
            g = next((g for g in on.get(b, _NONE).values() if self._counts(g, b, now_ms, evented)), None)
            if g is None:
                if lru is not None and b in lru:
                    i += 1
                    continue
                return i
            blocks = g.op.blocks
            p = i if i < len(blocks) and blocks[i] == b else blocks.index(b)
            i += 1
            p += 1
            confirmed = g.confirmed if evented else None
            if confirmed is None:
                i += _common_run(blocks, p, chain, i)
                continue
            m = len(blocks)
            while i < n and p < m and blocks[p] == chain[i] and confirmed.get(chain[i], NEVER) > now_ms:
                i += 1
                p += 1
        return i

    def _place(self, op: Placed) -> None:
        key = (op.request_id, op.node, op.at_ms)
        if key in self._groups or key in self._done or not op.blocks:
            return
        ttl = self.ttl_ms
        t0 = op.at_ms
        group = _Group(op, min((t for t in self._releases.get(op.request_id, ()) if t0 <= t < t0 + ttl),
                               default=NEVER))
        if t0 + ttl <= self._now:  # arrived after its ttl: settle it (or drop it) at once
            self._settle(group)
            self._done.add(key)
            self._marks.append((self._now, "done", key))
            return
        confirms = self._confirms
        if confirms:
            for b in op.blocks:
                c = confirms.get((op.node, b))
                tc = NEVER if c is None else min((t for t in c if t0 <= t < t0 + ttl), default=NEVER)
                if tc != NEVER:
                    group.confirmed = group.confirmed or {}
                    group.confirmed[b] = tc
        on = self._on.setdefault(op.node, {})
        for b in op.blocks:
            on.setdefault(b, {})[id(group)] = group
        starts = self._starts.setdefault(op.blocks[0], {})
        starts[op.node] = starts.get(op.node, 0) + 1
        self._groups[key] = group
        self._by_request.setdefault(op.request_id, set()).add(key)
        heapq.heappush(self._expiry, (t0, op.request_id, op.node, key))

    def _release(self, op: Released) -> None:
        times = self._releases.setdefault(op.request_id, [])
        if op.at_ms in times:
            return
        times.append(op.at_ms)
        self._marks.append((op.at_ms, "released", op.request_id))
        ttl = self.ttl_ms
        for key in self._by_request.get(op.request_id, ()):
            group = self._groups[key]
            if group.op.at_ms <= op.at_ms < group.op.at_ms + ttl:
                group.released_at = min(group.released_at, op.at_ms)

    def _confirm(self, op: Confirmed) -> None:
        ttl, tc = self.ttl_ms, op.at_ms
        on = self._on.get(op.node, {})
        for b in op.blocks:
            times = self._confirms.setdefault((op.node, b), [])
            if tc in times:
                continue
            times.append(tc)
            self._marks.append((tc, "confirmed", (op.node, b)))
            for g in on.get(b, _NONE).values():
                if g.op.at_ms <= tc < g.op.at_ms + ttl:
                    if g.confirmed is None:
                        g.confirmed = {}
                    g.confirmed[b] = min(g.confirmed.get(b, NEVER), tc)

    def _unindex(self, group: _Group) -> None:
        node, blocks = group.op.node, group.op.blocks
        on = self._on.get(node)
        if on is not None:
            for b in blocks:
                groups = on.get(b)
                if groups is None:
                    continue
                groups.pop(id(group), None)
                if not groups:
                    del on[b]
            if not on:
                del self._on[node]
        starts = self._starts.get(blocks[0])
        if starts is not None and node in starts:
            starts[node] -= 1
            if starts[node] <= 0:
                del starts[node]
                if not starts:
                    del self._starts[blocks[0]]

    def _settle(self, group: _Group) -> None:
        node = group.op.node
        if node not in self._capacity or group.released_at != NEVER:
            return
        lru = self._lru.setdefault(node, OrderedDict())
        holders = self._lru_holders
        for b in group.op.blocks:
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
                holders.setdefault(b, set()).add(node)
        self._trim(node)

    def _trim(self, node: str) -> None:
        lru = self._lru.get(node)
        if lru is None:
            return
        cap = self._capacity.get(node, 0)
        while len(lru) > cap:
            b, _ = lru.popitem(last=False)
            self._drop_holder(b, node)

    def _drop_holder(self, block: int, node: str) -> None:
        nodes = self._lru_holders.get(block)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._lru_holders[block]


def _common_run(a: tuple[int, ...], i: int, b: tuple[int, ...], j: int) -> int:
    """How many blocks ``a[i:]`` and ``b[j:]`` have in common from their start (slices compared
    whole, a binary search for the first difference: the hot walk stays out of Python loops)."""
    k = min(len(a) - i, len(b) - j)
    if a[i:i + k] == b[j:j + k]:
        return k
    lo, hi = 0, k  # a[i:i+lo] == b[j:j+lo], and they differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i + lo:i + mid] == b[j + lo:j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def pending_from_log(ops: Iterable[PendingOp], now_ms: int, ttl_ms: int,
                     capacity: Mapping[str, int] | None = None, *, any_stamp: bool = False) -> InMemoryPendingBlocks:
    """The pending record at ``now_ms`` after ``ops`` (any order; those stamped after ``now_ms``
    do not count yet, unless ``any_stamp``: ``ops`` are what a reader had applied, as it applied
    them): what ``explain`` re-derives a decision's pending blocks with."""
    store = InMemoryPendingBlocks(ttl_ms, capacity)
    for op in ops:
        if any_stamp or op.at_ms <= now_ms:
            store.apply(op)
    store.expire(now_ms)
    return store


# --- the shared log's form of an operation (JSON-able lists) ----------------------------------

def encode_op(op: PendingOp) -> list[Any]:
    """``op`` as a JSON-able list (the shared log's form)."""
    if isinstance(op, Placed):
        return ["P", op.request_id, op.at_ms, op.node, list(op.blocks)]
    if isinstance(op, Released):
        return ["R", op.request_id, op.at_ms]
    return ["C", op.node, op.at_ms, list(op.blocks)]


SESSION_TAG = "S"
"""The tag of a session placement on the pending blocks' shared log (:func:`encode_session`)."""


def encode_session(session: str, node: str, at_ms: int) -> list[Any]:
    """A decision at ``at_ms`` placed the conversation ``session`` on ``node``, in the shared
    log's form: every router, gateway and picker following the log learns where the session is,
    whichever of them decides its next turn. Not a :data:`PendingOp` (it places no blocks)."""
    return [SESSION_TAG, session, node, at_ms]


def decode_session(item: Any) -> tuple[str, str, int] | None:
    """(session, node, at_ms) of an item :func:`encode_session` wrote; None for an item of another
    kind; ValueError for a malformed one."""
    if not (isinstance(item, list) and item and item[0] == SESSION_TAG):
        return None
    try:
        session, node, at_ms = item[1], item[2], int(item[3])
    except (TypeError, IndexError, ValueError) as e:
        raise ValueError(f"not a session placement: {str(item)[:200]}") from e
    if not isinstance(session, str) or not isinstance(node, str) or not session or not node:
        raise ValueError(f"not a session placement: {str(item)[:200]}")
    return session, node, at_ms


def decode_op(item: Any) -> PendingOp:
    """The operation :func:`encode_op` wrote; ValueError for anything else."""
    try:
        tag = item[0]
        if tag == "P":
            return Placed(str(item[1]), int(item[2]), str(item[3]), tuple(int(b) for b in item[4]))
        if tag == "R":
            return Released(str(item[1]), int(item[2]))
        if tag == "C":
            return Confirmed(str(item[1]), int(item[2]), tuple(int(b) for b in item[3]))
    except (TypeError, IndexError, KeyError) as e:
        raise ValueError(f"not a pending-block operation: {str(item)[:200]}") from e
    raise ValueError(f"not a pending-block operation: {str(item)[:200]}")


__all__ = [
    "SESSION_TAG",
    "Confirmed",
    "InMemoryPendingBlocks",
    "PendingOp",
    "PendingPrefix",
    "PendingStore",
    "Placed",
    "Released",
    "decode_op",
    "decode_session",
    "encode_op",
    "encode_session",
    "pending_from_log",
]
