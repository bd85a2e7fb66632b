"""``GET /api/plan``'s reader (conductor/admin/plans.py) on the real embedded broker: the newest
capacity plan of the ``plans`` topic, None before the first, a bad record passed over."""

from __future__ import annotations

import pytest

from conductor.admin.plans import latest_plan
from schemas import encode, envelope
from schemas.records import CapacityPlan
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration


def _plan(prefill: int, decode: int) -> CapacityPlan:
    return CapacityPlan(prefill=prefill, decode=decode, predicted_slo_attainment=0.99, cluster_prefill=16,
                        cluster_decode=8, cluster_slo_attainment=0.98, target=0.99, growth=1.0, ttft_slo_s=30.0,
                        tbt_slo_ms=100.0, policy="kvcache-centric", model_profile="p", window_start_ms=0,
                        window_end_ms=3_600_000, requests=1500, goodput_rps=0.4, rejection_rate=0.02,
                        simulations=11)


async def test_latest_plan_is_the_newest_record(settings):
    plans = topics(settings.topic_config()).plans
    await kafka.ensure_topics(settings.kafka(), (plans,))
    assert await latest_plan(settings) is None  # an empty topic: no plan yet
    prod = kafka.producer(settings.kafka())
    await prod.start()
    try:
        for i, (p, d) in enumerate([(6, 2), (7, 3)]):
            env = envelope(_plan(p, d), producer_id="planner-1", producer_seq=i, ts_ms=1000 + i)
            await prod.send_and_wait(plans.name, encode(env), partition=0)
    finally:
        await prod.stop()
    got = await latest_plan(settings)
    assert got is not None
    assert (got["prefill"], got["decode"], got["planner"], got["ts_ms"]) == (7, 3, "planner-1", 1001)
