"""``conductor simulate``: replay a trace through the simulated cluster under one or more policies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from conductor.cli.common import err, exit_on, print_json, settings_or_exit
from conductor.harness.sim.run import DEFAULT_CLUSTER_PROFILE, DEFAULT_TARGET, SimulateConfig, run_simulation

Trace = Annotated[Path | None, typer.Option(
    "--trace", help="Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids of 512-token "
    "blocks); or --from-topics")]
FromTopics = Annotated[bool, typer.Option(
    "--from-topics", help="replay this cluster's own recorded traffic (requests, heartbeats, dispatch, "
    "request-outcomes on the topics of CONDUCTOR_TOPIC_PREFIX) instead of a trace: the cluster from its heartbeats, "
    "the cost model calibrated to the observed TTFTs")]
Since = Annotated[str | None, typer.Option(
    "--since", help="--from-topics: start of the range: 30m/2h/1d ago, an ISO 8601 time or epoch ms "
    "[default: the oldest record]")]
Until = Annotated[str | None, typer.Option(
    "--until", help="--from-topics: end of the range (same forms) [default: the newest record]")]
Calibrate = Annotated[str | None, typer.Option(
    "--calibrate", help="--from-topics: scale (prefill compute scaled until the recorded policy's simulated TTFT p50 "
    "matches the observed one), fit (prefill coefficients fitted to the observed prompt/cached/TTFT) or off "
    "[default: scale; off with --profile]")]
ModelProfileOpt = Annotated[str | None, typer.Option(
    "--profile", "--model-profile", help="the cost model the simulated engines run on: a profile name, a JSON file "
    "(`conductor profile calibrate` measures one on a live engine) or, with --from-topics, 'control' (the last "
    "set_profile on the control topic: the fit `conductor fit` publishes) [default: the cluster profile's; with "
    "--from-topics CONDUCTOR_MODEL_PROFILE]")]
Policy = Annotated[str, typer.Option(
    "--policy", help="comma-separated policy names, or 'all'; with --from-topics 'recorded' names the policy the "
    "cluster ran; NAME:VARIANT runs NAME with the --params given under 'NAME:VARIANT' (ablations)")]
Cluster = Annotated[str | None, typer.Option(
    "--cluster", help="instance counts as <P>P<D>D, e.g. 16P8D [default: the cluster profile's]")]
ClusterProfileName = Annotated[str, typer.Option(
    "--cluster-profile", help="cluster profile: a name (conductor/costmodel/data/cluster-<name>.json) or a JSON path")]
Speed = Annotated[float | None, typer.Option(
    "--speed", min=1e-6, help="arrival speed-up: 2 = twice the trace's rate [default: the cluster profile's]")]
Capacity = Annotated[bool, typer.Option(
    "--capacity", help="also find the effective request capacity: the highest speed at which --target of requests "
    "meet both SLOs (bisection)")]
Target = Annotated[float, typer.Option("--target", min=0.0, max=1.0, help="SLO attainment that defines capacity")]
TbtSlo = Annotated[float | None, typer.Option("--tbt-slo-ms", min=1e-3, help="TBT SLO (paper: 100, 200 or 300)")]
TtftSlo = Annotated[float | None, typer.Option("--ttft-slo-s", min=1e-3, help="TTFT SLO (paper: 30)")]
ViewDelay = Annotated[float | None, typer.Option(
    "--view-delay-ms", min=0.0, help="KV event → view propagation delay (stale views)")]
Limit = Annotated[int | None, typer.Option("--limit", min=1, help="replay only the first N requests of the trace")]
Params = Annotated[str | None, typer.Option(
    "--params", help='per-policy parameters as JSON {"kvcache-centric": {"slo_margin": 0.9}} or @file.json')]
Seed = Annotated[int | None, typer.Option(
    "--seed", min=0, help="seed of the policies' tie-breaks [default: CONDUCTOR_SEED]")]
Balance = Annotated[str, typer.Option(
    "--balance", help="on: run the KVCache balance loop (conductor balance's planner + the nodes executing its "
    "commands); off; both: each policy twice")]
BalanceParamsJson = Annotated[str | None, typer.Option(
    "--balance-params", help='balance planner parameters as JSON {"hot_threshold": 2} or @file.json')]
JsonOut = Annotated[bool, typer.Option("--json", help="one JSON line per policy on stdout")]
Report = Annotated[Path | None, typer.Option("--report", help="write DIR/README.md and PNG plots")]
Cpp = Annotated[str | None, typer.Option(
    "--cpp", help="on|off: chunked pipeline parallelism of policies that have it (kvcache-centric's cpp parameter) "
    "[default: the policy's]")]
TopologyFile = Annotated[Path | None, typer.Option(
    "--topology", help="cluster topology JSON (racks, zones, links; docs/topology.md) "
    "[default: CONDUCTOR_TOPOLOGY_FILE, else the model profile's two link speeds]")]
Workload = Annotated[str, typer.Option(
    "--workload", help="trace: the trace as is; long-context: every 20th request with its prompt moved to "
    "32k-128k tokens by its length rank and its prefix sharing kept (docs/simulation/cpp-topology.md)")]


def simulate(
    trace: Trace = None,
    from_topics: FromTopics = False,
    since: Since = None,
    until: Until = None,
    calibrate_mode: Calibrate = None,
    model_profile: ModelProfileOpt = None,
    policy: Policy = "all",
    cluster: Cluster = None,
    profile: ClusterProfileName = DEFAULT_CLUSTER_PROFILE,
    speed: Speed = None,
    capacity: Capacity = False,
    target: Target = DEFAULT_TARGET,
    tbt_slo_ms: TbtSlo = None,
    ttft_slo_s: TtftSlo = None,
    view_delay_ms: ViewDelay = None,
    limit: Limit = None,
    params: Params = None,
    seed: Seed = None,
    balance: Balance = "off",
    balance_params: BalanceParamsJson = None,
    json_out: JsonOut = False,
    report: Report = None,
    cpp: Cpp = None,
    topology: TopologyFile = None,
    workload: Workload = "trace",
) -> None:
    """Replay a trace through a simulated prefill/decode cluster and score the policies.

    Every request is placed by the real policy function on a snapshot built from the real fold/view path (KV events reach the view --view-delay-ms late, so views can be stale).

    Prints per policy: TTFT/TBT percentiles, SLO attainment, goodput, prefix reuse against the infinite-cache bound, rejections, load balance and, with --capacity, the effective request capacity. Progress goes to stderr; --json prints one JSON line per policy on stdout.

    Example: conductor simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl --policy all --cluster 16P8D --capacity --json --report docs/simulation

    What-if on this cluster's own traffic (what would least-loaded have done over the last day):
    conductor simulate --from-topics --since 1d --policy recorded,least-loaded --report whatif

    The same on the engines' measured costs: --profile calibrated.json (conductor profile calibrate) or --profile control (the fitted profile on the control topic).
    """
    s = settings_or_exit()
    config = SimulateConfig(
        trace=trace, from_topics=from_topics, since=since, until=until,
        calibrate=calibrate_mode or ("scale" if model_profile is None else "off"), model_profile=model_profile,
        policy=policy,
        cluster=cluster, cluster_profile=profile, speed=speed, capacity=capacity, target=target,
        tbt_slo_ms=tbt_slo_ms, ttft_slo_s=ttft_slo_s, view_delay_ms=view_delay_ms, limit=limit, params=params,
        seed=seed, balance=balance, balance_params=balance_params, json_out=json_out, report=report, cpp=cpp,
        topology=topology, workload=workload,
    )

    def say(name: str, summary: dict[str, Any]) -> None:
        if json_out:
            print_json(summary)
        else:
            err.print(_summary_line(name, summary, capacity))

    run_simulation(s, config, console=err, on_summary=say)


def _summary_line(name: str, summary: dict[str, Any], capacity: bool) -> str:
    return (
        f"[bold]{name}[/bold]: TTFT mean {summary['ttft_mean_s']} s p90 {summary['ttft_p90_s']} s, "
        f"TBT p90 {summary['tbt_p90_ms']} ms, SLO {summary['slo_attainment']}, "
        f"goodput {summary['goodput_rps']} req/s, reuse {summary['reuse_ratio']} "
        f"(bound {summary['reuse_upper_bound']}), rejected {summary['rejected']}"
        + (f", capacity {summary['capacity_speed']}x" if capacity else "")
        + f" [{summary['sim_wall_s']} s]"
    )


FidDuration = Annotated[float, typer.Option("--duration", min=1.0, help="seconds of the trace slice to send")]
FidSpeed = Annotated[float, typer.Option("--speed", min=0.01, help="arrival speed-up of the slice")]
FidSample = Annotated[int, typer.Option("--sample", min=1, help="keep every Nth request of the slice")]
FidEngines = Annotated[int, typer.Option("--engines", min=1, max=8, help="aggregated vLLM engines")]
FidMax = Annotated[int | None, typer.Option("--max-requests", min=1, help="send at most this many requests")]
FidRepeats = Annotated[int, typer.Option("--repeats", min=1, help="passes over the calibration grid (swept before the recording and again after it)")]
FidOut = Annotated[Path | None, typer.Option("--profile-out", dir_okay=False, help="write the calibrated profile "
    "here [default: the run's log folder]")]


def bench_sim_fidelity(duration: FidDuration = 60.0, speed: FidSpeed = 10.0, sample: FidSample = 6,
                       engines: FidEngines = 2, max_requests: FidMax = None, repeats: FidRepeats = 2,
                       profile_out: FidOut = None, json_out: JsonOut = False) -> None:
    """Check the simulator against a real run: calibrate, record, simulate from the topics, compare.

    On real vLLM CPU engines (scripts/vllm-kit): `profile calibrate`'s sweep against the first engine; the demo's trace slice through Conductor (every record on an embedded broker's topics) by the openai client; then `simulate --from-topics --policy recorded` with the calibrated --profile, with the configured profile as it is, and with it scaled to the observed TTFT p50 (--calibrate scale). Prints each simulated TTFT p50/p90 against the clients' (vs_client: simulated / observed - 1) and against the gateway's TTFT less routing (what the simulator models).
    """
    from conductor.harness.bench.live_vllm import VllmLiveOptions  # the official client: the harness extra's
    from conductor.harness.bench.sim_vllm import SimFidelityOptions, run_sim_fidelity

    s = settings_or_exit()
    live = VllmLiveOptions(duration_s=duration, speed=speed, sample=sample, engines=engines,
                           max_requests=max_requests)
    plan = dataclasses.replace(SimFidelityOptions().plan, repeats=repeats)
    with exit_on():
        out = run_sim_fidelity(s, SimFidelityOptions(live=live, plan=plan, profile_out=profile_out))
    if json_out:
        print_json(out)
        return
    c = out["observed_client_ttft"]
    err.print(f"observed (clients): TTFT p50 {c['p50']} s, p90 {c['p90']} s over {out['sent']} requests")
    for name, sim in out["simulated"].items():
        v = sim["vs_client"]
        err.print(f"simulated, {name}: p50 {sim['ttft_p50_s']} s ({_signed(v['p50'])}), "
                  f"p90 {sim['ttft_p90_s']} s ({_signed(v['p90'])})")
    typer.echo(json.dumps(out, indent=1))


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.1f} %"


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("simulate")(simulate)
    groups["bench"].command("sim-fidelity")(bench_sim_fidelity)
