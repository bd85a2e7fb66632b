"""``conductor router``, ``conductor policies``, ``conductor bench route``, ``conductor profile ...``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conductor import web
from conductor.cli.common import (
    JsonLine,
    err,
    exit_on,
    print_json,
    print_result,
    require_servers,
    run_until_signalled,
    settings_or_exit,
)
from conductor.costmodel.profiles import fit_profile, list_profiles, load_profile, read_timings_csv
from conductor.harness.bench.decision_record import run_decision_record_bench
from conductor.harness.bench.explain import run_explain_bench
from conductor.harness.bench.route import run_route_bench
from conductor.harness.bench.stack import with_redis, with_servers
from conductor.harness.calibrate import CalibrateConfig, SweepPlan, calibrate_engine, write_profile
from conductor.routing import serve as router_serve
from conductor.routing.control_log import current_control
from conductor.routing.policies import list_policies
from conductor.telemetry import setup_metrics

# --- conductor router | policies ----------------------------------------------------

RouterId = Annotated[str | None, typer.Option(help="producer id of this replica on `dispatch` [default: "
    "router-<host>-<pid>-<incarnation>]")]


def router_cmd(router_id: RouterId = None) -> None:
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
    with exit_on():
        worker = router_serve.build_router(s, router_id)
    require_servers(s, kafka=True, redis=True)  # after the config checks: a bad policy says so first
    setup_metrics("conductor-router", s.bind_host, s.metrics_port)
    err.print(f"router {worker.router_id}: policy {worker.router.policy.name} {worker.router.params}")
    with contextlib.suppress(KeyboardInterrupt):
        run_until_signalled(lambda stop: router_serve.serve(worker, stop), loop_factory=web.loop_factory())
    err.print(f"router {worker.router_id}: routed {worker.routed} request(s)")


def policies_cmd(json_out: Annotated[bool, typer.Option("--json", help="one JSON line")] = False) -> None:
    """List the routing policies and their parameters (name, type, default, meaning)."""
    items = list_policies()
    if json_out:
        print_json(items)
        return
    for p in items:
        typer.echo(f"{p['name']}: {p['summary']}")
        for k, v in p["params"].items():
            typer.echo(f"    {k} ({v['type']}, default {v['default']!r}): {v['description']}")


# --- conductor bench route ----------------------------------------------------------

Decisions = Annotated[int, typer.Option(min=1, help="timed decisions")]
Blocks = Annotated[int, typer.Option(min=1000, help="distinct blocks to load into the view")]
Instances = Annotated[int, typer.Option(min=3, help="instances in the synthetic cluster (1/2 prefill, 3/8 "
    "decode, the rest store; a rack per 8)")]
HeartbeatRate = Annotated[float | None, typer.Option(min=0.0, help="node heartbeats per second written during "
    "the run by a separate process [default: INSTANCES, every node once a second; 0: none]")]
Seed = Annotated[int, typer.Option(help="seed of the synthetic cluster and prompts")]
Concurrency = Annotated[int | None, typer.Option(min=1, max=64, help="requests in flight at once in the process "
    "[default: CONDUCTOR_ROUTER_CONCURRENCY, as the router]")]
Policy = Annotated[str | None, typer.Option(help="policy to time [default: CONDUCTOR_POLICY]")]
Reader = Annotated[str | None, typer.Option(help="view reader: raw (one round trip per decision) or tracking "
    "(client-side cache of block entries and node states, RESP3 CLIENT TRACKING; state/tracking.py) [default: "
    "CONDUCTOR_VIEW_READER, raw]")]
CacheKeys = Annotated[int | None, typer.Option(min=1, help="block entries the tracking reader keeps [default: "
    "CONDUCTOR_VIEW_CACHE_KEYS, 200000]")]
DistinctPrompts = Annotated[int, typer.Option(min=0, help="draw the timed prompts from this many, each decided "
    "once in the warm-up (a warm cache); 0: every timed prompt is new")]


def bench_route(
    json_out: JsonLine = False,
    decisions: Decisions = 5000,
    blocks: Blocks = 1_000_000,
    instances: Instances = 32,
    heartbeat_rate: HeartbeatRate = None,
    seed: Seed = 1,
    concurrency: Concurrency = None,
    policy: Policy = None,
    reader: Reader = None,
    cache_keys: CacheKeys = None,
    distinct_prompts: DistinctPrompts = 0,
) -> None:
    """Time the routing decision against a Redis view of INSTANCES instances and ~BLOCKS blocks.

    Builds the cluster (32: 16 prefill, 12 decode and 4 store instances in 4 racks) and fills the view with served-request history (tenant system prompts → shared documents → own questions, Zipf-popular).

    Then times DECISIONS decisions of 128-block prompts in one process: view read + reservations + policy + reservation record, while a separate process writes HEARTBEAT_RATE node heartbeats per second. Beside each decision it times one pipelined 128-key MGET on the same kind of connection, the baseline that makes the figures comparable across machines.

    Uses CONDUCTOR_REDIS_URL, else starts the embedded servers for the run. Prints decision_ms_p50, decision_ms_p99, decisions_per_s, mget128_ms_p50, mget128_ms_p99, decision_over_mget_p50 and view_bytes_per_block (used_memory growth per block: meaningful on a Redis of its own); with --reader tracking also cache_hit_ratio, keys_fetched_per_read and cached_reads_ratio (decisions made with no round trip: with --distinct-prompts, a warm cache).
    """
    s = settings_or_exit()
    reader = reader or s.view_reader
    if reader not in ("raw", "tracking"):
        err.print(f"[red]error:[/red] --reader must be raw or tracking, not {reader!r}")
        raise typer.Exit(2)
    with with_redis(s) as s:
        # A bench namespace of its own; nodes stay live for the whole run.
        s = s.model_copy(update={"view_namespace": f"bench{seed}", "heartbeat_ttl_s": 3600.0,
                                 "policy": policy or s.policy})
        out = asyncio.run(run_route_bench(
            s, decisions=decisions, target_blocks=blocks, seed=seed, instances=instances,
            heartbeat_rate=heartbeat_rate, concurrency=concurrency or s.router_concurrency,
            progress=None if json_out else (lambda m: err.print(m)), reader=reader,
            cache_keys=cache_keys or s.view_cache_keys, distinct_prompts=distinct_prompts,
        ))
    print_result(out, json_out)


ExplainSizes = Annotated[str, typer.Option(help="heartbeats topic sizes to explain at, comma-separated (the history "
    "grows from one to the next)")]
LiveRate = Annotated[float, typer.Option(min=1.0, help="live records a second (heartbeats and requests) during the run")]


def bench_explain(json_out: JsonLine = False, records: ExplainSizes = "100000,300000,1000000",
                  rate: LiveRate = 40.0) -> None:
    """Time `conductor explain` against the heartbeats topic's size, with the topics live.

    For each size, the heartbeats topic holds that many records of history (an hour old), four live nodes beat and new requests arrive at RATE records a second; a router with the decision index decides one request, then explain is timed with the index (explain_s_indexed) and without it (explain_s_scan), each checked against the decision.

    Uses CONDUCTOR_KAFKA_URL and CONDUCTOR_REDIS_URL, else starts the embedded servers for the run. Prints rows of records, explain_s_indexed and explain_s_scan.
    """
    s = settings_or_exit()
    try:
        sizes = [int(x) for x in records.split(",") if x.strip()]
    except ValueError:
        err.print(f"[red]error:[/red] --records: not comma-separated integers: {records!r}")
        raise typer.Exit(2) from None
    with with_servers(s) as s:
        s = s.model_copy(update={"topic_prefix": f"benchx{int(time.time())}.", "view_namespace": "benchx"})
        out = asyncio.run(run_explain_bench(s, sizes=sizes, rate=rate,
                                            progress=None if json_out else (lambda m: err.print(m))))
    print_result(out, json_out)


RecordRates = Annotated[str, typer.Option(help="the cluster's decisions per second to replay, comma-separated")]
RecordSeconds = Annotated[float, typer.Option(min=1.0, help="model seconds of decisions at each rate")]


def bench_decision_record(json_out: JsonLine = False, rates: RecordRates = "100,500,2000,5000",
                          seconds: RecordSeconds = 10.0) -> None:
    """What folding the decision-time record costs each router, gateway worker and picker, by cluster rate.

    Each of them folds every decision of the cluster (pending blocks and in-flight charges), so its cost per decision follows the cluster's rate. Replays synthetic P/D decisions in model time (a shared system prefix the view shows on 8 prefill instances, blocks of their own, the whole chain placed on one of 4 decode instances, engine events, first tokens and finishes 20 decisions later) and times each decision's reads and writes of the record.

    Pure code, one process, no servers. Prints, per rate: us_per_decision_p50, us_per_decision_p99, us_per_decision_mean, core_share_at_rate (the share of one core the fold takes at that rate) and placements_live.
    """
    try:
        wanted = [int(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        err.print(f"[red]error:[/red] --rates: not comma-separated integers: {rates!r}")
        raise typer.Exit(2) from None
    if not wanted or min(wanted) < 1:
        err.print(f"[red]error:[/red] --rates: give one or more rates of at least 1, not {rates!r}")
        raise typer.Exit(2)
    s = settings_or_exit()
    out = run_decision_record_bench(wanted, seconds=seconds, ttl_s=s.pending_ttl_s, lease_s=s.inflight_lease_s,
                                    progress=None if json_out else (lambda m: err.print(m)))
    print_result(out, json_out)


# --- conductor profile list | show | fit --------------------------------------------

profile_app = typer.Typer(help="Model + hardware cost profiles (prefill, decode, KV transfer).", no_args_is_help=True)


def profile_list(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the shipped model profiles."""
    items = [load_profile(n) for n in list_profiles()]
    if json_out:
        print_json([p.model_dump() for p in items])
    else:
        for p in items:
            typer.echo(f"{p.name}: {p.description}")


