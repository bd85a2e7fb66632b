"""Pending blocks (state/pending.py): what a decision placed counts at once, and ends on a
confirmation, a release or its TTL; instances without KV events keep an LRU record."""

from __future__ import annotations

import pytest

from state.pending import (
    Confirmed,
    InMemoryPendingBlocks,
    PendingOp,
    PendingPrefix,
    Placed,
    Released,
    decode_op,
    decode_session,
    encode_op,
    encode_session,
    pending_from_log,
)

TTL = 1_000
CHAIN = [11, 12, 13, 14]


def test_a_placement_counts_at_once_on_each_instance() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN, "d0": CHAIN[:3]}, 100)
    assert s.prefixes(CHAIN, 100) == {"p0": PendingPrefix(0, 4), "d0": PendingPrefix(0, 3)}
    assert s.prefixes([11, 12, 99], 100) == {"p0": PendingPrefix(0, 2), "d0": PendingPrefix(0, 2)}
    assert s.prefixes([99, 11], 100) == {}  # a prefix: the first block must be there


def test_pending_extends_what_the_view_confirms() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN[2:]}, 100)  # the blocks the engine did not have yet
    out = s.prefixes(CHAIN, 100, held={"p0": 2, "p1": 3})
    assert out == {"p0": PendingPrefix(2, 4)}
    assert out["p0"].pending == 2
    assert s.prefixes(CHAIN, 100) == {}  # without the confirmed part the prefix does not start


def test_the_ttl_ends_a_placement() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN}, 100)
    assert s.holds("p0", 11, 100 + TTL - 1)
    assert not s.holds("p0", 11, 100 + TTL)
    assert s.prefixes(CHAIN, 100 + TTL) == {}
    assert s.pending_requests() == set()  # expired ones are dropped, not only hidden


def test_a_placement_is_not_seen_before_it_was_made() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN}, 500)
    assert not s.holds("p0", 11, 499)


def test_release_ends_its_request_only_and_is_idempotent() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN}, 100)
    s.record("r2", {"p0": CHAIN[:2]}, 110)
    s.release("r1", 200)
    s.release("r1", 200)
    s.release("r1", 300)
    s.release("never-seen", 200)
    assert s.prefixes(CHAIN, 200) == {"p0": PendingPrefix(0, 2)}
    s.release("r2", 250)
    assert s.prefixes(CHAIN, 250) == {}


def test_a_retry_after_a_release_counts_again() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN}, 100)
    s.release("r1", 150)
    s.record("r1", {"p1": CHAIN}, 160)  # the gateway's retry on another instance, same id
    assert s.prefixes(CHAIN, 170) == {"p1": PendingPrefix(0, 4)}


def test_confirmation_ends_pending_so_a_later_eviction_is_believed() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.record("r1", {"p0": CHAIN}, 100)
    s.confirm("p0", CHAIN[:2], 150)
    # confirmed blocks are the view's now: with the view holding them, the answer is the same
    assert s.prefixes(CHAIN, 160, held={"p0": 2}) == {"p0": PendingPrefix(2, 4)}
    # the engine evicted them: the view no longer holds them, and pending does not either
    assert s.prefixes(CHAIN, 160) == {}


def test_a_confirmation_before_the_placement_does_not_end_it() -> None:
    s = InMemoryPendingBlocks(TTL)
    s.confirm("p0", CHAIN, 90)  # an older copy of the blocks, evicted since
    s.record("r1", {"p0": CHAIN}, 100)
    assert s.prefixes(CHAIN, 100) == {"p0": PendingPrefix(0, 4)}


def test_repeated_operations_change_nothing() -> None:
    s = InMemoryPendingBlocks(TTL, capacity={"e0": 8})
    for _ in range(3):
        s.apply(Placed("r1", 100, "e0", (1, 2)))
        s.apply(Placed("r2", 200, "e0", (3,)))
    s.expire(100 + TTL + 500)
    s.apply(Placed("r1", 100, "e0", (1, 2)))  # a repeat after it settled: still once
    s.expire(200 + TTL)
    assert s.record_of("e0") == [1, 2, 3]


