"""``conductor plan``: how many prefill and decode instances the traffic needs; ``conductor planner`` re-plans on a schedule."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Annotated

import typer

from conductor.cli.common import err, exit_on, print_json, require_servers, settings_or_exit
from conductor.errors import ConfigError
from conductor.harness.plan.planner import DEFAULT_TARGET, ClusterScore, Plan, PlanConfig, plan_cluster
from conductor.harness.sim.recorded import parse_time
from conductor.harness.sim.run import DEFAULT_CLUSTER_PROFILE

Trace = Annotated[Path | None, typer.Option(
    "--trace", help="Mooncake-format JSONL trace to plan for; or --since (this cluster's own log)")]
Since = Annotated[str | None, typer.Option(
    "--since", help="plan for this cluster's recorded traffic from then on (the topics `simulate --from-topics` "
    "reads): 30m/2h/1d ago, an ISO 8601 time or epoch ms")]
Until = Annotated[str | None, typer.Option("--until", help="with --since: end of the range [default: the newest record]")]
ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", help="the cost model: a profile name, a JSON file (`conductor profile calibrate`) or, with --since, "
    "'control' (the last set_profile `conductor fit` published) [default: as `conductor simulate`]")]
Cluster = Annotated[str | None, typer.Option(
    "--cluster", help="today's cluster as <P>P<D>D, e.g. 16P8D [default: the cluster profile's; with --since the "
    "recorded one]")]
ClusterProfileName = Annotated[str, typer.Option(
    "--cluster-profile", help="cluster profile (cache sizes, block size): a name or a JSON path")]
Target = Annotated[float, typer.Option(
    "--target", min=0.0, max=1.0, help="share of requests that must meet both SLOs (a rejected one meets none)")]
Growth = Annotated[float, typer.Option(
    "--growth", min=1e-3, help="plan for this many times the traffic (1.5 = 50 % more, at the same mix)")]
Forecast = Annotated[bool, typer.Option(
    "--forecast", help="the growth from the traffic's own arrival-rate trend, projected --horizon ahead (never below "
    "today's rate)")]
Horizon = Annotated[str, typer.Option("--horizon", help="with --forecast: how far ahead (30m, 1h, 1d)")]
TtftSlo = Annotated[float | None, typer.Option(
    "--ttft-slo-s", min=1e-3, help="TTFT SLO in seconds [default: CONDUCTOR_TTFT_SLO_S, the policy's]")]
TbtSlo = Annotated[float | None, typer.Option(
    "--tbt-slo-ms", min=1e-3, help="TBT SLO in milliseconds [default: CONDUCTOR_TBT_SLO_MS, the policy's]")]
MaxInstances = Annotated[int, typer.Option("--max-instances", min=1, help="no role is planned past this many")]
MaxSimulations = Annotated[int, typer.Option(
    "--max-simulations", min=4, help="the search's budget of simulations (headroom's are extra)")]
Headroom = Annotated[bool, typer.Option(
    "--headroom/--no-headroom", help="also bisect how much more traffic the plan and the cluster carry (a few "
    "simulations each)")]
Seed = Annotated[int | None, typer.Option("--seed", min=0, help="seed of the policy's tie-breaks [default: CONDUCTOR_SEED]")]
Limit = Annotated[int | None, typer.Option("--limit", min=1, help="plan for the first N requests only")]
TimeScale = Annotated[float, typer.Option(
    "--time-scale", min=1e-6, help="with --since: the recorded engines ran this many times faster than their cost "
    "model (emulated engines' --time-scale); the log's arrivals are replayed that much slower")]
PathOverhead = Annotated[bool, typer.Option(
    "--path-overhead/--no-path-overhead", help="with --since: each request's recorded time outside the engines "
    "(gateway, the log's round trip to its decision, the hand-off) counts toward its TTFT on top of the simulated "
    "one, as its client saw it")]
JsonOut = Annotated[bool, typer.Option(
    "--json", help="print one JSON object: prefill, decode, predicted_slo_attainment (the plan's), then plan and "
    "cluster in full")]


def duration_s(text: str, flag: str) -> float:
    """``30s``/``5m``/``1h``/``1d`` in seconds (the forms --since takes as a time ago)."""
    ms = -parse_time(text, 0, flag)
    if ms <= 0:
        raise ConfigError(f"{flag} {text!r}: expected a duration (30s, 5m, 1h, 1d)")
    return ms / 1000.0


def plan(
    trace: Trace = None,
    since: Since = None,
    until: Until = None,
    profile: ProfileOpt = None,
    cluster: Cluster = None,
    cluster_profile: ClusterProfileName = DEFAULT_CLUSTER_PROFILE,
    target: Target = DEFAULT_TARGET,
    growth: Growth = 1.0,
    forecast: Forecast = False,
    horizon: Horizon = "1h",
    ttft_slo_s: TtftSlo = None,
    tbt_slo_ms: TbtSlo = None,
    max_instances: MaxInstances = 1024,
    max_simulations: MaxSimulations = 48,
    headroom: Headroom = True,
    seed: Seed = None,
    limit: Limit = None,
    time_scale: TimeScale = 1.0,
    path_overhead: PathOverhead = True,
    json_out: JsonOut = False,
) -> None:
    """Size the cluster: the fewest prefill and decode instances that meet the SLOs for --target of the traffic.

    The traffic (a trace, or this cluster's log since --since) is replayed, --growth times faster, through the simulator with the policy in force (CONDUCTOR_POLICY; with --since the recorded one) on clusters of every size the search tries: each role is bisected with the other one ample, then the pair is checked together (about log2 P + log2 D + 2 simulations); a simulation that only has to show a cluster misses the target stops as soon as more requests have missed than the target allows. Aggregated engines are simulated as one prefill and one decode instance.

    Prints the plan and today's cluster (--cluster), each with its predicted SLO attainment, goodput, rejection rate and headroom (how much more traffic it carries before it falls below the target). Progress goes to stderr. It only advises: `conductor planner` publishes the same on a schedule for an autoscaler.

    Example: conductor plan --trace ../shared/traces/mooncake_conversation_trace.jsonl --cluster 16P8D --growth 1.5 --json

    On this cluster's last hour, with the fitted profile: conductor plan --since 1h --profile control --forecast
    """
    s = settings_or_exit()
    with exit_on():
        config = PlanConfig(trace=trace, since=since, until=until, model_profile=profile, cluster=cluster,
                            cluster_profile=cluster_profile, target=target, growth=growth, forecast=forecast,
                            horizon_s=duration_s(horizon, "--horizon"), ttft_slo_s=ttft_slo_s, tbt_slo_ms=tbt_slo_ms,
                            max_instances=max_instances, max_runs=max_simulations, headroom=headroom, seed=seed,
                            limit=limit, time_scale=time_scale, path_overhead=path_overhead)
        if since is not None:
            require_servers(s, kafka=True)
        result = plan_cluster(s, config, console=err)
    if json_out:
        print_json(result.as_dict())
    else:
        for line in describe(result):
            typer.echo(line)


def describe(p: Plan) -> list[str]:
    """The plan in a few lines for a person."""

    def row(name: str, c: ClusterScore) -> str:
        room = "-" if c.headroom is None else f"{100 * c.headroom:+.0f} % traffic"
        return (f"{name:<8} {c.prefill:>4}P {c.decode:>4}D  SLO {100 * c.predicted_slo_attainment:6.2f} %  "
                f"goodput {c.goodput_rps:.3f} req/s  rejected {100 * c.rejection_rate:.2f} %  headroom {room}")

    goal = (f"target {100 * p.target:g} %" if p.target_met
            else f"target {100 * p.target:g} % not reachable by more instances; planned for {100 * p.goal:.2f} %")
    head = (f"{p.requests} requests ({p.source}), {p.arrival_rps:.3f} req/s planned (growth {p.growth:.3g}x), "
            f"policy {p.policy}, profile {p.model_profile}, TTFT <= {p.ttft_slo_s:g} s, TBT <= {p.tbt_slo_ms:g} ms, "
            f"{goal}")
    tail = (f"{p.simulations} simulations ({p.stopped_early} stopped once the goal was out of reach) in "
            f"{p.plan_wall_s:.1f} s" + ("; the budget ran out first" if p.exhausted else ""))
    return [head, row("plan", p.plan), row("cluster", p.cluster), tail]


Every = Annotated[str, typer.Option("--every", help="re-plan this often (30s, 5m, 1h)")]
Window = Annotated[str, typer.Option("--since", help="each plan covers the log's traffic of this long before it")]
PlannerId = Annotated[str | None, typer.Option(
    "--planner-id", help="producer id of its plan records [default: planner-<host>]")]
Rounds = Annotated[int | None, typer.Option("--rounds", min=1, help="stop after this many plans [default: never]")]


def planner(
    every: Every = "5m",
    since: Window = "1h",
    profile: ProfileOpt = None,
    cluster_profile: ClusterProfileName = DEFAULT_CLUSTER_PROFILE,
    target: Target = DEFAULT_TARGET,
    growth: Growth = 1.0,
    forecast: Forecast = False,
    horizon: Horizon = "1h",
    ttft_slo_s: TtftSlo = None,
    tbt_slo_ms: TbtSlo = None,
    max_instances: MaxInstances = 1024,
    max_simulations: MaxSimulations = 48,
    headroom: Headroom = True,
    planner_id: PlannerId = None,
    rounds: Rounds = None,
) -> None:
    """Re-plan on a schedule from the log and publish the plan: Prometheus gauges and a record on the plans topic.

    Every --every it runs `conductor plan --since SINCE` (the cluster as its heartbeats show it) and sets conductor_planner_desired_instances{role=prefill|decode}, conductor_planner_current_instances{role}, conductor_planner_predicted_slo_attainment{cluster=plan|current}, conductor_planner_headroom{cluster}, conductor_planner_target_met on CONDUCTOR_METRICS_PORT, and appends a capacity_plan record to the plans topic (audit it with the console or any consumer). It never scales anything: a Kubernetes HPA or KEDA scaler reads the gauge (deploy/kubernetes/base/planner.yaml).
    """
    from conductor.harness.plan.serve import run_planner
    from conductor.telemetry import setup_metrics

    s = settings_or_exit()
    with exit_on():
        config = PlanConfig(since=since, model_profile=profile, cluster_profile=cluster_profile, target=target,
                            growth=growth, forecast=forecast, horizon_s=duration_s(horizon, "--horizon"),
                            ttft_slo_s=ttft_slo_s, tbt_slo_ms=tbt_slo_ms, max_instances=max_instances,
                            max_runs=max_simulations, headroom=headroom)
        every_s = duration_s(every, "--every")
    require_servers(s, kafka=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_metrics("conductor-planner", s.bind_host, s.metrics_port)
    try:
        run_planner(s, config, every_s=every_s, planner_id=planner_id or f"planner-{socket.gethostname()}",
                    console=err, rounds=rounds)
    except KeyboardInterrupt:
        pass


BenchDuration = Annotated[float, typer.Option("--duration", min=1.0, help="seconds of the trace slice to send")]
BenchSpeed = Annotated[float, typer.Option(
    "--speed", min=0.01, help="arrival speed-up of the slice, and the emulated engines' time scale")]
BenchSample = Annotated[int, typer.Option("--sample", min=1, help="keep every Nth conversation of the slice")]
BenchCluster = Annotated[str, typer.Option("--cluster", help="the recorded cluster as <P>P<D>D")]
BenchTarget = Annotated[float, typer.Option("--target", min=0.0, max=1.0, help="the plan's target attainment")]
BenchTrace = Annotated[Path | None, typer.Option("--trace", help="Mooncake-format JSONL trace [default: the bundled one]")]
BenchMax = Annotated[int | None, typer.Option("--max-requests", min=1, help="send at most this many requests")]
BenchJson = Annotated[bool, typer.Option(
    "--json", help="print one JSON object: prefill, decode, predicted_slo_attainment, measured_slo_attainment, "
    "difference_points (the planned cluster's), then the recorded and planned clusters in full")]


def bench_plan(duration: BenchDuration = 30.0, speed: BenchSpeed = 10.0, sample: BenchSample = 6,
               cluster: BenchCluster = "1P1D", target: BenchTarget = 0.95, trace: BenchTrace = None,
               ttft_slo_s: TtftSlo = None, tbt_slo_ms: TbtSlo = None, max_requests: BenchMax = None,
               json_out: BenchJson = False) -> None:
    """Check conductor plan against what happened: record a run, plan it, run the plan, compare SLO attainment.

    On emulated engines: the trace slice through Conductor on the recorded --cluster (every record on an embedded broker's topics); `conductor plan --since` on those topics (--time-scale --speed; the engines' cost model calibrated on the gateways' outcomes, each request's recorded time outside the engines counted toward its TTFT) for --target; the same slice on a fresh cluster of the planned size. Prints each cluster's predicted and measured SLO attainment (both SLOs met, rejected or unanswered requests missed), their difference in points, and the measured TTFT split (real seconds outside the engines, model seconds inside). The emulated engines are timed by the same cost model the policy and the simulator use: this checks the search, the replay and the simulated queueing against a running cluster, not the cost model.
    """
    from conductor.harness.bench.plan import PlanBenchOptions, run_plan_bench
    from conductor.harness.sim.cluster import load_cluster

    s = settings_or_exit()
    with exit_on():
        counts = load_cluster(DEFAULT_CLUSTER_PROFILE).with_counts(cluster)
        out = run_plan_bench(s, PlanBenchOptions(duration_s=duration, speed=speed, sample=sample, trace=trace,
                                                 prefill=counts.prefill_instances, decode=counts.decode_instances,
                                                 target=target,
                                                 ttft_slo_s=ttft_slo_s, tbt_slo_ms=tbt_slo_ms,
                                                 max_requests=max_requests))
    if json_out:
        print_json(out)
        return
    for c in (out["recorded"], out["planned"]):
        err.print(f"{c['cluster']:<8} {c['prefill']}P{c['decode']}D: predicted {100 * c['predicted_slo_attainment']:.1f} %, "
                  f"measured {100 * c['measured_slo_attainment']:.1f} % ({c['difference_points']:+.1f} points)")
    typer.echo(json.dumps(out, indent=1))


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("plan")(plan)
    groups["app"].command("planner")(planner)
    groups["bench"].command("plan")(bench_plan)
