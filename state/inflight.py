"""The in-flight ledger: the work Conductor itself sent to each instance and that is not done yet.

A decision *charges* its request: on the prefill instance its uncached prompt tokens (work not
yet at the first token), on the decode instance one decoding sequence and its context. The
prefill part is released by the request's first token, the rest when it finishes (completes,
fails or is cancelled): explicit releases, not "the next heartbeat". A charge nobody releases
(a gateway that crashed) ends ``lease`` after its last news (the charge, or its first token if
that came within the lease).

**The rule.** Everything is a time-stamped operation (``Charged``, ``FirstToken``,
``Finished``; times passed in, on the view's clock). A charge of request ``r`` at ``t0`` is
ended by a ``Finished(r, t2)`` with ``t0 <= t2`` and its prefill part by a ``FirstToken(r, t1)``
with ``t0 <= t1``; so a retried request (the same id charged again after its failure) counts
again. The totals after a set of operations (stamped no later than ``now``) do not depend on
the order they arrived in, so every process following the shared log agrees and ``explain``
re-derives them (:func:`inflight_from_log`).

Reading an instance's totals is O(1) (running sums); all of them, O(instances).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class Charged:
    """``request_id`` decided at ``at_ms``: ``uncached_tokens`` to compute on ``prefill``, then one
    sequence of ``context_tokens`` decoding on ``decode`` (the same node when aggregated)."""

    request_id: str
    at_ms: int
    prefill: str
    decode: str
    uncached_tokens: int
    context_tokens: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    """``request_id``'s first token came back at ``at_ms``: its prefill is done."""

    request_id: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class Finished:
    """``request_id`` completed, failed or was cancelled at ``at_ms``."""

    request_id: str
    at_ms: int


InflightOp = Charged | FirstToken | Finished


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """Conductor's own work on one instance: requests in flight on it (either part), the uncached
    prompt tokens of those not yet at their first token, and the sequences decoding (or about to)
    with their context tokens."""

    requests: int = 0
    prefill_requests: int = 0
    prefill_tokens: int = 0
    decode_requests: int = 0
    decode_context_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests or self.prefill_tokens or self.decode_context_tokens)


_ZERO = InstanceLoad()


class InflightLedger(Protocol):
    """The ledger a router, gateway or picker writes and reads: in memory (:class:`InMemoryInflight`)
    or shared through Redis (:class:`state.shared_log.RedisInflight`). No call waits on I/O."""

    def charge(self, request_id: str, prefill_node: str, decode_node: str, uncached_tokens: int,
               context_tokens: int, now_ms: int) -> Any:
        """Charge a decision made at ``now_ms``."""
        ...

    def first_token(self, request_id: str, now_ms: int) -> None:
        """Release the prefill part of ``request_id`` (idempotent; unknown: a no-op)."""
        ...

    def finish(self, request_id: str, now_ms: int) -> None:
        """Release all of ``request_id`` (completed, failed or cancelled; idempotent)."""
        ...

    def load(self, node: str, now_ms: int) -> InstanceLoad:
        """Conductor's work on ``node`` at ``now_ms``."""
        ...

    def loads(self, now_ms: int) -> dict[str, InstanceLoad]:
        """Every instance with work in flight at ``now_ms``."""
        ...


@dataclass(slots=True)
class _Charge:
    op: Charged
    first_at: int = NEVER
    finished_at: int = NEVER
    counted: dict[str, tuple[int, int, int, int, int]] = field(default_factory=dict)
    """What this charge adds to each node's totals now."""


