"""``conductor epp`` (Conductor as the Gateway API Inference Extension's endpoint picker) and ``conductor bench epp``."""

from __future__ import annotations

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
    settings_or_exit,
)
from conductor.epp import serve as epp_serve
from conductor.epp import workers as epp_workers
from conductor.frontdoor.protocol import engine_map
from conductor.harness.bench.epp import run_epp_bench
from conductor.telemetry import setup_metrics

EppPort = Annotated[int, typer.Option("--port", min=0, max=65535, help="gRPC port on CONDUCTOR_BIND_HOST (0 = a free "
    "one; the Inference Extension's pickers serve ext_proc on 9002)")]
EppEngine = Annotated[list[str] | None, typer.Option("--engine", help="NODE_ID=http://HOST:PORT: override the URL an "
    "engine's heartbeats announce, or name one that announces none (repeat for each); the destination the proxy is "
    "told is its HOST:PORT [default: the engines found through the view: `conductor bridge --engine-url`]")]
EppId = Annotated[str | None, typer.Option("--epp-id", help="names this picker on the log (its producer id, its reply "
    "topic with --routing log) [default: epp-HOST-PID]")]
EppModel = Annotated[str | None, typer.Option("--model", help="the engines' base model: another model name in a "
    "request is a LoRA adapter (it enters the block keys)")]
EppRouting = Annotated[str, typer.Option("--routing", help="colocated: decide in this process (the routers' policy "
    "over the Redis view, reservations shared through Redis), the request and its decision written to the log with "
    "the broker's acknowledgement before the answer; log: each request onto `requests`, a router's decision back on "
    "this picker's reply topic (needs `conductor router` running)")]
EppDecisionTimeoutS = Annotated[float, typer.Option(min=0.05, help="the whole answer, from the body's end (parse, "
    "tokenize, decide, the broker's acknowledgement): past it 503 decision_timeout; a decision made later, or one "
    "whose stream the proxy cancelled, is released (its pending blocks) and recorded on request-outcomes")]
EppMaxStreams = Annotated[int, typer.Option("--max-streams", min=0, help="requests the picker works on at once, each "
    "from its first message to its answer (a stream the proxy keeps open after the answer does not count); beyond "
    "it a new stream is answered 429 picker_busy with Retry-After at once, never queued; 0 = no bound")]
EppBodyMode = Annotated[str, typer.Option("--body-mode", help="the proxy's ext_proc request_body_mode when its first "
    "message does not say (Envoy 1.32+ does): full-duplex (FULL_DUPLEX_STREAMED, the Inference Extension's) or "
    "buffered (BUFFERED)")]
EppMaxBody = Annotated[int, typer.Option(min=1024, help="a longer request body is answered 413")]
EppTokenizer = Annotated[str | None, typer.Option("--tokenizer", help="a tokenizer.json for text prompts "
    "[default: the engines' /tokenize]")]
EppTlsCert = Annotated[Path | None, typer.Option("--tls-cert", help="serve gRPC over TLS with this PEM certificate "
    "chain (with --tls-key) [default: plaintext, as inside a mesh or a pod network]")]
EppTlsKey = Annotated[Path | None, typer.Option("--tls-key", help="the PEM private key of --tls-cert")]
EppWorkers = Annotated[int, typer.Option("--workers", min=1, max=256, help="picker processes serving --port, one core "
    "each (Linux: the port shared with SO_REUSEPORT, the kernel spreading the proxy's connections over them); each a "
    "whole picker with its own id <epp id>-w<i> (its producer id on the log), reservations shared through Redis; "
    "worker i serves its metrics on CONDUCTOR_METRICS_PORT + i. Prints one ready line for all")]
EppReusePort = Annotated[bool, typer.Option("--reuse-port", hidden=True, help="share --port with other processes "
    "(SO_REUSEPORT): set by --workers for its workers")]
EppHealth = Annotated[bool, typer.Option("--health/--no-health", help="serve gRPC health (grpc.health.v1) beside "
    "ext_proc: liveness, readiness and the ext_proc service, for Kubernetes' grpc probes")]


