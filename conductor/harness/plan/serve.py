"""``conductor planner``: re-plan on a schedule from the log; publish gauges and a plan record. It advises, never scales.

Each round plans the last ``--since`` of this cluster's recorded traffic (:func:`plan_cluster`), sets
the Prometheus gauges an autoscaler reads (``conductor_planner_desired_instances{role}``, the predicted
attainment of the plan and of today's cluster), and appends a :class:`schemas.records.CapacityPlan` to
the ``plans`` topic, so every plan can be audited later beside the decisions it was made from. A round
that fails (no traffic in the window, the log unreachable) is logged and counted; the gauges keep the
last plan, and the next round tries again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from aiokafka.errors import KafkaError
from opentelemetry import metrics
from rich.console import Console

from conductor.errors import ConductorError
from conductor.harness.plan.planner import Plan, PlanConfig, plan_cluster
from conductor.settings import Settings
from schemas import encode, envelope, headers
from schemas.records import CapacityPlan
from streams.kafka import ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)


def plan_record(plan: Plan) -> CapacityPlan:
    """The record of ``plan`` on the ``plans`` topic."""
    return CapacityPlan(
        prefill=plan.plan.prefill, decode=plan.plan.decode,
        predicted_slo_attainment=plan.plan.predicted_slo_attainment,
        cluster_prefill=plan.cluster.prefill, cluster_decode=plan.cluster.decode,
        cluster_slo_attainment=plan.cluster.predicted_slo_attainment, target=plan.target,
        target_met=plan.target_met, growth=plan.growth, ttft_slo_s=plan.ttft_slo_s, tbt_slo_ms=plan.tbt_slo_ms,
        policy=plan.policy, model_profile=plan.model_profile, window_start_ms=max(0, plan.window_ms[0]),
        window_end_ms=max(0, plan.window_ms[1]), requests=plan.requests, goodput_rps=plan.plan.goodput_rps,
        rejection_rate=plan.plan.rejection_rate, headroom=plan.plan.headroom, simulations=plan.simulations)


class PlannerMetrics:
    """The gauges an autoscaler reads, and the planner's own health."""

    def __init__(self) -> None:
        m = metrics.get_meter(__name__)
        self.desired = m.create_gauge(
            "conductor_planner_desired_instances", unit="1",
            description="instances per role (prefill, decode) the last plan advises")
        self.current = m.create_gauge(
            "conductor_planner_current_instances", unit="1",
            description="instances per role of the cluster the last plan was made on")
        self.attainment = m.create_gauge(
            "conductor_planner_predicted_slo_attainment", unit="1",
            description="share of requests meeting both SLOs as the simulator predicts it, by cluster (plan, current)")
        self.target_met = m.create_gauge(
            "conductor_planner_target_met", unit="1", description="1 when the plan meets the target attainment")
        self.headroom = m.create_gauge(
            "conductor_planner_headroom", unit="1",
            description="extra traffic each cluster (plan, current) carries before falling below the target")
        self.seconds = m.create_gauge("conductor_planner_plan_seconds", unit="s", description="time the last plan took")
        self.plans = m.create_counter("conductor_planner_plans", description="plans made and published")
        self.failures = m.create_counter("conductor_planner_failures", description="planning rounds that failed")

    def plan(self, plan: Plan) -> None:
        for role, n in (("prefill", plan.plan.prefill), ("decode", plan.plan.decode)):
            self.desired.set(n, {"role": role})
        for role, n in (("prefill", plan.cluster.prefill), ("decode", plan.cluster.decode)):
            self.current.set(n, {"role": role})
        for name, score in (("plan", plan.plan), ("current", plan.cluster)):
            self.attainment.set(score.predicted_slo_attainment, {"cluster": name})
            if score.headroom is not None:
                self.headroom.set(score.headroom, {"cluster": name})
        self.target_met.set(1 if plan.target_met else 0)
        self.seconds.set(plan.plan_wall_s)
        self.plans.add(1)


async def publish_plan(settings: Settings, record: CapacityPlan, *, planner_id: str) -> int:
    """Append ``record`` to the ``plans`` topic; its offset."""
    t = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), (t.plans,))
    prod = producer(settings.kafka())
    await prod.start()
    try:
        env = envelope(record, producer_id=planner_id, producer_seq=time.time_ns() // 1000,
                       ts_ms=int(time.time() * 1000))
        md = await prod.send_and_wait(t.plans.name, encode(env), key=planner_id.encode(), headers=headers(env),
                                      partition=0)
        return int(md.offset)
    finally:
        await prod.stop()


def run_planner(settings: Settings, config: PlanConfig, *, every_s: float, planner_id: str, console: Console,
                stop: threading.Event | None = None, rounds: int | None = None) -> None:
    """Plan every ``every_s`` (from the start of one round to the next) until ``stop`` or ``rounds`` rounds."""
    stop = stop or threading.Event()
    m = PlannerMetrics()
    done = 0
    while not stop.is_set() and (rounds is None or done < rounds):
        began = time.monotonic()
        try:
            plan = plan_cluster(settings, config, console=console)
            offset = asyncio.run(publish_plan(settings, plan_record(plan), planner_id=planner_id))
        except (ConductorError, KafkaError) as e:  # no traffic in the window, an unreadable log: try again next round
            m.failures.add(1)
            log.warning("planning failed: %s", e)
        else:
            m.plan(plan)
            log.info("plans offset %d: %dP%dD (predicted %.3f; today %dP%dD %.3f) in %.1f s", offset,
                     plan.plan.prefill, plan.plan.decode, plan.plan.predicted_slo_attainment, plan.cluster.prefill,
                     plan.cluster.decode, plan.cluster.predicted_slo_attainment, plan.plan_wall_s)
        done += 1
        if rounds is None or done < rounds:
            stop.wait(max(0.0, every_s - (time.monotonic() - began)))


__all__ = ["PlannerMetrics", "plan_record", "publish_plan", "run_planner"]
