"""``conductor simulate`` as one call: :class:`SimulateConfig` (the command's options) → :func:`run_simulation`.

Reads the trace (or this cluster's recorded topics, with the cost model calibrated to what the
gateways observed), runs every policy (twice with ``balance="both"``), optionally bisects each
one's capacity, and writes the report. Progress goes to the console given; each policy's
summary goes to ``on_summary`` as soon as it is done.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from conductor.balance.planner import BalanceParams
from conductor.costmodel.profiles import ModelProfile, load_profile
from conductor.errors import ConfigError
from conductor.harness.sim.capacity import find_capacity
from conductor.harness.sim.cluster import ClusterProfile, load_cluster
from conductor.harness.sim.engine import SimResult
from conductor.harness.sim.from_topics import read_recorded
from conductor.harness.sim.recorded import Calibration, RecordedTraffic, calibrate, parse_time, recorded_traffic
from conductor.harness.sim.report import PolicyRun, write_report
from conductor.harness.sim.session import Bench
from conductor.harness.sim.session import Progress as ProgressCallback
from conductor.routing.control_log import current_control
from conductor.routing.policies import POLICIES
from conductor.settings import Settings
from conductor.topology import Topology, load_topology
from streams.spans import LogReadError
from streams.topics import topics

DEFAULT_CLUSTER_PROFILE = "paper-16p8d"
DEFAULT_TARGET = 0.9
BALANCE_MODES = {"on": [True], "off": [False], "both": [False, True]}
CONTROL_PROFILE = "control"
"""``--profile control``: the last ``set_profile`` record on the control topic."""


@dataclass(frozen=True)
class SimulateConfig:
    """What ``conductor simulate`` is told, one field per option (the option's name, ``--`` and
    dashes dropped). Checked on construction; a bad value raises :class:`ConfigError` naming
    the option."""

    trace: Path | None = None
    from_topics: bool = False
    since: str | None = None
    until: str | None = None
    calibrate: str = "scale"
    policy: str = "all"
    cluster: str | None = None
    cluster_profile: str = DEFAULT_CLUSTER_PROFILE
    speed: float | None = None
    capacity: bool = False
    target: float = DEFAULT_TARGET
    tbt_slo_ms: float | None = None
    ttft_slo_s: float | None = None
    view_delay_ms: float | None = None
    limit: int | None = None
    params: str | None = None
    """Per-policy parameters: JSON text, or ``@file.json``."""
    seed: int | None = None
    """``None``: the settings' seed."""
    balance: str = "off"
    balance_params: str | None = None
    """Balance planner parameters: JSON text, or ``@file.json``."""
    json_out: bool = False
    """Summaries are printed as JSON lines (kept here for the report's command line)."""
    report: Path | None = None
    cpp: str | None = None
    topology: Path | None = None
    workload: str = "trace"
    model_profile: str | None = None
    """The cost model the simulated engines run on: a profile name or file (``conductor profile
    calibrate`` writes one), or ``control`` (the last ``set_profile`` on the control topic: the
    cluster's fitted model); None: the cluster profile's (a trace) or the settings' (the topics)."""
    time_scale: float = 1.0
    """With the topics: the recorded engines ran this many times faster than their cost model, so
    the engines' part of each observed TTFT is scaled by it for calibration (not a ``simulate``
    option: ``conductor plan --time-scale`` sets it, with ``speed`` = 1 / it)."""
    path_overhead: bool = False
    """With the topics: each request's observed time outside the engines counts toward the TTFT SLO
    on top of the simulated TTFT (``conductor plan``'s; ``simulate`` compares engines only)."""

    def __post_init__(self) -> None:
        if (self.trace is None) == (not self.from_topics):
            raise ConfigError("give either --trace FILE or --from-topics")
        if not self.from_topics and (self.since or self.until):
            raise ConfigError("--since/--until select a range of the topics: use them with --from-topics")
        self.policies()
        if self.balance not in BALANCE_MODES:
            raise ConfigError(f"--balance: expected on, off or both, not {self.balance!r}")
        if self.model_profile == CONTROL_PROFILE and not self.from_topics:
            raise ConfigError(f"--profile {CONTROL_PROFILE}: the control topic's fitted profile goes with --from-topics")

    def policies(self) -> list[str]:
        """Policy names; with ``from_topics`` the name 'recorded' stands for the policy the
        cluster ran, resolved once the topics are read."""
        if self.policy.strip() == "all":
            return list(POLICIES)
        names = [n.strip() for n in self.policy.split(",") if n.strip()]
        unknown = [n for n in names if n.split(":", 1)[0] not in POLICIES
                   and not (self.from_topics and n == "recorded")]
        if unknown or not names:
            raise ConfigError(f"--policy: unknown {', '.join(unknown) or '(empty)'}; known: all, {', '.join(POLICIES)}")
        return names

    def default_calibration(self) -> str:
        """``--calibrate``'s default: ``scale`` on the settings' profile, ``off`` on a profile given
        (a calibrated or fitted one is the engines' measured behaviour already)."""
        return "scale" if self.model_profile is None else "off"

    def cpp_override(self) -> bool | None:
        if self.cpp not in (None, "on", "off"):
            raise ConfigError(f"--cpp: expected on or off, got {self.cpp!r}")
        return None if self.cpp is None else self.cpp == "on"

    def command_line(self) -> str:
        """The ``conductor simulate`` command that reproduces this run (for the report), rebuilt
        from the options, not argv, so it is right however the command was invoked."""
        if self.from_topics:
            parts = ["--from-topics", *[a for f, v in (("--since", self.since), ("--until", self.until)) if v
                                        for a in (f, v)]]
            parts += ["--calibrate", self.calibrate] if self.calibrate != self.default_calibration() else []
        else:
            parts = ["--trace", str(self.trace)]
        parts += ["--policy", self.policy]
        parts += ["--profile", self.model_profile] if self.model_profile is not None else []
        for flag, value in (("--cluster", self.cluster), ("--speed", self.speed), ("--tbt-slo-ms", self.tbt_slo_ms),
                            ("--ttft-slo-s", self.ttft_slo_s), ("--view-delay-ms", self.view_delay_ms),
                            ("--limit", self.limit), ("--params", self.params), ("--seed", self.seed),
                            ("--cpp", self.cpp), ("--topology", self.topology),
                            ("--workload", self.workload if self.workload != "trace" else None),
                            ("--balance-params", self.balance_params)):
            if value is not None:
                parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        if self.balance != "off":
            parts += ["--balance", self.balance]
        if self.cluster_profile != DEFAULT_CLUSTER_PROFILE:
            parts += ["--cluster-profile", self.cluster_profile]
        if self.capacity:
            parts += ["--capacity"] + (["--target", f"{self.target:g}"] if self.target != DEFAULT_TARGET else [])
        if self.json_out:
            parts.append("--json")
        parts += ["--report", str(self.report)]
        return "conductor simulate " + " ".join(shlex.quote(a) for a in parts)