def profile_show(name: Annotated[str | None, typer.Argument(
        help="a profile name or a .json file [default: the one the routers use now: the last fit `conductor fit` "
        "published on the control topic, else CONDUCTOR_MODEL_PROFILE]")] = None) -> None:
    """Print one profile (its fitted error too: ttft_error_p50/p90, tbt_error_p50/p90, fit_rows) and what it
    predicts for a few prompt lengths."""
    source = name
    with exit_on():
        if name is None:
            s = settings_or_exit()
            require_servers(s, kafka=True)
            st = asyncio.run(current_control(s))
            p = st.profile or load_profile(s.model_profile)
            source = f"control offset {st.offset} (set_profile)" if st.profile else f"{s.model_profile} (configured)"
        else:
            p = load_profile(name)
    out = {"source": source, **p.model_dump()}
    out["predicted"] = {
        f"prefill_s@{n}": round(p.prefill_seconds(n), 4) for n in (1024, 8192, 32768, 131072)
    } | {"decode_step_ms@b32x4k": round(1000 * p.decode_step_seconds(32, 32 * 4096), 2),
         "rack_transfer_s@8k": round(p.transfer_seconds(8192, "hbm", True), 4)}
    print_json(out)


CsvPath = Annotated[Path, typer.Option("--csv", exists=True, dir_okay=False, help="measured prefills: columns "
    "tokens,cached,seconds (header optional)")]
