"""``conductor router``, ``conductor policies``, ``conductor bench route``, ``conductor profile ...``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from pathlib import Path

import typer

from conductor.cli.common import err, print_json, print_result, require_servers, settings_or_exit, stop_on_signals
from conductor.errors import ConductorError
from conductor.profiles import fit_profile, list_profiles, load_profile, read_timings_csv
from conductor.routing.policies import list_policies
from conductor.routing.router import Router, RouterWorker, default_router_id, redis_stores
from conductor.telemetry import setup_metrics
from conductor.harness.bench.route import run_route_bench
from conductor.harness.devstack import EmbeddedStack


def register(groups: dict[str, typer.Typer]) -> None:
    app, bench = groups["app"], groups["bench"]

    @app.command("router")
    def router_cmd(
        router_id: str = typer.Option(None, help="producer id of this replica on `dispatch` [default: router-<host>-<pid>]"),
    ) -> None:
        """Run one routing worker: `requests` → policy → `dispatch`.

        Joins the routers' consumer group on `requests`; start several for throughput and availability.

        Each request's snapshot is read from the Redis view in one round trip; the decision (prefill + decode instance, reused prefix, predictions, seed, view watermark) goes to `dispatch` keyed by the prefill instance, a rejection (with its reason) keyed by the request id.

        Decisions not yet visible in heartbeats are shared between replicas as reservations (a Redis stream), released by the node's next heartbeat or after CONDUCTOR_RESERVATION_TTL_S.

        If Redis is unreachable, decisions come from the last snapshot, marked degraded, until it is CONDUCTOR_MAX_SNAPSHOT_AGE_S old; then requests are rejected with view_unavailable.

        Policy: CONDUCTOR_POLICY and CONDUCTOR_POLICY_PARAMS (JSON), checked at start-up (see `conductor policies`); costs: CONDUCTOR_MODEL_PROFILE; metrics: CONDUCTOR_METRICS_PORT.
        """

        s = settings_or_exit()
        if not s.kafka_url or not s.redis_url:
            require_servers(s, kafka=True, redis=True)

        router_id = router_id or default_router_id()
        try:
            view, resv = redis_stores(s, producer_id=router_id)
            router = Router(s, view, resv)
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        require_servers(s, kafka=True, redis=True)  # after the config checks: a bad policy says so first
        setup_metrics("conductor-router", s.bind_host, s.metrics_port)
        worker = RouterWorker(s, router, router_id=router_id)
        err.print(f"router {worker.router_id}: policy {router.policy.name} {router.params}")

        async def main() -> None:
            stop = asyncio.Event()
            stop_on_signals(stop)
            try:
                await worker.run(stop)
            finally:
                await view.close()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main())
        err.print(f"router {worker.router_id}: routed {worker.routed} request(s)")

    @app.command("policies")
    def policies_cmd(json_out: bool = typer.Option(False, "--json", help="one JSON line")) -> None:
        """List the routing policies and their parameters (name, type, default, meaning)."""

        items = list_policies()
        if json_out:
            print_json(items)
            return
        for p in items:
            typer.echo(f"{p['name']}: {p['summary']}")
            for k, v in p["params"].items():
                typer.echo(f"    {k} ({v['type']}, default {v['default']!r}): {v['description']}")

    @bench.command("route")
    def bench_route(
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
        decisions: int = typer.Option(5000, min=1, help="timed decisions"),
        blocks: int = typer.Option(1_000_000, min=1000, help="distinct blocks to load into the view"),
        instances: int = typer.Option(32, min=3, help="instances in the synthetic cluster (1/2 prefill, 3/8 decode, "
                                                       "the rest store; a rack per 8)"),
        heartbeat_rate: float = typer.Option(
            None, min=0.0, help="node heartbeats per second written during the run by a separate process "
                                "[default: INSTANCES, every node once a second; 0: none]"),
        seed: int = typer.Option(1, help="seed of the synthetic cluster and prompts"),
        concurrency: int = typer.Option(
            None, min=1, max=64,
            help="requests in flight at once in the process [default: CONDUCTOR_ROUTER_CONCURRENCY, as the router]",
        ),
        policy: str = typer.Option(None, help="policy to time [default: CONDUCTOR_POLICY]"),
        reader: str = typer.Option(None, help="view reader: raw (one round trip per decision) or tracking "
                                              "(client-side cache of block entries and node states, RESP3 CLIENT "
                                              "TRACKING; state/tracking.py) [default: CONDUCTOR_VIEW_READER, raw]"),
        cache_keys: int = typer.Option(None, min=1, help="block entries the tracking reader keeps "
                                                         "[default: CONDUCTOR_VIEW_CACHE_KEYS, 200000]"),
        distinct_prompts: int = typer.Option(
            0, min=0, help="draw the timed prompts from this many, each decided once in the warm-up (a warm cache); "
                           "0: every timed prompt is new"),
    ) -> None:
        """Time the routing decision against a Redis view of INSTANCES instances and ~BLOCKS blocks.

        Builds the cluster (32: 16 prefill, 12 decode and 4 store instances in 4 racks) and fills the view with served-request history (tenant system prompts → shared documents → own questions, Zipf-popular).

        Then times DECISIONS decisions of 128-block prompts in one process: view read + reservations + policy + reservation record, while a separate process writes HEARTBEAT_RATE node heartbeats per second. Beside each decision it times one pipelined 128-key MGET on the same kind of connection, the baseline that makes the figures comparable across machines.

        Uses CONDUCTOR_REDIS_URL, else starts the embedded servers for the run. Prints decision_ms_p50, decision_ms_p99, decisions_per_s, mget128_ms_p50, mget128_ms_p99, decision_over_mget_p50 and view_bytes_per_block (used_memory growth per block: meaningful on a Redis of its own); with --reader tracking also cache_hit_ratio, keys_fetched_per_read and cached_reads_ratio (decisions made with no round trip: with --distinct-prompts, a warm cache).
        """

        s = settings_or_exit()
        reader = reader or s.view_reader
        cache_keys = cache_keys or s.view_cache_keys
        if reader not in ("raw", "tracking"):
            err.print(f"[red]error:[/red] --reader must be raw or tracking, not {reader!r}")
            raise typer.Exit(2)
        stack = None
        tmp = None
        if not s.redis_url:
            tmp = tempfile.TemporaryDirectory(prefix="conductor-bench-")
            stack = EmbeddedStack(Path(tmp.name), host=s.bind_host)
            st = stack.up(die_with_parent=True)
            s = s.model_copy(update={"redis_url": st.redis_url})
        # A bench namespace of its own; nodes stay live for the whole run.
        s = s.model_copy(update={"view_namespace": f"bench{seed}", "heartbeat_ttl_s": 3600.0,
                                 "policy": policy or s.policy})
        try:
            out = asyncio.run(run_route_bench(
                s, decisions=decisions, target_blocks=blocks, seed=seed, instances=instances,
                heartbeat_rate=heartbeat_rate, concurrency=concurrency or s.router_concurrency,
                progress=None if json_out else (lambda m: err.print(m)), reader=reader, cache_keys=cache_keys,
                distinct_prompts=distinct_prompts,
            ))
        finally:
            if stack is not None:
                stack.down()
                tmp.cleanup()  # type: ignore[union-attr]
        print_result(out, json_out)

    profile_app = typer.Typer(help="Model + hardware cost profiles (prefill, decode, KV transfer).",
                              no_args_is_help=True)
    app.add_typer(profile_app, name="profile")

    @profile_app.command("list")
    def profile_list(json_out: bool = typer.Option(False, "--json")) -> None:
        """List the shipped model profiles."""

        items = [load_profile(n) for n in list_profiles()]
        if json_out:
            print_json([p.model_dump() for p in items])
        else:
            for p in items:
                typer.echo(f"{p.name}: {p.description}")

    @profile_app.command("show")
    def profile_show(name: str = typer.Argument(..., help="a profile name or a .json file")) -> None:
        """Print one profile and what it predicts for a few prompt lengths."""

        try:
            p = load_profile(name)
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        out = p.model_dump()
        out["predicted"] = {
            f"prefill_s@{n}": round(p.prefill_seconds(n), 4) for n in (1024, 8192, 32768, 131072)
        } | {"decode_step_ms@b32x4k": round(1000 * p.decode_step_seconds(32, 32 * 4096), 2),
             "rack_transfer_s@8k": round(p.transfer_seconds(8192, "hbm", True), 4)}
        print_json(out)

    @profile_app.command("fit")
    def profile_fit(
        csv_path: Path = typer.Option(..., "--csv", exists=True, dir_okay=False,
                                      help="measured prefills: columns tokens,cached,seconds (header optional)"),
        base: str = typer.Option(None, help="profile whose l, d and FLOP/s are kept [default: CONDUCTOR_MODEL_PROFILE]"),
        out: Path = typer.Option(None, "--out", help="write the fitted profile JSON here"),
    ) -> None:
        """Fit the prefill coefficients a, b and a fixed overhead to measured timings (least squares).

        The model is seconds = overhead + (flops(tokens) - flops(cached)) / effective FLOP/s with flops(n) = l*(a*n^2*d + b*n*d^2); l, d and the FLOP/s stay those of --base.

        Prints the fit and its error as one JSON line; use the result with CONDUCTOR_MODEL_PROFILE=<the --out file>.
        """

        s = settings_or_exit()
        try:
            fit = fit_profile(read_timings_csv(csv_path), base=load_profile(base or s.model_profile))
        except ConductorError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        prof = fit.profile.model_dump()
        if out:
            out.write_text(json.dumps(prof, indent=2) + "\n")
        print_json({"rows": fit.rows, "rmse_s": fit.rmse_s, "max_rel_error": fit.max_rel_error,
                    "a": prof["a"], "b": prof["b"], "prefill_overhead_s": prof["prefill_overhead_s"],
                    "profile": prof})