@dataclass
class _Setup:
    """A simulation ready to run: the workload, the cluster and what the report says about them."""

    bench: Bench
    names: list[str]
    speed: float
    topology: Topology | None
    traffic: RecordedTraffic | None = None
    calibration: Calibration | None = None


def run_simulation(settings: Settings, config: SimulateConfig, *, console: Console,
                   on_summary: Callable[[str, dict[str, Any]], None] = lambda _name, _summary: None) -> list[PolicyRun]:
    """Simulate every policy of ``config`` and write its report; one :class:`PolicyRun` per policy run,
    each also handed to ``on_summary(policy name, summary)`` as it ends."""
    setup = _prepare(settings, config, console)
    runs: list[PolicyRun] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("loading", total=len(setup.bench.records))

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        for name in setup.names:
            for balance in BALANCE_MODES[config.balance]:
                run = _run_policy(setup, config, name, balance, progress)
                runs.append(run)
                on_summary(name, run.summary)
    if config.report is not None:
        context = _report_context(settings, setup, config)
        title = "What-if on recorded traffic" if config.from_topics else "Conductor policy benchmark"
        md = write_report(runs, config.report, title=title, context=context, command=config.command_line(),
                          paper=not config.from_topics)
        console.print(f"report: {md}")
    return runs


def _prepare(settings: Settings, config: SimulateConfig, console: Console) -> _Setup:
    names = config.policies()
    balance = _balance_params(config.balance_params)
    prof = load_cluster(config.cluster_profile).with_counts(config.cluster)
    overrides = {k: v for k, v in (("tbt_slo_ms", config.tbt_slo_ms), ("ttft_slo_s", config.ttft_slo_s),
                                   ("view_delay_ms", config.view_delay_ms)) if v is not None}
    if overrides:
        prof = prof.model_copy(update=overrides)
    speed = config.speed if config.speed is not None else prof.default_speed
    if config.speed is not None:
        prof = prof.model_copy(update={"default_speed": config.speed})
    cpp = config.cpp_override()
    topo_file = config.topology or settings.topology_file
    topo = load_topology(topo_file) if topo_file is not None else None
    seed = settings.seed if config.seed is None else config.seed
    if config.from_topics:
        return _prepare_recorded(settings, config, console, prof, names, topo, seed, balance)
    assert config.trace is not None  # SimulateConfig holds one of the two
    model = load_profile(config.model_profile) if config.model_profile is not None else None
    if model is not None:
        prof = prof.model_copy(update={"model_profile": config.model_profile})
    bench = Bench(config.trace, prof, seed=seed, limit=config.limit, params=_params(config.params), topology=topo,
                  cpp=cpp, workload=config.workload, balance=balance, profile=model)
    return _Setup(bench, names, speed, topo)


