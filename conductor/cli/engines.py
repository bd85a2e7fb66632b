"""``conductor bridge``, ``conductor engine`` and ``conductor demo``: engines plug in."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import start_http_server

from conductor import web
from conductor.bridge.commands import VllmCommandExecutor
from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, Sink, endpoint_of_metrics, kafka_sink, rank_configs
from conductor.cli.common import err, print_json, print_result, settings_or_exit, stop_on_signals, table_console
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.executor import EngineCommandExecutor, commands_for
from conductor.harness.engine.http import engine_app
from conductor.harness.engine.metrics import engine_registry
from conductor.harness.engine.pool import POOL_NODE, LocalMaster, MooncakePool, PoolError, PoolIndex, PoolLink, measure_latency
from conductor.errors import ConfigError
from conductor.profiles import load_profile
from conductor.routing.dispatch import decisions_for
from conductor.routing.policies import POLICIES
from conductor.telemetry import setup_metrics
from conductor.harness.bench.bridge import run_bridge_bench
from conductor.harness.bench.scrape import run_scrape_bench
from conductor.harness.demo import DemoOptions, run_demo
from schemas import Envelope, Heartbeat
from streams.kafka import ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
_BASE_URL = re.compile(r"https?://[^\s/?#]+")
CLOCK_SLACK_MS = 2_000



async def _until_stopped(stop: asyncio.Event, *tasks: asyncio.Task[Any]) -> None:
    """Wait for ``stop`` or for any task to end (an error in one stops all); re-raise errors."""
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    for t in tasks:
        if not t.done():
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    stopper.cancel()
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            raise r


def _bridge_metrics(settings: Any, bridges: list[Bridge]) -> None:
    """Export the bridges' counters (records, gaps, epochs, orphans, scrape failures...) on CONDUCTOR_METRICS_PORT."""
    setup_metrics("conductor-bridge", settings.bind_host, settings.metrics_port)
    bridge_instruments(bridges)


def bridge_instruments(bridges: list[Bridge]) -> None:
    """The bridges' instruments, read from ``bridges`` at each collection."""

    def observe(_: CallbackOptions) -> list[Observation]:
        return [
            Observation(v, {"node": b.config.node_id, "what": k})
            for b in bridges
            for k, v in (b.counts + b.translator.counts).items()
        ]

    def reachable(_: CallbackOptions) -> list[Observation]:
        return [
            Observation(1 if b.scraper.reachable else 0, {"node": b.config.node_id})
            for b in bridges
            if b.scraper is not None
        ]

    meter = metrics.get_meter(__name__)
    meter.create_observable_counter(
        "conductor_bridge_events", callbacks=[observe], description="bridge counters by node and kind"
    )
    meter.create_observable_gauge(
        "conductor_bridge_engine_reachable", callbacks=[reachable],
        description="1 while the engine's /metrics answers (no heartbeats otherwise)",
    )
    for field, name, what in (
        ("prefix_hit_tokens", "conductor_bridge_engine_prefix_cache_hit_tokens",
         "prompt tokens the engine served from its prefix cache (its own counter, e.g. vllm:prefix_cache_hits_total): "
         "the reuse realised, against conductor_router_predicted_reused_tokens"),
        ("prefix_query_tokens", "conductor_bridge_engine_prefix_cache_query_tokens",
         "prompt tokens the engine looked up in its prefix cache (vllm:prefix_cache_queries_total)"),
    ):
        meter.create_observable_counter(name, callbacks=[engine_counter(bridges, field)], description=what)


def engine_counter(bridges: list[Bridge], field: str) -> Any:
    """An observable-counter callback: ``field`` of each bridge's last scrape, by node."""

    def observe(_: CallbackOptions) -> list[Observation]:
        out = []
        for b in bridges:
            v = getattr(b.last_load, field, None)
            if v is not None:
                out.append(Observation(v, {"node": b.config.node_id}))
        return out

    return observe


