"""Runtime control: the pure fold of control records, and a router deciding under it."""

from __future__ import annotations

import pytest

from conductor.routing.control import ControlState, apply_control, fold_control
from schemas import ControlCommand, RoutingDecision, RoutingRejection, chain_keys
from tests.unit.test_router import BS, TOKENS, heartbeat, make_router, stored, token_request


def cmd(action: str, **kw) -> ControlCommand:
    return ControlCommand(action=action, **kw)


@pytest.mark.parametrize(
    "records,cordoned,draining,policy,params",
    [
        ([], set(), set(), None, None),
        ([cmd("cordon", node_id="a")], {"a"}, set(), None, None),
        ([cmd("cordon", node_id="a"), cmd("drain", node_id="b"), cmd("uncordon", node_id="a")], set(), {"b"}, None, None),
        ([cmd("drain", node_id="a"), cmd("uncordon", node_id="a")], set(), set(), None, None),
        ([cmd("set_policy", policy="least-loaded")], set(), set(), "least-loaded", {}),
        ([cmd("set_policy", policy="random", params={"x": 1}), cmd("set_params", params={"y": 2})], set(), set(),
         "random", {"y": 2}),
    ],
)
def test_fold_in_log_order(records, cordoned, draining, policy, params):
    st = fold_control(enumerate(records))
    assert st.offset == len(records) - 1
    assert (set(st.cordoned), set(st.draining), st.policy) == (cordoned, draining, policy)
    assert (None if st.params is None else dict(st.params)) == params
    assert st.excluded == frozenset(cordoned | draining)


def test_a_refused_change_keeps_the_policy_but_counts_its_offset():
    def check(name, params):
        if name == "nope":
            raise ValueError("unknown policy 'nope'")

    st = fold_control([(0, cmd("set_policy", policy="least-loaded")), (1, cmd("set_policy", policy="nope"))],
                      check=check)
    assert (st.offset, st.policy, st.changes) == (1, "least-loaded", 1)
    assert "unknown policy 'nope'" in st.last_error and st.history[-1]["applied"] is False


def test_replayed_offsets_are_ignored():
    st = apply_control(ControlState(), cmd("cordon", node_id="a"), 3)
    assert apply_control(st, cmd("uncordon", node_id="a"), 3) is st
    assert apply_control(st, cmd("uncordon", node_id="a"), 2) is st


def test_control_command_needs_its_target():
    with pytest.raises(ValueError):
        ControlCommand(action="cordon")
    with pytest.raises(ValueError):
        ControlCommand(action="set_policy")


async def test_router_skips_cordoned_nodes_and_records_the_offset():
    router, view, _ = make_router()
    for n in ("p0", "p1"):
        heartbeat(view, n)
    heartbeat(view, "d0", "decode")
    stored(view, "p1", chain_keys(TOKENS, BS))
    before = await router.route(token_request("r0"))
    assert isinstance(before, RoutingDecision) and before.prefill_instance == "p1" and before.control_offset == -1
    assert before.block_size == BS and before.model_profile == router.settings.model_profile

    router.apply_control(cmd("cordon", node_id="p1"), 0)
    after = await router.route(token_request("r1"))
    assert isinstance(after, RoutingDecision) and after.prefill_instance == "p0" and after.control_offset == 0

    router.apply_control(cmd("drain", node_id="d0"), 1)
    rej = await router.route(token_request("r2"))
    assert isinstance(rej, RoutingRejection) and rej.control_offset == 1

    router.apply_control(cmd("uncordon", node_id="p1"), 2)
    router.apply_control(cmd("uncordon", node_id="d0"), 3)
    back = await router.route(token_request("r3"))
    assert isinstance(back, RoutingDecision) and back.prefill_instance == "p1" and back.control_offset == 3


async def test_router_swaps_policy_and_refuses_bad_params():
    router, view, _ = make_router()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    router.apply_control(cmd("set_policy", policy="least-loaded"), 0)
    out = await router.route(token_request("r0"))
    assert out.policy == "least-loaded" and out.control_offset == 0
    router.apply_control(cmd("set_params", params={"temprature": 1}), 1)  # a typo: refused by every router
    out = await router.route(token_request("r1"))
    assert out.policy == "least-loaded" and out.control_offset == 1
    assert "temprature" in router.control.last_error