def _prepare_recorded(settings: Settings, config: SimulateConfig, console: Console, prof: ClusterProfile,
                      names: list[str], topo: Topology | None, seed: int, balance: BalanceParams | None) -> _Setup:
    """The recorded cluster's shape comes from its heartbeats, its block size and SLOs from the
    settings the routers run with; the cluster profile gives the rest. The cost model is
    calibrated on the cluster that served the traffic; ``--cluster`` then resizes it."""
    if config.ttft_slo_s is None:
        prof = prof.model_copy(update={"ttft_slo_s": settings.ttft_slo_s})
    if config.tbt_slo_ms is None:
        prof = prof.model_copy(update={"tbt_slo_ms": settings.tbt_slo_ms})
    prof = prof.model_copy(update={"model_profile": settings.model_profile,
                                   "default_speed": config.speed if config.speed is not None else 1.0})
    model = _model_profile(settings, config.model_profile, console)
    speed = prof.default_speed
    traffic = _recorded(settings, prof, config, console)
    prof = traffic.cluster
    recorded = traffic.recorded_policy or settings.policy
    names = list(dict.fromkeys(recorded if n == "recorded" else n for n in names))
    run_params = {recorded: traffic.recorded_params or dict(settings.policy_params), **_params(config.params)}
    routers = None
    if model is not None:
        # The engines run on the measured profile; the policies predict with the routers' own, as
        # the recorded decisions did (else a what-if would credit them with what they never knew).
        routers = _routers_profile(prof.model_profile)
        named = model.name if config.model_profile == CONTROL_PROFILE else config.model_profile
        prof = prof.model_copy(update={"model_profile": named})
    bench = Bench(traffic.records, prof, seed=seed, limit=config.limit, params=run_params, bucket_ms=1.0,
                  topology=topo, cpp=config.cpp_override(), workload=config.workload, balance=balance, profile=model,
                  policy_profile=routers)
    console.print(f"recorded: {len(bench.records)} requests on {prof.prefill_instances}P{prof.decode_instances}D, "
                  f"policy {recorded}, {len(traffic.observed)} observed outcomes"
                  + (f"; left out {traffic.skipped}" if traffic.skipped else ""))
    bench.profile, calibration = calibrate(
        traffic, bench.profile, lambda p: _run_with(bench, p, recorded, speed), policy=recorded,
        method=config.calibrate)
    console.print(f"calibration: {calibration.describe()}")
    bench.cluster = prof.with_counts(config.cluster)
    return _Setup(bench, names, speed, topo, traffic, calibration)


