"""Sessions (issue 34 item 7): a conversation stays on the instance that served its session last
unless leaving pays, by the prefix holder's stay rule; the decision records the instance."""

from __future__ import annotations

import pytest

from conductor.frontdoor.protocol import (
    SESSION_HEADER,
    BadRequest,
    Prompt,
    Slo,
    parse_body,
    routing_request,
    with_session,
)
from conductor.routing.policies.prefill_plan import stay_on_holder
from schemas import RoutingDecision
from tests.unit.test_decision_time_routing import make
from tests.unit.test_router import BS, heartbeat, token_request

SHORT = list(range(7000, 7000 + 4 * BS))
LONG = list(range(9000, 9000 + 40 * BS))


@pytest.mark.parametrize(("ttfts", "held", "chosen", "session", "want", "left"), [
    ([1.0, 0.9], [0, 0], 1, 0, 0, False),    # no prefix anywhere: the session's instance is the holder
    ([1.0, 0.5], [0, 0], 1, 0, 1, True),     # leaving pays by more than the margin
    ([1.0, 0.9], [0, 10], 1, 0, 0, False),   # the pick holds a longer prefix, but gains too little
    ([1.0, 0.9], [10, 0], 0, 0, 0, False),   # the pick is the session's instance
])
def test_the_session_s_instance_is_the_holder(ttfts: list[float], held: list[int], chosen: int, session: int,
                                               want: int, left: bool) -> None:
    at, why = stay_on_holder(ttfts, held, [f"p{i}" for i in range(len(ttfts))], chosen, 0.25, session)
    assert at == want and (why is not None) == left
    if why:
        assert why.startswith("session's instance p0 predicted 1.000s")


async def _two_turns(session: str | None, queued: int = 0) -> tuple[RoutingDecision, RoutingDecision]:
    router, view, _, _ = make()
    for n in ("p0", "p1", "p2"):
        heartbeat(view, n)
    heartbeat(view, "d0", "decode")
    first = await router.route(token_request("r1", SHORT, session=session))
    assert isinstance(first, RoutingDecision) and first.session_instance is None
    if queued:  # the session's instance got busy with traffic Conductor did not send
        heartbeat(view, first.prefill_instance, queued_prefill_tokens=queued, queue_depth=40)
    second = await router.route(token_request("r2", LONG, session=session))  # another prompt
    assert isinstance(second, RoutingDecision)
    return first, second


async def test_a_session_s_turns_stay_on_its_instance_with_different_prompts() -> None:
    first, second = await _two_turns("conv-1")
    assert second.prefill_instance == first.prefill_instance
    assert second.session_instance == first.prefill_instance and second.left_holder is None
    # Without a session the second prompt goes where nothing is queued.
    first, second = await _two_turns(None)
    assert second.prefill_instance != first.prefill_instance and second.session_instance is None


async def test_a_session_leaves_its_instance_when_leaving_pays_and_says_why() -> None:
    first, second = await _two_turns("conv-1", queued=400_000)
    assert second.prefill_instance != first.prefill_instance
    assert second.session_instance == first.prefill_instance
    assert second.left_holder is not None
    assert second.left_holder.startswith(f"session's instance {first.prefill_instance} predicted")


def test_the_session_comes_from_the_header_else_the_user_field() -> None:
    body = {"model": "m", "prompt": "hi", "user": "alice"}
    creq = parse_body(body, chat=False)
    assert creq.session == "alice"
    assert with_session(creq, {SESSION_HEADER: "conv-9"}).session == "conv-9"
    assert with_session(creq, {}).session == "alice"
    assert parse_body({"model": "m", "prompt": "hi"}, chat=False).session is None
    req = routing_request("r1", with_session(creq, {SESSION_HEADER: "conv-9"}), Slo(None, None, 0),
                          Prompt([1, 2, 3]), base_model=None, reachable=[])
    assert req.session == "conv-9"
    with pytest.raises(BadRequest) as e:
        parse_body({"model": "m", "prompt": "hi", "user": 5}, chat=False)
    assert e.value.param == "user"
    with pytest.raises(BadRequest) as e:
        with_session(creq, {SESSION_HEADER: "x" * 300})
    assert e.value.param == SESSION_HEADER
