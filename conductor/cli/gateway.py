"""``conductor gateway`` (the OpenAI-compatible HTTP gateway) and ``conductor bench gateway | live``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from conductor import web
from conductor.cli.common import (
    JsonLine,
    err,
    exit_on,
    need_kafka_url,
    print_json,
    print_result,
    run_until_signalled,
    say_error,
    settings_or_exit,
)
from conductor.frontdoor.protocol import engine_map
from conductor.gateway import config as gateway_config
from conductor.gateway import serve as gateway_serve
from conductor.gateway import workers as gateway_workers
from conductor.gateway.auth import KeyRing, key_ring
from conductor.harness.bench.gateway import check_client, run_gateway_bench
from conductor.harness.bench.live import PEERS, LiveBenchError, LiveOptions, run_live_bench
from conductor.settings import Settings
from conductor.telemetry import scrape, setup_metrics
from state.claim import ProducerIdInUse

# --- conductor gateway --------------------------------------------------------------

GatewayPort = Annotated[int, typer.Option("--port", min=0, max=65535, help="HTTP port on CONDUCTOR_BIND_HOST (0 = a "
    "free one)")]
GatewayEngine = Annotated[list[str] | None, typer.Option("--engine", help="NODE_ID=http://HOST:PORT: override the "
    "URL an engine's heartbeats announce, or name one that announces none (repeat for each; the node id is the one "
    "its heartbeats carry) [default: the engines found through the view: `conductor bridge --engine-url`]")]
GatewayEngineProtocol = Annotated[str, typer.Option("--engine-protocol", help="the P/D hand-off: vllm "
    "(kv_transfer_params, prefill then decode) or sglang (bootstrap room)")]
GatewayTokenizer = Annotated[str | None, typer.Option("--tokenizer", help="the engines' tokenizer.json (or the "
    "model directory holding it): text prompts tokenized in the gateway, no round trip; chats still go to the engine, "
    "which owns the template [default: the engines' /tokenize]")]
GatewayEnginePrompt = Annotated[str, typer.Option("--engine-prompt", help="how a text completion's prompt reaches "
    "vLLM engines: ids (the token ids the gateway tokenized it to, the engine's own, so the engine does not "
    "tokenize it again; chats, LoRA adapters' prompts and echoed or engine-truncated ones keep their text) or text (the client's "
    "prompt as it came); sglang engines always get the text")]
GatewayId = Annotated[str | None, typer.Option("--gateway-id", help="names this gateway's reply topic "
    "[default: gw-HOST-PID]")]
GatewayModel = Annotated[str | None, typer.Option("--model", help="the engines' base model: another model name in a "
    "request is a LoRA adapter (it enters the block keys)")]
GatewayDecisionTimeoutS = Annotated[float, typer.Option(min=0.05, help="answer 503 decision_timeout after this long")]
GatewayMaxAttempts = Annotated[int, typer.Option(min=1, max=10, help="routing attempts when engines fail (then 502)")]
GatewayInsecure = Annotated[bool, typer.Option("--insecure", help="serve with no API key configured: every "
    "request is anonymous (the default SLO bounds, no limits); without it the gateway refuses to start unless "
    "CONDUCTOR_GATEWAY_API_KEY or CONDUCTOR_GATEWAY_API_KEYS_FILE is set")]
GatewayRouting = Annotated[str, typer.Option("--routing", help="colocated: decide in the gateway's own process (the "
    "routers' code and shared reservations; the request and decision are on the log, acknowledged, before an engine "
    "is called); log: send each routing request through the log to `conductor router` processes and wait for "
    "the decision on this gateway's reply topic")]
GatewayDrainS = Annotated[float | None, typer.Option("--drain-s", min=0.0, help="on SIGTERM: seconds the requests in "
    "flight get to finish (/health and new requests 503 draining meanwhile); then a stream still open ends with an "
    "SSE error event gateway_shutdown [default: the setting gateway_drain_s, 50: the manifests' 60 s grace period "
    "less their 5 s preStop, less 5 s to close]")]
GatewayWorkers = Annotated[int, typer.Option("--workers", min=1, max=256, help="gateway processes serving the port, "
    "one core each (the parent binds it and forks them: Linux, macOS); each a whole gateway with its own id "
    "<gateway id>-w<i> (its producer id; with --routing log its reply topic), reservations shared through Redis; "
    "worker i serves its metrics on CONDUCTOR_METRICS_PORT + i")]
GatewayBootstrapPort = Annotated[int | None, typer.Option(min=1, max=65535, help="sglang: the prefill instances' "
    "bootstrap port [default: the port of their URL]")]


def gateway(
    port: GatewayPort = 8000,
    engine: GatewayEngine = None,
    engine_protocol: GatewayEngineProtocol = "vllm",
    tokenizer: GatewayTokenizer = None,
    engine_prompt: GatewayEnginePrompt = "ids",
    gateway_id: GatewayId = None,
    model: GatewayModel = None,
    decision_timeout_s: GatewayDecisionTimeoutS = 5.0,
    max_attempts: GatewayMaxAttempts = 3,
    bootstrap_port: GatewayBootstrapPort = None,
    insecure: GatewayInsecure = False,
    routing: GatewayRouting = "colocated",
    drain_s: GatewayDrainS = None,
    workers: GatewayWorkers = 1,
) -> None:
    """Serve OpenAI's /v1/completions and /v1/chat/completions (SSE streaming too) in front of the engines.

    Each request is tokenized, decided by Conductor (by default in the gateway's own process, the request and its decision acknowledged on the log before any engine is called; with --routing log, through the log: requests → a router → this gateway's reply topic), handed from the chosen prefill instance to the chosen decode instance, and relayed to the client. Rejections answer 429 (SLO cannot be met, overloaded) or 503 (no live instance, view unavailable, no decision in time) with the reason as the error code and a Retry-After. A request_outcome record per request goes to request-outcomes.

    Clients send an API key as `Authorization: Bearer <key>` (CONDUCTOR_GATEWAY_API_KEY, or CONDUCTOR_GATEWAY_API_KEYS_FILE with per-key limits: requests in flight, rate, the loosest SLO and highest priority; 401 for an unknown key, 429 with Retry-After over a limit). Client SLOs: headers x-conductor-ttft-slo-ms, x-conductor-tbt-slo-ms, x-conductor-priority, clamped to the key's bounds.
    """
    with exit_on():
        protocol = gateway_config.engine_protocol(engine_protocol)
        mode = gateway_config.routing_mode(routing)
        prompt_form = gateway_config.engine_prompt(engine_prompt)
        engines = engine_map(engine or [])
    s = settings_or_exit()
    need_kafka_url(s)
    with exit_on():
        config = gateway_config.gateway_config(
            s, gateway_id=gateway_id, engines=engines, protocol=protocol, base_model=model,
            decision_timeout_s=decision_timeout_s, max_attempts=max_attempts, bootstrap_port=bootstrap_port,
            routing=mode, drain_s=drain_s, prompt_form=prompt_form)
    with exit_on(soft_wrap=True):  # one line, however wide the terminal
        keys = key_ring(s, insecure=insecure)
    if keys.open:
        err.print("[yellow]warning:[/yellow] --insecure: the gateway serves anyone who reaches "
                  f"{s.bind_host}:{port}, with no API key", soft_wrap=True)
    if workers > 1:
        raise typer.Exit(_gateway_workers(config, s, workers, port=port, keys=keys, tokenizer=tokenizer))
    setup_metrics("conductor-gateway", s.bind_host, s.metrics_port)
    with exit_on(ProducerIdInUse, soft_wrap=True):  # another live gateway runs under this --gateway-id: one line
        run_until_signalled(lambda stop: gateway_serve.serve(
            config, s, port=port, stop=stop, keys=keys, tokenizer_path=tokenizer, metrics_text=scrape,
            on_ready=print_json), loop_factory=web.loop_factory())


def _gateway_workers(config: gateway_config.GatewayConfig, s: Settings, workers: int, *, port: int, keys: KeyRing,
                     tokenizer: str | None) -> int:
    """``--workers N``: the port bound here, N forked gateways serving it (:mod:`conductor.gateway.workers`)."""
    ids = gateway_workers.worker_ids(config.gateway_id, workers)
    with exit_on():
        gateway_workers.check_supported(workers)
        for gid in ids:
            gateway_config.check_gateway_id(s, gid)
    with exit_on(OSError):
        sock = web.bind(s.bind_host, port)

    def one(i: int, ready: gateway_workers.Ready) -> int:
        setup_metrics("conductor-gateway", s.bind_host, s.metrics_port + i if s.metrics_port else 0)
        try:
            run_until_signalled(lambda stop: gateway_serve.serve(
                dataclasses.replace(config, gateway_id=ids[i]), s, port=port, stop=stop, keys=keys,
                tokenizer_path=tokenizer, metrics_text=scrape, on_ready=lambda line: ready({**line, "worker": i}),
                sock=sock), loop_factory=web.loop_factory())
        except ProducerIdInUse as e:  # another live gateway runs under this worker's id
            say_error(e, soft_wrap=True)
            return 2
        return 0

    return gateway_workers.run_workers(workers, sock, one, print_json)


# --- conductor bench gateway | live -------------------------------------------------

DEFAULT_LEVELS = [50, 200]
BenchGatewayClients = Annotated[list[int], typer.Option("--clients", min=1, help="concurrent streaming clients "
    "(repeat for several levels)")]
BenchGatewayRequestsPerClient = Annotated[int, typer.Option(min=1, help="requests each client sends back to back")]
BenchGatewayMaxTokens = Annotated[int, typer.Option(min=1, help="output tokens per request")]
BenchGatewayLocalTokenizer = Annotated[bool, typer.Option("--local-tokenizer/--engine-tokenizer", help="the engines "
    "and the gateway share a tokenizer.json (the gateway tokenizes with no round trip), or the gateway asks an "
    "engine's /tokenize")]
BenchGatewayWorkers = Annotated[int, typer.Option("--workers", min=1, max=64, help="the gateway under test runs "
    "this many processes on its port (`conductor gateway --workers`); requests_per_s and the gateway's CPU are "
    "theirs together")]
BenchGatewayPromptWords = Annotated[int | None, typer.Option("--prompt-words", min=10, max=3000, help="each "
    "prompt's length in words, about (a word is a token of the bench's tokenizer): the gateway's cost at your "
    "prompts' length [default: ~100 tokens]")]
BenchGatewayClient = Annotated[str, typer.Option("--client", help="the load generator's HTTP client: aiohttp (lighter on the cores it shares with the gateway) or httpx "
    "(the bench's client before 2026-11-29, to compare); client_cpu_ms_per_request says what it spent")]
BenchGatewayArg = Annotated[list[str] | None, typer.Option("--gateway-arg", help="one more `conductor gateway` "
    "option for the gateway under test (repeat; e.g. --gateway-arg=--routing --gateway-arg=log)")]


def bench_gateway(
    clients: BenchGatewayClients = DEFAULT_LEVELS,
    requests_per_client: BenchGatewayRequestsPerClient = 10,
    max_tokens: BenchGatewayMaxTokens = 8,
    gateway_arg: BenchGatewayArg = None,
    local_tokenizer: BenchGatewayLocalTokenizer = True,
    workers: BenchGatewayWorkers = 1,
    prompt_words: BenchGatewayPromptWords = None,
    client: BenchGatewayClient = "aiohttp",
    json_out: JsonLine = False,
) -> None:
    """Gateway overhead over calling the chosen engines directly, with zero-compute emulated engines.

    Starts (on CONDUCTOR_KAFKA_URL/REDIS_URL, or the embedded ones) a worker, a router, 2 prefill + 2 decode engines and a gateway. At each concurrency: (1) paired: every client sends each of its prompts both through the gateway and straight to a prefill/decode pair (the order alternating), and a request's overhead is its gateway time to first token minus its own direct one; (2) throughput: the same clients send the same number of requests through the gateway only. Fields (headline: the first level; per level under "levels"): gateway_overhead_ms_p50, _p90, _p99 (percentiles of the per-request paired differences; before 2026-11 they were p(gateway) minus p(direct)), requests_per_s (phase 2, all --workers of the gateway together; gateway_processes says how many), gateway_cpu_ms_per_request (the gateway process's CPU time over phase 2, per request; Linux), control_cpu_s, control_cpu_s_by_process and control_cpu_ms_per_request (every control-plane process over phase 2: gateway, router, worker, broker, Redis), throttled (429s, counted apart: the client waits its Retry-After), errors (every other failure, either side; errors_gateway and errors_direct split them, error_kinds counts them by kind), ttft and routing percentiles, client (the load generator's HTTP client) and per level client_cpu_ms_per_request (the bench process's own CPU over phase 2, per request: it shares the cores).
    """
    try:
        check_client(client)
    except ValueError as e:
        err.print(f"[red]error:[/red] --{e}")
        raise typer.Exit(2) from None
    s = settings_or_exit()
    out = run_gateway_bench(s, levels=tuple(clients), requests_per_client=requests_per_client,
                            max_tokens=max_tokens, gateway_args=gateway_arg or [],
                            local_tokenizer=local_tokenizer, workers=workers, prompt_words=prompt_words,
                            client=client)
    print_result(out, json_out)


LivePeer = Annotated[str, typer.Option("--peer", help=f"the router to compare with: {', '.join(PEERS)} "
                                       "(needs the optional extra named peer)")]
LiveDuration = Annotated[float, typer.Option(min=1.0, help="wall seconds of trace replayed on each side")]
LiveSpeed = Annotated[float, typer.Option(min=0.1, help="trace arrivals and engines run this many times faster than "
    "real time")]
LiveSample = Annotated[int, typer.Option(min=1, help="keep one conversation in N of the trace (as conductor demo)")]
LiveTrace = Annotated[Path | None, typer.Option(help="Mooncake-format JSONL trace [default: the bundled conversation "
    "trace]")]
LivePrefill = Annotated[int, typer.Option(min=1, max=16, help="emulated prefill instances on each side")]
LiveDecode = Annotated[int, typer.Option(min=1, max=16, help="emulated decode instances on each side")]
LiveBlockSize = Annotated[int, typer.Option(min=1, max=4096, help="tokens per KV block of the emulated engines")]
LiveKvBlocks = Annotated[int, typer.Option(min=1, help="prefix-cache capacity of each engine, in blocks")]
LiveMaxRequests = Annotated[int | None, typer.Option(min=1, help="send at most this many requests of the slice")]
LiveMaxOutputTokens = Annotated[int | None, typer.Option(min=1, help="cap each request's output tokens")]
LivePeerPolicy = Annotated[str, typer.Option(help="the SGLang router's policy (prefill and decode; --engines vllm: the "
                                            "peer side's, round_robin keeps its own)")]
LiveDrainS = Annotated[float, typer.Option(min=1.0, help="after the last arrival, wait this long for answers")]
LivePeerArgs = Annotated[str | None, typer.Option("--peer-args", help="--engines vllm: more arguments of the SGLang "
    "router on its sides, as shell words (e.g. '--cache-threshold 0.3 --balance-abs-threshold 16'); the engines, "
    "ports and policy are the bench's (--peer-policy)")]
LivePeerFirst = Annotated[bool, typer.Option("--peer-first", help="run the peer's side before Conductor's "
                                             "(--engines emulated; with vllm, --sides orders them)")]
LiveEngines = Annotated[str, typer.Option("--engines", help="emulated (the default: 2P2D emulated engines, model "
    "time) or vllm (real vLLM CPU engines from scripts/vllm-kit, aggregated, fresh for each side; conductor, "
    "sglang-router cache_aware and round_robin; wall-clock TTFT)")]
LiveVllmEngines = Annotated[int, typer.Option("--vllm-engines", min=1, max=8, help="--engines vllm: engines per side")]
LiveRounds = Annotated[int, typer.Option("--rounds", min=1, max=20, help="--engines vllm: run every side this many "
    "times, the order rotating from round to round; a side's fields are the medians over its rounds, each round's "
    "own under rounds")]
LiveSides = Annotated[str | None, typer.Option("--sides", help="--engines vllm: the sides, in order, comma-separated: "
    "conductor, conductor:POLICY (any of Conductor's policies, e.g. conductor:sglang-style), peer (sglang-router "
    "with --peer-policy, cache_aware by default), round_robin (sglang-router round_robin); default conductor,peer,round_robin")]
LiveEngineModel = Annotated[str, typer.Option("--engine-model", help="--engines vllm: tiny (a 1,500-token prefill "
    "~25 ms) or heavy (a larger dummy-weight model of the kit, ~300 ms or more on one core, with a KV cache small "
    "enough that the engines evict during the replay)")]
LiveEngineKvMib = Annotated[int | None, typer.Option("--engine-kv-mib", min=16, help="--engines vllm: each "
    "engine's KV cache in MiB (default: 1024 for tiny, 48 for heavy)")]
LivePinEngines = Annotated[str | None, typer.Option("--pin-engines", help="--engines vllm: run the engines on these "
    "cores (e.g. 1, 2-3, 1,3) and everything else on the other cores of this process")]
LiveCalibrate = Annotated[bool, typer.Option("--calibrate", help="--engines vllm: first calibrate a fresh engine of "
    "the same kind (conductor profile calibrate's sweep, one repeat, a few minutes) and run Conductor's sides on that "
    "profile (the run's model_profile and calibration say which and how well it fit)")]


def bench_live(
    peer: LivePeer = "sglang-router",
    duration: LiveDuration = 30.0,
    speed: LiveSpeed = 10.0,
    sample: LiveSample = 6,
    trace: LiveTrace = None,
    prefill: LivePrefill = 2,
    decode: LiveDecode = 2,
    block_size: LiveBlockSize = 64,
    kv_blocks: LiveKvBlocks = 16_384,
    max_requests: LiveMaxRequests = None,
    max_output_tokens: LiveMaxOutputTokens = None,
    peer_policy: LivePeerPolicy = "cache_aware",
    drain_s: LiveDrainS = 60.0,
    peer_first: LivePeerFirst = False,
    peer_args: LivePeerArgs = None,
    engines: LiveEngines = "emulated",
    vllm_engines: LiveVllmEngines = 2,
    rounds: LiveRounds = 3,
    sides: LiveSides = None,
    engine_model: LiveEngineModel = "tiny",
    engine_kv_mib: LiveEngineKvMib = None,
    pin_engines: LivePinEngines = None,
    calibrate: LiveCalibrate = False,
    json_out: JsonLine = False,
) -> None:
    """The same trace slice through Conductor's gateway and through the SGLang router, on identical engines.

    --engines vllm: the slice through Conductor, through sglang-router (regular HTTP mode, --peer-policy: cache_aware by default) and through sglang-router's round_robin, each in front of fresh identical real vLLM engines (scripts/vllm-kit makes the kit). Per side: ttft_p50_s, ttft_p90_s (as the client saw them), engine_prefix_hit_ratio (the engines' own prefix-cache counters), served, rejected, errors, each the median over --rounds (rounds: each round's values); control_cpu_s, control_cpu_s_by_process, control_cpu_ms_per_request (CPU of everything but the engines and the client over the replay: gateway, worker, bridges, broker, Redis, no router process since the gateway decides colocated; the SGLang router on its sides); engine_evicted_blocks (with a set KV cache size); on Conductor's sides decisions, left_holder_decisions and left_holder_by_reason (null until decisions say why a prefix holder was left); the run's model_profile (the profile Conductor's sides ran on) and calibration (with --calibrate: the fit and its TTFT error on the sweep). Takes several minutes: every side starts its engines afresh.

    --engines emulated: Conductor side: stream worker, router (CONDUCTOR_POLICY) and gateway (SGLang bootstrap hand-off) in front of fresh emulated engines whose KV events reach the view through bridges. Peer side: `python -m sglang_router.launch_router --pd-disaggregation --policy cache_aware` in front of fresh, identical engines. Each request is a streamed completion sent by the openai client at its trace arrival time, its prompt a text in which each trace block is a fixed run of pseudo-words (the SGLang router matches text). Prints per side: ttft_p50_s, ttft_p90_s (model time, as conductor demo), reuse_ratio (cached / prompt tokens the engines reported), rejected (429/503), errors.
    """
    s = settings_or_exit()
    if engines not in ("emulated", "vllm"):
        err.print(f"[red]error:[/red] --engines must be emulated or vllm, not {engines!r}")
        raise typer.Exit(2)
    if peer_first and engines == "vllm":
        err.print("[red]error:[/red] --peer-first is for --engines emulated: with --engines vllm, --sides says the "
                  "order (e.g. --sides peer,conductor), and it rotates from round to round")
        raise typer.Exit(2)
    if peer_args is not None and engines != "vllm":
        err.print("[red]error:[/red] --peer-args is for --engines vllm (the emulated side-by-side starts its peer "
                  "in PD mode with its own arguments)")
        raise typer.Exit(2)
    with exit_on(LiveBenchError):  # VllmLiveError is one
        if engines == "vllm":
            from conductor.harness.bench.live_vllm import (
                SIDES,
                VllmLiveOptions,
                parse_cpus,
                parse_peer_args,
                parse_sides,
                run_vllm_live_bench,
            )
            try:
                side_list = parse_sides(sides) if sides is not None else SIDES
                cpus = parse_cpus(pin_engines) if pin_engines is not None else ()
                extra = parse_peer_args(peer_args) if peer_args is not None else ()
            except ValueError as e:
                err.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2) from None
            out = run_vllm_live_bench(s, VllmLiveOptions(
                duration_s=duration, speed=speed, sample=sample, trace=trace, engines=vllm_engines,
                max_requests=max_requests, max_output_tokens=max_output_tokens or 8, drain_s=max(drain_s, 120.0),
                rounds=rounds, sides=side_list, engine_model=engine_model, pin_engines=cpus, calibrate=calibrate,
                engine_kv_cache_bytes=engine_kv_mib * 2**20 if engine_kv_mib else None, peer_policy=peer_policy,
                peer_args=extra))
        else:
            out = run_live_bench(s, LiveOptions(
                duration_s=duration, speed=speed, sample=sample, trace=trace, prefill=prefill, decode=decode,
                block_size=block_size, kv_blocks=kv_blocks, max_requests=max_requests,
                max_output_tokens=max_output_tokens, drain_s=drain_s, peer=peer, peer_policy=peer_policy,
                peer_first=peer_first))
    print_result(out, json_out)


IdleSeconds = Annotated[float, typer.Option("--seconds", min=1.0, help="seconds of no traffic measured")]
IdleSettle = Annotated[float, typer.Option("--settle", min=0.0, help="seconds to wait after start-up before measuring")]
IdleHeartbeat = Annotated[float, typer.Option("--heartbeat-s", min=0.01, help="how often each engine heartbeats "
                                              "(a bridge's default is 1 s; the tests' clusters use 0.3 s)")]


def bench_idle(seconds: IdleSeconds = 30.0, settle: IdleSettle = 5.0, heartbeat_s: IdleHeartbeat = 1.0,
               json_out: JsonLine = False) -> None:
    """The CPU a started stack uses with no traffic, per process.

    Starts (on CONDUCTOR_KAFKA_URL/REDIS_URL, or the embedded ones) a worker, a router, 2 prefill + 2 decode emulated engines with a bridge each and a gateway, waits --settle seconds, then reads each process's CPU time over --seconds with no request sent (Linux /proc). Fields: control_core_percent (the control plane's CPU as a share of one core: gateway, router, worker, bridges, broker, Redis) and control_core_percent_by_process, control_cpu_s and control_cpu_s_by_process, engines_core_percent_by_process (the emulated engines, apart), heartbeat_s (the engines' heartbeats are the only traffic).
    """
    from conductor.harness.bench.idle import run_idle_bench

    s = settings_or_exit()
    print_result(run_idle_bench(s, seconds=seconds, settle_s=settle, heartbeat_s=heartbeat_s), json_out)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("gateway")(gateway)
    groups["bench"].command("gateway")(bench_gateway)
    groups["bench"].command("live")(bench_live)
    groups["bench"].command("idle")(bench_idle)
