"""streams.batches.take_batches on a Faust agent with no broker (Faust's agent test context), and
streams.kafka.FetchPace: what an idle stream worker does (nothing) and how its fetches slow down."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import faust
import pytest

import streams.kafka
from streams.batches import take_batches
from streams.kafka import DEEP_IDLE_FETCH_WAIT_MS, IDLE_FETCH_WAIT_MS, FetchPace


def batching_app(max_records: int, within_s: float) -> tuple[Any, list[tuple[list[Any], float]], list[int]]:
    app = faust.App("test-take-batches", store="memory://", web_enabled=False)
    got: list[tuple[list[Any], float]] = []
    waits = [0]

    async def batcher(stream: Any) -> None:
        inner = stream.wait_for_stopped

        async def counted(*args: Any, **kwargs: Any) -> bool:
            waits[0] += 1
            return bool(await inner(*args, **kwargs))

        stream.wait_for_stopped = counted
        async for batch in take_batches(stream, max_records, within_s):
            got.append(([e.value for e in batch], time.monotonic()))

    return app.agent(name="batcher")(batcher), got, waits


async def test_batches_are_at_most_max_records_and_a_lone_record_waits_within_s() -> None:
    agent, got, _ = batching_app(3, 0.05)
    async with agent.test_context() as a:
        t0 = time.monotonic()
        for i in range(7):
            await a.put(i)
        await asyncio.sleep(0.3)
    assert [values for values, _ in got] == [[0, 1, 2], [3, 4, 5], [6]]
    assert got[2][1] - t0 >= 0.05  # the last one, not full, closed within_s after it started


async def test_an_idle_agent_does_not_wake() -> None:
    agent, got, waits = batching_app(100, 0.01)
    async with agent.test_context() as a:
        await asyncio.sleep(0.3)  # Faust's take_events(within=0.01) waits ~30 times here
        assert waits[0] <= 1 and got == []
        await a.put("x")
        await asyncio.sleep(0.1)
    assert [values for values, _ in got] == [["x"]]


def test_take_batches_refuses_an_empty_batch_size() -> None:
    with pytest.raises(ValueError, match="max_records"):
        asyncio.run(anext(take_batches(object(), 0, 0.01)))  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_short_fetch_wait_grows_with_the_quiet_and_shrinks_with_the_first_record() -> None:
    clock = Clock()
    pace = FetchPace(10, clock=clock)
    assert pace.saw(False) is None  # quiet, but not for long yet
    clock.now = streams.kafka.IDLE_AFTER_S
    assert pace.saw(False) == IDLE_FETCH_WAIT_MS and pace.idle
    assert pace.saw(False) is None  # no change: nothing to set
    clock.now = streams.kafka.DEEP_IDLE_AFTER_S
    assert pace.saw(False) == DEEP_IDLE_FETCH_WAIT_MS
    assert pace.saw(True) == 10 and not pace.idle
    clock.now += streams.kafka.IDLE_AFTER_S - 0.1
    assert pace.saw(False) is None  # records came less than IDLE_AFTER_S ago


def test_a_fetch_wait_with_one_step_goes_straight_there() -> None:
    clock = Clock()
    pace = FetchPace(10, steps=((2.0, 500),), clock=clock)
    clock.now = 2.0
    assert pace.saw(False) == 500
    clock.now = 60.0
    assert pace.saw(False) is None


def test_steps_no_longer_than_the_short_wait_are_left_out() -> None:
    clock = Clock()
    pace = FetchPace(IDLE_FETCH_WAIT_MS, steps=((2.0, IDLE_FETCH_WAIT_MS), (10.0, 50)), clock=clock)
    clock.now = 60.0
    assert not pace.paced and pace.saw(False) is None and pace.saw(True) is None


def _fetch_at_rate(pace: FetchPace, clock: Clock, per_s: float, seconds: float) -> list[int]:
    """Fetches against records arriving ``per_s`` a second; each fetch lasts the wait it asked for
    (the embedded broker answers when the wait runs out). The waits asked for, in order."""
    waits: list[int] = []
    due, end = clock.now, clock.now + seconds
    while clock.now < end:
        clock.now += pace.wait_ms / 1000.0
        n = 0
        while due <= clock.now:
            n, due = n + 1, due + 1.0 / per_s
        pace.saw(n > 0, n)
        waits.append(pace.wait_ms)
    return waits


def test_a_trickle_of_records_lengthens_the_wait_to_about_half_a_record_a_fetch() -> None:
    clock = Clock()
    pace = FetchPace(10, steps=((2.0, 500),), clock=clock, trickle_max_ms=50)
    assert _fetch_at_rate(pace, clock, 10.0, 3.0)[-1] == 50  # 0.5 / 10 a second: 50 ms, the cap
    assert _fetch_at_rate(pace, clock, 25.0, 3.0)[-1] == 20  # 0.5 / 25 a second
    assert _fetch_at_rate(pace, clock, 200.0, 3.0)[-5:] == [10] * 5  # a stream: the short wait
    waits = _fetch_at_rate(pace, clock, 25.0, 3.0)  # a stream slowing to a trickle follows it down
    assert waits[0] == 10 and waits[-1] == 20


def test_a_trickle_pace_keeps_its_longest_busy_wait_until_the_idle_step_then_a_record_shortens_it() -> None:
    clock = Clock()
    pace = FetchPace(10, steps=((2.0, 500),), clock=clock, trickle_max_ms=50)
    _fetch_at_rate(pace, clock, 200.0, 1.0)
    last = clock.now
    clock.now = last + 1.5  # past the rate's window, before the idle step: the trickle's cap
    assert pace.saw(False) == 50
    clock.now = last + 2.0
    assert pace.saw(False) == 500
    clock.now += 30.0
    assert pace.saw(True, 1) == 10  # the first record after a quiet spell: others may follow at once
    clock.now += 0.2
    assert pace.saw(False) == 50  # none did: a trickle


def test_without_a_trickle_cap_the_count_changes_nothing() -> None:
    clock = Clock()
    pace = FetchPace(10, steps=((2.0, 500),), clock=clock)
    assert _fetch_at_rate(pace, clock, 10.0, 3.0)[-1] == 10


def test_a_consumer_still_folding_what_it_fetched_is_not_idle() -> None:
    """A burst fetched at once and folded for seconds: the quiet spell counts from the last batch
    folded, so the first record after the burst is not held by an idle fetch."""
    clock = Clock()
    pace = FetchPace(10, steps=((2.0, 500),), clock=clock)
    pace.saw(True, 5_000)  # the burst, all in one fetch
    for t in (1.0, 2.0, 3.0, 3.5):  # folding it: a batch done a moment before each fetch
        clock.now = t
        assert pace.saw(False, busy_at=t - 0.01) is None and pace.wait_ms == 10
    clock.now = 3.5 + 2.0  # folded; then 2 s of nothing: idle
    assert pace.saw(False, busy_at=3.5) == 500