def _run_policy(setup: _Setup, config: SimulateConfig, name: str, balance: bool,
                progress: ProgressCallback) -> PolicyRun:
    """One policy at the run speed (and, with ``capacity``, at the speeds the bisection probes)."""
    bench, speed = setup.bench, setup.speed
    cache: dict[float, tuple[dict[str, Any], Any]] = {}

    def run_at(sp: float) -> dict[str, Any]:
        if sp not in cache:
            cache[sp] = bench.run(name, sp, progress, balance=balance)
        return cache[sp][0]

    summary = run_at(speed)
    probes: list[tuple[float, float]] = [(speed, summary["slo_attainment"] or 0.0)]
    if config.capacity:
        search = find_capacity(run_at, target=config.target, start=speed)
        probes = search.probes
        summary = dict(summary)
        summary["capacity_speed"] = round(search.capacity_speed, 4)
        summary["capacity_rps"] = (
            round(bench.arrival_rate(search.capacity_speed), 4) if search.capacity_speed > 0 else 0.0
        )
        summary["capacity_target"] = config.target
        summary["capacity_probes"] = len(search.probes)
        summary["sim_wall_s"] = round(sum(v[0]["sim_wall_s"] for v in cache.values()), 3)
        summary["run_wall_s"] = cache[speed][0]["sim_wall_s"]
    if balance:
        summary = dict(summary, policy=f"{name}+balance")
    if setup.calibration is not None:
        summary = dict(summary, source="topics", calibration=setup.calibration.as_dict())
    run = PolicyRun.from_result(summary, cache[speed][1])
    run.probes = probes
    return run  # the cache of raw outcomes (large) goes with this frame


def _report_context(settings: Settings, setup: _Setup, config: SimulateConfig) -> dict[str, Any]:
    bench, prof, topo = setup.bench, setup.bench.cluster, setup.topology
    trace = config.trace
    context: dict[str, Any] = {
        ("trace" if trace is not None else "traffic"): f"`{trace.name}` ({len(bench.records)} requests)"
        if trace is not None else _recorded_context(settings, setup),
        "cluster": f"{prof.prefill_instances} prefill + {prof.decode_instances} decode instances "
                   f"(profile `{prof.name}`: {prof.description})",
        "model profile": f"`{prof.model_profile}`",
        "SLOs": f"TTFT ≤ {prof.ttft_slo_s:g} s, TBT ≤ {prof.tbt_slo_ms:g} ms",
        "arrival speed": f"{setup.speed:g}x ({bench.arrival_rate(setup.speed):.3f} req/s)",
        "view propagation delay": f"{prof.view_delay_ms:g} ms",
        "seed": bench.seed,
        "topology": f"`{topo.name}`" if topo is not None else "flat (the model profile's link speeds)",
    }
    if setup.calibration is not None:
        context["model profile"] = f"`{prof.model_profile}`, calibrated: `{bench.profile.name}`"
        context["calibration"] = setup.calibration.describe()
    return context


