"""Properties of the decision-time records: each is a function of the operations (stamped no
later than ``now``) and ``now`` alone, whatever order the operations arrive in, and equals the
rule written in its module's docstring, checked here by brute force."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from state.inflight import Charged, Finished, FirstToken, InflightOp, InMemoryInflight, inflight_from_log
from state.pending import Confirmed, InMemoryPendingBlocks, PendingOp, Placed, Released, pending_from_log

TTL = 100
LEASE = 300
NODES = ("n0", "n1", "e0")  # e0 publishes no KV events
CAPACITY = {"e0": 3}
PATHS = ((1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9))  # chained hashes: a tree; a block has one position
BLOCKS = tuple(sorted({b for p in PATHS for b in p}))
REQUESTS = ("r0", "r1", "r2", "r3")

times = st.integers(0, 400)
chains = st.tuples(st.sampled_from(PATHS), st.integers(0, 3), st.integers(1, 4)).map(
    lambda t: t[0][min(t[1], len(t[0]) - 1):][:t[2]])  # a slice of a path: from its start, or past a confirmed part
helds = st.dictionaries(st.sampled_from(NODES[:2]), st.integers(0, 4), max_size=2)
pending_ops = st.lists(st.one_of(
    st.builds(Placed, st.sampled_from(REQUESTS), times, st.sampled_from(NODES), chains),
    st.builds(Released, st.sampled_from(REQUESTS), times),
    st.builds(Confirmed, st.sampled_from(NODES), times, chains),
), max_size=25)


def _picture(s: InMemoryPendingBlocks, now: int) -> tuple[object, ...]:
    return (frozenset((n, b) for n in NODES for b in BLOCKS if s.holds(n, b, now)),
            tuple(tuple(s.record_of(n)) for n in NODES))


def _prefixes_by_the_rule(held_blocks: frozenset[tuple[str, int]], held: dict[str, int]) -> list[dict[str, tuple[int, int]]]:
    """Per path: each instance's prefix, walking from the confirmed part while blocks are held."""
    out = []
    for path in PATHS:
        got = {}
        for n in NODES:
            start = min(held.get(n, 0), len(path))
            end = start
            while end < len(path) and (n, path[end]) in held_blocks:
                end += 1
            if end > start:
                got[n] = (start, end)
        out.append(got)
    return out


def _prefixes(s: InMemoryPendingBlocks, now: int, held: dict[str, int]) -> list[dict[str, tuple[int, int]]]:
    return [{n: (p.start, p.length) for n, p in s.prefixes(path, now, held).items()} for path in PATHS]


def _unique(ops: list[PendingOp]) -> list[PendingOp]:
    """One placement per (request, node, time): a repeat is the same operation again."""
    seen: set[tuple[str, str, int]] = set()
    out: list[PendingOp] = []
    for op in ops:
        if isinstance(op, Placed):
            if (op.request_id, op.node, op.at_ms) in seen:
                continue
            seen.add((op.request_id, op.node, op.at_ms))
        out.append(op)
    return out


def _pending_by_the_rule(ops: list[PendingOp], now: int) -> tuple[object, ...]:
    ops = [op for op in _unique(ops) if op.at_ms <= now]
    released = [op for op in ops if isinstance(op, Released)]
    confirmed = [op for op in ops if isinstance(op, Confirmed)]

    def cancelled(p: Placed) -> bool:
        return any(r.request_id == p.request_id and p.at_ms <= r.at_ms < p.at_ms + TTL for r in released)

    held = set()
    for p in (op for op in ops if isinstance(op, Placed)):
        if not p.at_ms <= now < p.at_ms + TTL or cancelled(p):
            continue
        for b in p.blocks:
            if p.node in CAPACITY or not any(c.node == p.node and b in c.blocks and p.at_ms <= c.at_ms <= now
                                             for c in confirmed):
                held.add((p.node, b))
    records = []
    for n in NODES:
        lru: OrderedDict[int, None] = OrderedDict()
        if n in CAPACITY:
            settled = sorted((p for p in ops if isinstance(p, Placed) and p.node == n and p.at_ms + TTL <= now
                              and not cancelled(p)), key=lambda p: (p.at_ms, p.request_id))
            for p in settled:
                for b in p.blocks:
                    lru[b] = None
                    lru.move_to_end(b)
                while len(lru) > CAPACITY[n]:
                    lru.popitem(last=False)
        held.update((n, b) for b in lru)
        records.append(tuple(lru))
    return frozenset(held), tuple(records)


