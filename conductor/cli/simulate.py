"""``conductor simulate``: replay a trace through the simulated cluster under one or more policies."""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from conductor.balance.planner import BalanceParams
from conductor.cli.common import err, print_json, settings_or_exit
from conductor.errors import ConfigError
from conductor.profiles import ModelProfile
from conductor.routing.explain import read_topic
from conductor.routing.policies import POLICIES
from conductor.settings import Settings
from conductor.harness.sim.capacity import find_capacity
from conductor.harness.sim.cluster import ClusterProfile, load_cluster
from conductor.harness.sim.engine import SimResult
from conductor.harness.sim.recorded import Calibration, RecordedTraffic, calibrate, parse_time, recorded_traffic
from conductor.harness.sim.report import PolicyRun, write_report
from conductor.harness.sim.session import Bench
from conductor.topology import load_topology
from schemas import Envelope
from streams.topics import topics


def _policies(spec: str, recorded: bool = False) -> list[str]:
    """Policy names; with ``recorded`` (--from-topics) the name 'recorded' stands for the
    policy the cluster ran, resolved once the topics are read."""
    if spec.strip() == "all":
        return list(POLICIES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n.split(":", 1)[0] not in POLICIES and not (recorded and n == "recorded")]
    if unknown or not names:
        raise ConfigError(f"--policy: unknown {', '.join(unknown) or '(empty)'}; known: all, {', '.join(POLICIES)}")
    return names


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


def _recorded(s: Settings, base: ClusterProfile, since: str | None, until: str | None) -> RecordedTraffic:
    """Read the four topics of this cluster and turn the range into a simulator workload."""
    now = int(time.time() * 1000)
    lo = parse_time(since, now, "--since") if since else None
    hi = parse_time(until, now, "--until") if until else None
    if lo is not None and hi is not None and hi < lo:
        raise ConfigError(f"--until ({until}) is before --since ({since})")
    t = topics(s.topic_config())

    async def read_all() -> list[list[Envelope]]:
        return list(await asyncio.gather(*(read_topic(s, topic.name) for topic in
                                           (t.requests, t.heartbeats, t.request_outcomes, t.dispatch))))

    with err.status(f"reading {t.requests.name}, {t.heartbeats.name}, {t.request_outcomes.name}, {t.dispatch.name}"):
        reqs, hbs, outs, disp = asyncio.run(read_all())
    return recorded_traffic(reqs, hbs, outs, disp, base=base, block_size=s.block_size, since_ms=lo, until_ms=hi)


def _run_with(bench: Bench, profile: ModelProfile, policy: str, speed: float) -> SimResult:
    bench.profile = profile
    return bench.run(policy, speed)[1]


def _recorded_context(s: Settings, traffic: RecordedTraffic | None, bench: Bench) -> str:
    assert traffic is not None

    def at(ms: int) -> str:
        return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds")
    served = [o for o in traffic.observed.values()]
    hit = sum(o.cached_tokens for o in served) / max(1, sum(o.prompt_tokens for o in served))
    ttfts = sorted(v for rid in traffic.request_ids if (v := traffic.observed_ttft_s(rid)) is not None)
    obs = (f"; observed by the gateways: {len(ttfts)} served, TTFT p50 {ttfts[len(ttfts) // 2]:.3g} s "
           f"(routing excluded), prompt cache hit {100 * hit:.1f} %") if ttfts else "; no request-outcomes"
    return (f"recorded traffic on `{s.topic_prefix}*`: {len(bench.records)} requests from {at(traffic.first_ms)} "
            f"to {at(traffic.last_ms)}, policy `{traffic.recorded_policy or s.policy}`{obs}")


