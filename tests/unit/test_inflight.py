"""The in-flight ledger (state/inflight.py): charged at decision, the prefill part released at
the first token, the rest at finish; a lease ends what nobody released."""

from __future__ import annotations

import pytest

from state.inflight import (
    Charged,
    Finished,
    FirstToken,
    InflightOp,
    InMemoryInflight,
    InstanceLoad,
    decode_op,
    encode_op,
    inflight_from_log,
)

LEASE = 60_000


def test_a_disaggregated_request_from_decision_to_finish() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "p0", "d0", 900, 1000, 100)
    assert led.load("p0", 100) == InstanceLoad(requests=1, prefill_requests=1, prefill_tokens=900)
    assert led.load("d0", 100) == InstanceLoad(requests=1, decode_requests=1, decode_context_tokens=1000)
    led.first_token("r1", 300)
    assert led.load("p0", 300) == InstanceLoad()
    assert not led.load("p0", 300)
    assert led.loads(300) == {"d0": InstanceLoad(requests=1, decode_requests=1, decode_context_tokens=1000)}
    led.finish("r1", 900)
    assert led.loads(900) == {} and led.in_flight() == set()


def test_an_aggregated_request_is_one_request_on_its_instance() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "a0", "a0", 500, 800, 0)
    led.charge("r2", "a0", "a0", 100, 200, 5)
    assert led.load("a0", 5) == InstanceLoad(2, 2, 600, 2, 1000)
    led.first_token("r1", 10)
    assert led.load("a0", 10) == InstanceLoad(2, 1, 100, 2, 1000)


def test_releases_are_idempotent_and_unknown_requests_are_no_ops() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "p0", "d0", 10, 20, 0)
    led.charge("r2", "p0", "d0", 30, 40, 0)
    for _ in range(2):
        led.first_token("r1", 5)
        led.finish("r1", 9)
        led.finish("nobody", 9)
        led.first_token("nobody", 9)
    assert led.loads(10) == {"p0": InstanceLoad(1, 1, 30, 0, 0), "d0": InstanceLoad(1, 0, 0, 1, 40)}


def test_a_repeated_charge_counts_once_even_after_its_finish() -> None:
    led = InMemoryInflight(LEASE)
    op = Charged("r1", 0, "p0", "d0", 10, 20)
    led.apply(op)
    led.apply(op)
    assert led.load("p0", 0).prefill_tokens == 10
    led.finish("r1", 5)
    led.apply(op)  # the shared log delivering it again
    assert led.loads(6) == {}


def test_a_retry_after_a_failure_is_charged_again() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "p0", "d0", 10, 20, 0)
    led.finish("r1", 5)  # failed
    led.charge("r1", "p1", "d0", 10, 20, 6)
    assert set(led.loads(6)) == {"p1", "d0"}


def test_the_lease_ends_unreleased_charges_and_the_first_token_renews_it() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "p0", "d0", 10, 20, 0)
    led.charge("r2", "p1", "d1", 10, 20, 0)
    led.first_token("r2", 1_000)
    assert set(led.loads(LEASE - 1)) == {"p0", "d0", "d1"}
    assert led.loads(LEASE) == {"d1": InstanceLoad(1, 0, 0, 1, 20)}
    assert led.loads(1_000 + LEASE) == {}
    assert led.in_flight() == set()


def test_a_release_that_arrives_before_its_charge_still_applies() -> None:
    led = InMemoryInflight(LEASE)
    led.apply(FirstToken("r1", 50))
    led.apply(Charged("r1", 10, "p0", "d0", 10, 20))
    assert led.loads(60) == {"d0": InstanceLoad(1, 0, 0, 1, 20)}
    led.apply(Finished("r2", 70))
    led.apply(Charged("r2", 20, "p0", "d0", 10, 20))
    assert "p0" not in led.loads(70)


def test_the_fold_ignores_arrival_order_and_later_operations() -> None:
    ops: list[InflightOp] = [
        Charged("r1", 0, "p0", "d0", 100, 200),
        Charged("r2", 10, "p0", "p0", 50, 60),
        FirstToken("r1", 20),
        Finished("r2", 30),
        Finished("r1", 500),  # after ``now``: not yet
    ]
    a = inflight_from_log(ops, 100, LEASE)
    b = inflight_from_log(list(reversed(ops)), 100, LEASE)
    assert a.loads(100) == b.loads(100) == {"d0": InstanceLoad(1, 0, 0, 1, 200)}


def test_operations_survive_the_shared_logs_form() -> None:
    for op in (Charged("r,\n1", 1, "p0", "d0", 2, 3), FirstToken("r1", 4), Finished("r1", 5)):
        assert decode_op(encode_op(op)) == op
    for bad in ([], ["z", "r", 1], ["c", "r"], 7):
        with pytest.raises(ValueError):
            decode_op(bad)


def test_negative_amounts_are_charged_as_zero_and_the_lease_must_be_positive() -> None:
    led = InMemoryInflight(LEASE)
    led.charge("r1", "p0", "p0", -5, -1, 0)
    assert led.load("p0", 0) == InstanceLoad(1, 1, 0, 1, 0)
    with pytest.raises(ValueError):
        InMemoryInflight(0)
