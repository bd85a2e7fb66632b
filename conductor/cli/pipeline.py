"""``conductor worker``, ``conductor view rebuild|show``, ``conductor bench ingest``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import faust
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from conductor.admin.cluster import view_summary
from conductor.cli.common import err, print_json, print_result, require_servers, settings_or_exit, table_console
from conductor.errors import ConfigError
from conductor.telemetry import setup_metrics
from conductor.harness.bench.ingest import IngestBenchConfig, run_ingest_bench
from conductor.harness.bench.view_read import run_view_read_bench
from schemas import TIERS
from state.redis_view import RedisViewStore
from streams.agents import build_worker
from streams.app import WEB_PORT, bind_web_port
from streams.kafka import ensure_topics
from streams.replay import diff_dumps, replay_into
from streams.topics import topics


def register(groups: dict[str, typer.Typer]) -> None:

    app, view, bench = groups["app"], groups["view"], groups["bench"]

    @app.command("worker")
    def worker(
        web_port: int = typer.Option(None, help="Faust web port on bind_host [default: CONDUCTOR_WEB_PORT, else 6066 "
                                     "or the next free one]"),
        loglevel: str = typer.Option("info", help="Faust worker log level"),
    ) -> None:
        """Run the stream worker: fold kv-events and heartbeats into the Redis view.

        Joins the worker consumer group (scale out with more workers, up to the partition
        count). Bad records go to the dead-letter topic; the worker never stops on one.
        Metrics on bind_host:metrics_port when CONDUCTOR_METRICS_PORT is set. Faust's web
        server takes port 6066, or the next free one when another worker on the host holds it.
        """


        s = settings_or_exit(**({"web_port": web_port} if web_port else {}))
        require_servers(s, kafka=True, redis=True)
        try:
            web_socket = bind_web_port(s.bind_host, s.web_port)
        except ConfigError as e:
            err.print(f"[red]error:[/red] {e}", soft_wrap=True)
            raise typer.Exit(2) from None
        chosen = web_socket.getsockname()[1]
        if s.web_port is None and chosen != WEB_PORT:
            err.print(f"web port {WEB_PORT} is taken (another worker?): this worker's is {chosen}", soft_wrap=True)
        asyncio.run(ensure_topics(s.kafka(), topics(s.topic_config()).all()))
        setup_metrics("conductor-worker", s.bind_host, s.metrics_port)
        store = RedisViewStore.connect(s.redis(), s.view_namespace)
        w = build_worker(s.worker(), store, web_socket=web_socket)
        faust.Worker(w.app, loglevel=loglevel).execute_from_commandline()

    @view.command("show")
    def show(json_out: bool = typer.Option(False, "--json", help="print one JSON line")) -> None:
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

    @view.command("rebuild")
    def rebuild(
        namespace: str = typer.Option(None, help="namespace to rebuild into [default: CONDUCTOR_VIEW_NAMESPACE]"),
        force: bool = typer.Option(False, help="clear the target namespace first if it is not empty"),
        compare: bool = typer.Option(False, help="compare the result with the live view key by key; exit 1 if they differ"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
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
        target_settings = s.model_copy(update={"view_namespace": target_ns})

        async def go() -> dict[str, Any]:
            store = RedisViewStore.connect(target_settings.redis(), target_settings.view_namespace)
            try:
                if (await store.dump())["watermark"] or await store.block_count():
                    if not force:
                        err.print(f"[red]error:[/red] namespace {target_ns!r} is not empty (use --force to clear it)")
                        raise typer.Exit(2)
                    await store.clear()
                with Progress(
                    TextColumn("rebuilding view"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err, transient=json_out,
                ) as bar:
                    task = bar.add_task("replay", total=None)
                    res = await replay_into(s.kafka(), s.topic_config(), store, progress=lambda done, total: bar.update(task, completed=done, total=total))
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

        out = asyncio.run(go())
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

    @bench.command("ingest")
    def bench_ingest(
        json_out: bool = typer.Option(False, "--json", help="print one JSON line with the results"),
        nodes: int = typer.Option(16, min=1, help="engine nodes publishing"),
        block_events: int = typer.Option(1_000_000, min=1000, help="block events in the throughput phase"),
        mean_blocks: int = typer.Option(96, min=1, help="mean block keys per stored record (16-token blocks)"),
        offered_rate: int = typer.Option(10_000, min=100, help="block events/s offered in the staleness phase"),
        staleness_s: float = typer.Option(6.0, min=1.0, help="length of the staleness phase"),
        seed: int = typer.Option(0, help="seed of the synthetic stream"),
    ) -> None:
        """Measure the pipeline end to end: publish a realistic KV-event stream, run the stream
        worker (a `conductor worker` subprocess), and time until the effects are visible in Redis.

        Uses CONDUCTOR_KAFKA_URL / CONDUCTOR_REDIS_URL when set, else starts (and stops) an
        embedded broker and Redis. Prints block_events_per_s, records_per_s, blocks_per_record,
        staleness_ms_p50/p99 (publish → visible at the offered rate) and view_bytes_per_block.
        """

        s = settings_or_exit()
        cfg = IngestBenchConfig(
            nodes=nodes, block_events=block_events, mean_blocks=mean_blocks, offered_rate=offered_rate,
            staleness_s=staleness_s, seed=seed,
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

    @bench.command("view-read")
    def bench_view_read(
        json_out: bool = typer.Option(False, "--json", help="print one JSON line with the results"),
        nodes: int = typer.Option(16, min=1, help="nodes in the synthetic view"),
        blocks_per_node: int = typer.Option(200_000, min=1000, help="blocks each node holds"),
        chain_len: int = typer.Option(512, min=1, help="blocks in the chain read (all held by one node)"),
        reads: int = typer.Option(300, min=10, help="reads per option"),
        cluster: bool = typer.Option(False, "--cluster", help="on a 3-primary Valkey Cluster (redis+cluster://) "
                                     "instead of one server"),
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


async def _view_summary(store: Any, ttl_s: float) -> dict[str, Any]:
    try:
        snap = await store.snapshot([])
    finally:
        await store.close()
    return view_summary(snap, ttl_s)