class InMemoryInflight:
    """The ledger of one process (tests, the simulator, explain, and each process's copy of the
    shared log). Reads take ``now`` and first end the charges whose lease ran out; ``now``
    should not go backwards."""

    def __init__(self, lease_ms: int) -> None:
        if lease_ms <= 0:
            raise ValueError("lease_ms must be positive")
        self.lease_ms = lease_ms
        self._now = -NEVER
        self._charges: dict[tuple[str, int], _Charge] = {}
        self._by_request: dict[str, list[_Charge]] = {}
        # first tokens and finishes seen, kept 2 x lease for charges that arrive after them
        self._firsts: dict[str, list[int]] = {}
        self._finishes: dict[str, list[int]] = {}
        self._marks: deque[tuple[int, str, str]] = deque()
        self._leases: list[tuple[int, str, int]] = []
        self._totals: dict[str, list[int]] = {}

    # --- writing --------------------------------------------------------------------------

    def charge(self, request_id: str, prefill_node: str, decode_node: str, uncached_tokens: int,
               context_tokens: int, now_ms: int) -> Charged:
        """Charge a decision made at ``now_ms``; returns the operation (what a shared ledger publishes)."""
        op = Charged(request_id, now_ms, prefill_node, decode_node, max(uncached_tokens, 0), max(context_tokens, 0))
        self.apply(op)
        return op

    def first_token(self, request_id: str, now_ms: int) -> None:
        """Release the prefill part of ``request_id``'s charges (idempotent; unknown: a no-op)."""
        self.apply(FirstToken(request_id, now_ms))

    def finish(self, request_id: str, now_ms: int) -> None:
        """Release all of ``request_id``'s charges: completed, failed or cancelled (idempotent)."""
        self.apply(Finished(request_id, now_ms))

    def apply(self, op: InflightOp) -> None:
        """Apply one operation, whatever order operations come in (a repeat is a no-op)."""
        if isinstance(op, Charged):
            self._charge(op)
            return
        table = self._firsts if isinstance(op, FirstToken) else self._finishes
        times = table.setdefault(op.request_id, [])
        if op.at_ms in times:
            return
        times.append(op.at_ms)
        self._marks.append((op.at_ms, "first" if isinstance(op, FirstToken) else "finish", op.request_id))
        for c in self._by_request.get(op.request_id, ()):
            if c.op.at_ms <= op.at_ms:
                if isinstance(op, FirstToken):
                    if op.at_ms < c.first_at:  # an earlier first token: the lease may end sooner
                        c.first_at = op.at_ms
                        heapq.heappush(self._leases, (self._deadline(c), op.request_id, c.op.at_ms))
                else:
                    c.finished_at = min(c.finished_at, op.at_ms)
        for c in list(self._by_request.get(op.request_id, ())):
            self._recount(c)
            if c.finished_at != NEVER:
                self._forget(c)  # a repeat of its charge finds the finish kept in ``_finishes``

    # --- reading --------------------------------------------------------------------------

    def load(self, node: str, now_ms: int) -> InstanceLoad:
        """Conductor's work on ``node`` at ``now_ms`` (O(1) besides ending expired leases)."""
        self.expire(now_ms)
        t = self._totals.get(node)
        return InstanceLoad(*t) if t else _ZERO

    def loads(self, now_ms: int) -> dict[str, InstanceLoad]:
        """Every instance with work in flight at ``now_ms``."""
        self.expire(now_ms)
        return {node: InstanceLoad(*t) for node, t in self._totals.items()}

    def charged(self, request_id: str) -> Charged | None:
        """The last charge of ``request_id`` still counting (None: none)."""
        live = [c.op for c in self._by_request.get(request_id, ()) if c.counted]
        return max(live, key=lambda op: op.at_ms) if live else None

    def in_flight(self) -> set[str]:
        """The requests with a charge still counting (for tests and metrics)."""
        return {rid for rid, cs in self._by_request.items() if any(c.counted for c in cs)}

    # --- time -----------------------------------------------------------------------------

    def expire(self, now_ms: int) -> None:
        """End the charges whose lease ran out by ``now_ms``."""
        if now_ms <= self._now:
            return
        self._now = now_ms
        heap = self._leases
        while heap and heap[0][0] <= now_ms:
            _, rid, t0 = heapq.heappop(heap)
            c = self._charges.get((rid, t0))
            if c is None:
                continue
            deadline = self._deadline(c)
            if deadline > now_ms:  # its first token moved the lease on
                heapq.heappush(heap, (deadline, rid, t0))
                continue
            self._recount(c)
            self._forget(c)
        marks = self._marks
        while marks and marks[0][0] + 2 * self.lease_ms <= now_ms:
            t, kind, rid = marks.popleft()
            table = self._firsts if kind == "first" else self._finishes
            times = table.get(rid)
            if times is not None and t in times:
                times.remove(t)
                if not times:
                    del table[rid]

    # --- inside ---------------------------------------------------------------------------

    def _charge(self, op: Charged) -> None:
        key = (op.request_id, op.at_ms)
        if key in self._charges:
            return
        t0 = op.at_ms
        c = _Charge(op)
        c.first_at = min((t for t in self._firsts.get(op.request_id, ()) if t >= t0), default=NEVER)
        c.finished_at = min((t for t in self._finishes.get(op.request_id, ()) if t >= t0), default=NEVER)
        deadline = self._deadline(c)
        if deadline <= self._now or c.finished_at != NEVER:
            return  # over before it arrived here
        self._charges[key] = c
        self._by_request.setdefault(op.request_id, []).append(c)
        heapq.heappush(self._leases, (deadline, op.request_id, t0))
        self._recount(c)

    def _deadline(self, c: _Charge) -> int:
        """When ``c``'s lease ends: ``lease`` after the charge, or after its first token when that
        came before (news at or past the end is too late to renew it)."""
        end = c.op.at_ms + self.lease_ms
        return c.first_at + self.lease_ms if c.first_at < end else end

    def _recount(self, c: _Charge) -> None:
        """Bring ``c``'s share of the totals to what it should be now."""
        op = c.op
        want: dict[str, tuple[int, int, int, int, int]] = {}
        if c.finished_at == NEVER and self._deadline(c) > self._now:
            decode = (1, 0, 0, 1, op.context_tokens)
            if c.first_at == NEVER:
                prefill = (1, 1, op.uncached_tokens, 0, 0)
                if op.prefill == op.decode:
                    want[op.prefill] = (1, 1, op.uncached_tokens, 1, op.context_tokens)
                else:
                    want[op.prefill] = prefill
                    want[op.decode] = decode
            else:
                want[op.decode] = decode
        if want == c.counted:
            return
        totals = self._totals
        for node, amounts in c.counted.items():
            t = totals[node]
            for i, a in enumerate(amounts):
                t[i] -= a
            if not any(t):
                del totals[node]
        for node, amounts in want.items():
            t = totals.setdefault(node, [0, 0, 0, 0, 0])
            for i, a in enumerate(amounts):
                t[i] += a
        c.counted = want

    def _forget(self, c: _Charge) -> None:
        rid = c.op.request_id
        self._charges.pop((rid, c.op.at_ms), None)
        cs = self._by_request.get(rid)
        if cs is not None:
            cs[:] = [x for x in cs if x is not c]
            if not cs:
                del self._by_request[rid]