@settings(max_examples=200, deadline=None)
@given(pending_ops, times, helds, st.randoms(use_true_random=False))
def test_pending_blocks_follow_the_rule_in_any_order(ops: list[PendingOp], now: int, held: dict[str, int],
                                                     rnd: random.Random) -> None:
    ops = _unique(ops)
    expected = _pending_by_the_rule(ops, now)
    folded = pending_from_log(ops, now, TTL, CAPACITY)
    assert _picture(folded, now) == expected
    assert _prefixes(folded, now, held) == _prefixes_by_the_rule(expected[0], held)  # type: ignore[arg-type]
    shuffled = list(ops)
    rnd.shuffle(shuffled)
    assert _picture(pending_from_log(shuffled, now, TTL, CAPACITY), now) == expected
    # as a live copy gets them: in time order, the clock moving with them
    live = InMemoryPendingBlocks(TTL, CAPACITY)
    for op in sorted((op for op in ops if op.at_ms <= now), key=lambda op: op.at_ms):
        live.expire(op.at_ms)
        live.apply(op)
    assert _picture(live, now) == expected


inflight_ops = st.lists(st.one_of(
    st.builds(Charged, st.sampled_from(REQUESTS), times, st.sampled_from(NODES), st.sampled_from(NODES),
              st.integers(0, 50), st.integers(0, 50)),
    st.builds(FirstToken, st.sampled_from(REQUESTS), times),
    st.builds(Finished, st.sampled_from(REQUESTS), times),
), max_size=25)


def _unique_charges(ops: list[InflightOp]) -> list[InflightOp]:
    """One charge per (request, time): a repeat is the same operation again."""
    seen: set[tuple[str, int]] = set()
    out: list[InflightOp] = []
    for op in ops:
        if isinstance(op, Charged):
            if (op.request_id, op.at_ms) in seen:
                continue
            seen.add((op.request_id, op.at_ms))
        out.append(op)
    return out


def _loads_by_the_rule(ops: list[InflightOp], now: int) -> dict[str, tuple[int, ...]]:
    ops = [op for op in ops if op.at_ms <= now]
    charges = {(op.request_id, op.at_ms): op for op in ops if isinstance(op, Charged)}
    totals: dict[str, list[int]] = {}
    for c in charges.values():
        if any(isinstance(o, Finished) and o.request_id == c.request_id and o.at_ms >= c.at_ms for o in ops):
            continue
        first = min((o.at_ms for o in ops if isinstance(o, FirstToken) and o.request_id == c.request_id
                     and o.at_ms >= c.at_ms), default=None)
        last = first if first is not None and first < c.at_ms + LEASE else c.at_ms  # news within the lease renews it
        if last + LEASE <= now:
            continue
        parts = {c.decode: [1, 0, 0, 1, c.context_tokens]}
        if first is None:
            pre = parts.setdefault(c.prefill, [1, 0, 0, 0, 0])
            pre[1] += 1
            pre[2] += c.uncached_tokens
        for node, amounts in parts.items():
            t = totals.setdefault(node, [0] * 5)
            for i, a in enumerate(amounts):
                t[i] += a
    return {n: tuple(t) for n, t in totals.items() if any(t)}


def _loads(led: InMemoryInflight, now: int) -> dict[str, tuple[int, ...]]:
    return {n: (x.requests, x.prefill_requests, x.prefill_tokens, x.decode_requests,
                 x.decode_context_tokens) for n, x in led.loads(now).items()}


@settings(max_examples=200, deadline=None)
@given(inflight_ops, times, st.randoms(use_true_random=False))
def test_inflight_totals_follow_the_rule_in_any_order(ops: list[InflightOp], now: int, rnd: random.Random) -> None:
    ops = _unique_charges(ops)
    expected = _loads_by_the_rule(ops, now)
    assert _loads(inflight_from_log(ops, now, LEASE), now) == expected
    shuffled = list(ops)
    rnd.shuffle(shuffled)
    assert _loads(inflight_from_log(shuffled, now, LEASE), now) == expected
    live = InMemoryInflight(LEASE)
    for op in sorted((op for op in ops if op.at_ms <= now), key=lambda op: op.at_ms):
        live.expire(op.at_ms)
        live.apply(op)
    assert _loads(live, now) == expected
