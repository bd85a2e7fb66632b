"""``GET /api/plan``: the newest capacity plan on the ``plans`` topic (``conductor planner``'s), for the console.

Read on demand (the last record of the topic's one partition) and kept ``CACHE_S``: a planner
publishes every few minutes, the console asks every ``PLAN_POLL_S``.
"""

from __future__ import annotations

import time
from typing import Any

from aiokafka.errors import KafkaError
from fastapi import FastAPI, HTTPException

from conductor.settings import Settings
from schemas.records import CapacityPlan
from streams.follow import Follower, OnBad, Tail
from streams.topics import topics

CACHE_S = 10.0


async def latest_plan(settings: Settings) -> dict[str, Any] | None:
    """The newest ``capacity_plan`` record with its offset, time and planner; None when there is none."""
    plans = topics(settings.topic_config()).plans
    async with Follower(settings.kafka(), [(plans, Tail(1))], on_bad=OnBad.SKIP, name="admin-plans",
                        max_records=None) as follower:
        if not any(end > 0 for end in follower.ends.values()):
            return None
        found: dict[str, Any] | None = None
        for batch in await follower.fetch(timeout_ms=2000):
            for rec in batch.records:
                env = rec.env
                if env is not None and isinstance(env.body, CapacityPlan):
                    found = {"offset": rec.offset, "ts_ms": env.ts_ms, "planner": env.producer_id,
                             **env.body.model_dump(mode="json")}
        return found


def add_plan_routes(app: FastAPI, settings: Settings, read: Any) -> None:
    """Register ``GET /api/plan`` (``read`` scope) on ``app``."""
    cached: dict[str, Any] = {"at": -CACHE_S, "plan": None}

    @app.get("/api/plan", tags=["cluster"], dependencies=[read])
    async def plan() -> dict[str, Any]:
        """The newest capacity plan (`conductor planner`): instances per role advised and the attainment
        predicted for them and for the cluster it was made on; ``plan`` is null before the first."""
        if time.monotonic() - cached["at"] >= CACHE_S:
            try:
                cached["plan"] = await latest_plan(settings)
            except KafkaError as e:
                raise HTTPException(503, f"the plans topic is unreachable: {e}") from None
            cached["at"] = time.monotonic()
        return {"plan": cached["plan"]}


__all__ = ["add_plan_routes", "latest_plan"]
