"""``conductor worker``, ``conductor view rebuild|show``, ``conductor bench ingest|view-read``."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from conductor.admin.cluster import view_summary
from conductor.cli.common import (
    JsonLine,
    err,
    exit_on,
    print_json,
    print_result,
    require_servers,
    settings_or_exit,
    table_console,
)
from conductor.errors import ConfigError
from conductor.harness.bench.ingest import IngestBenchConfig, run_ingest_bench
from conductor.harness.bench.view_read import run_view_read_bench
from conductor.settings import Settings
from conductor.telemetry import setup_metrics
from schemas import TIERS
from state.redis_view import RedisViewStore
from streams.app import WEB_PORT, bind_web_port
from streams.replay import diff_dumps, replay_into
from streams.run import run_worker

JsonResults = Annotated[bool, typer.Option("--json", help="print one JSON line with the results")]

# --- conductor worker ---------------------------------------------------------------

WebPort = Annotated[int | None, typer.Option(help="Faust web port on bind_host [default: CONDUCTOR_WEB_PORT, "
    "else 6066 or the next free one]")]
Loglevel = Annotated[str, typer.Option(help="Faust worker log level")]


def worker(web_port: WebPort = None, loglevel: Loglevel = "info") -> None:
    """Run the stream worker: fold kv-events and heartbeats into the Redis view.

    Joins the worker consumer group (scale out with more workers, up to the partition
    count). Bad records go to the dead-letter topic; the worker never stops on one.
    Metrics on bind_host:metrics_port when CONDUCTOR_METRICS_PORT is set. Faust's web
    server takes port 6066, or the next free one when another worker on the host holds it.
    """
    s = settings_or_exit(**({"web_port": web_port} if web_port else {}))
    require_servers(s, kafka=True, redis=True)
    with exit_on(ConfigError, soft_wrap=True):
        web_socket = bind_web_port(s.bind_host, s.web_port)
    chosen = web_socket.getsockname()[1]
    if s.web_port is None and chosen != WEB_PORT:
        err.print(f"web port {WEB_PORT} is taken (another worker?): this worker's is {chosen}", soft_wrap=True)
    setup_metrics("conductor-worker", s.bind_host, s.metrics_port)
    run_worker(s.worker(), s.redis(), s.view_namespace, web_socket=web_socket, loglevel=loglevel)


# --- conductor view show | rebuild --------------------------------------------------


def show(json_out: JsonLine = False) -> None:
    """Print every node of the view (role, liveness, load, blocks per tier) and totals.

    A node is live when its last heartbeat is at most CONDUCTOR_HEARTBEAT_TTL_S old
    (measured on the Redis server's clock).
    """
    s = settings_or_exit()
    require_servers(s, redis=True)
    out = asyncio.run(_view_summary(RedisViewStore.connect(s.redis(), s.view_namespace), s.heartbeat_ttl_s))
    if json_out:
        print_json(out)
        return
    t = Table(title=f"view {s.view_namespace!r} ({out['totals']['live_nodes']}/{out['totals']['nodes']} live)")
    for col in ("node", "role", "live", "hb age s", "queue", "queued tok", "running", "batch", *TIERS, "gaps"):
        t.add_column(col, justify="right" if col not in ("node", "role") else "left")
    for n in out["nodes"]:
        b = n["blocks"]
        t.add_row(
            n["node_id"], n["role"], "yes" if n["live"] else "[red]no[/red]",
            "-" if n["heartbeat_age_s"] is None else f"{n['heartbeat_age_s']:.1f}",
            str(n["queue_depth"]), str(n["queued_prefill_tokens"]), str(n["running_requests"]),
            str(n["batch_size"]), *(str(b.get(tier, 0)) for tier in TIERS), str(n["seq_gaps"]),
        )
    table_console().print(t)
    tot = out["totals"]["blocks"]
    typer.echo("blocks: " + "  ".join(f"{tier} {tot.get(tier, 0)}" for tier in TIERS))
    typer.echo("watermark: " + (", ".join(f"{k}={v}" for k, v in out["watermark"].items()) or "-"))


async def _view_summary(store: Any, ttl_s: float) -> dict[str, Any]:
    try:
        snap = await store.snapshot([])
    finally:
        await store.close()
    return view_summary(snap, ttl_s)


Namespace = Annotated[str | None, typer.Option(help="namespace to rebuild into [default: "
    "CONDUCTOR_VIEW_NAMESPACE]")]
Force = Annotated[bool, typer.Option(help="clear the target namespace first if it is not empty")]
Compare = Annotated[bool, typer.Option(help="compare the result with the live view key by key; exit 1 if they "
    "differ")]


def rebuild(namespace: Namespace = None, force: Force = False, compare: Compare = False,
            json_out: JsonLine = False) -> None:
    """Replay kv-events and heartbeats from offset 0 into an empty view namespace.

    Use after losing Redis (rebuild into the live namespace at once; running stream
    workers also read a partition back from the log when they find its fence gone, but
    only as its next record arrives), or into another namespace with --compare to audit
    the live view: both must be equal key by key.
    """
    s = settings_or_exit()
    require_servers(s, kafka=True, redis=True)
    target_ns = namespace or s.view_namespace
    if compare and target_ns == s.view_namespace:
        err.print("[red]error:[/red] --compare needs --namespace other than the live one")
        raise typer.Exit(2)
    out = asyncio.run(_rebuild(s, target_ns, force=force, compare=compare, quiet=json_out))
    if json_out:
        print_json(out)
    else:
        err.print(
            f"replayed {out['records']} records ({out['applied']} applied) into {target_ns!r} in {out['seconds']}s"
        )
        if compare:
            err.print("[green]equal to the live view[/green]" if out["equal"] else "[red]differs from the live view:[/red]")
            for d in out["differences"]:
                err.print(f"  {d}")
    if compare and not out["equal"]:
        raise typer.Exit(1)


async def _rebuild(s: Settings, target_ns: str, *, force: bool, compare: bool, quiet: bool) -> dict[str, Any]:
    """Replay the log into ``target_ns`` (cleared first with ``force``), then compare it with the live view."""
    store = RedisViewStore.connect(s.redis(), target_ns)
    try:
        if (await store.dump())["watermark"] or await store.block_count():
            if not force:
                err.print(f"[red]error:[/red] namespace {target_ns!r} is not empty (use --force to clear it)")
                raise typer.Exit(2)
            await store.clear()
        with Progress(
            TextColumn("rebuilding view"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=err, transient=quiet,
        ) as bar:
            task = bar.add_task("replay", total=None)
            res = await replay_into(s.kafka(), s.topic_config(), store,
                                    progress=lambda done, total: bar.update(task, completed=done, total=total))
        out: dict[str, Any] = {
            "namespace": target_ns, "records": res.records, "applied": res.applied,
            "dead_letters": res.dead, "seconds": round(res.seconds, 3),
            "records_per_s": round(res.records / res.seconds, 1) if res.seconds else None,
        }
        if compare:
            live = RedisViewStore.connect(s.redis(), s.view_namespace)
            try:
                diffs = diff_dumps(await live.dump(), await store.dump())
            finally:
                await live.close()
            out["equal"] = not diffs
            out["differences"] = diffs
        return out
    finally:
        await store.close()


# --- conductor bench ingest | view-read ---------------------------------------------

IngestNodes = Annotated[int, typer.Option(min=1, help="engine nodes publishing")]
BlockEvents = Annotated[int, typer.Option(min=1000, help="block events in the throughput phase")]
MeanBlocks = Annotated[int, typer.Option(min=1, help="mean block keys per stored record (16-token blocks)")]
OfferedRate = Annotated[int, typer.Option(min=100, help="block events/s offered in the staleness phase")]
StalenessS = Annotated[float, typer.Option(min=1.0, help="length of the staleness phase")]
StreamSeed = Annotated[int, typer.Option(help="seed of the synthetic stream")]


IngestWorkers = Annotated[int, typer.Option(min=1, max=64, help="`conductor worker` processes (one consumer group: "
    "they split the partitions, CONDUCTOR_PARTITIONS of each topic)")]


def bench_ingest(
    json_out: JsonResults = False,
    nodes: IngestNodes = 16,
    block_events: BlockEvents = 1_000_000,
    mean_blocks: MeanBlocks = 96,
    offered_rate: OfferedRate = 10_000,
    staleness_s: StalenessS = 6.0,
    seed: StreamSeed = 0,
    workers: IngestWorkers = 1,
) -> None:
    """Measure the pipeline end to end: publish a realistic KV-event stream, run the stream
    worker (a `conductor worker` subprocess), and time until the effects are visible in Redis.

    Uses CONDUCTOR_KAFKA_URL / CONDUCTOR_REDIS_URL when set, else starts (and stops) an
    embedded broker and Redis. Prints block_events_per_s, records_per_s, blocks_per_record,
    staleness_ms_p50/p99 (publish → visible at the offered rate) and view_bytes_per_block;
    with --workers N, N worker processes share the topics' partitions.
    """
    s = settings_or_exit()
    cfg = IngestBenchConfig(
        nodes=nodes, block_events=block_events, mean_blocks=mean_blocks, offered_rate=offered_rate,
        staleness_s=staleness_s, seed=seed, workers=workers,
    )
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        out = asyncio.run(run_ingest_bench(s, cfg, log=None if json_out else err.print))
    except (OSError, TimeoutError, RuntimeError) as e:
        err.print(f"[red]error:[/red] bench failed: {type(e).__name__}: {e}")
        raise typer.Exit(1) from None
    except Exception as e:  # aiokafka's errors share no base we import here
        if type(e).__module__.startswith("aiokafka"):
            err.print(f"[red]error:[/red] Kafka: {type(e).__name__}: {e}")
            raise typer.Exit(1) from None
        raise
    print_result(out, json_out)


ViewNodes = Annotated[int, typer.Option(min=1, help="nodes in the synthetic view")]
BlocksPerNode = Annotated[int, typer.Option(min=1000, help="blocks each node holds")]
ChainLen = Annotated[int, typer.Option(min=1, help="blocks in the chain read (all held by one node)")]
Reads = Annotated[int, typer.Option(min=10, help="reads per option")]
OnCluster = Annotated[bool, typer.Option("--cluster", help="on a 3-primary Valkey Cluster (redis+cluster://) "
    "instead of one server")]


def bench_view_read(
    json_out: JsonResults = False,
    nodes: ViewNodes = 16,
    blocks_per_node: BlocksPerNode = 200_000,
    chain_len: ChainLen = 512,
    reads: Reads = 300,
    cluster: OnCluster = False,
) -> None:
    """Compare the two routing-read layouts on a dedicated Valkey: the store's pipelined MGET
    (+ client-side prefix walk) against a server-side Lua walk; latency, Redis server time
    per read, and view memory per block.
    """
    s = settings_or_exit()
    out = asyncio.run(
        run_view_read_bench(nodes, blocks_per_node, chain_len, reads, host=s.bind_host,
                            log=None if json_out else err.print, cluster=cluster)
    )
    print_result(out, json_out)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("worker")(worker)
    groups["view"].command("show")(show)
    groups["view"].command("rebuild")(rebuild)
    groups["bench"].command("ingest")(bench_ingest)
    groups["bench"].command("view-read")(bench_view_read)
