"""``conductor balance`` as one call: :func:`run_balancer` runs the balance worker until the process is
stopped (Faust owns the loop and the signals)."""

from __future__ import annotations

import asyncio

import faust

from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from conductor.settings import Settings
from streams.kafka import ensure_topics
from streams.topics import topics


def run_balancer(settings: Settings, params: BalanceParams, *, interval_s: float, loglevel: str = "info") -> None:
    """Create the topics, then plan every ``interval_s`` with ``params`` and publish the commands."""
    asyncio.run(ensure_topics(settings.kafka(), topics(settings.topic_config()).all()))
    balancer = Balancer(settings, params, interval_s=interval_s)
    faust.Worker(balancer.app, loglevel=loglevel).execute_from_commandline()