BaseProfile = Annotated[str | None, typer.Option(help="profile whose l, d and FLOP/s are kept [default: "
    "CONDUCTOR_MODEL_PROFILE]")]
OutFile = Annotated[Path | None, typer.Option("--out", help="write the fitted profile JSON here")]


def profile_fit(csv_path: CsvPath, base: BaseProfile = None, out: OutFile = None) -> None:
    """Fit the prefill coefficients a, b and a fixed overhead to measured timings (least squares).

    The model is seconds = overhead + (flops(tokens) - flops(cached)) / effective FLOP/s with flops(n) = l*(a*n^2*d + b*n*d^2); l, d and the FLOP/s stay those of --base.

    Prints the fit and its error as one JSON line; use the result with CONDUCTOR_MODEL_PROFILE=<the --out file>.
    """
    s = settings_or_exit()
    with exit_on():
        fit = fit_profile(read_timings_csv(csv_path), base=load_profile(base or s.model_profile))
    prof = fit.profile.model_dump()
    if out:
        out.write_text(json.dumps(prof, indent=2) + "\n")
    print_json({"rows": fit.rows, "rmse_s": fit.rmse_s, "max_rel_error": fit.max_rel_error,
                "a": prof["a"], "b": prof["b"], "prefill_overhead_s": prof["prefill_overhead_s"],
                "profile": prof})