def epp(
    port: EppPort = 9002,
    engine: EppEngine = None,
    epp_id: EppId = None,
    model: EppModel = None,
    routing: EppRouting = "colocated",
    decision_timeout_s: EppDecisionTimeoutS = 5.0,
    body_mode: EppBodyMode = "full-duplex",
    max_body_bytes: EppMaxBody = 16 * 1024 * 1024,
    max_streams: EppMaxStreams = 256,
    tokenizer: EppTokenizer = None,
    tls_cert: EppTlsCert = None,
    tls_key: EppTlsKey = None,
    health: EppHealth = True,
    workers: EppWorkers = 1,
    reuse_port: EppReusePort = False,
) -> None:
    """Be the endpoint picker of a Gateway API Inference Extension gateway (Envoy's ext_proc over gRPC).

    The proxy (Envoy, kgateway, Istio, GKE's gateway) streams each request's headers and body to this service; Conductor tokenizes the OpenAI body, decides with its policy (the decision on `dispatch`, as any other: `conductor explain` re-derives it), and answers with the decode instance's HOST:PORT in the x-gateway-destination-endpoint header and the envoy.lb dynamic metadata (route cache cleared), and, for a disaggregated decision, the prefill instance's in x-prefiller-host-port (llm-d's routing sidecar on the decode pod runs the prefill there first). A rejection is an immediate response: 429 (the SLOs cannot be met, overloaded) or 503 (no live instance, view unavailable, no decision in time) with the reason as the OpenAI error code; a bad body 400 naming the field. Client SLOs: headers x-conductor-ttft-slo-ms, x-conductor-tbt-slo-ms, x-conductor-priority. Prints one JSON ready line.
    """
    with exit_on():
        engines = engine_map(engine or [])
        tls = epp_serve.tls_config(tls_cert, tls_key)
    s = settings_or_exit()
    need_kafka_url(s)
    with exit_on():
        config = epp_serve.epp_config(s, epp_id=epp_id, engines=engines, base_model=model, routing=routing,
                                      decision_timeout_s=decision_timeout_s, body_mode=body_mode,
                                      max_body_bytes=max_body_bytes, max_streams=max_streams)
    if workers > 1:

        def worker_args(i: int, worker_port: str) -> list[str]:
            args = ["epp", "--reuse-port", "--port", worker_port, "--epp-id", epp_workers.worker_id(config.epp_id, i),
                    "--routing", routing, "--decision-timeout-s", repr(decision_timeout_s), "--body-mode", body_mode,
                    "--max-body-bytes", str(max_body_bytes), "--max-streams", str(max_streams),
                    "--health" if health else "--no-health"]
            args += [a for e in engine or [] for a in ("--engine", e)]
            for flag, value in (("--model", model), ("--tokenizer", tokenizer), ("--tls-cert", tls_cert),
                                ("--tls-key", tls_key)):
                if value is not None:
                    args += [flag, str(value)]
            return args

        with exit_on():
            code = run_until_signalled(lambda stop: epp_workers.supervise(
                worker_args, epp_id=config.epp_id, workers=workers, host=s.bind_host, port=port, stop=stop,
                metrics_port=s.metrics_port, on_ready=print_json))
        raise typer.Exit(code)
    setup_metrics("conductor-epp", s.bind_host, s.metrics_port)
    with exit_on():
        run_until_signalled(lambda stop: epp_serve.serve(config, s, port=port, stop=stop, tls=tls,
                                                         health_service=health, tokenizer_path=tokenizer,
                                                         on_ready=print_json, reuse_port=reuse_port),
                            loop_factory=web.loop_factory())


BenchEppRequests = Annotated[int, typer.Option(min=10, help="requests timed on each path")]
BenchEppConcurrency = Annotated[int, typer.Option(min=1, help="requests in flight at once on each path")]
BenchEppRouting = Annotated[str, typer.Option("--routing", help="how both the picker and the gateway decide: "
    "colocated (each in its own process) or log (through the routers)")]

BenchEppWorkers = Annotated[int, typer.Option("--epp-workers", min=1, max=64, help="the picker's --workers (each "
    "of the --concurrency clients has a gRPC connection of its own, as Envoy's worker threads do, which the kernel "
    "spreads over the workers)")]


def bench_epp(
    requests: BenchEppRequests = 200,
    concurrency: BenchEppConcurrency = 1,
    routing: BenchEppRouting = "colocated",
    epp_workers: BenchEppWorkers = 1,
    json_out: JsonLine = False,
) -> None:
    """Decision latency of `conductor epp` over gRPC against the gateway's own decision path, on the same cluster.

    Starts (on CONDUCTOR_KAFKA_URL/REDIS_URL, or the embedded ones) a worker, a router, 2 prefill + 2 decode emulated engines, `conductor gateway` and `conductor epp`; sends the same completions to each (prompts as token ids: no tokenizer call on either path), both deciding as --routing says. EPP: the time from sending a request's headers and body over one ext_proc stream to the answer naming the destination (gRPC, parse, decide, the decision acknowledged on the log). Gateway: the routing_ms of its request_outcome (decide, the decision acknowledged on the log), measured inside the gateway. Fields: epp_ms_p50, epp_ms_p99, epp_inside_ms_p50, epp_inside_ms_p99 (the picker's own time from the body's end to its answer: its x-conductor-routing-ms header), gateway_routing_ms_p50, gateway_routing_ms_p99, epp_decisions_per_s (the picker's phase: requests over its wall time), epp_workers, requests, errors; control_cpu_* (CPU of every control-plane process over the picker's phase; "epp" counts its workers too) and gateway_control_cpu_* (the gateway's phase).
    """
    if routing not in ("colocated", "log"):
        err.print(f"[red]error:[/red] --routing must be colocated or log, not {routing!r}")
        raise typer.Exit(2)
    s = settings_or_exit()
    out = run_epp_bench(s, requests=requests, concurrency=concurrency, routing=routing, workers=epp_workers)
    print_result(out, json_out)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("epp")(epp)
    groups["bench"].command("epp")(bench_epp)
