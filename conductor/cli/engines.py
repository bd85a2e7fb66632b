"""``conductor bridge``, ``conductor engine``, ``conductor demo`` and the engine-side benchmarks: engines plug in.

Each command parses its options into the typed config of the package that does the work and
calls that package's entry point: :func:`conductor.bridge.serve.serve`,
:func:`conductor.harness.engine.serve.serve`, :func:`conductor.harness.demo.run_demo`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from conductor.bridge import serve as bridge_serve
from conductor.bridge.serve import BridgeServeConfig, engine_role
from conductor.cli.common import (
    JsonLine,
    err,
    exit_on,
    need_kafka_url,
    print_json,
    print_result,
    run_until_signalled,
    settings_or_exit,
    table_console,
)
from conductor.harness.bench.bridge import run_bridge_bench
from conductor.harness.bench.pool import run_pool_bench
from conductor.harness.bench.scrape import run_scrape_bench
from conductor.harness.demo import DemoOptions, run_demo
from conductor.harness.engine import serve as engine_serve
from conductor.harness.engine.pool import POOL_NODE, PoolError
from conductor.harness.engine.serve import EngineServeConfig, PoolOptions
from conductor.routing.policies import POLICIES
from conductor.settings import Settings
from conductor.telemetry import setup_metrics

# --- conductor bridge -------------------------------------------------------------

BridgeZmqEndpoint = Annotated[str | None, typer.Option("--zmq", help="the engine's KV-event PUB socket, e.g. "
    "tcp://10.0.0.5:5557 (required unless --no-events)")]
BridgeReplay = Annotated[str | None, typer.Option("--replay", help="the engine's replay ROUTER socket, e.g. "
    "tcp://10.0.0.5:5558 (without it, gaps cannot be filled and mark the node stale)")]
BridgeNodeId = Annotated[str, typer.Option("--node-id", help="the node id Conductor routes to (the Kafka key)")]
BridgeRole = Annotated[str, typer.Option("--role", help="prefill, decode or both")]
BridgeHeartbeatS = Annotated[float, typer.Option("--heartbeat-s", help="heartbeat the node this often while the "
    "engine answers; 0 = the engine heartbeats itself")]
BridgeModel = Annotated[str, typer.Option(help="model name announced in heartbeats")]
BridgeMetricsUrl = Annotated[str | None, typer.Option("--metrics-url", help="the engine's Prometheus endpoint, e.g. "
    "http://10.0.0.5:8000/metrics: heartbeats then carry its real queue, running batch and KV use, and stop while it "
    "does not answer")]
BridgeDpSize = Annotated[int, typer.Option("--dp-size", min=1, max=256, help="data-parallel ranks of this engine: "
    "rank r publishes on both ports + r and becomes node ID-dp<r>")]
BridgeDefaultPromptTokens = Annotated[int, typer.Option(min=0, help="mean prompt length assumed for queued requests "
    "until the engine has finished one")]
BridgeRack = Annotated[str | None, typer.Option("--rack", help="the engine's rack, carried in heartbeats (transfer "
    "costs follow CONDUCTOR_TOPOLOGY_FILE's links)")]
BridgeZone = Annotated[str | None, typer.Option("--zone", help="the engine's zone, carried in heartbeats")]
BridgeEngineUrl = Annotated[str | None, typer.Option("--engine-url", help="the engine's serving base URL "
    "(http://HOST:PORT), announced in heartbeats so gateways find it through the view [default: the base of "
    "--metrics-url]")]
BridgeKvTransfer = Annotated[bool | None, typer.Option("--kv-transfer/--no-kv-transfer", help="whether the engine "
    "runs a KV connector (NIXL, Mooncake) and takes part in P/D hand-offs [default: yes for prefill and decode, no "
    "for both: an aggregated engine serves whole requests]")]
BridgeBootstrapPort = Annotated[int | None, typer.Option("--bootstrap-port", min=1, max=65535, help="SGLang: the "
    "prefill server's bootstrap port, announced in heartbeats [default: a prefill bridge asks the engine's "
    "/server_info for its disaggregation_bootstrap_port (SGLang's --disaggregation-bootstrap-port, 8998 unless "
    "set); none announced when it has none]")]
BridgeMaxTrackedBlocks = Annotated[int | None, typer.Option("--max-tracked-blocks", min=1, help="engine block "
    "hashes remembered per rank (the bridge's memory bound); past it the least recently stored are forgotten, "
    "counted and taken out of the view [default: twice the engine's KV capacity from --metrics-url, at least "
    "65,536; else 1,000,000]")]
BridgeExecuteCommands = Annotated[bool, typer.Option("--execute-commands", help="vLLM: carry out this node's "
    "kv-commands (a replicate pulls the prefix from its holder over the KV connector; other actions are answered "
    "unsupported); needs the engine URL and the view's Redis")]
BridgeNoEvents = Annotated[bool, typer.Option("--no-events", help="the engine publishes no KV events (an SGLang or "
    "vLLM started without them, a hosted endpoint): open no ZMQ socket, publish heartbeats (with its load from "
    "--metrics-url, if it has one) that mark the node as such; routers then know its blocks only from their own "
    "decisions (pending blocks, LRU-bounded by its KV capacity)")]


def bridge(
    *,
    zmq_endpoint: BridgeZmqEndpoint = None,
    replay: BridgeReplay = None,
    node_id: BridgeNodeId,
    role: BridgeRole,
    heartbeat_s: BridgeHeartbeatS = 1.0,
    model: BridgeModel = "default",
    metrics_url: BridgeMetricsUrl = None,
    dp_size: BridgeDpSize = 1,
    default_prompt_tokens: BridgeDefaultPromptTokens = 0,
    rack: BridgeRack = None,
    zone: BridgeZone = None,
    engine_url: BridgeEngineUrl = None,
    kv_transfer: BridgeKvTransfer = None,
    bootstrap_port: BridgeBootstrapPort = None,
    execute_commands: BridgeExecuteCommands = False,
    max_tracked_blocks: BridgeMaxTrackedBlocks = None,
    no_events: BridgeNoEvents = False,
) -> None:
    """Carry one vLLM/SGLang engine's KV events onto the kv-events topic.

    Start the engine with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'.

    Block keys are derived from the events' token ids with CONDUCTOR_BLOCK_SIZE (it must equal the engine's).

    Gaps are filled from the replay socket; a gap it cannot fill, or an engine restart, starts a new epoch.

    With data parallelism (--dp-size N), vLLM's rank r publishes on both ports + r and labels its metrics engine="r": each rank is its own node (ID-dp0, ID-dp1...), since each has its own KV cache and queue.
    """
    with exit_on():
        config = BridgeServeConfig(
            zmq_endpoint=zmq_endpoint, node_id=node_id, role=engine_role(role), replay_endpoint=replay,
            heartbeat_s=heartbeat_s, model=model, metrics_url=metrics_url, dp_size=dp_size,
            default_prompt_tokens=default_prompt_tokens, rack=rack, zone=zone, engine_url=engine_url,
            kv_transfer=kv_transfer, bootstrap_port=bootstrap_port, execute_commands=execute_commands,
            max_tracked_blocks=max_tracked_blocks, kv_events=not no_events,
        )
    s = settings_or_exit()
    need_kafka_url(s)
    setup_metrics("conductor-bridge", s.bind_host, s.metrics_port)
    counts = run_until_signalled(lambda stop: bridge_serve.serve(config, s, stop=stop))
    err.print(f"bridge {node_id} stopped: {dict(counts)}")


# --- conductor engine -------------------------------------------------------------

EmulatedRole = Annotated[str, typer.Option("--role", help="prefill, decode or both")]
EmulatedNodeId = Annotated[str, typer.Option("--node-id", help="this instance's node id")]
EmulatedZmqPort = Annotated[int, typer.Option(help="KV-event PUB port on CONDUCTOR_BIND_HOST (0 = a free one)")]
EmulatedReplayPort = Annotated[int, typer.Option(help="replay ROUTER port on CONDUCTOR_BIND_HOST (0 = a free one)")]
EmulatedKvBlocks = Annotated[int, typer.Option(min=1, help="prefix-cache capacity in blocks of CONDUCTOR_BLOCK_SIZE")]
EmulatedDramBlocks = Annotated[int, typer.Option(min=0, help="host-memory tier in blocks: HBM evictions move there (0 "
    "= none)")]
EmulatedTimeScale = Annotated[float, typer.Option(min=0.001, help="run this many times faster than the profile's time")]
EmulatedMaxOutputTokens = Annotated[int | None, typer.Option(min=1, help="cap on decoded tokens per request")]
EmulatedHeartbeatS = Annotated[float, typer.Option(min=0.05, help="heartbeat interval")]
EmulatedReport = Annotated[bool, typer.Option("--report", help="print one JSON line per finished request on stdout")]
EmulatedHttpPort = Annotated[int | None, typer.Option("--http-port", min=0, max=65535, help="serve vLLM's OpenAI HTTP "
    "API (and the P/D KV hand-off) on this port of CONDUCTOR_BIND_HOST (0 = a free one); unset = no HTTP")]
EmulatedModel = Annotated[str, typer.Option("--model", help="served model name (heartbeats, /v1/models)")]
EmulatedMetricsPort = Annotated[int | None, typer.Option("--metrics-port", min=0, max=65535, help="serve vLLM-named "
    "Prometheus metrics (/metrics) on CONDUCTOR_BIND_HOST:PORT (0 = a free port) for `conductor bridge --metrics-url`")]
EmulatedSelfHeartbeat = Annotated[bool, typer.Option("--self-heartbeat/--no-self-heartbeat", help="publish heartbeats "
    "itself; --no-self-heartbeat leaves them to a bridge that scrapes /metrics")]
EmulatedRack = Annotated[str | None, typer.Option("--rack", help="this instance's rack, carried in its heartbeats")]
EmulatedZone = Annotated[str | None, typer.Option("--zone", help="this instance's zone, carried in its heartbeats")]
EmulatedKvCommands = Annotated[bool, typer.Option("--kv-commands/--no-kv-commands", help="carry out this node's KV "
    "commands (replicate, migrate, demote, evict) and answer them on kv-command-results")]
EmulatedDispatch = Annotated[bool, typer.Option("--dispatch/--no-dispatch", help="carry out the decisions naming "
    "this node on dispatch; --no-dispatch: requests come by HTTP only (behind a gateway, as a real engine)")]
EmulatedMooncakeMaster = Annotated[str | None, typer.Option("--mooncake-master", metavar="HOST:PORT", help="join this "
    "Mooncake Store as the shared KV pool (needs the mooncake extra): blocks leaving the last local tier are put "
    "there, prefixes the router reads from the pool are read back from it, a demote to DRAM without --dram-blocks "
    "goes there, and this engine carries out the balance worker's replicate into the pool (puts of blocks it holds) "
    "and evict from it (forced removes); the pool is the view's store node --pool-node-id")]
EmulatedTokenizer = Annotated[str | None, typer.Option("--tokenizer", help="a tokenizer.json for text prompts "
    "(/tokenize and generation), as a real engine tokenizes [default: the emulated one id per word]")]
EmulatedPoolNodeId = Annotated[str, typer.Option("--pool-node-id", help="the shared pool's node id in the view")]
EmulatedPoolSegmentMb = Annotated[int, typer.Option("--pool-segment-mb", min=1, help="memory this engine mounts into "
    "the pool (MB)")]
EmulatedPoolBlockBytes = Annotated[int | None, typer.Option("--pool-block-bytes", min=8, help="bytes per block object "
    "(default: the profile's KV bytes per token x CONDUCTOR_BLOCK_SIZE)")]


def engine(
    role: EmulatedRole,
    node_id: EmulatedNodeId,
    zmq_port: EmulatedZmqPort = 0,
    replay_port: EmulatedReplayPort = 0,
    kv_blocks: EmulatedKvBlocks = 16_384,
    dram_blocks: EmulatedDramBlocks = 0,
    time_scale: EmulatedTimeScale = 1.0,
    max_output_tokens: EmulatedMaxOutputTokens = None,
    heartbeat_s: EmulatedHeartbeatS = 0.5,
    report: EmulatedReport = False,
    http_port: EmulatedHttpPort = None,
    model: EmulatedModel = "default",
    metrics_port: EmulatedMetricsPort = None,
    self_heartbeat: EmulatedSelfHeartbeat = True,
    rack: EmulatedRack = None,
    zone: EmulatedZone = None,
    kv_commands: EmulatedKvCommands = True,
    dispatch: EmulatedDispatch = True,
    mooncake_master: EmulatedMooncakeMaster = None,
    pool_node_id: EmulatedPoolNodeId = POOL_NODE,
    pool_segment_mb: EmulatedPoolSegmentMb = 256,
    pool_block_bytes: EmulatedPoolBlockBytes = None,
    tokenizer: EmulatedTokenizer = None,
) -> None:
    """Run an emulated prefill/decode instance that speaks vLLM's KV-event protocol.

    It reads its decisions from the dispatch topic (unless --no-dispatch), executes them with CONDUCTOR_MODEL_PROFILE's timing model, keeps an LRU prefix cache and heartbeats.

    With --http-port it also serves what vLLM serves (/v1/completions, /v1/chat/completions with SSE, /tokenize, /v1/models, /health, /metrics) including vLLM's kv_transfer_params and SGLang's bootstrap room hand-off: the path `conductor gateway` uses.

    Its first stdout line is JSON with the ZMQ endpoints to give `conductor bridge` (and the HTTP URL).
    """
    with exit_on():
        config = EngineServeConfig(
            node_id=node_id, role=engine_role(role), zmq_port=zmq_port, replay_port=replay_port,
            kv_blocks=kv_blocks, dram_blocks=dram_blocks, time_scale=time_scale,
            max_output_tokens=max_output_tokens, heartbeat_s=heartbeat_s, report=report, http_port=http_port,
            model=model, metrics_port=metrics_port, self_heartbeat=self_heartbeat, rack=rack, zone=zone,
            kv_commands=kv_commands, dispatch=dispatch, tokenizer=tokenizer,
            pool=PoolOptions(mooncake_master, pool_node_id, pool_segment_mb, pool_block_bytes)
            if mooncake_master is not None else None,
        )
    s = settings_or_exit()
    need_kafka_url(s)
    with exit_on():  # a bad profile, a pool that cannot be joined
        run_until_signalled(lambda stop: engine_serve.serve(config, s, stop=stop, on_ready=print_json))


# --- conductor demo ---------------------------------------------------------------

DemoDuration = Annotated[float, typer.Option(min=10, help="wall-clock budget in seconds for both runs together")]
DemoSpeed = Annotated[float, typer.Option(min=0.1, help="trace and engines run this many times faster than real time")]
DemoPolicy = Annotated[str | None, typer.Option(help="Conductor's policy [default: CONDUCTOR_POLICY]")]
DemoBaseline = Annotated[str, typer.Option(help="the policy to compare with, on the same trace slice")]
DemoTrace = Annotated[Path | None, typer.Option(help="Mooncake-format JSONL trace [default: the bundled conversation "
    "trace]")]
DemoPrefill = Annotated[int, typer.Option(min=1, max=16, help="emulated prefill instances")]
DemoDecode = Annotated[int, typer.Option(min=1, max=16, help="emulated decode instances")]
DemoSample = Annotated[int, typer.Option(min=1, help="keep one conversation in N of the trace (a short run then "
    "covers more trace time, so conversations come back to their prefixes)")]
DemoBlockSize = Annotated[int, typer.Option(min=1, max=4096, help="tokens per KV block in this demo's cluster")]
DemoKvBlocks = Annotated[int, typer.Option(min=1, help="prefix-cache capacity of each emulated instance, in blocks")]
DemoDramBlocks = Annotated[int, typer.Option(min=0, help="host-memory tier of each prefill instance, in blocks (0 = "
    "none)")]
DemoJsonOut = Annotated[bool, typer.Option("--json", help="print one JSON line with the results at the end")]
DemoConsolePort = Annotated[int | None, typer.Option(min=0, max=65535, help="port of the live web console on "
    "bind_host (0 = none) [default: CONDUCTOR_ADMIN_PORT]")]
DemoGatewayPort = Annotated[int, typer.Option(min=0, max=65535, help="port of the gateway the demo's clients send to "
    "on bind_host, the same for both runs (0 = a free one)")]
DemoEngines = Annotated[str, typer.Option("--engines", help="emulated (the default: fast, model time) or vllm: real "
    "vLLM CPU engines with a tiny random-weight model from the kit (`scripts/vllm-kit` makes it, several GB, once), "
    "aggregated, fresh for each run; TTFT as the client saw it and the engines' own prefix-cache hit ratio")]
DemoVllmEngines = Annotated[int, typer.Option("--vllm-engines", min=1, max=8, help="--engines vllm: engines per run")]


def demo(
    duration: DemoDuration = 60.0,
    speed: DemoSpeed = 10.0,
    policy: DemoPolicy = None,
    baseline: DemoBaseline = "round-robin",
    trace: DemoTrace = None,
    prefill: DemoPrefill = 2,
    decode: DemoDecode = 2,
    sample: DemoSample = 6,
    block_size: DemoBlockSize = 64,
    kv_blocks: DemoKvBlocks = 16_384,
    dram_blocks: DemoDramBlocks = 0,
    json_out: DemoJsonOut = False,
    console_port: DemoConsolePort = None,
    gateway_port: DemoGatewayPort = 0,
    engines: DemoEngines = "emulated",
    vllm_engines: DemoVllmEngines = 2,
) -> None:
    """The whole system on one machine: broker, Redis, stream worker, router, bridges and emulated engines.

    Replays a slice of the Mooncake conversation trace through Conductor's policy, then through the baseline on the same slice, with a live dashboard on stderr, and prints a comparison. Every request goes through `conductor gateway` with the openai client; the gateway's URL is printed at the start, so you can curl it while the demo runs.

    Uses the servers named by CONDUCTOR_KAFKA_URL / CONDUCTOR_REDIS_URL, or starts the embedded ones. Every process it starts is stopped at the end (also on Ctrl-C).
    """
    s = settings_or_exit()
    policy = policy or s.policy
    _known_policies(policy, baseline)
    if engines not in ("emulated", "vllm"):
        err.print(f"[red]error:[/red] --engines must be emulated or vllm, not {engines!r}")
        raise typer.Exit(2)
    if engines == "vllm":
        _vllm_demo(s, policy, baseline, duration, speed, sample, trace, vllm_engines, json_out)
        return
    opts = DemoOptions(
        duration_s=duration, speed=speed, policy=policy, baseline=baseline, trace=trace,
        prefill=prefill, decode=decode, json_out=json_out, sample=sample, block_size=block_size,
        kv_blocks=kv_blocks, dram_blocks=dram_blocks,
        admin_port=s.admin_port if console_port is None else console_port, gateway_port=gateway_port,
    )
    result = run_demo(s, opts)
    if json_out:
        print_json(result)
    if not result.get("ok", False):
        raise typer.Exit(1)


def _known_policies(*names: str) -> None:
    for name in names:
        if name not in POLICIES:
            err.print(f"[red]error:[/red] unknown policy {name!r}; known: {', '.join(POLICIES)}")
            raise typer.Exit(2)


def _vllm_demo(s: Settings, policy: str, baseline: str, duration: float, speed: float, sample: int,
               trace: Path | None, n_engines: int, json_out: bool) -> None:
    """``conductor demo --engines vllm``: the slice through Conductor with each policy, on fresh real engines."""
    from conductor.harness.bench.live_vllm import VllmLiveError, VllmLiveOptions, run_vllm_demo

    err.print(f"demo on real vLLM: {n_engines} aggregated engine(s) per run, started afresh for {policy} and "
              f"{baseline} (about two minutes each on 2 cores)")
    with exit_on(VllmLiveError):
        r = run_vllm_demo(s, VllmLiveOptions(duration_s=duration / 2, speed=speed, sample=sample, trace=trace,
                                             engines=n_engines), policy, baseline)
    if json_out:
        print_json(r)
    else:
        table_console().print(_vllm_summary(r, policy, baseline))
        err.print(f"wall time {r['wall_s']}s; logs in {r['logs']}")
    if not r["ok"]:
        raise typer.Exit(1)


def _vllm_summary(r: dict[str, Any], policy: str, baseline: str) -> Table:
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
                            ("TTFT p50 (s, client)", "ttft_p50_s", ".3f"),
                            ("TTFT p90 (s, client)", "ttft_p90_s", ".3f")):
        t.add_row(label, f(a.get(key), fmt), f(b.get(key), fmt))
    return t


# --- conductor bench pool | bridge | scrape -----------------------------------------

PoolMaster = Annotated[str | None, typer.Option("--master", metavar="HOST:PORT", help="a running mooncake_master "
    "(default: start one of our own on loopback)")]
PoolSize = Annotated[int, typer.Option("--size", min=8, help="bytes per object")]
PoolCount = Annotated[int, typer.Option("--count", min=1, help="objects put, read back and removed")]


def bench_pool(
    master: PoolMaster = None,
    size: PoolSize = 1 << 20,
    count: PoolCount = 50,
    json_out: JsonLine = False,
) -> None:
    """Put/get latency of the shared KV pool (Mooncake Store; needs the mooncake extra) through Conductor's client.

    Mounts a segment large enough for COUNT objects of SIZE bytes, puts them one by one, gets them back,
    removes them, and reports the p50/p99 milliseconds of each call; then the same through a second client
    that mounts no memory (remote_*: the bytes cross the transfer engine over TCP).
    """
    with exit_on(PoolError):
        out = run_pool_bench(master, size=size, count=count)
    print_result(out, json_out)


BenchBridgeBatches = Annotated[int, typer.Option(min=1, help="engine batches to publish")]
BenchBridgeBlocks = Annotated[int, typer.Option(min=1, max=1024, help="blocks stored per batch (each a child of the "
    "previous)")]
BenchBridgeKafka = Annotated[bool, typer.Option("--kafka", help="publish to Kafka too (needs CONDUCTOR_KAFKA_URL)")]
BenchBridgeMemoryBlocks = Annotated[int, typer.Option(min=0, help="blocks stored in one translator to measure its "
    "memory per block with tracemalloc (bytes_per_block; 0: not measured)")]


def bench_bridge(
    batches: BenchBridgeBatches = 5_000,
    blocks: BenchBridgeBlocks = 4,
    kafka: BenchBridgeKafka = False,
    json_out: JsonLine = False,
    memory_blocks: BenchBridgeMemoryBlocks = 100_000,
) -> None:
    """Throughput of the bridge: vLLM-format batches over ZMQ → decode → Conductor keys (→ Kafka).

    Publishes BlockStored batches of one long chain on a loopback PUB socket and times how long the bridge
    takes to turn all of them into records. Then stores --memory-blocks blocks (random 64-bit engine hashes)
    in one node's translator and reports the bytes it holds per block (tracemalloc).
    """
    s = settings_or_exit()
    if kafka:
        need_kafka_url(s)
    out = asyncio.run(run_bridge_bench(s, batches=batches, blocks=blocks, kafka=kafka, memory_blocks=memory_blocks))
    print_result(out, json_out)


ScrapeScrapes = Annotated[int, typer.Option(min=1, help="scrapes to time")]
ScrapeIntervalS = Annotated[float, typer.Option(min=0.0, help="seconds between scrapes (the bridge's --heartbeat-s)")]
ScrapeVllmSize = Annotated[bool, typer.Option("--vllm-size/--small", help="pad the page with vLLM's histograms")]


def bench_scrape(
    scrapes: ScrapeScrapes = 30,
    interval_s: ScrapeIntervalS = 1.0,
    vllm_size: ScrapeVllmSize = True,
    json_out: JsonLine = False,
) -> None:
    """Cost of following one engine's load: scrape /metrics, parse, build and encode the heartbeat.

    Reports the bridge thread's CPU ms per scrape (the served page runs in another thread).
    """
    s = settings_or_exit()
    out = asyncio.run(run_scrape_bench(s, scrapes=scrapes, interval_s=interval_s, vllm_size=vllm_size))
    print_result(out, json_out)


def register(groups: dict[str, typer.Typer]) -> None:
    app, bench = groups["app"], groups["bench"]
    app.command("bridge")(bridge)
    app.command("engine")(engine)
    bench.command("pool")(bench_pool)
    bench.command("bridge")(bench_bridge)
    bench.command("scrape")(bench_scrape)
    app.command("demo")(demo)