EngineUrl = Annotated[str, typer.Option("--engine", help="the engine's base URL (OpenAI-compatible: /v1/completions "
    "streamed, /v1/models), e.g. http://10.0.0.5:8000")]
Lengths = Annotated[str, typer.Option("--lengths", help="prefill sweep: prompt lengths in tokens, comma-separated")]
CachedFractions = Annotated[str, typer.Option("--cached", help="prefill sweep: fractions of each prompt sent first "
    "(then cached by the engine's prefix cache), comma-separated, each in [0, 1)")]
Batches = Annotated[str, typer.Option("--batches", help="decode sweep: streams at once, comma-separated")]
Contexts = Annotated[str, typer.Option("--contexts", help="decode sweep: prompt tokens of each stream, comma-separated")]
DecodeTokens = Annotated[int, typer.Option("--decode-tokens", min=3, help="decode sweep: tokens each stream generates")]
Repeats = Annotated[int, typer.Option("--repeats", min=1, help="passes over each grid (more: steadier medians)")]
Warmup = Annotated[int, typer.Option("--warmup", min=0, help="unmeasured requests first, cycling over --lengths "
    "(an engine's first prefill of a length is slow)")]
CalBlock = Annotated[int, typer.Option("--block-size", min=1, help="the engine's tokens per KV block: a warmed "
    "prefix counts as cached to whole blocks when the engine does not report cached tokens")]
CalModel = Annotated[str | None, typer.Option("--model", help="model name sent [default: the first of /v1/models]")]
CalName = Annotated[str | None, typer.Option("--name", help="the profile's name [default: <base>-calibrated]")]
CalOut = Annotated[Path, typer.Option("--out", dir_okay=False, help="where the profile JSON goes")]
Timings = Annotated[Path | None, typer.Option("--timings", dir_okay=False, help="also write the measured prefills "
    "as tokens,cached,seconds (what `profile fit --csv` reads)")]
CalSeed = Annotated[int, typer.Option("--seed", help="seed of the random token ids")]
Vocab = Annotated[int, typer.Option("--vocab", min=100, help="token ids are drawn below this (and from a tenth of it)")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos/--no-ignore-eos", help="send vLLM's ignore_eos so every "
    "decode stream runs its --decode-tokens (off for engines that refuse unknown fields)")]


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        err.print(f"[red]error:[/red] {flag}: not comma-separated integers: {text!r}")
        raise typer.Exit(2) from None


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        err.print(f"[red]error:[/red] {flag}: not comma-separated numbers: {text!r}")
        raise typer.Exit(2) from None