def inflight_from_log(ops: Iterable[InflightOp], now_ms: int, lease_ms: int, *,
                      any_stamp: bool = False) -> InMemoryInflight:
    """The ledger at ``now_ms`` after ``ops`` (any order; those stamped after ``now_ms`` do not
    count yet, unless ``any_stamp``: ``ops`` are what a reader had applied, as it applied them):
    what ``explain`` re-derives a decision's in-flight work with."""
    ledger = InMemoryInflight(lease_ms)
    for op in ops:
        if any_stamp or op.at_ms <= now_ms:
            ledger.apply(op)
    ledger.expire(now_ms)
    return ledger


# --- the shared log's form of an operation (JSON-able lists) ----------------------------------

def encode_op(op: InflightOp) -> list[Any]:
    """``op`` as a JSON-able list (the shared log's form)."""
    if isinstance(op, Charged):
        return ["c", op.request_id, op.at_ms, op.prefill, op.decode, op.uncached_tokens, op.context_tokens]
    return ["t" if isinstance(op, FirstToken) else "f", op.request_id, op.at_ms]


def decode_op(item: Any) -> InflightOp:
    """The operation :func:`encode_op` wrote; ValueError for anything else."""
    try:
        tag = item[0]
        if tag == "c":
            return Charged(str(item[1]), int(item[2]), str(item[3]), str(item[4]), int(item[5]), int(item[6]))
        if tag == "t":
            return FirstToken(str(item[1]), int(item[2]))
        if tag == "f":
            return Finished(str(item[1]), int(item[2]))
    except (TypeError, IndexError, KeyError) as e:
        raise ValueError(f"not an in-flight operation: {str(item)[:200]}") from e
    raise ValueError(f"not an in-flight operation: {str(item)[:200]}")


__all__ = [
    "Charged",
    "Finished",
    "FirstToken",
    "InMemoryInflight",
    "InflightLedger",
    "InflightOp",
    "InstanceLoad",
    "decode_op",
    "encode_op",
    "inflight_from_log",
]
