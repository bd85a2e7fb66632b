"""Turns at prefill in a capacity group (conductor.gateway.turns): one engine of the group at a time,
first come first served; an engine already prefilling takes more while nobody waits; a wait ends
after ``max_wait_s`` without a turn; a waiter that goes away passes nothing on."""

from __future__ import annotations

import asyncio

import pytest

from conductor.gateway.turns import PrefillTurns
from conductor.topology import Topology

LINK = {"bandwidth_gbps": 100.0, "transport": "tcp"}


def group_of(node: str) -> tuple[str, ...]:
    return ("a", "b") if node in ("a", "b") else (node,)


async def settle() -> None:
    """Let the tasks given a turn resume (a wait is a few awaits deep)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def started(turns: PrefillTurns, node: str, log: list[str]) -> asyncio.Task[object]:
    """A task taking ``node``'s turn (``log`` gets ``node`` once it has it), run until it waits or has it."""
    async def go() -> object:
        t = await turns.take(node)
        log.append(node)
        return t
    task = asyncio.create_task(go())
    await settle()
    return task


async def test_one_engine_of_a_group_prefills_at_a_time_first_come_first_served() -> None:
    turns = PrefillTurns(group_of)
    order: list[str] = []
    first = await started(turns, "a", order)
    second_a = await started(turns, "a", order)  # a prefills, nobody waits: a takes another at once
    assert order == ["a", "a"]
    on_b = await started(turns, "b", order)  # b waits for a's two
    behind = await started(turns, "a", order)  # a is prefilling, but b waits: a queues behind b
    also_b = await started(turns, "b", order)
    assert order == ["a", "a"] and turns.waiting("a") == 3
    (await first).end()  # type: ignore[attr-defined]
    await settle()
    assert order == ["a", "a"]  # one of a's still runs
    (await second_a).end()  # type: ignore[attr-defined]
    await settle()
    assert order == ["a", "a", "b"]  # b's turn; the a behind it still waits, so does the b behind that
    b_turn = await on_b
    assert b_turn.waited_s >= 0 and turns.waiting("b") == 2  # type: ignore[attr-defined]
    b_turn.end()  # type: ignore[attr-defined]
    b_turn.end()  # type: ignore[attr-defined]  # once, however often
    await settle()
    assert order == ["a", "a", "b", "a"]
    (await behind).end()  # type: ignore[attr-defined]
    await settle()
    assert order == ["a", "a", "b", "a", "b"]
    (await also_b).end()  # type: ignore[attr-defined]
    assert turns.waited == 3 and turns.timed_out == 0


async def test_a_node_in_no_turn_taking_group_never_waits() -> None:
    turns = PrefillTurns(group_of)
    held = [await turns.take("c") for _ in range(5)]
    assert all(t.ended for t in held) and turns.waited == 0


async def test_a_wait_past_max_wait_goes_ahead_without_a_turn() -> None:
    turns = PrefillTurns(group_of, max_wait_s=0.05)
    a = await turns.take("a")
    late = await turns.take("b")  # a never ends (its engine hangs)
    assert late.ended and late.waited_s >= 0.05 and turns.timed_out == 1 and turns.waiting("b") == 0
    a.end()
    again = await asyncio.wait_for(turns.take("b"), 1.0)  # the group is free again
    assert not again.ended


async def test_a_waiter_whose_client_went_passes_the_turn_on() -> None:
    turns = PrefillTurns(group_of)
    order: list[str] = []
    a = await turns.take("a")
    gone = await started(turns, "b", order)
    next_a = await started(turns, "a", order)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert turns.waiting("a") == 1
    a.end()
    await settle()
    assert order == ["a"]  # the waiter behind the one that left
    (await next_a).end()  # type: ignore[attr-defined]


def test_the_topology_names_the_groups_that_take_turns_and_refuses_an_unknown_one() -> None:
    topo = Topology.model_validate({"links": {"same_rack": LINK, "cross_rack": LINK},
                                    "capacity_groups": {"core-1": ["x", "y"], "gpu-0": ["p", "q"]},
                                    "prefill_turns": ["core-1"]})
    assert topo.turn_group("x") == ("x", "y") and topo.turn_group("p") == ("p",) and topo.turn_group("z") == ("z",)
    assert topo.capacity_group("p") == ("p", "q")
    with pytest.raises(ValueError, match="prefill_turns names 'core-2'"):
        Topology.model_validate({"links": {"same_rack": LINK, "cross_rack": LINK},
                                 "capacity_groups": {"core-1": ["x", "y"]}, "prefill_turns": ["core-2"]})