def register(groups: dict[str, typer.Typer]) -> None:
    app = groups["app"]

    @app.command("simulate")
    def simulate(
        trace: Path = typer.Option(None, "--trace", help="Mooncake-format JSONL trace (timestamp ms, input_length, "
                                   "output_length, hash_ids of 512-token blocks); or --from-topics"),
        from_topics: bool = typer.Option(False, "--from-topics", help="replay this cluster's own recorded traffic "
                                         "(requests, heartbeats, dispatch, request-outcomes on the topics of "
                                         "CONDUCTOR_TOPIC_PREFIX) instead of a trace: the cluster from its "
                                         "heartbeats, the cost model calibrated to the observed TTFTs"),
        since: str = typer.Option(None, "--since", help="--from-topics: start of the range: 30m/2h/1d ago, "
                                  "an ISO 8601 time or epoch ms [default: the oldest record]"),
        until: str = typer.Option(None, "--until", help="--from-topics: end of the range (same forms) "
                                  "[default: the newest record]"),
        calibrate_mode: str = typer.Option("scale", "--calibrate", help="--from-topics: scale (prefill compute scaled "
                                      "until the recorded policy's simulated TTFT p50 matches the observed one), "
                                      "fit (prefill coefficients fitted to the observed prompt/cached/TTFT) or off"),
        policy: str = typer.Option("all", "--policy", help="comma-separated policy names, or 'all'; with "
                                   "--from-topics 'recorded' names the policy the cluster ran; "
                                   "NAME:VARIANT runs NAME with the --params given under 'NAME:VARIANT' (ablations)"),
        cluster: str = typer.Option(None, "--cluster", help="instance counts as <P>P<D>D, e.g. 16P8D "
                                    "[default: the cluster profile's]"),
        profile: str = typer.Option("paper-16p8d", "--cluster-profile",
                                    help="cluster profile: a name (conductor/profiles/cluster-<name>.json) or a JSON path"),
        speed: float = typer.Option(None, "--speed", min=1e-6, help="arrival speed-up: 2 = twice the trace's rate "
                                    "[default: the cluster profile's]"),
        capacity: bool = typer.Option(False, "--capacity", help="also find the effective request capacity: the "
                                      "highest speed at which --target of requests meet both SLOs (bisection)"),
        target: float = typer.Option(0.9, "--target", min=0.0, max=1.0, help="SLO attainment that defines capacity"),
        tbt_slo_ms: float = typer.Option(None, "--tbt-slo-ms", min=1e-3, help="TBT SLO (paper: 100, 200 or 300)"),
        ttft_slo_s: float = typer.Option(None, "--ttft-slo-s", min=1e-3, help="TTFT SLO (paper: 30)"),
        view_delay_ms: float = typer.Option(None, "--view-delay-ms", min=0.0,
                                            help="KV event → view propagation delay (stale views)"),
        limit: int = typer.Option(None, "--limit", min=1, help="replay only the first N requests of the trace"),
        params: str = typer.Option(None, "--params", help='per-policy parameters as JSON '
                                   '{"kvcache-centric": {"slo_margin": 0.9}} or @file.json'),
        seed: int = typer.Option(None, "--seed", min=0, help="seed of the policies' tie-breaks [default: CONDUCTOR_SEED]"),
        balance: str = typer.Option("off", "--balance", help="on: run the KVCache balance loop (conductor balance's "
                                    "planner + the nodes executing its commands); off; both: each policy twice"),
        balance_params: str = typer.Option(None, "--balance-params", help="balance planner parameters as JSON "
                                           '{"hot_threshold": 2} or @file.json'),
        json_out: bool = typer.Option(False, "--json", help="one JSON line per policy on stdout"),
        report: Path = typer.Option(None, "--report", help="write DIR/README.md and PNG plots"),
        cpp: str = typer.Option(None, "--cpp", help="on|off: chunked pipeline parallelism of policies that have it "
                                "(kvcache-centric's cpp parameter) [default: the policy's]"),
        topology: Path = typer.Option(None, "--topology", help="cluster topology JSON (racks, zones, links; "
                                      "docs/topology.md) [default: CONDUCTOR_TOPOLOGY_FILE, else the model "
                                      "profile's two link speeds]"),
        workload: str = typer.Option("trace", "--workload", help="trace: the trace as is; long-context: every "
                                     "20th request with its prompt moved to 32k-128k tokens by its length rank "
                                     "and its prefix sharing kept (docs/simulation/cpp-topology.md)"),
    ) -> None:
        """Replay a trace through a simulated prefill/decode cluster and score the policies.

        Every request is placed by the real policy function on a snapshot built from the real fold/view path (KV events reach the view --view-delay-ms late, so views can be stale).

        Prints per policy: TTFT/TBT percentiles, SLO attainment, goodput, prefix reuse against the infinite-cache bound, rejections, load balance and, with --capacity, the effective request capacity. Progress goes to stderr; --json prints one JSON line per policy on stdout.

        Example: conductor simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl --policy all --cluster 16P8D --capacity --json --report docs/simulation

        What-if on this cluster's own traffic (what would least-loaded have done over the last day):
        conductor simulate --from-topics --since 1d --policy recorded,least-loaded --report whatif
        """


        s = settings_or_exit()
        if (trace is None) == (not from_topics):
            raise ConfigError("give either --trace FILE or --from-topics")
        if not from_topics and (since or until):
            raise ConfigError("--since/--until select a range of the topics: use them with --from-topics")
        names = _policies(policy, recorded=from_topics)
        if balance not in ("on", "off", "both"):
            raise ConfigError(f"--balance: expected on, off or both, not {balance!r}")
        modes = {"on": [True], "off": [False], "both": [False, True]}[balance]
        bparams = _balance_params(balance_params)
        prof = load_cluster(profile).with_counts(cluster)
        overrides = {k: v for k, v in (("tbt_slo_ms", tbt_slo_ms), ("ttft_slo_s", ttft_slo_s),
                                       ("view_delay_ms", view_delay_ms)) if v is not None}
        if overrides:
            prof = prof.model_copy(update=overrides)
        run_speed = speed if speed is not None else prof.default_speed
        if speed is not None:
            prof = prof.model_copy(update={"default_speed": speed})
        if cpp not in (None, "on", "off"):
            raise ConfigError(f"--cpp: expected on or off, got {cpp!r}")
        topo_file = topology or s.topology_file
        topo = load_topology(topo_file) if topo_file is not None else None
        run_seed = s.seed if seed is None else seed
        traffic: RecordedTraffic | None = None
        calibration: Calibration | None = None
        if from_topics:
            # The recorded cluster's shape comes from its heartbeats, its block size and SLOs
            # from the settings the routers run with; the --cluster-profile gives the rest.
            if ttft_slo_s is None:
                prof = prof.model_copy(update={"ttft_slo_s": s.ttft_slo_s})
            if tbt_slo_ms is None:
                prof = prof.model_copy(update={"tbt_slo_ms": s.tbt_slo_ms})
            prof = prof.model_copy(update={"model_profile": s.model_profile,
                                           "default_speed": speed if speed is not None else 1.0})
            run_speed = prof.default_speed
            traffic = _recorded(s, prof, since, until)
            prof = traffic.cluster
            recorded = traffic.recorded_policy or s.policy
            names = [recorded if n == "recorded" else n for n in names]
            names = list(dict.fromkeys(names))
            user_params = _params(params)
            run_params = {recorded: traffic.recorded_params or dict(s.policy_params), **user_params}
            bench = Bench(traffic.records, prof, seed=run_seed, limit=limit, params=run_params, bucket_ms=1.0,
                          topology=topo, cpp=None if cpp is None else cpp == "on", workload=workload,
                          balance=bparams)
            err.print(f"recorded: {len(bench.records)} requests on {prof.prefill_instances}P{prof.decode_instances}D, "
                      f"policy {recorded}, {len(traffic.observed)} observed outcomes"
                      + (f"; left out {traffic.skipped}" if traffic.skipped else ""))
            bench.profile, calibration = calibrate(
                traffic, bench.profile, lambda p: _run_with(bench, p, recorded, run_speed), policy=recorded,
                method=calibrate_mode)
            err.print(f"calibration: {calibration.describe()}")
            # Calibrated on the cluster that served the traffic; --cluster then resizes it.
            prof = bench.cluster = prof.with_counts(cluster)
        else:
            bench = Bench(trace, prof, seed=run_seed, limit=limit, params=_params(params),
                          topology=topo, cpp=None if cpp is None else cpp == "on", workload=workload,
                          balance=bparams)

        runs: list[PolicyRun] = []
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("loading", total=len(bench.records))

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, description=label, completed=done, total=total)

            for name, on in [(n, m) for n in names for m in modes]:
                cache: dict[float, tuple[dict[str, Any], Any]] = {}

                def run_at(sp: float, name: str = name, cache: dict = cache, on: bool = on) -> dict[str, Any]:
                    if sp not in cache:
                        cache[sp] = bench.run(name, sp, progress, balance=on)
                    return cache[sp][0]

                summary = run_at(run_speed)
                probes: list[tuple[float, float]] = [(run_speed, summary["slo_attainment"] or 0.0)]
                if capacity:

                    search = find_capacity(run_at, target=target, start=run_speed)
                    probes = search.probes
                    summary = dict(summary)
                    summary["capacity_speed"] = round(search.capacity_speed, 4)
                    summary["capacity_rps"] = (
                        round(bench.arrival_rate(search.capacity_speed), 4) if search.capacity_speed > 0 else 0.0
                    )
                    summary["capacity_target"] = target
                    summary["capacity_probes"] = len(search.probes)
                    summary["sim_wall_s"] = round(sum(v[0]["sim_wall_s"] for v in cache.values()), 3)
                    summary["run_wall_s"] = cache[run_speed][0]["sim_wall_s"]
                result = cache[run_speed][1]
                if on:
                    summary = dict(summary, policy=f"{name}+balance")
                if calibration is not None:
                    summary = dict(summary, source="topics", calibration=calibration.as_dict())
                run = PolicyRun.from_result(summary, result)
                run.probes = probes
                runs.append(run)
                cache.clear()  # the runs' outcomes are large; keep only what the report needs
                if json_out:
                    print_json(summary)
                else:
                    err.print(
                        f"[bold]{name}[/bold]: TTFT mean {summary['ttft_mean_s']} s p90 {summary['ttft_p90_s']} s, "
                        f"TBT p90 {summary['tbt_p90_ms']} ms, SLO {summary['slo_attainment']}, "
                        f"goodput {summary['goodput_rps']} req/s, reuse {summary['reuse_ratio']} "
                        f"(bound {summary['reuse_upper_bound']}), rejected {summary['rejected']}"
                        + (f", capacity {summary['capacity_speed']}x" if capacity else "")
                        + f" [{summary['sim_wall_s']} s]"
                    )
        if report is not None:
            # Rebuilt from the options (not argv), so it is right however the command was invoked.
            parts = (["--from-topics"] + [a for f, v in (("--since", since), ("--until", until)) if v
                                          for a in (f, v)]
                     + (["--calibrate", calibrate_mode] if calibrate_mode != "scale" else [])
                     if from_topics else ["--trace", str(trace)]) + ["--policy", policy]
            for flag, value in (("--cluster", cluster), ("--speed", speed), ("--tbt-slo-ms", tbt_slo_ms),
                                ("--ttft-slo-s", ttft_slo_s), ("--view-delay-ms", view_delay_ms),
                                ("--limit", limit), ("--params", params), ("--seed", seed), ("--cpp", cpp),
                                ("--topology", topology), ("--workload", workload if workload != "trace" else None),
                                ("--balance-params", balance_params)):
                if value is not None:
                    parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
            if balance != "off":
                parts += ["--balance", balance]
            if profile != "paper-16p8d":
                parts += ["--cluster-profile", profile]
            if capacity:
                parts += ["--capacity"] + (["--target", f"{target:g}"] if target != 0.9 else [])
            if json_out:
                parts.append("--json")
            parts += ["--report", str(report)]
            cmd = "conductor simulate " + " ".join(shlex.quote(a) for a in parts)
            context = {
                ("trace" if trace is not None else "traffic"): f"`{trace.name}` ({len(bench.records)} requests)"
                if trace is not None else _recorded_context(s, traffic, bench),
                "cluster": f"{prof.prefill_instances} prefill + {prof.decode_instances} decode instances "
                           f"(profile `{prof.name}`: {prof.description})",
                "model profile": f"`{prof.model_profile}`",
                "SLOs": f"TTFT ≤ {prof.ttft_slo_s:g} s, TBT ≤ {prof.tbt_slo_ms:g} ms",
                "arrival speed": f"{run_speed:g}x ({bench.arrival_rate(run_speed):.3f} req/s)",
                "view propagation delay": f"{prof.view_delay_ms:g} ms",
                "seed": bench.seed,
                "topology": f"`{topo.name}`" if topo is not None else "flat (the model profile's link speeds)",
            }
            if calibration is not None:
                context["model profile"] = f"`{prof.model_profile}`, calibrated: `{bench.profile.name}`"
                context["calibration"] = calibration.describe()
            title = ("What-if on recorded traffic" if from_topics else "Conductor policy benchmark")
            md = write_report(runs, report, title=title, context=context, command=cmd, paper=not from_topics)
            err.print(f"report: {md}")
