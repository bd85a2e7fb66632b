"""``conductor plan`` as one call: :class:`PlanConfig` (the command's options) → :func:`plan_cluster` → :class:`Plan`.

The traffic is what ``conductor simulate`` replays (a trace, or this cluster's recorded topics with the
cost model calibrated to what the gateways observed), at ``growth`` times its rate; every probe of the
search (:func:`~conductor.harness.plan.search.find_plan`) is one simulation of it with the policy in
force on a cluster of that size; the plan and today's cluster are then each scored, with their
headroom (how much more traffic they carry before falling below the target) when asked.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from conductor.errors import ConfigError
from conductor.harness.plan.forecast import Forecast, forecast_growth
from conductor.harness.plan.search import PlanSearch, Probe, SearchLimits, find_plan
from conductor.harness.sim.capacity import find_capacity
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.run import DEFAULT_CLUSTER_PROFILE, SimulateConfig, prepare_bench
from conductor.harness.sim.session import Bench
from conductor.settings import Settings
from conductor.stats import percentile

DEFAULT_TARGET = 0.99
HEADROOM_TOLERANCE = 0.05
"""Headroom is bisected to within this share of the traffic: a coarse number, a few simulations."""


@dataclass(frozen=True)
class PlanConfig:
    """What ``conductor plan`` is told, one field per option. Checked on construction (:class:`ConfigError`)."""

    trace: Path | None = None
    since: str | None = None
    """From the log: the start of the range (``1h``: the last hour)."""
    until: str | None = None
    model_profile: str | None = None
    cluster: str | None = None
    """Today's cluster as ``<P>P<D>D``; None: the cluster profile's, or the recorded one."""
    cluster_profile: str = DEFAULT_CLUSTER_PROFILE
    target: float = DEFAULT_TARGET
    growth: float = 1.0
    forecast: bool = False
    horizon_s: float = 3600.0
    ttft_slo_s: float | None = None
    tbt_slo_ms: float | None = None
    max_instances: int = 1024
    max_runs: int = 48
    headroom: bool = True
    seed: int | None = None
    limit: int | None = None
    time_scale: float = 1.0
    """With --since: the recorded engines ran this many times faster than their cost model (emulated
    engines' ``--time-scale``); the log's arrivals are replayed that much slower, in model time."""
    path_overhead: bool = True
    """With --since: each request's recorded time outside the engines (gateway, the log's round trip
    to its decision, the hand-off) counts toward its TTFT on top of the simulated one, as the client
    saw it; off: the engines' TTFT only (what ``simulate --from-topics`` compares)."""

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.since is None):
            raise ConfigError("give either --trace FILE or --since (a range of this cluster's log, e.g. 1h)")
        if self.until is not None and self.since is None:
            raise ConfigError("--until ends a range of the log: use it with --since")
        if not 0.0 < self.target <= 1.0:
            raise ConfigError(f"--target {self.target}: expected a share in (0, 1]")
        if self.growth <= 0:
            raise ConfigError(f"--growth {self.growth}: expected a positive factor")
        if self.forecast and self.growth != 1.0:
            raise ConfigError("--forecast computes the growth from the log: give it or --growth, not both")
        if self.time_scale <= 0 or (self.time_scale != 1.0 and self.since is None):
            raise ConfigError(f"--time-scale {self.time_scale}: a positive factor, for a recorded run (--since)")
        SearchLimits(self.max_instances, self.max_runs)

    def simulate_config(self, settings: Settings) -> SimulateConfig:
        """The ``conductor simulate`` run that replays this traffic with the policy in force."""
        from_topics = self.since is not None
        policy = "recorded" if from_topics else settings.policy
        params = None if from_topics or not settings.policy_params else json.dumps({policy: settings.policy_params})
        return SimulateConfig(
            trace=self.trace, from_topics=from_topics, since=self.since, until=self.until,
            calibrate="scale" if self.model_profile is None else "off", model_profile=self.model_profile,
            policy=policy, cluster=self.cluster, cluster_profile=self.cluster_profile,
            tbt_slo_ms=self.tbt_slo_ms if self.tbt_slo_ms is not None else settings.tbt_slo_ms,
            ttft_slo_s=self.ttft_slo_s if self.ttft_slo_s is not None else settings.ttft_slo_s,
            limit=self.limit, params=params, seed=self.seed,
            speed=1.0 / self.time_scale if from_topics and self.time_scale != 1.0 else None,
            time_scale=self.time_scale, path_overhead=from_topics and self.path_overhead)


