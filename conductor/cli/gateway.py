"""``conductor gateway``: the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import typer

from conductor import web
from conductor.cli.common import err, print_json, print_result, settings_or_exit, stop_on_signals
from conductor.gateway.app import run_gateway
from conductor.gateway.protocol import ENGINE_PROTOCOLS, parse_engine_map
from conductor.gateway.service import GatewayConfig
from conductor.telemetry import scrape, setup_metrics
from conductor.harness.bench.gateway import run_gateway_bench
from conductor.harness.bench.live import PEERS, LiveBenchError, LiveOptions, run_live_bench
from streams.topics import topics


def default_gateway_id() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}".replace("_", "-")[:120]


def register(groups: dict[str, typer.Typer]) -> None:
    app = groups["app"]

    @app.command("gateway")
    def gateway(
        port: int = typer.Option(8000, "--port", min=0, max=65535, help="HTTP port on CONDUCTOR_BIND_HOST (0 = a free one)"),
        engine: list[str] = typer.Option([], "--engine", help="NODE_ID=http://HOST:PORT: override the URL an "
                                         "engine's heartbeats announce, or name one that announces none (repeat for "
                                         "each; the node id is the one its heartbeats carry) [default: the engines "
                                         "found through the view: `conductor bridge --engine-url`]"),
        engine_protocol: str = typer.Option("vllm", "--engine-protocol", help="the P/D hand-off: vllm "
                                            "(kv_transfer_params, prefill then decode) or sglang (bootstrap room)"),
        tokenizer: str = typer.Option(None, "--tokenizer", help="a tokenizer.json for text prompts "
                                      "[default: the engines' /tokenize]"),
        gateway_id: str = typer.Option(None, "--gateway-id", help="names this gateway's reply topic "
                                       "[default: gw-HOST-PID]"),
        model: str = typer.Option(None, "--model", help="the engines' base model: another model name in a request "
                                  "is a LoRA adapter (it enters the block keys)"),
        decision_timeout_s: float = typer.Option(5.0, min=0.05, help="answer 503 decision_timeout after this long"),
        max_attempts: int = typer.Option(3, min=1, max=10, help="routing attempts when engines fail (then 502)"),
        bootstrap_port: int = typer.Option(None, min=1, max=65535, help="sglang: the prefill instances' bootstrap "
                                           "port [default: the port of their URL]"),
    ) -> None:
        """Serve OpenAI's /v1/completions and /v1/chat/completions (SSE streaming too) in front of the engines.

        Each request is tokenized, routed by Conductor through the log (requests → a router → this gateway's reply topic), handed from the chosen prefill instance to the chosen decode instance, and relayed to the client. Rejections answer 429 (SLO cannot be met, overloaded) or 503 (no live instance, view unavailable, no decision in time) with the reason as the error code and a Retry-After. A request_outcome record per request goes to request-outcomes.

        Client SLOs: headers x-conductor-ttft-slo-ms, x-conductor-tbt-slo-ms, x-conductor-priority.
        """
        if engine_protocol not in ENGINE_PROTOCOLS:
            err.print(f"[red]error:[/red] --engine-protocol must be one of {', '.join(ENGINE_PROTOCOLS)}")
            raise typer.Exit(2)
        try:
            engines = parse_engine_map(engine) if engine else {}
        except ValueError as e:
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        s = settings_or_exit()
        if not s.kafka_url:
            err.print("[red]error:[/red] CONDUCTOR_KAFKA_URL is not set: start the embedded stack with "
                      "`conductor dev up` or name a Kafka cluster")
            raise typer.Exit(2)
        gid = gateway_id or default_gateway_id()
        try:
            topics(s.topic_config()).replies(gid)
        except ValueError as e:
            err.print(f"[red]error:[/red] --gateway-id: {e}")
            raise typer.Exit(2) from None
        cfg = GatewayConfig(gateway_id=gid, engines=engines, protocol=engine_protocol,  # type: ignore[arg-type]
                            base_model=model, decision_timeout_s=decision_timeout_s, max_attempts=max_attempts,
                            bootstrap_port=bootstrap_port)
        setup_metrics("conductor-gateway", s.bind_host, s.metrics_port)
        sock = web.bind(s.bind_host, port)
        url = f"http://{s.bind_host}:{sock.getsockname()[1]}"

        async def main() -> None:
            stop = asyncio.Event()
            stop_on_signals(stop)

            def ready(_: Any) -> None:
                print_json({"event": "ready", "gateway_id": gid, "url": url, "openai_base_url": f"{url}/v1"})

            await run_gateway(s, cfg, sock, stop, tokenizer_path=tokenizer, metrics_text=scrape, on_ready=ready)

        asyncio.run(main())

    @groups["bench"].command("gateway")
    def bench_gateway(
        clients: list[int] = typer.Option([50, 200], "--clients", min=1, help="concurrent streaming clients "
                                          "(repeat for several levels)"),
        requests_per_client: int = typer.Option(10, min=1, help="requests each client sends back to back"),
        max_tokens: int = typer.Option(8, min=1, help="output tokens per request"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
        """Gateway overhead over calling the chosen engines directly, with zero-compute emulated engines.

        Starts (on CONDUCTOR_KAFKA_URL/REDIS_URL, or the embedded ones) a worker, a router, 2 prefill + 2 decode engines and a gateway; measures time to first token straight to a prefill/decode pair and through the gateway at each concurrency. Fields: gateway_overhead_ms_p50, gateway_overhead_ms_p99, requests_per_s, errors (headline: the first level; per level under "levels").
        """
        s = settings_or_exit()
        out = run_gateway_bench(s, levels=tuple(clients), requests_per_client=requests_per_client,
                                max_tokens=max_tokens)
        print_result(out, json_out)

    @groups["bench"].command("live")
    def bench_live(
        peer: str = typer.Option("sglang-router", "--peer", help=f"the router to compare with: {', '.join(PEERS)} "
                                 "(needs the optional extra named peer)"),
        duration: float = typer.Option(30.0, min=1.0, help="wall seconds of trace replayed on each side"),
        speed: float = typer.Option(10.0, min=0.1, help="trace arrivals and engines run this many times faster "
                                    "than real time"),
        sample: int = typer.Option(6, min=1, help="keep one conversation in N of the trace (as conductor demo)"),
        trace: Path = typer.Option(None, help="Mooncake-format JSONL trace [default: the bundled conversation trace]"),
        prefill: int = typer.Option(2, min=1, max=16, help="emulated prefill instances on each side"),
        decode: int = typer.Option(2, min=1, max=16, help="emulated decode instances on each side"),
        block_size: int = typer.Option(64, min=1, max=4096, help="tokens per KV block of the emulated engines"),
        kv_blocks: int = typer.Option(16_384, min=1, help="prefix-cache capacity of each engine, in blocks"),
        max_requests: int = typer.Option(None, min=1, help="send at most this many requests of the slice"),
        max_output_tokens: int = typer.Option(None, min=1, help="cap each request's output tokens"),
        peer_policy: str = typer.Option("cache_aware", help="the SGLang router's policy (prefill and decode)"),
        drain_s: float = typer.Option(60.0, min=1.0, help="after the last arrival, wait this long for answers"),
        peer_first: bool = typer.Option(False, "--peer-first", help="run the peer's side before Conductor's"),
        engines: str = typer.Option("emulated", "--engines", help="emulated (the default: 2P2D emulated engines, "
                                    "model time) or vllm (real vLLM CPU engines from scripts/vllm-kit, aggregated, "
                                    "fresh for each side; conductor, sglang-router cache_aware and round_robin; "
                                    "wall-clock TTFT)"),
        vllm_engines: int = typer.Option(2, "--vllm-engines", min=1, max=8, help="--engines vllm: engines per side"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON line"),
    ) -> None:
        """The same trace slice through Conductor's gateway and through the SGLang router, on identical engines.

        --engines vllm: the slice through Conductor, through sglang-router (regular HTTP mode, cache_aware) and through sglang-router's round_robin, each in front of fresh identical real vLLM engines (scripts/vllm-kit makes the kit). Per side: ttft_p50_s, ttft_p90_s (as the client saw them), engine_prefix_hit_ratio (the engines' own prefix-cache counters), served, rejected, errors. Takes several minutes: every side starts its engines afresh.

        Conductor side: stream worker, router (CONDUCTOR_POLICY) and gateway (SGLang bootstrap hand-off) in front of fresh emulated engines whose KV events reach the view through bridges. Peer side: `python -m sglang_router.launch_router --pd-disaggregation --policy cache_aware` in front of fresh, identical engines. Each request is a streamed completion sent by the openai client at its trace arrival time, its prompt a text in which each trace block is a fixed run of pseudo-words (the SGLang router matches text). Prints per side: ttft_p50_s, ttft_p90_s (model time, as conductor demo), reuse_ratio (cached / prompt tokens the engines reported), rejected (429/503), errors.
        """
        s = settings_or_exit()
        if engines not in ("emulated", "vllm"):
            err.print(f"[red]error:[/red] --engines must be emulated or vllm, not {engines!r}")
            raise typer.Exit(2)
        try:
            if engines == "vllm":
                from conductor.harness.bench.live_vllm import VllmLiveOptions, run_vllm_live_bench
                out = run_vllm_live_bench(s, VllmLiveOptions(
                    duration_s=duration, speed=speed, sample=sample, trace=trace, engines=vllm_engines,
                    max_requests=max_requests, max_output_tokens=max_output_tokens or 8, drain_s=max(drain_s, 120.0)))
            else:
                out = run_live_bench(s, LiveOptions(
                    duration_s=duration, speed=speed, sample=sample, trace=trace, prefill=prefill, decode=decode,
                    block_size=block_size, kv_blocks=kv_blocks, max_requests=max_requests,
                    max_output_tokens=max_output_tokens, drain_s=drain_s, peer=peer, peer_policy=peer_policy,
                    peer_first=peer_first))
        except LiveBenchError as e:  # VllmLiveError is one
            err.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        print_result(out, json_out)