def _vllm_demo(s: Any, policy: str, baseline: str, duration: float, speed: float, sample: int, trace: Path | None,
               n_engines: int, json_out: bool) -> None:
    """``conductor demo --engines vllm``: the slice through Conductor with each policy, on fresh real engines."""
    from rich.table import Table

    from conductor.harness.bench.live_vllm import VllmLiveError, VllmLiveOptions, run_vllm_demo

    err.print(f"demo on real vLLM: {n_engines} aggregated engine(s) per run, started afresh for {policy} and "
              f"{baseline} (about two minutes each on 2 cores)")
    try:
        r = run_vllm_demo(s, VllmLiveOptions(duration_s=duration / 2, speed=speed, sample=sample, trace=trace,
                                             engines=n_engines), policy, baseline)
    except VllmLiveError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if json_out:
        print_json(r)
    else:
        t = Table(title=f"Summary on real vLLM engines: {policy} vs {baseline} on the same trace slice")
        t.add_column("")
        t.add_column(policy, justify="right")
        t.add_column(baseline, justify="right")
        a, b = r["runs"][policy], r["runs"][baseline]

        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        for label, key, fmt in (("requests", "requests", "d"), ("served", "served", "d"), ("rejected", "rejected", "d"),
                                ("errors", "errors", "d"),
                                ("engine prefix-cache hit ratio", "engine_prefix_hit_ratio", ".1%"),
                                ("TTFT p50 (s, client)", "ttft_p50_s", ".3f"), ("TTFT p90 (s, client)", "ttft_p90_s", ".3f")):
            t.add_row(label, f(a.get(key), fmt), f(b.get(key), fmt))
        table_console().print(t)
        err.print(f"wall time {r['wall_s']}s; logs in {r['logs']}")
    if not r["ok"]:
        raise typer.Exit(1)


def placed_heartbeats(sink: Sink, rack: str | None, zone: str | None) -> Sink:
    """``sink`` with ``rack``/``zone`` stamped on every heartbeat that does not name its own
    (the emulated engine's heartbeats carry no placement)."""
    if rack is None and zone is None:
        return sink

    async def send(envs: list[Envelope]) -> None:
        out = []
        for env in envs:
            body = env.body
            if isinstance(body, Heartbeat):
                update = {k: v for k, v in (("rack", rack), ("zone", zone)) if v is not None and getattr(body, k) is None}
                if update:
                    env = env.model_copy(update={"body": Heartbeat.model_validate({**body.model_dump(), **update})})
            out.append(env)
        await sink(out)

    return send