@dataclass(frozen=True)
class ClusterScore:
    """One cluster on the planned traffic: what it is predicted to achieve."""

    prefill: int
    decode: int
    predicted_slo_attainment: float
    ttft_attainment: float
    tbt_attainment: float
    goodput_rps: float
    rejection_rate: float
    ttft_p90_s: float | None
    tbt_p90_ms: float | None
    headroom: float | None
    """Extra traffic (0.25 = 25 % more) it carries before attainment falls below the goal; negative:
    the traffic must fall by that share; None: not measured (``--no-headroom``)."""
    aggregated: int | None = None
    """The simulator models disaggregated instances only: an aggregated engine is one of each role."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The plan, today's cluster, and how they were found."""

    plan: ClusterScore
    cluster: ClusterScore
    target: float
    goal: float
    target_met: bool
    growth: float
    forecast: Forecast | None
    speed: float
    arrival_rps: float
    policy: str
    model_profile: str
    ttft_slo_s: float
    tbt_slo_ms: float
    source: str
    requests: int
    window_ms: tuple[int, int]
    """First and last arrival of the traffic planned for (epoch ms from the log; trace time for a trace)."""
    simulations: int
    stopped_early: int
    """Of the simulations, those stopped once the goal was out of reach (a cluster too small, or a
    headroom probe too fast): each answered its question with part of the replay."""
    exhausted: bool
    plan_wall_s: float
    probes: tuple[Probe, ...]
    calibration: str | None = None
    """How the cost model was fitted to the recorded outcomes (``simulate --from-topics``' line); None: a trace."""
    path_s: tuple[float | None, float | None] = (None, None)
    """p50 and p90 of the recorded time outside the engines each replayed request carries (``path_overhead``);
    (None, None) when none is counted (a trace, or ``--no-path-overhead``)."""

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object: the plan's counts and attainment at the top, then everything."""
        return {
            "prefill": self.plan.prefill, "decode": self.plan.decode, "aggregated": self.plan.aggregated,
            "predicted_slo_attainment": self.plan.predicted_slo_attainment,
            "plan": self.plan.as_dict(), "cluster": self.cluster.as_dict(),
            "target": self.target, "goal": round(self.goal, 4), "target_met": self.target_met,
            "growth": round(self.growth, 4),
            "forecast": None if self.forecast is None else {k: round(v, 4) for k, v in asdict(self.forecast).items()},
            "speed": round(self.speed, 4), "arrival_rps": round(self.arrival_rps, 4), "policy": self.policy,
            "model_profile": self.model_profile, "ttft_slo_s": self.ttft_slo_s, "tbt_slo_ms": self.tbt_slo_ms,
            "source": self.source, "requests": self.requests, "window_ms": list(self.window_ms),
            "simulations": self.simulations, "stopped_early": self.stopped_early, "exhausted": self.exhausted, "plan_wall_s": round(self.plan_wall_s, 2),
            "probes": [[p.prefill, p.decode, p.slo_attainment] for p in self.probes],
            "path_p50_s": self.path_s[0], "path_p90_s": self.path_s[1], "calibration": self.calibration,
        }