def test_an_instance_without_events_keeps_an_lru_record() -> None:
    s = InMemoryPendingBlocks(TTL, capacity={"e0": 3})
    s.record("r1", {"e0": [1, 2]}, 0)
    s.record("r2", {"e0": [1, 5]}, 10)  # 1 placed again: most recent
    s.record("r3", {"e0": [7]}, 20)
    s.confirm("e0", [1], 30)  # no events for this instance: a confirmation means nothing
    assert s.holds("e0", 1, 40)
    s.expire(20 + TTL)
    # settled in time order: 2, then 1 and 5, then 7; four blocks into three: 2 leaves
    assert s.record_of("e0") == [1, 5, 7]
    assert s.prefixes([1, 5, 9], 10_000) == {"e0": PendingPrefix(0, 2)}
    assert not s.holds("e0", 2, 10_000)
    s.record("r4", {"e0": [9]}, 10_000)
    s.expire(10_000 + TTL)
    assert s.record_of("e0") == [5, 7, 9]


def test_a_released_placement_never_enters_the_lru_record() -> None:
    s = InMemoryPendingBlocks(TTL, capacity={"e0": 10})
    s.record("r1", {"e0": [1, 2]}, 0)
    s.release("r1", 50)
    s.expire(TTL + 1)
    assert s.record_of("e0") == []


def test_capacity_trims_and_none_forgets() -> None:
    s = InMemoryPendingBlocks(TTL, capacity={"e0": 4})
    s.record("r1", {"e0": [1, 2, 3, 4]}, 0)
    s.expire(TTL)
    s.set_capacity("e0", 2)
    assert s.record_of("e0") == [3, 4]
    s.set_capacity("e0", None)
    assert s.record_of("e0") == [] and s.prefixes([3], TTL) == {}
    with pytest.raises(ValueError):
        s.set_capacity("e0", -1)


def test_the_fold_ignores_arrival_order_and_later_operations() -> None:
    ops: list[PendingOp] = [
        Placed("r1", 100, "p0", (1, 2, 3)),
        Placed("r2", 150, "p1", (1, 2)),
        Released("r2", 180),
        Confirmed("p0", 190, (1,)),
        Placed("r3", 300, "p1", (1,)),  # after ``now``: not yet
    ]
    a = pending_from_log(ops, 200, TTL)
    b = pending_from_log(list(reversed(ops)), 200, TTL)
    assert a.prefixes([1, 2, 3], 200, held={"p0": 1}) == b.prefixes([1, 2, 3], 200, held={"p0": 1}) == {
        "p0": PendingPrefix(1, 3)}
    assert a.prefixes([1, 2, 3], 200) == {}


def test_operations_survive_the_shared_logs_form() -> None:
    for op in (Placed("r 1,\n", 5, "p0", (1, 2**64 - 1)), Released("r1", 6), Confirmed("p0", 7, (3,))):
        assert decode_op(encode_op(op)) == op
    for bad in ([], ["X", 1], ["P", "r1"], None):
        with pytest.raises(ValueError):
            decode_op(bad)


def test_a_session_placement_survives_the_shared_logs_form_and_is_no_block_operation() -> None:
    assert decode_session(encode_session("conv 1,\n", "p0", 7)) == ("conv 1,\n", "p0", 7)
    assert decode_session(encode_op(Released("r1", 6))) is None  # another kind: the pending store's
    with pytest.raises(ValueError):
        decode_op(encode_session("conv-1", "p0", 7))  # a reader that does not know it skips it
    for bad in (["S"], ["S", "conv-1", "p0"], ["S", "", "p0", 1], ["S", "conv-1", 3, 1], ["S", "c", "p0", "x"]):
        with pytest.raises(ValueError):
            decode_session(bad)


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError):
        InMemoryPendingBlocks(0)