def register(groups: dict[str, typer.Typer]) -> None:
    app = groups["app"]

    def _need_kafka(s: Any) -> None:
        if not s.kafka_url:
            err.print(
                "[red]error:[/red] CONDUCTOR_KAFKA_URL is not set: start the embedded stack with "
                "`conductor dev up` (it prints the URLs) or name a Kafka cluster"
            )
            raise typer.Exit(2)

    @app.command("bridge")
    def bridge(
        zmq_endpoint: str = typer.Option(..., "--zmq", help="the engine's KV-event PUB socket, e.g. tcp://10.0.0.5:5557"),
        replay: str = typer.Option(None, "--replay", help="the engine's replay ROUTER socket, e.g. tcp://10.0.0.5:5558 "
                                   "(without it, gaps cannot be filled and mark the node stale)"),
        node_id: str = typer.Option(..., "--node-id", help="the node id Conductor routes to (the Kafka key)"),
        role: str = typer.Option(..., "--role", help="prefill, decode or both"),
        heartbeat_s: float = typer.Option(
            1.0, "--heartbeat-s",
            help="heartbeat the node this often while the engine answers; 0 = the engine heartbeats itself",
        ),
        model: str = typer.Option("default", help="model name announced in heartbeats"),
        metrics_url: str = typer.Option(
            None, "--metrics-url",
            help="the engine's Prometheus endpoint, e.g. http://10.0.0.5:8000/metrics: heartbeats then carry its real "
            "queue, running batch and KV use, and stop while it does not answer",
        ),
        dp_size: int = typer.Option(
            1, "--dp-size", min=1, max=256,
            help="data-parallel ranks of this engine: rank r publishes on both ports + r and becomes node ID-dp<r>",
        ),
        default_prompt_tokens: int = typer.Option(
            0, min=0, help="mean prompt length assumed for queued requests until the engine has finished one",
        ),
        rack: str = typer.Option(None, "--rack", help="the engine's rack, carried in heartbeats (transfer costs "
                                 "follow CONDUCTOR_TOPOLOGY_FILE's links)"),
        zone: str = typer.Option(None, "--zone", help="the engine's zone, carried in heartbeats"),
        engine_url: str = typer.Option(
            None, "--engine-url",
            help="the engine's serving base URL (http://HOST:PORT), announced in heartbeats so gateways find it "
            "through the view [default: the base of --metrics-url]",
        ),
        kv_transfer: bool = typer.Option(
            None, "--kv-transfer/--no-kv-transfer",
            help="whether the engine runs a KV connector (NIXL, Mooncake) and takes part in P/D hand-offs "
            "[default: yes for prefill and decode, no for both: an aggregated engine serves whole requests]",
        ),
        bootstrap_port: int = typer.Option(None, "--bootstrap-port", min=1, max=65535,
                                           help="SGLang: the prefill server's bootstrap port, announced in heartbeats"),
        execute_commands: bool = typer.Option(
            False, "--execute-commands",
            help="vLLM: carry out this node's kv-commands (a replicate pulls the prefix from its holder over the KV "
            "connector; other actions are answered unsupported); needs the engine URL and the view's Redis",
        ),
    ) -> None:
        """Carry one vLLM/SGLang engine's KV events onto the kv-events topic.

        Start the engine with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'.

        Block keys are derived from the events' token ids with CONDUCTOR_BLOCK_SIZE (it must equal the engine's).

        Gaps are filled from the replay socket; a gap it cannot fill, or an engine restart, starts a new epoch.

        With data parallelism (--dp-size N), vLLM's rank r publishes on both ports + r and labels its metrics engine="r": each rank is its own node (ID-dp0, ID-dp1...), since each has its own KV cache and queue.
        """
        if role not in ROLES:
            err.print(f"[red]error:[/red] --role must be one of {', '.join(ROLES)}, not {role!r}")
            raise typer.Exit(2)
        if metrics_url and not heartbeat_s:
            err.print("[red]error:[/red] --metrics-url needs --heartbeat-s > 0 (the scrape interval)")
            raise typer.Exit(2)
        if engine_url is not None and not _BASE_URL.fullmatch(engine_url.rstrip("/")):
            err.print(f"[red]error:[/red] --engine-url must be http(s)://HOST:PORT, not {engine_url!r}")
            raise typer.Exit(2)
        served = engine_url.rstrip("/") if engine_url else endpoint_of_metrics(metrics_url)
        if execute_commands and (served is None or dp_size > 1):
            err.print("[red]error:[/red] --execute-commands needs the engine's URL (--engine-url or --metrics-url) "
                      "and one rank (no --dp-size)")
            raise typer.Exit(2)
        s = settings_or_exit()
        _need_kafka(s)

        async def main() -> Counter[str]:

            tps = topics(s.topic_config())
            commands = (tps.kv_commands, tps.kv_command_results) if execute_commands else ()
            await ensure_topics(s.kafka(), (tps.kv_events, tps.heartbeats, *commands))
            prod = producer(s.kafka())
            await prod.start()
            events = kafka_sink(prod, tps.kv_events.name)
            bridges = []
            for cfg in rank_configs(
                node_id=node_id, role=role, zmq_endpoint=zmq_endpoint, replay_endpoint=replay,
                block_size=s.block_size, heartbeat_s=heartbeat_s or None, model=model, metrics_url=metrics_url,
                dp_size=dp_size, default_prompt_tokens=default_prompt_tokens, rack=rack, zone=zone,
                endpoint=engine_url.rstrip("/") if engine_url else None, kv_transfer=kv_transfer,
                bootstrap_port=bootstrap_port,
            ):
                bridges.append(Bridge(cfg, events, kafka_sink(prod, tps.heartbeats.name)))
            _bridge_metrics(s, bridges)
            stop = asyncio.Event()
            stop_on_signals(stop)
            tasks = [asyncio.create_task(b.run(stop)) for b in bridges]
            executor = None
            if execute_commands:  # conductor/bridge/commands.py
                assert served is not None
                executor = VllmCommandExecutor.from_settings(s, node_id, served,
                                                             kafka_sink(prod, tps.kv_command_results.name),
                                                             model=None if model == "default" else model)
                tasks.append(asyncio.create_task(executor.run(commands_for(s, node_id, stop))))
            try:
                await _until_stopped(stop, *tasks)
                await events.flush()
            finally:
                if executor is not None:
                    await executor.close()
                await prod.stop()
            total: Counter[str] = Counter()
            for b in bridges:
                total += b.counts + b.translator.counts
            return total

        counts = asyncio.run(main())
        err.print(f"bridge {node_id} stopped: {dict(counts)}")

    @app.command("engine")
    def engine(
        role: str = typer.Option(..., "--role", help="prefill, decode or both"),
        node_id: str = typer.Option(..., "--node-id", help="this instance's node id"),
        zmq_port: int = typer.Option(0, help="KV-event PUB port on CONDUCTOR_BIND_HOST (0 = a free one)"),
        replay_port: int = typer.Option(0, help="replay ROUTER port on CONDUCTOR_BIND_HOST (0 = a free one)"),
        kv_blocks: int = typer.Option(16_384, min=1, help="prefix-cache capacity in blocks of CONDUCTOR_BLOCK_SIZE"),
        dram_blocks: int = typer.Option(0, min=0, help="host-memory tier in blocks: HBM evictions move there (0 = none)"),
        time_scale: float = typer.Option(1.0, min=0.001, help="run this many times faster than the profile's time"),
        max_output_tokens: int = typer.Option(None, min=1, help="cap on decoded tokens per request"),
        heartbeat_s: float = typer.Option(0.5, min=0.05, help="heartbeat interval"),
        report: bool = typer.Option(False, "--report", help="print one JSON line per finished request on stdout"),
        http_port: int = typer.Option(None, "--http-port", min=0, max=65535,
                                      help="serve vLLM's OpenAI HTTP API (and the P/D KV hand-off) on this port of "
                                      "CONDUCTOR_BIND_HOST (0 = a free one); unset = no HTTP"),
        model: str = typer.Option("default", "--model", help="served model name (heartbeats, /v1/models)"),
        metrics_port: int = typer.Option(
            None, "--metrics-port", min=0, max=65535,
            help="serve vLLM-named Prometheus metrics (/metrics) on CONDUCTOR_BIND_HOST:PORT (0 = a free port) for "
            "`conductor bridge --metrics-url`",
        ),
        self_heartbeat: bool = typer.Option(
            True, "--self-heartbeat/--no-self-heartbeat",
            help="publish heartbeats itself; --no-self-heartbeat leaves them to a bridge that scrapes /metrics",
        ),
        rack: str = typer.Option(None, "--rack", help="this instance's rack, carried in its heartbeats"),
        zone: str = typer.Option(None, "--zone", help="this instance's zone, carried in its heartbeats"),
        kv_commands: bool = typer.Option(True, "--kv-commands/--no-kv-commands",
                                         help="carry out this node's KV commands (replicate, migrate, demote, evict) "
                                         "and answer them on kv-command-results"),
        mooncake_master: str = typer.Option(
            None, "--mooncake-master", metavar="HOST:PORT",
            help="join this Mooncake Store as the shared KV pool (needs the mooncake extra): blocks leaving the "
            "last local tier are put there, prefixes the router reads from the pool are read back from it, a "
            "demote to DRAM without --dram-blocks goes there, and this engine carries out the balance worker's "
            "replicate into the pool (puts of blocks it holds) and evict from it (forced removes); the pool is "
            "the view's store node --pool-node-id",
        ),
        pool_node_id: str = typer.Option(POOL_NODE, "--pool-node-id", help="the shared pool's node id in the view"),
        pool_segment_mb: int = typer.Option(256, "--pool-segment-mb", min=1,
                                            help="memory this engine mounts into the pool (MB)"),
        pool_block_bytes: int = typer.Option(
            None, "--pool-block-bytes", min=8,
            help="bytes per block object (default: the profile's KV bytes per token x CONDUCTOR_BLOCK_SIZE)"),
    ) -> None:
        """Run an emulated prefill/decode instance that speaks vLLM's KV-event protocol.

        It reads its decisions from the dispatch topic, executes them with CONDUCTOR_MODEL_PROFILE's timing model, keeps an LRU prefix cache and heartbeats.

        With --http-port it also serves what vLLM serves (/v1/completions, /v1/chat/completions with SSE, /tokenize, /v1/models, /health, /metrics) including vLLM's kv_transfer_params and SGLang's bootstrap room hand-off: the path `conductor gateway` uses.

        Its first stdout line is JSON with the ZMQ endpoints to give `conductor bridge` (and the HTTP URL).
        """
        if role not in ROLES:
            err.print(f"[red]error:[/red] --role must be one of {', '.join(ROLES)}, not {role!r}")
            raise typer.Exit(2)
        s = settings_or_exit()
        _need_kafka(s)

        try:
            profile = load_profile(s.model_profile)
        except (ConfigError, ValueError) as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None

        async def main() -> None:


            tps = topics(s.topic_config())
            await ensure_topics(s.kafka(), tps.all())
            pub = EventPublisher(f"tcp://{s.bind_host}:{zmq_port}", f"tcp://{s.bind_host}:{replay_port}")
            prod = producer(s.kafka())
            await prod.start()
            started_ms = time.time_ns() // 1_000_000
            cfg = EngineConfig(
                node_id=node_id, role=role, block_size=s.block_size, kv_blocks=kv_blocks,  # type: ignore[arg-type]
                dram_blocks=dram_blocks,
                time_scale=time_scale, heartbeat_s=heartbeat_s, max_output_tokens=max_output_tokens, seed=s.seed,
                model=model,
            )
            hb_sink = kafka_sink(prod, tps.heartbeats.name) if self_heartbeat else None
            pool = None
            if mooncake_master is not None:
                size = pool_block_bytes or s.block_size * profile.kv_bytes_per_token
                try:
                    client = await asyncio.to_thread(MooncakePool.connect, mooncake_master, block_size_bytes=size,
                                                     segment_bytes=pool_segment_mb << 20, local_host=s.bind_host,
                                                     model=model)
                except PoolError as e:
                    await prod.stop()
                    err.print(f"[red]error:[/red] --mooncake-master: {e}")
                    raise typer.Exit(2) from None
                index = PoolIndex(node_id, pool_node_id, epoch=started_ms, capacity_blocks=client.capacity_blocks,
                                  heartbeat_s=heartbeat_s)
                pool = PoolLink(client, index, events=kafka_sink(prod, tps.kv_events.name),
                                heartbeats=kafka_sink(prod, tps.heartbeats.name))
                log.info("engine %s joined the KV pool at %s as %s (%d blocks of %d bytes)", node_id, mooncake_master,
                         pool_node_id, client.capacity_blocks, size)
            eng = EmulatedEngine(cfg, profile, pub,
                                 heartbeat_sink=placed_heartbeats(hb_sink, rack, zone) if hb_sink else None,
                                 report=sys.stdout if report else None, pool=pool)
            metrics_server = None
            metrics_url = None
            if metrics_port is not None:
                # prometheus_client's own server (a thread), for an engine run without --http-port.
                metrics_server, _ = start_http_server(metrics_port, addr=s.bind_host, registry=engine_registry(eng))
                metrics_url = f"http://{s.bind_host}:{metrics_server.server_port}/metrics"
            sock = web.bind(s.bind_host, http_port) if http_port is not None else None
            ready: dict[str, Any] = {"event": "ready", "node_id": node_id, "role": role, "zmq": pub.endpoint,
                                     "replay": pub.replay_endpoint, "metrics": metrics_url}
            if sock is not None:
                ready["http"] = f"http://{s.bind_host}:{sock.getsockname()[1]}"
                ready["metrics"] = metrics_url or ready["http"] + "/metrics"  # as vLLM: on the API port
            print_json(ready)
            stop = asyncio.Event()
            stop_on_signals(stop)
            try:
                # A little before our start: the router's clock may lag ours.
                stream = decisions_for(s, node_id, since_ms=started_ms - CLOCK_SLACK_MS, stop=stop)
                tasks = [asyncio.create_task(eng.run(stream))]
                if sock is not None:
                    app = engine_app(eng, s.bind_host, sock.getsockname()[1])
                    tasks.append(asyncio.create_task(web.serve(app, sock, stop)))
                if kv_commands and role != "decode":  # the KV command executor (conductor.harness.engine.executor)
                    executor = EngineCommandExecutor(eng, kafka_sink(prod, tps.kv_command_results.name))
                    tasks.append(asyncio.create_task(executor.run(commands_for(s, node_id, stop))))
                await _until_stopped(stop, *tasks)
            finally:
                if metrics_server is not None:
                    metrics_server.shutdown()
                if pool is not None:
                    pool.close()
                await pub.close()
                await prod.stop()

        asyncio.run(main())

    @groups["bench"].command("pool")
    def bench_pool(
        master: str = typer.Option(None, "--master", metavar="HOST:PORT",
                                   help="a running mooncake_master (default: start one of our own on loopback)"),
        size: int = typer.Option(1 << 20, "--size", min=8, help="bytes per object"),
        count: int = typer.Option(50, "--count", min=1, help="objects put, read back and removed"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
        """Put/get latency of the shared KV pool (Mooncake Store; needs the mooncake extra) through Conductor's client.

        Mounts a segment large enough for COUNT objects of SIZE bytes, puts them one by one, gets them back,
        removes them, and reports the p50/p99 milliseconds of each call; then the same through a second client
        that mounts no memory (remote_*: the bytes cross the transfer engine over TCP).
        """
        own = LocalMaster() if master is None else None
        try:
            address = own.start() if own is not None else master
            pool = MooncakePool.connect(address, block_size_bytes=size, segment_bytes=max(64 << 20, 2 * size * count))
            # A client that mounts no memory: its objects live in the first one's segment, so its
            # puts and gets cross the transfer engine (TCP), as between two engines' processes.
            remote = MooncakePool.connect(address, block_size_bytes=size, segment_bytes=0)
            try:
                out: dict[str, object] = {"bench": "pool", "master": address,
                                          **measure_latency(pool, size=size, count=count)}
                out.update({f"remote_{k}": v for k, v in measure_latency(remote, size=size, count=count).items()
                            if k not in ("size_bytes", "count")})
            finally:
                remote.close()
                pool.close()
        except PoolError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        finally:
            if own is not None:
                own.stop()
        print_result(out, json_out)

    @groups["bench"].command("bridge")
    def bench_bridge(
        batches: int = typer.Option(5_000, min=1, help="engine batches to publish"),
        blocks: int = typer.Option(4, min=1, max=1024, help="blocks stored per batch (each a child of the previous)"),
        kafka: bool = typer.Option(False, "--kafka", help="publish to Kafka too (needs CONDUCTOR_KAFKA_URL)"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
        """Throughput of the bridge: vLLM-format batches over ZMQ → decode → Conductor keys (→ Kafka).

        Publishes BlockStored batches of one long chain on a loopback PUB socket and times how long the bridge
        takes to turn all of them into records.
        """
        s = settings_or_exit()
        if kafka:
            _need_kafka(s)

        out = asyncio.run(run_bridge_bench(s, batches=batches, blocks=blocks, kafka=kafka))
        print_result(out, json_out)

    @groups["bench"].command("scrape")
    def bench_scrape(
        scrapes: int = typer.Option(30, min=1, help="scrapes to time"),
        interval_s: float = typer.Option(1.0, min=0.0, help="seconds between scrapes (the bridge's --heartbeat-s)"),
        vllm_size: bool = typer.Option(True, "--vllm-size/--small", help="pad the page with vLLM's histograms"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
        """Cost of following one engine's load: scrape /metrics, parse, build and encode the heartbeat.

        Reports the bridge thread's CPU ms per scrape (the served page runs in another thread).
        """
        s = settings_or_exit()
        out = asyncio.run(run_scrape_bench(s, scrapes=scrapes, interval_s=interval_s, vllm_size=vllm_size))
        print_result(out, json_out)

    @app.command("demo")
    def demo(
        duration: float = typer.Option(60.0, min=10, help="wall-clock budget in seconds for both runs together"),
        speed: float = typer.Option(10.0, min=0.1, help="trace and engines run this many times faster than real time"),
        policy: str = typer.Option(None, help="Conductor's policy [default: CONDUCTOR_POLICY]"),
        baseline: str = typer.Option("round-robin", help="the policy to compare with, on the same trace slice"),
        trace: Path = typer.Option(None, help="Mooncake-format JSONL trace [default: the bundled conversation trace]"),
        prefill: int = typer.Option(2, min=1, max=16, help="emulated prefill instances"),
        decode: int = typer.Option(2, min=1, max=16, help="emulated decode instances"),
        sample: int = typer.Option(6, min=1, help="keep one conversation in N of the trace (a short run then "
                                   "covers more trace time, so conversations come back to their prefixes)"),
        block_size: int = typer.Option(64, min=1, max=4096, help="tokens per KV block in this demo's cluster"),
        kv_blocks: int = typer.Option(16_384, min=1, help="prefix-cache capacity of each emulated instance, in blocks"),
        dram_blocks: int = typer.Option(0, min=0, help="host-memory tier of each prefill instance, in blocks (0 = none)"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line with the results at the end"),
        console_port: int = typer.Option(
            None, min=0, max=65535,
            help="port of the live web console on bind_host (0 = none) [default: CONDUCTOR_ADMIN_PORT]"),
        gateway_port: int = typer.Option(
            0, min=0, max=65535,
            help="port of the gateway the demo's clients send to on bind_host, the same for both runs (0 = a free one)"),
        engines: str = typer.Option(
            "emulated", "--engines",
            help="emulated (the default: fast, model time) or vllm: real vLLM CPU engines with a tiny random-weight "
            "model from the kit (`scripts/vllm-kit` makes it, several GB, once), aggregated, fresh for each run; "
            "TTFT as the client saw it and the engines' own prefix-cache hit ratio"),
        vllm_engines: int = typer.Option(2, "--vllm-engines", min=1, max=8, help="--engines vllm: engines per run"),
    ) -> None:
        """The whole system on one machine: broker, Redis, stream worker, router, bridges and emulated engines.

        Replays a slice of the Mooncake conversation trace through Conductor's policy, then through the baseline on the same slice, with a live dashboard on stderr, and prints a comparison. Every request goes through `conductor gateway` with the openai client; the gateway's URL is printed at the start, so you can curl it while the demo runs.

        Uses the servers named by CONDUCTOR_KAFKA_URL / CONDUCTOR_REDIS_URL, or starts the embedded ones. Every process it starts is stopped at the end (also on Ctrl-C).
        """
        s = settings_or_exit()

        for name in (policy or s.policy, baseline):
            if name not in POLICIES:
                err.print(f"[red]error:[/red] unknown policy {name!r}; known: {', '.join(POLICIES)}")
                raise typer.Exit(2)

        if engines not in ("emulated", "vllm"):
            err.print(f"[red]error:[/red] --engines must be emulated or vllm, not {engines!r}")
            raise typer.Exit(2)
        if engines == "vllm":
            _vllm_demo(s, policy or s.policy, baseline, duration, speed, sample, trace, vllm_engines, json_out)
            return
        opts = DemoOptions(
            duration_s=duration, speed=speed, policy=policy or s.policy, baseline=baseline, trace=trace,
            prefill=prefill, decode=decode, json_out=json_out, sample=sample, block_size=block_size,
            kv_blocks=kv_blocks, dram_blocks=dram_blocks,
            admin_port=s.admin_port if console_port is None else console_port, gateway_port=gateway_port,
        )
        result = run_demo(s, opts)
        if json_out:
            print_json(result)
        if not result.get("ok", False):
            raise typer.Exit(1)