def _recorded_context(settings: Settings, setup: _Setup) -> str:
    traffic = setup.traffic
    assert traffic is not None

    def at(ms: int) -> str:
        return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds")

    served = list(traffic.observed.values())
    hit = sum(o.cached_tokens for o in served) / max(1, sum(o.prompt_tokens for o in served))
    ttfts = sorted(v for rid in traffic.request_ids if (v := traffic.observed_ttft_s(rid)) is not None)
    obs = (f"; observed by the gateways: {len(ttfts)} served, TTFT p50 {ttfts[len(ttfts) // 2]:.3g} s "
           f"(routing excluded), prompt cache hit {100 * hit:.1f} %") if ttfts else "; no request-outcomes"
    return (f"recorded traffic on `{settings.topic_prefix}*`: {len(setup.bench.records)} requests from "
            f"{at(traffic.first_ms)} to {at(traffic.last_ms)}, policy `{traffic.recorded_policy or settings.policy}`"
            f"{obs}")


def _params(text: str | None) -> dict[str, dict[str, Any]]:
    if not text:
        return {}
    try:
        data = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--params: not a JSON object of policy → parameters ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError('--params: expected {"policy-name": {"param": value}, ...}')
    return data


def _balance_params(text: str | None) -> BalanceParams | None:
    if not text:
        return None
    try:
        data = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
        return BalanceParams(**data)
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"--balance-params: not a JSON object of planner parameters ({e})") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"--balance-params: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _recorded(settings: Settings, base: ClusterProfile, config: SimulateConfig, console: Console) -> RecordedTraffic:
    """Read the four topics of this cluster and turn the range into a simulator workload."""
    since, until = config.since, config.until
    now = int(time.time() * 1000)
    lo = parse_time(since, now, "--since") if since else None
    hi = parse_time(until, now, "--until") if until else None
    if lo is not None and hi is not None and hi < lo:
        raise ConfigError(f"--until ({until}) is before --since ({since})")
    t = topics(settings.topic_config())
    with console.status(f"reading {t.requests.name}, {t.heartbeats.name}, {t.request_outcomes.name}, "
                        f"{t.dispatch.name}"):
        try:
            reqs, hbs, outs, disp = asyncio.run(read_recorded(settings, lo, hi))
        except LogReadError as e:
            raise ConfigError(f"--from-topics: {e}") from None
    return recorded_traffic(reqs, hbs, outs, disp, base=base, block_size=settings.block_size, since_ms=lo, until_ms=hi,
                            time_scale=config.time_scale, path=config.path_overhead)


def _model_profile(settings: Settings, name: str | None, console: Console) -> ModelProfile | None:
    """The profile ``--profile`` names: None (not given), a name or file, or the control topic's last
    ``set_profile`` (``control``; :class:`ConfigError` when the topic holds none)."""
    if name is None:
        return None
    if name != CONTROL_PROFILE:
        return load_profile(name)
    with console.status(f"reading {topics(settings.topic_config()).control.name}"):
        try:
            state = asyncio.run(current_control(settings))
        except KafkaError as e:
            raise ConfigError(f"--profile control: cannot read the control topic: {e}") from None
    if state.profile is None:
        raise ConfigError("--profile control: no set_profile record on the control topic (is `conductor fit` running?)")
    console.print(f"profile: {state.profile.name} (control offset {state.offset})")
    return state.profile


def _routers_profile(name: str) -> ModelProfile | None:
    """The profile the recorded decisions name (their ``model_profile``), if it still loads."""
    try:
        return load_profile(name)
    except ConfigError:
        return None


def _run_with(bench: Bench, profile: ModelProfile, policy: str, speed: float) -> SimResult:
    bench.profile = profile
    return bench.run(policy, speed)[1]


def prepare_bench(settings: Settings, config: SimulateConfig,
                  console: Console) -> tuple[Bench, list[str], float, Calibration | None]:
    """The workload ``config`` names, ready to run as ``conductor simulate`` would: (bench, policy
    names, speed, the calibration of recorded traffic's cost model or None); recorded traffic is read
    and its cost model calibrated. For commands that replay the same traffic on other clusters
    (``conductor plan``)."""
    setup = _prepare(settings, config, console)
    return setup.bench, setup.names, setup.speed, setup.calibration
