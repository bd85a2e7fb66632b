"""A decision's stages: timed by the caller's clock, never part of the decision."""

from __future__ import annotations

import random

from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.routing.policies import make_policy
from conductor.routing.policies.mode import decide_mode
from conductor.routing.policies.stages import (
    ADMISSION,
    CANDIDATES,
    CLUSTER,
    DECIDE,
    DECODE_PICK,
    MODE,
    PREFILL_PLAN,
    VIEW_READ,
    StageTimes,
)
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from schemas import RoutingDecision
from tests.unit.test_router import heartbeat, make_router, stored, token_request

PROFILE = load_profile(DEFAULT_PROFILE)
SNAP = ClusterSnapshot((
    Instance("p0", "prefill", prefix_blocks=(8, 8, 8), queued_prefill_tokens=4_000, queued_requests=1),
    Instance("p1", "prefill"),
    Instance("d0", "decode", batch_size=4, decode_context_tokens=8_000),
    Instance("d1", "decode", batch_size=1, decode_context_tokens=1_000),
), 512)
REQ = PolicyRequest("r", 8_192, 16)


def test_stage_times_charge_each_interval_to_the_stage_that_ends_it() -> None:
    ticks = iter([0.0, 1.0, 1.5, 4.0, 4.25, 5.0])
    times = StageTimes(lambda: next(ticks))  # created at 0
    times.start()  # 1: what came before is charged to nothing
    times.mark(CANDIDATES)  # 1.5
    times.mark("custom")  # 4
    times.mark(CANDIDATES)  # 4.25: added to the first
    times.mark(VIEW_READ)  # 5
    assert times.seconds == {CANDIDATES: 0.75, "custom": 2.5, VIEW_READ: 0.75}
    assert list(times.ms()) == [VIEW_READ, CANDIDATES, "custom"]  # the pipeline's order, then by name


def test_kvcache_centric_reports_its_stages_in_order_and_decides_as_without() -> None:
    policy = make_policy("kvcache-centric", {}, PROFILE)
    seen: list[str] = []
    staged = policy.decide_staged(REQ, SNAP, random.Random(3), seen.append)  # type: ignore[attr-defined]
    assert staged == policy.decide(REQ, SNAP, random.Random(3))
    assert seen == [CANDIDATES, PREFILL_PLAN, ADMISSION, DECODE_PICK]


def test_a_policy_without_stages_is_one_and_mode_follows() -> None:
    seen: list[str] = []
    choice = decide_mode(make_policy("least-loaded", {}, PROFILE), REQ, SNAP, random.Random(3), seen.append)
    assert choice.decision == make_policy("least-loaded", {}, PROFILE).decide(REQ, SNAP, random.Random(3))
    assert seen == [DECIDE]  # no aggregated instance: no mode to weigh
    both = ClusterSnapshot((*SNAP.instances, Instance("b0", "both")), 512)
    seen.clear()
    decide_mode(make_policy("kvcache-centric", {}, PROFILE), REQ, both, random.Random(3), seen.append)
    assert seen == [CANDIDATES, PREFILL_PLAN, ADMISSION, DECODE_PICK, MODE]


async def test_router_times_every_stage_and_the_decision_does_not_change() -> None:
    router, view, _ = make_router()
    heartbeat(view, "p0")
    heartbeat(view, "d0", role="decode")
    stored(view, "p0", router.chain_of(token_request())[:8])
    got: list[dict[str, float]] = []
    router.on_stages = got.append
    out = await router.route(token_request())
    assert isinstance(out, RoutingDecision) and out.prefill_instance == "p0"
    assert len(got) == 1 and all(v >= 0 for v in got[0].values())
    # The index path: the plan is built before the queues are walked.
    assert list(got[0]) == [VIEW_READ, CLUSTER, CANDIDATES, PREFILL_PLAN, ADMISSION, DECODE_PICK]
    again, view2, _ = make_router()
    heartbeat(view2, "p0")
    heartbeat(view2, "d0", role="decode")
    stored(view2, "p0", again.chain_of(token_request())[:8])
    same = await again.route(token_request())  # nobody listens
    assert isinstance(same, RoutingDecision)
    assert (same.prefill_instance, same.decode_instance, same.reused_tokens, same.predicted_ttft_s) == (
        out.prefill_instance, out.decode_instance, out.reused_tokens, out.predicted_ttft_s)