class _Runs:
    """Every simulation of one plan: ``bench`` at ``speed`` on clusters of any size, with a progress bar.

    A run asked only whether it reaches a share (``stop_below``) may stop early; it is kept, and reused
    for any later question it answers (another such share no lower), else run again in full."""

    def __init__(self, bench: Bench, base: ClusterProfile, policy: str, speed: float, bar: Progress | None) -> None:
        self.bench, self.base, self.policy, self.speed, self.bar = bench, base, policy, speed, bar
        self.summaries: dict[tuple[int, int, float], dict[str, Any]] = {}
        self._stopped_below: dict[tuple[int, int, float], float] = {}
        self.runs = 0
        """Simulations run (a stopped one run again in full counts twice)."""
        self.stopped = 0
        """Runs stopped early (their replay cut short once the goal was out of reach)."""
        self._run_task: TaskID | None = bar.add_task("plan", total=len(bench.records)) if bar is not None else None

    def summary(self, p: int, d: int, speed: float | None = None, stop_below: float | None = None) -> dict[str, Any]:
        key = (p, d, self.speed if speed is None else speed)
        known = self.summaries.get(key)
        if known is not None and (not known["stopped_early"]
                                  or (stop_below is not None and stop_below >= self._stopped_below[key])):
            return known
        self.bench.cluster = self.base.with_counts(f"{p}P{d}D")
        bar, task = self.bar, self._run_task

        def progress(label: str, done: int, total: int) -> None:
            if bar is not None and task is not None:
                bar.update(task, description=f"{p}P{d}D @ {key[2]:.3g}x (simulation {len(self.summaries) + 1})",
                           completed=done, total=total)

        s = self.bench.run(self.policy, key[2], progress, stop_below=stop_below)[0]
        self.runs += 1
        self.summaries[key] = s
        if s["stopped_early"]:
            assert stop_below is not None  # only a run asked for a share stops
            self._stopped_below[key] = stop_below
            self.stopped += 1
        return s

    def probe(self, p: int, d: int, /, stop_below: float | None = None) -> Probe:
        s = self.summary(p, d, stop_below=stop_below)
        return Probe(p, d, s["slo_attainment"] or 0.0, s["ttft_slo_attainment"] or 0.0, s["tbt_slo_attainment"] or 0.0,
                     stopped=s["stopped_early"])

    def score(self, p: int, d: int, goal: float, headroom: bool) -> ClusterScore:
        s = self.summary(p, d)
        room = None
        if headroom:
            found = find_capacity(lambda sp: self.summary(p, d, sp, stop_below=goal), target=goal,
                                  start=self.speed, rel_tol=HEADROOM_TOLERANCE)
            room = round(found.capacity_speed / self.speed - 1.0, 3)
        n = max(1, s["requests"])
        return ClusterScore(
            prefill=p, decode=d, predicted_slo_attainment=s["slo_attainment"] or 0.0,
            ttft_attainment=s["ttft_slo_attainment"] or 0.0, tbt_attainment=s["tbt_slo_attainment"] or 0.0,
            goodput_rps=s["goodput_rps"] or 0.0, rejection_rate=round(s["rejected"] / n, 4),
            ttft_p90_s=s["ttft_p90_s"], tbt_p90_ms=s["tbt_p90_ms"], headroom=room)


def plan_cluster(settings: Settings, config: PlanConfig, *, console: Console) -> Plan:
    """Find the smallest cluster that meets ``config.target`` on the configured traffic, and score it
    and today's cluster. Progress goes to ``console`` (a transient bar)."""
    t0 = time.perf_counter()
    bench, names, speed, calibration = prepare_bench(settings, config.simulate_config(settings), console)
    policy = names[0]
    base = bench.cluster
    today = (base.prefill_instances, base.decode_instances)
    arrivals = [r.timestamp_ms for r in bench.records]
    fc = forecast_growth(arrivals, horizon_s=config.horizon_s) if config.forecast else None
    growth = fc.growth if fc is not None else config.growth
    planned_speed = speed * growth
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        runs = _Runs(bench, base, policy, planned_speed, bar)
        search: PlanSearch = find_plan(runs.probe, start=today, target=config.target,
                                       limits=SearchLimits(config.max_instances, config.max_runs))
        plan = runs.score(search.prefill, search.decode, search.goal, config.headroom)
        cluster = runs.score(*today, search.goal, config.headroom)
    first, last = (int(min(arrivals)), int(max(arrivals))) if arrivals else (0, 0)
    return Plan(
        plan=plan, cluster=cluster, target=config.target, goal=search.goal, target_met=search.target_met,
        growth=growth, forecast=fc, speed=planned_speed, arrival_rps=bench.arrival_rate(planned_speed),
        policy=policy, model_profile=bench.profile.name, ttft_slo_s=base.ttft_slo_s, tbt_slo_ms=base.tbt_slo_ms,
        source="trace" if config.trace is not None else "topics", requests=len(bench.records),
        window_ms=(first, last), simulations=runs.runs, stopped_early=runs.stopped, exhausted=search.exhausted,
        plan_wall_s=time.perf_counter() - t0, probes=search.probes, path_s=_path_percentiles(bench),
        calibration=None if calibration is None else calibration.describe())


def _path_percentiles(bench: Bench) -> tuple[float | None, float | None]:
    paths = sorted(r.path_s for r in bench.records)
    if not any(paths):
        return None, None
    p50, p90 = percentile(paths, 50), percentile(paths, 90)
    return (None if p50 is None else round(p50, 3)), (None if p90 is None else round(p90, 3))


__all__ = ["DEFAULT_TARGET", "ClusterScore", "Plan", "PlanConfig", "plan_cluster"]
