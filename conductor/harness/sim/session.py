"""One benchmark session: a trace and a cluster, run under any policy at any speed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conductor.balance.planner import BalanceParams
from conductor.costmodel.profiles import ModelProfile, load_profile
from conductor.harness.sim.balance import BalanceLoop
from conductor.harness.sim.capacity import CapacitySearch, find_capacity
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.engine import SimResult, Simulation
from conductor.harness.sim.errors import SimulationError
from conductor.harness.sim.summary import ATTAINMENT_PLACES, summarize
from conductor.harness.sim.trace import TraceRecord, TraceRequest, long_context, read_trace, reuse_upper_bound, schedule
from conductor.routing.policies import POLICIES, make_policy
from conductor.topology import Topology

Progress = Callable[[str, int, int], None]
"""``progress(label, done, total)``: requests decided so far in the current run."""


def miss_budget(requests: int, share: float) -> int:
    """The most of ``requests`` that may miss an SLO with the attainment still at least ``share``
    as the summary rounds it (to ``ATTAINMENT_PLACES``), so a run stopped past it is one that misses."""
    if requests <= 0:
        return 0
    m = min(requests, math.floor((1.0 - share + 10.0**-ATTAINMENT_PLACES) * requests) + 1)
    while m > 0 and round((requests - m) / requests, ATTAINMENT_PLACES) < share:
        m -= 1
    return m


class Bench:
    """Holds the parsed trace and the profiles; every run builds a fresh policy and cluster."""

    def __init__(
        self,
        trace: str | Path | list[TraceRecord],
        cluster: ClusterProfile,
        *,
        seed: int = 0,
        limit: int | None = None,
        params: dict[str, dict[str, Any]] | None = None,
        bucket_ms: float = 1000.0,
        topology: Topology | None = None,
        cpp: bool | None = None,
        workload: str = "trace",
        balance: BalanceParams | None = None,
        profile: ModelProfile | None = None,
        policy_profile: ModelProfile | None = None,
    ) -> None:
        self.records = read_trace(trace) if isinstance(trace, (str, Path)) else trace
        if workload == "long-context":
            self.records = long_context(self.records, block_size=cluster.block_size)
        elif workload != "trace":
            raise SimulationError(f"--workload {workload!r}: expected trace or long-context")
        self.topology = topology
        self.cpp = cpp
        if limit is not None:
            self.records = self.records[:limit]
        self.cluster = cluster
        self.profile = profile if profile is not None else load_profile(cluster.model_profile)
        """The cost model the simulated engines run on (a calibrated one for recorded traffic)."""
        self.policy_profile = policy_profile
        """The cost model the policies predict with, when not the engines' (recorded traffic on a
        measured profile: the routers predicted with theirs); None: ``profile``."""
        self.seed = seed
        self.params = params or {}
        self.bucket_ms = bucket_ms
        self.balance = balance
        """Balance planner parameters; runs with balancing on use them (None: default ones)."""
        self._schedules: dict[float, list[TraceRequest]] = {}
        self.upper_bound = reuse_upper_bound(self.requests(1.0), cluster.block_size)

    def requests(self, speed: float) -> list[TraceRequest]:
        s = self._schedules.get(speed)
        if s is None:
            s = schedule(self.records, speed=speed, bucket_ms=self.bucket_ms)
            self._schedules = {speed: s}  # keep one: capacity probes rarely repeat a speed
        return s

    def balance_loop(self) -> BalanceLoop:
        """A fresh balance loop for one run: the planner's parameters, with replicas written to
        the tier the simulated prefill caches live in."""
        # The simulated pool executes no commands yet (its puts come from evictions only), so the
        # planner does not name it as a replica target here.
        params = (self.balance or BalanceParams()).model_copy(
            update={"replica_tier": self.cluster.prefill_cache_tier, "pool_copies": False})
        return BalanceLoop(params, self.profile, self.cluster.block_size)

    def run(self, policy: str, speed: float, progress: Progress | None = None,
            balance: bool = False, stop_below: float | None = None) -> tuple[dict[str, Any], SimResult]:
        """Simulate ``policy`` (a registered name, or ``name:variant``) at ``speed``, with the
        KVCache balance loop when ``balance``; (summary, raw result).

        ``stop_below``: stop the replay once its SLO attainment can no longer reach this share (more
        requests missed than it allows); the summary then says ``stopped_early`` and its attainments
        are upper bounds, below ``stop_below``. A run that reaches it is the same as without."""
        reqs = self.requests(speed)
        # "name:variant" runs policy ``name`` with the parameters given for "name:variant",
        # so ablations of one policy can share a run and a table.
        base = policy.split(":", 1)[0]
        params = dict(self.params.get(policy) or {})
        if self.cpp is not None and "cpp" in POLICIES[base].Params.model_fields:
            params["cpp"] = self.cpp
        pol = make_policy(base, params, self.policy_profile or self.profile, self.topology)
        label = f"{policy}{' +balance' if balance else ''} @ {speed:.3g}x"
        cb = (lambda done: progress(label, done, len(reqs))) if progress is not None else None
        t0 = time.perf_counter()
        loop = self.balance_loop() if balance else None
        budget = None if stop_below is None else miss_budget(len(reqs), stop_below)
        result = Simulation(self.cluster, self.profile, pol, reqs, seed=self.seed, progress=cb,
                            topology=self.topology, balance=loop, miss_budget=budget).run()
        wall = time.perf_counter() - t0
        summary = summarize(result, policy=policy, speed=speed, reuse_upper_bound=self.upper_bound, sim_wall_s=wall)
        summary["balance"] = balance
        if result.balance is not None:
            summary.update(result.balance)
        if self.params.get(policy):
            summary["params"] = self.params[policy]
        return summary, result

    def capacity(self, policy: str, *, target: float = 0.9, progress: Progress | None = None,
                 balance: bool = False) -> CapacitySearch:
        return find_capacity(
            lambda s: self.run(policy, s, progress, balance)[0], target=target, start=self.cluster.default_speed
        )

    def arrival_rate(self, speed: float) -> float:
        """Requests per second the trace offers at ``speed``."""
        reqs = self.requests(speed)
        span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
        return len(reqs) / span if span > 0 else float("nan")