def profile_calibrate(
    engine: EngineUrl,
    out: CalOut = Path("profile-calibrated.json"),
    lengths: Lengths = "64,256,512,1024,1536",
    cached: CachedFractions = "0,0.5,0.9",
    batches: Batches = "1,2,4,8",
    contexts: Contexts = "64,512",
    decode_tokens: DecodeTokens = 24,
    repeats: Repeats = 2,
    warmup: Warmup = 5,
    block_size: CalBlock = 16,
    base: BaseProfile = None,
    model: CalModel = None,
    name: CalName = None,
    timings: Timings = None,
    seed: CalSeed = 0,
    vocab: Vocab = 1000,
    ignore_eos: IgnoreEos = True,
    json_out: JsonLine = False,
) -> None:
    """Measure a live engine and write a model profile fitted to it (a cluster starts from it with CONDUCTOR_MODEL_PROFILE=<the --out file>).

    The sweep, each grid --repeats times, one engine and nothing else on it:

    prefill: for every prompt length (--lengths) and cached fraction (--cached), a prompt of fresh random token ids; with a fraction above 0 its first fraction x length tokens are sent first, so the engine's prefix cache holds them; then the whole prompt, alone, streamed with one output token: its time to first token is the engine's TTFT with an empty queue. Cached tokens are those the engine reports (usage.prompt_tokens_details.cached_tokens: vLLM with --enable-prompt-tokens-details), else the warmed prefix to whole --block-size blocks.

    decode: for every batch size (--batches) and context (--contexts), that many streams at once, each generating --decode-tokens; the median gap between a stream's tokens while all are decoding is the step time of that batch and context.

    The prefill coefficients (a, b, fixed overhead) are fitted to each grid point's median (tokens, cached, TTFT) as `conductor profile fit` does (non-negative least squares), the decode step (per-sequence cost, context cost, fixed cost) to each point's median (batch, context, step); l, d, FLOP/s and KV bytes per token stay those of --base. Prints the fit, its RMSE and the TTFT/TBT prediction error p50/p90 of the base and of the calibrated profile on the sweep; --json prints them as one JSON line. A progress bar on stderr.

    Example: conductor profile calibrate --engine http://127.0.0.1:8000 --out vllm-a100.json --repeats 3
    """
    s = settings_or_exit()
    with exit_on():
        plan = SweepPlan(prompt_lengths=_ints("--lengths", lengths), cached_fractions=_floats("--cached", cached),
                         batch_sizes=_ints("--batches", batches), decode_contexts=_ints("--contexts", contexts),
                         decode_tokens=decode_tokens, repeats=repeats, warmup=warmup, block_size=block_size)
        config = CalibrateConfig(engine=engine, plan=plan, base=load_profile(base or s.model_profile), model=model,
                                 name=name, seed=seed, vocab=vocab, ignore_eos=ignore_eos)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("calibrating", total=plan.requests())

            def progress(label: str, done: int, total: int) -> None:
                bar.update(task, description=label, completed=done, total=total)

            cal = asyncio.run(calibrate_engine(config, progress))
    write_profile(cal.profile, out)
    if timings is not None:
        cal.write_timings(timings)
    summary = cal.summary() | {"out": str(out)}
    if json_out:
        print_json(summary)
        return
    for note in cal.notes:
        err.print(f"note: {note}")
    te, be = cal.ttft_error, cal.tbt_error
    typer.echo(f"{cal.model} at {cal.engine}: {len(cal.prefill)} prefills, {len(cal.decode)} decode batches "
               f"in {cal.wall_s:.1f} s")
    typer.echo(f"prefill: a={cal.profile.a:.4g} b={cal.profile.b:.4g} overhead={cal.profile.prefill_overhead_s:.4g} s "
               f"(RMSE {cal.prefill_rmse_s:.3g} s)")
    typer.echo(f"TTFT error p50/p90: {_pct(te.get('base'))} with {cal.base}, {_pct(te.get('calibrated'))} calibrated")
    if be:
        typer.echo(f"decode step error p50/p90: {_pct(be.get('base'))} with {cal.base}, "
                   f"{_pct(be.get('calibrated'))} calibrated")
    typer.echo(f"profile written to {out}: CONDUCTOR_MODEL_PROFILE={out}")


def _pct(err_: dict[str, float] | None) -> str:
    if not err_:
        return "-"
    return f"{100 * err_['p50']:.1f} % / {100 * err_['p90']:.1f} %"


def register(groups: dict[str, typer.Typer]) -> None:
    app = groups["app"]
    app.command("router")(router_cmd)
    app.command("policies")(policies_cmd)
    groups["bench"].command("route")(bench_route)
    groups["bench"].command("explain")(bench_explain)
    groups["bench"].command("decision-record")(bench_decision_record)
    app.add_typer(profile_app, name="profile")
    profile_app.command("list")(profile_list)
    profile_app.command("show")(profile_show)
    profile_app.command("fit")(profile_fit)
    profile_app.command("calibrate")(profile_calibrate)
