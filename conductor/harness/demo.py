"""``conductor demo``: the whole system on one machine, Conductor's policy against a baseline.

One run per policy on the same slice of a Mooncake trace: the embedded broker and
Redis (unless CONDUCTOR_KAFKA_URL/REDIS_URL name servers), a stream worker, a
router, emulated prefill and decode engines (separate processes, each with its
own vLLM-format ZMQ publisher), one bridge per engine (ZMQ → kv-events, run in
this process), and the trace replayed onto ``requests``. Each run has its own
topic prefix and view namespace, so the baseline starts as cold as Conductor did.

Requests enter as a user's would: each run starts ``conductor gateway`` in front
of the engines (engines serve vLLM's HTTP API with the P/D KV hand-off), and the
demo sends every trace request through it with the official ``openai`` client
(a streamed completion, prompt as token ids). The gateway's address is printed
at the start (the same port for both runs), so a person can ``curl`` it.

Time: the trace's arrivals and the engines' timing model both run ``speed``
times faster than real time. TTFT is what the client observes (first streamed
token: routing, prefill, KV hand-off, first decode step), reported in model time:
what the engines emulated (prefill queue and compute, KV transfer; they report it
in model seconds) scaled back by ``speed``, everything else (the gateway's parse
and route, the HTTP hops, the relay) as it really took; the wall-clock value is
reported too.

The trace only has block ids (``hash_ids``, 512-token blocks), so each id is
given deterministic token ids; requests carry them and Conductor hashes them
exactly as the engines' events report them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.errors import ConductorError
from conductor.harness.devstack import EmbeddedStack, free_port
from conductor.harness.sim.trace import read_trace, schedule
from conductor.settings import Settings, child_environment
from conductor.stats import percentile
from schemas import Role, RoutingDecision, RoutingRejection, decode
from state.redis_view import RedisViewStore
from streams.kafka import consumer, ensure_topics, producer
from streams.topics import topics

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

TRACE_BLOCK_TOKENS = 512
VOCAB = 32_000
TRACE_NAME = Path("shared") / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / TRACE_NAME
"""``../shared/traces/`` next to the repository this package runs from."""


def default_trace() -> Path:
    """The bundled conversation trace: next to the repository, else next to the working directory."""
    for candidate in (DEFAULT_TRACE, Path.cwd().parent / TRACE_NAME, Path.cwd() / TRACE_NAME):
        if candidate.exists():
            return candidate
    return DEFAULT_TRACE


MIN_REPLAY_S = 4.0
SCRAPE_INTERVAL_S = 0.5
"""How often each bridge scrapes its engine's /metrics and heartbeats the node."""


class DemoError(ConductorError):
    """The demo could not run (a process died, the cluster never became ready...)."""


@dataclass
class DemoOptions:
    duration_s: float = 60.0
    speed: float = 20.0
    policy: str = "kvcache-centric"
    baseline: str = "round-robin"
    trace: Path | None = None
    prefill: int = 2
    decode: int = 2
    json_out: bool = False
    sample: int = 6
    """Keep one conversation in ``sample`` (by its first private block), so a short run
    covers more trace time and conversations come back to their prefixes."""
    block_size: int = 64
    kv_blocks: int = 16_384
    dram_blocks: int = 0
    partitions: int = 2
    admin_port: int = 0
    """Port of the live console (`conductor admin`) each run serves; 0: no console."""
    gateway_port: int = 0
    """Port of the gateway (`conductor gateway`) each run's clients send to; 0: a free one, the same for both runs."""


# --- the trace -------------------------------------------------------------------


def block_tokens(hash_id: int, seed: int = 0) -> list[int]:
    """The 512 token ids that stand for trace block ``hash_id`` (deterministic)."""
    raw = hashlib.shake_128(f"conductor-demo/{seed}/{hash_id}".encode()).digest(2 * TRACE_BLOCK_TOKENS)
    return [int.from_bytes(raw[i : i + 2], "little") % VOCAB for i in range(0, len(raw), 2)]


def request_tokens(hash_ids: tuple[int, ...], input_length: int, index: int, seed: int = 0) -> list[int]:
    """A prompt whose 512-token blocks are the trace's blocks; the tail past them is unique to the request."""
    toks: list[int] = []
    for h in hash_ids:
        if len(toks) >= input_length:
            break
        toks.extend(block_tokens(h, seed))
    if len(toks) < input_length:
        tail = hashlib.shake_128(f"conductor-demo/{seed}/request/{index}".encode()).digest(2 * (input_length - len(toks)))
        toks.extend(int.from_bytes(tail[i : i + 2], "little") % VOCAB for i in range(0, len(tail), 2))
    return toks[:input_length]


@dataclass(frozen=True)
class DemoRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_slice(path: Path, speed: float, sample: int, horizon_s: float) -> list[DemoRequest]:
    """The trace's requests arriving within ``horizon_s`` wall seconds at ``speed``, one conversation in ``sample``."""

    out: list[DemoRequest] = []
    for r in schedule(read_trace(path), speed=speed):
        if r.arrival_s > horizon_s:
            break
        pick = r.hash_ids[1] if len(r.hash_ids) > 1 else r.index
        if pick % sample == 0:
            out.append(DemoRequest(len(out), r.arrival_s, r.input_length, r.output_length, tuple(r.hash_ids)))
    return out


@dataclass
class RunStats:
    policy: str
    speed: float = 1.0
    """How many times faster than the model the engines run."""
    sent: int = 0
    decisions: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    routed_reuse_tokens: int = 0
    routed_prompt_tokens: int = 0
    prefills: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    client_ttft: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Request id → (TTFT the client observed, the gateway's routing time), wall-clock seconds."""
    emulated_s: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Request id → model seconds the engines emulated before its first token (prefill queue and
    compute, KV transfer to the decode instance), from their reports."""
    predicted: dict[str, float] = field(default_factory=dict)
    client_errors: Counter[str] = field(default_factory=Counter)
    """Requests the client got no completion for, by HTTP status (rejections: 429/503) or error."""
    tbt: list[float] = field(default_factory=list)
    decodes: int = 0
    per_node: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    prompt_of: dict[str, int] = field(default_factory=dict)
    bridge_counts: Counter[str] = field(default_factory=Counter)
    reject_examples: list[str] = field(default_factory=list)
    topic_prefix: str = ""
    example_ids: list[str] = field(default_factory=list)
    """A few decided request ids, to show how `conductor explain` audits them."""
    view_load: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """node → (queue depth, decode batch, blocks) as the view shows it."""
    started: float = field(default_factory=time.monotonic)
    phase: str = "starting"

    @property
    def reuse_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def observed(self) -> dict[str, float]:
        """Request id → TTFT the client observed, in model time.

        The engines run ``speed`` times faster than the model; the gateway, the log and the HTTP
        hops in real time. So the engines' emulated part (prefill queue and compute, KV transfer,
        reported in model seconds) counts at model time and the rest (parse, route, hand-off,
        relay) as it really took. A request without engine reports (a retry under another id)
        counts everything but its routing as emulated, which overstates it.
        """
        out = {}
        for rid, (wall, routing) in self.client_ttft.items():
            model = self.emulated_s.get(rid)
            if model is None:
                routing = min(max(routing, 0.0), wall)
                out[rid] = routing + (wall - routing) * self.speed
            else:
                out[rid] = max(wall - model / self.speed, 0.0) + model
        return out

    @property
    def ttft(self) -> list[float]:
        """TTFT the client observed, model time (see :attr:`observed`)."""
        return list(self.observed.values())

    @property
    def ttft_error(self) -> list[float]:
        """|predicted - observed| / observed TTFT of every request the client saw a token of."""
        return [abs(self.predicted[rid] - obs) / obs for rid, obs in self.observed.items()
                if rid in self.predicted and obs > 0]

    def on_client(self, request_id: str, wall_ttft_s: float, routing_s: float) -> None:
        """One streamed completion's first token as the client saw it (wall-clock seconds)."""
        self.client_ttft[request_id] = (wall_ttft_s, routing_s)

    def on_dispatch(self, body: Any) -> None:
        if isinstance(body, RoutingDecision):
            self.decisions += 1
            self.predicted[body.request_id] = body.predicted_ttft_s
            if len(self.example_ids) < 3 and body.reused_tokens:
                self.example_ids.append(body.request_id)
            self.routed_reuse_tokens += body.reused_tokens
            self.routed_prompt_tokens += self.prompt_of.get(body.request_id, 0)
            self.per_node[body.prefill_instance]["routed"] += 1
            self.per_node[body.decode_instance]["routed"] += 1
        elif isinstance(body, RoutingRejection):
            self.rejected[body.reason] += 1
            if len(self.reject_examples) < 3:
                self.reject_examples.append(f"{body.request_id}: {body.reason}: {body.message}"[:300])

    def on_report(self, row: dict[str, Any]) -> None:
        node = str(row.get("node"))
        if row.get("event") == "kv_received":
            self.emulated_s[str(row.get("request_id"))] += float(row.get("transfer_model_s") or 0.0)
        elif row.get("event") == "prefill_done":
            self.emulated_s[str(row.get("request_id"))] += float(row.get("engine_s") or 0.0)
            self.prefills += 1
            self.prompt_tokens += int(row["prompt_tokens"])
            self.cached_tokens += int(row["cached_tokens"])
            self.per_node[node]["done"] += 1
            self.per_node[node]["cached_tokens"] += int(row["cached_tokens"])
            self.per_node[node]["prompt_tokens"] += int(row["prompt_tokens"])
        elif row.get("event") == "decode_done":
            self.decodes += 1
            self.tbt.append(float(row["tbt_ms"]))
            self.per_node[node]["done"] += 1

    def summary(self) -> dict[str, Any]:
        def r(x: float | None, n: int = 3) -> float | None:
            return None if x is None else round(x, n)

        return {
            "policy": self.policy,
            "requests": self.sent,
            "decisions": self.decisions,
            "rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected),
            "rejection_examples": list(self.reject_examples),
            "prefills_done": self.prefills,
            "decodes_done": self.decodes,
            "reuse_ratio": r(self.reuse_ratio),
            "routed_reuse_ratio": r(self.routed_reuse_tokens / self.routed_prompt_tokens if self.routed_prompt_tokens else 0.0),
            "ttft_p50_s": r(percentile(self.ttft, 50)),
            "ttft_p90_s": r(percentile(self.ttft, 90)),
            "ttft_mean_s": r(statistics.fmean(self.ttft) if self.ttft else None),
            "ttft_prediction_error_p50": r(percentile(self.ttft_error, 50)),
            "ttft_prediction_error_p90": r(percentile(self.ttft_error, 90)),
            "tbt_p50_ms": r(percentile(self.tbt, 50), 2),
            "tbt_p90_ms": r(percentile(self.tbt, 90), 2),
            "client_ttft_wall_p50_s": r(percentile([w for w, _ in self.client_ttft.values()], 50), 4),
            "client_ttft_not_emulated_p50_s": r(percentile(
                [max(w - self.emulated_s[rid] / self.speed, 0.0) for rid, (w, _) in self.client_ttft.items()
                 if rid in self.emulated_s], 50), 4),
            "gateway_routing_ms_p50": r(percentile([g * 1000.0 for _, g in self.client_ttft.values()], 50), 2),
            "gateway_routing_ms_p99": r(percentile([g * 1000.0 for _, g in self.client_ttft.values()], 99), 2),
            "client_errors": dict(self.client_errors),
        }


# --- the dashboard -----------------------------------------------------------------


def render(runs: list[RunStats], opts: DemoOptions) -> Group:
    head = Table(title=f"Conductor demo — {opts.prefill} prefill + {opts.decode} decode emulated instances, "
                 f"Mooncake trace x{opts.speed:g}", expand=False)
    for col in ("policy", "phase", "requests", "decisions", "rejected", "reuse", "TTFT p50/p90 s",
                "TBT p50/p90 ms", "done P/D"):
        head.add_column(col, justify="right" if col not in ("policy", "phase") else "left")
    for s in runs:
        sm = s.summary()

        def pair(a: Any, b: Any) -> str:
            return "-" if a is None else f"{a:.2f} / {b:.2f}"

        head.add_row(s.policy, s.phase, str(s.sent), str(s.decisions), str(sm["rejected"]),
                     f"{s.reuse_ratio:.1%}", pair(sm["ttft_p50_s"], sm["ttft_p90_s"]),
                     pair(sm["tbt_p50_ms"], sm["tbt_p90_ms"]), f"{s.prefills}/{s.decodes}")
    nodes = Table(title="per instance (current run)", expand=False)
    for col in ("instance", "routed", "done", "in flight", "reuse", "view: queue", "batch", "blocks"):
        nodes.add_column(col, justify="right" if col != "instance" else "left")
    if runs:
        for node, c in sorted(runs[-1].per_node.items()):
            reuse = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
            q, b, blocks = runs[-1].view_load.get(node, (0, 0, 0))
            nodes.add_row(node, str(c["routed"]), str(c["done"]), str(max(0, c["routed"] - c["done"])),
                          f"{reuse:.1%}" if c["prompt_tokens"] else "-", str(q), str(b), str(blocks))
    return Group(head, nodes)


# --- processes ----------------------------------------------------------------------


class Processes:
    """Every process one run started; ``stop()`` ends exactly those (by pid), always."""

    def __init__(self, log_dir: Path, started: list[int] | None = None, cwd: Path | None = None) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.procs: list[tuple[str, asyncio.subprocess.Process]] = []
        self.started = started if started is not None else []
        """Pids of every process started (kept after ``stop()``, for the record)."""

    async def start(self, name: str, args: list[str], env: dict[str, str], *, stdout_pipe: bool = False,
                    program: list[str] | None = None) -> asyncio.subprocess.Process:
        """Start ``conductor ARGS`` (or ``PROGRAM ARGS``), its stderr (and stdout unless piped) in ``NAME.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The child writes to its own copy of the descriptor; ours is closed once it runs.
        with open(self.log_dir / f"{name}.log", "ab") as logf:  # noqa: ASYNC230 — a local append-open: no wait
            proc = await asyncio.create_subprocess_exec(
                *(program or [sys.executable, "-c", "from conductor.cli import main; main()"]), *args,
                stdout=asyncio.subprocess.PIPE if stdout_pipe else logf, stderr=logf, stdin=asyncio.subprocess.DEVNULL,
                env=env, start_new_session=True,  # Ctrl-C reaches the demo only; it stops them in order
                cwd=self.cwd,  # whatever a process writes next to itself stays in the run's directory
            )
        self.procs.append((name, proc))
        self.started.append(proc.pid)
        return proc

    def dead(self) -> list[str]:
        return [n for n, p in self.procs if p.returncode is not None]

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, timeout_s: float = 5.0) -> None:
        for _, p in reversed(self.procs):
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        self.procs.clear()


# --- one run ------------------------------------------------------------------------


async def _run_once(
    base: Settings, opts: DemoOptions, policy: str, requests: list[DemoRequest], budget_s: float,
    stats: RunStats, log_dir: Path, refresh: Any, *, exact: bool = False, pids: list[int] | None = None,
) -> None:
    t_start = time.monotonic()
    tag = f"{os.getpid():x}{time.time_ns() // 1_000_000 % 0xFFFFFF:06x}"  # unique per run, not random
    s = _run_settings(base, opts, policy, log_dir, tag)
    stats.topic_prefix = s.topic_prefix
    run = _DemoRun(s, opts, stats, log_dir / policy, pids, refresh, gateway_id=f"demo-{tag}")
    try:
        await run.start()
        await run.replay(requests, policy, t_start, budget_s, exact=exact)
        await run.drain(t_start, budget_s, exact=exact)
    finally:
        await run.close()


def _run_settings(base: Settings, opts: DemoOptions, policy: str, log_dir: Path, tag: str) -> Settings:
    """One run's settings: topics and a view namespace of its own, so each policy starts cold."""
    return base.model_copy(update={
        "topic_prefix": f"demo-{tag}.", "view_namespace": f"demo-{tag}", "partitions": opts.partitions,
        "block_size": opts.block_size, "policy": policy,
        # Parameters belong to the policy they were written for; the baseline runs on its defaults.
        "policy_params": base.policy_params if policy == opts.policy else {},
        "web_port": free_port(base.bind_host), "metrics_port": 0, "data_dir": log_dir / "data",
        "admin_port": opts.admin_port or base.admin_port,
    })


class _DemoRun:
    """One policy's run: the processes it starts (worker, router, console, engines, gateway, as the
    ``conductor`` commands), the engines' bridges and the followers in this process, the clients."""

    def __init__(self, s: Settings, opts: DemoOptions, stats: RunStats, log_dir: Path, pids: list[int] | None,
                 refresh: Any, *, gateway_id: str) -> None:
        self.s, self.opts, self.stats, self.refresh = s, opts, stats, refresh
        self.env = child_environment(s)
        self.tps = topics(s.topic_config())
        work = log_dir / "work"
        work.mkdir(parents=True, exist_ok=True)
        self.procs = Processes(log_dir, pids, cwd=work)
        self.tasks: list[asyncio.Task[Any]] = []
        self.bridges: dict[str, asyncio.Task[None]] = {}
        self.prod = producer(s.kafka())
        self.stop = asyncio.Event()
        self.view = RedisViewStore.connect(s.redis(), s.view_namespace)
        self.gateway_id = gateway_id
        self.client: openai.AsyncOpenAI | None = None
        self.clients: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Everything up, the view showing every engine live, the gateway answering."""
        await ensure_topics(self.s.kafka(), self.tps.all())
        await self.prod.start()
        await self.procs.start("worker", ["worker"], self.env)
        await self.procs.start("router", ["router"], self.env)
        if self.opts.admin_port:
            await self.procs.start("admin", ["admin"], self.env)  # the live console, on the same port every run
        engines = await self._start_engines()
        await self._start_bridges(engines)
        # The gateway: the only way requests enter, as for a user. It starts while the view fills.
        # No --engine: the gateway finds the engines through the view (the endpoints the bridges announce).
        gw = await self.procs.start("gateway", ["gateway", "--port", str(self.opts.gateway_port), "--gateway-id",
                                                self.gateway_id, "--decision-timeout-s", "10"],
                                    self.env, stdout_pipe=True)
        await self._wait_live(set(engines))
        gw_ready = await ready_line(gw, 60.0)
        if gw_ready is None:
            raise DemoError(f"the gateway did not start:\n{self.procs.log_tail('gateway')}")
        self.tasks.append(asyncio.create_task(_drain(gw)))
        key = self.s.gateway_api_key.get_secret_value() if self.s.gateway_api_key else "none"
        import openai  # the harness extra's: imported when a run starts, so the product's install imports this module

        self.client = openai.AsyncOpenAI(base_url=gw_ready["openai_base_url"], api_key=key, max_retries=0,
                                         timeout=300.0)
        self.tasks.append(asyncio.create_task(self._follow_dispatch()))
        self.tasks.append(asyncio.create_task(self._follow_view()))

    async def _start_engines(self) -> dict[str, tuple[Role, asyncio.subprocess.Process]]:
        engines: dict[str, tuple[Role, asyncio.subprocess.Process]] = {}
        opts = self.opts
        roles: tuple[tuple[Role, int], ...] = (("prefill", opts.prefill), ("decode", opts.decode))
        for role, n in roles:
            for i in range(n):
                node = f"{role}-{i}"
                # Load reaches the view the way it does from a real vLLM: the bridge scrapes /metrics.
                # vLLM's HTTP API (with the P/D hand-off); /metrics on a port of its own (a thread), so
                # a busy event loop never makes the bridge's scrape time out and the node look dead.
                args = ["engine", "--role", role, "--node-id", node, "--kv-blocks", str(opts.kv_blocks),
                        "--time-scale", str(opts.speed), "--report", "--http-port", "0", "--metrics-port", "0",
                        "--no-self-heartbeat"]
                if role == "prefill" and opts.dram_blocks:
                    args += ["--dram-blocks", str(opts.dram_blocks)]
                engines[node] = (role, await self.procs.start(node, args, self.env, stdout_pipe=True))
        return engines

    async def _start_bridges(self, engines: dict[str, tuple[Role, asyncio.subprocess.Process]]) -> None:
        """A bridge per engine, in this process, once the engine printed its endpoints."""
        readies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        for node, (_, proc) in engines.items():
            readies[node] = asyncio.get_running_loop().create_future()
            self.tasks.append(asyncio.create_task(self._read_reports(proc, readies[node])))
        for node, fut in readies.items():
            try:
                info = await asyncio.wait_for(fut, 60)
            except TimeoutError:
                raise DemoError(f"engine {node} did not start:\n{self.procs.log_tail(node)}") from None
            bridge = Bridge(
                BridgeConfig(node_id=node, role=engines[node][0], zmq_endpoint=info["zmq"],
                             replay_endpoint=info["replay"], block_size=self.opts.block_size,
                             heartbeat_s=SCRAPE_INTERVAL_S, metrics_url=info["metrics"],
                             endpoint=info["http"]),  # announced: the gateway finds the engine through the view
                kafka_sink(self.prod, self.tps.kv_events.name),
                kafka_sink(self.prod, self.tps.heartbeats.name),
            )
            self.bridges[node] = asyncio.create_task(bridge.run(self.stop))
            self.tasks.append(self.bridges[node])
            self.tasks.append(asyncio.create_task(_collect_counts(bridge, self.stats.bridge_counts, self.stop)))

    async def _read_reports(self, proc: asyncio.subprocess.Process, ready: asyncio.Future[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == "ready" and not ready.done():
                ready.set_result(row)
            else:
                self.stats.on_report(row)

    def check_alive(self) -> None:
        dead = self.procs.dead()
        if dead:
            raise DemoError(f"{dead[0]} exited early:\n{self.procs.log_tail(dead[0])}")
        for node, t in self.bridges.items():
            if t.done():
                raise DemoError(f"the bridge of {node} stopped: {t.exception() if not t.cancelled() else 'cancelled'}")

    async def _wait_live(self, want: set[str]) -> None:
        """Ready when the view (written by the stream worker) shows every engine live, and no partition
        is still being read back (routers answer 503 view_rebuilding meanwhile)."""
        self.stats.phase = "waiting for the view"
        deadline = time.monotonic() + 90
        while True:
            self.check_alive()
            now = time.time_ns() // 1_000_000
            live = {n.node_id for n in await self.view.nodes() if n.is_live(now, self.s.heartbeat_ttl_s)}
            rebuilding = await self.view.rebuild_pending() if want <= live else {}
            if want <= live and not rebuilding:
                return
            if time.monotonic() > deadline:
                raise DemoError(f"the view never showed every engine live (live: {sorted(live)}, partitions "
                                f"rebuilding: {sorted(rebuilding)}); worker log:\n{self.procs.log_tail('worker')}")
            self.refresh()
            await asyncio.sleep(0.3)

    async def _follow_dispatch(self) -> None:
        cons = consumer(self.s.kafka(), self.tps.dispatch.name, group_id=None, fetch_max_wait_ms=100)
        await cons.start()
        try:
            while not self.stop.is_set():
                for recs in (await cons.getmany(timeout_ms=200)).values():
                    for rec in recs:
                        with contextlib.suppress(Exception):
                            self.stats.on_dispatch(decode(rec.value).body)
        finally:
            await cons.stop()

    async def _follow_view(self) -> None:
        # The load the routers see: heartbeats and blocks as folded into the view.
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                for n in await self.view.nodes():
                    self.stats.view_load[n.node_id] = (n.queue_depth, n.batch_size, sum(n.blocks.values()))
                    self.stats.per_node[n.node_id]  # listed even before its first request
            await asyncio.sleep(1.0)

    async def replay(self, requests: list[DemoRequest], policy: str, t_start: float, budget_s: float, *,
                     exact: bool) -> None:
        """Send the slice's requests at their arrival times, until the budget leaves just enough time to drain."""
        assert self.client is not None
        stats = self.stats
        stats.phase = "replaying"
        t0 = time.monotonic()
        # A slow start (a busy machine) eats into the budget, but never leaves nothing to replay.
        replay_until = max(t_start + budget_s - _drain_s(budget_s), t0 + MIN_REPLAY_S)
        for r in requests:
            at = t0 + r.arrival_s
            if at > replay_until and not exact:
                break
            while time.monotonic() < at:
                await asyncio.sleep(min(0.25, at - time.monotonic()))
                self.refresh()
            self.check_alive()
            toks = request_tokens(r.hash_ids, r.input_length, r.index, self.s.seed)
            client_id = f"{policy}-{r.index}"
            stats.prompt_of[f"{self.gateway_id}-{client_id}"] = len(toks)
            self.clients.add(asyncio.create_task(ask_completion(
                self.client, stats, f"{self.gateway_id}-{client_id}", client_id, toks, r.output_length)))
            stats.sent += 1

    async def drain(self, t_start: float, budget_s: float, *, exact: bool) -> None:
        """Wait for what was decided to finish its prefill (and decode), within the budget."""
        stats = self.stats
        stats.phase = "draining"
        end = max(time.monotonic() + (_drain_s(budget_s) if exact else 2.0), t_start + budget_s)
        while time.monotonic() < end:
            if stats.decisions + sum(stats.rejected.values()) >= stats.sent and stats.prefills >= stats.decisions \
                    and stats.decodes >= stats.decisions and all(t.done() for t in self.clients):
                break
            self.refresh()
            await asyncio.sleep(0.25)
        stats.phase = "done"

    async def close(self) -> None:
        """Stop exactly what this run started, clients first."""
        for t in self.clients:
            t.cancel()
        await asyncio.gather(*self.clients, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        self.stop.set()
        await self.procs.stop()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.prod.stop()
        with contextlib.suppress(Exception):
            await self.view.close()
        self.refresh()


def _drain_s(budget_s: float) -> float:
    return max(4.0, 0.15 * budget_s)


async def ask_completion(client: openai.AsyncOpenAI, stats: RunStats, request_id: str, client_id: str,
               tokens: list[int] | str, max_tokens: int) -> None:
    """One user request through the gateway: a streamed completion of the trace's prompt (token ids or a text).

    ``request_id`` is the id the engines see (their reports' key) unless the gateway names it in
    ``x-conductor-request-id``; ``client_id`` goes out as ``x-request-id``."""
    import openai  # the harness extra's (see _DemoRun.start)

    t0 = time.perf_counter()
    try:
        # The token ids ride in ``extra_body``, which the SDK sends as is: given as ``prompt``, the SDK
        # type-checks the list element by element before sending (0.5-1.5 s of this event loop for a
        # trace prompt of ~12k tokens, on this machine), and that blocked the bridges' scrapes (nodes
        # looked dead: no_live_instance) and every other client's stream (TTFTs of seconds, requests
        # that reached the gateway only late or never).
        raw = await client.completions.with_raw_response.create(
            model="default", prompt=[], max_tokens=max(1, max_tokens), stream=True,
            extra_body={"prompt": tokens}, extra_headers={"x-request-id": client_id})
        routing_s = float(raw.headers.get("x-conductor-routing-ms") or 0.0) / 1000.0
        first = None
        async for chunk in raw.parse():
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
        if first is not None:
            stats.on_client(raw.headers.get("x-conductor-request-id") or request_id, first, routing_s)
    except openai.APIStatusError as e:
        stats.client_errors[str(e.status_code)] += 1  # a rejection: 429/503 with its reason (also on dispatch)
    except (openai.APIError, ValueError) as e:
        stats.client_errors[type(e).__name__] += 1


async def ready_line(proc: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any] | None:
    """The process's ``{"event": "ready", ...}`` stdout line (None if it exits or times out first)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return None
        if not line:
            return None
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("event") == "ready":
                return row
    return None


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def _collect_counts(bridge: Any, into: Counter[str], stop: asyncio.Event) -> None:
    last: Counter[str] = Counter()
    try:
        while not stop.is_set():
            await asyncio.sleep(1.0)
            now = bridge.counts + bridge.translator.counts
            into.update(now - last)
            last = now
    finally:
        now = bridge.counts + bridge.translator.counts
        into.update(now - last)


# --- the command --------------------------------------------------------------------


def run_demo(settings: Settings, opts: DemoOptions) -> dict[str, Any]:
    """Run both policies on the same slice; return the comparison (``ok`` False on failure)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=max(console.width, 120))  # a log file, not a window
    # The dashboard is the demo's output; per-record logs go to the processes' log files.
    for name in ("conductor.bridge", "aiokafka", "conductor.harness.dispatch", "httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    trace = opts.trace or default_trace()
    if not trace.exists():
        raise DemoError(f"trace not found: {trace} (pass --trace PATH)")
    data_dir = (Path(settings.data_dir) / "demo").resolve()
    log_dir = data_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
    stack: EmbeddedStack | None = None
    runs: list[RunStats] = []
    result: dict[str, Any] = {"ok": False}
    t_all = time.monotonic()
    pids: list[int] = []
    # SIGTERM takes the Ctrl-C path, so the same finally blocks stop every process.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if settings.kafka_url and settings.redis_url:
            base = settings
        else:
            console.print("starting the embedded broker and Redis ...")
            stack = EmbeddedStack(data_dir / "stack", host=settings.bind_host)
            st = stack.up(die_with_parent=True)
            base = settings.model_copy(update={"kafka_url": settings.kafka_url or st.kafka_url,
                                               "redis_url": settings.redis_url or st.redis_url,
                                               "profile": "embedded" if not settings.kafka_url else settings.profile})
        base = _with_credentials(base)
        opts = _with_ports(base, opts, console)
        gw_url = f"http://{settings.bind_host}:{opts.gateway_port}"
        budget = opts.duration_s / 2
        requests = load_slice(trace, opts.speed, opts.sample, budget)
        with Live(render(runs, opts), console=console, refresh_per_second=2, transient=False) as live:
            def refresh() -> None:
                live.update(render(runs, opts))

            for i, policy in enumerate((opts.policy, opts.baseline)):
                stats = RunStats(policy, opts.speed)
                runs.append(stats)
                asyncio.run(_run_once(base, opts, policy, requests, budget, stats, log_dir, refresh,
                                      exact=i == 1, pids=pids))
                # The baseline replays exactly the requests the first run replayed.
                requests = requests[: stats.sent]
        result = _comparison(runs, opts, gateway_url=gw_url, wall_s=round(time.monotonic() - t_all, 1), pids=pids,
                             log_dir=log_dir, stack_kept=stack is None)
        # The summary is the demo's result: stdout (stderr when stdout carries the --json line).
        out = console if opts.json_out else Console(width=None if sys.stdout.isatty() else 160)
        _print_summary(out, result)
        return result
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping everything the demo started[/yellow]")
        result = {"ok": False, "error": "interrupted"}
        return result
    except ConductorError as e:
        console.print(f"[red]demo failed:[/red] {e}")
        console.print(f"logs: {log_dir}")
        result = {"ok": False, "error": str(e)[:2000]}
        return result
    finally:
        signal.signal(signal.SIGTERM, previous)
        if stack is not None:
            stack.down()


def _with_credentials(settings: Settings) -> Settings:
    """``settings`` with a gateway API key and an admin token, made up for this demo when not configured:
    the gateway and the console are closed by default, and the demo prints both to sign in with."""
    update: dict[str, Any] = {}
    if settings.gateway_api_key is None:
        update["gateway_api_key"] = SecretStr(f"sk-demo-{secrets.token_urlsafe(18)}")
    if settings.admin_token is None and settings.read_token is None:
        update["admin_token"] = SecretStr(f"demo-admin-{secrets.token_urlsafe(18)}")
    return settings.model_copy(update=update)


def _with_ports(settings: Settings, opts: DemoOptions, console: Console) -> DemoOptions:
    """``opts`` with a free console port (when one is wanted) and a gateway port, both said on ``console``
    with the credentials to use them (``settings``: :func:`_with_credentials`'s)."""
    if opts.admin_port and not _port_free(settings.bind_host, opts.admin_port):
        opts = dataclasses.replace(opts, admin_port=free_port(settings.bind_host))  # another one serves there
    if opts.admin_port:
        token = settings.admin_token or settings.read_token
        sign_in = f", sign in with {token.get_secret_value()}" if token is not None else ""
        console.print(f"live console: http://{settings.bind_host}:{opts.admin_port}/ (while the demo runs{sign_in})",
                      soft_wrap=True, highlight=False, markup=False)
    if not opts.gateway_port or not _port_free(settings.bind_host, opts.gateway_port):
        opts = dataclasses.replace(opts, gateway_port=free_port(settings.bind_host))  # the same for both runs
    gw_url = f"http://{settings.bind_host}:{opts.gateway_port}"
    key = settings.gateway_api_key.get_secret_value() if settings.gateway_api_key else ""
    console.print(f"gateway (OpenAI API, while the demo runs): {gw_url}/v1  API key {key}  e.g.\n"
                  f"  curl -s {gw_url}/v1/completions -H 'Authorization: Bearer {key}' "
                  "-H 'content-type: application/json' -d '{\"model\": \"default\", \"prompt\": \"hello there\", "
                  "\"max_tokens\": 8}'", soft_wrap=True, highlight=False, markup=False)
    return opts


def _comparison(runs: list[RunStats], opts: DemoOptions, *, gateway_url: str, wall_s: float, pids: list[int],
                log_dir: Path, stack_kept: bool) -> dict[str, Any]:
    """The demo's result: Conductor's run against the baseline's (the ``--json`` line)."""
    main, other = runs[0].summary(), runs[1].summary()
    return {
        "ok": True,
        **{k: main[k] for k in ("requests", "decisions", "rejected", "reuse_ratio", "ttft_p50_s", "ttft_p90_s",
                                "tbt_p50_ms", "tbt_p90_ms", "prefills_done", "decodes_done", "routed_reuse_ratio",
                                "rejected_by_reason", "rejection_examples", "ttft_prediction_error_p50",
                                "ttft_prediction_error_p90")},
        "policy": opts.policy,
        "baseline_policy": opts.baseline,
        "baseline_requests": other["requests"],
        "baseline_rejected": other["rejected"],
        "baseline_reuse_ratio": other["reuse_ratio"],
        "baseline_ttft_p50_s": other["ttft_p50_s"],
        "baseline_ttft_p90_s": other["ttft_p90_s"],
        "baseline_tbt_p90_ms": other["tbt_p90_ms"],
        "baseline_ttft_prediction_error_p50": other["ttft_prediction_error_p50"],
        "baseline_ttft_prediction_error_p90": other["ttft_prediction_error_p90"],
        "speed": opts.speed,
        "gateway_url": gateway_url,
        "client_ttft_wall_p50_s": main["client_ttft_wall_p50_s"],
        "client_ttft_not_emulated_p50_s": main["client_ttft_not_emulated_p50_s"],
        "gateway_routing_ms_p50": main["gateway_routing_ms_p50"],
        "gateway_routing_ms_p99": main["gateway_routing_ms_p99"],
        "client_errors": main["client_errors"],
        "baseline_client_errors": other["client_errors"],
        "instances": {"prefill": opts.prefill, "decode": opts.decode},
        "bridge": {k: v for k, v in runs[-1].bridge_counts.items() if v},
        "wall_s": wall_s,
        "pids": pids,
        "logs": str(log_dir),
        "runs": [{"policy": r.policy, "topic_prefix": r.topic_prefix, "example_request_ids": r.example_ids}
                 for r in runs],
        "stack_kept": stack_kept,
    }


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _print_summary(console: Console, r: dict[str, Any]) -> None:
    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    console.print()
    t = Table(title=f"Summary: {r['policy']} vs {r['baseline_policy']} on the same trace slice")
    t.add_column("")
    t.add_column(r["policy"], justify="right")
    t.add_column(r["baseline_policy"], justify="right")
    t.add_row("requests", str(r["requests"]), str(r["baseline_requests"]))
    t.add_row("rejected", str(r["rejected"]), str(r["baseline_rejected"]))
    t.add_row("KV reuse (tokens read, not recomputed)", f(r["reuse_ratio"], ".1%"), f(r["baseline_reuse_ratio"], ".1%"))
    t.add_row("TTFT p50 (s)", f(r["ttft_p50_s"], ".2f"), f(r["baseline_ttft_p50_s"], ".2f"))
    t.add_row("TTFT p90 (s)", f(r["ttft_p90_s"], ".2f"), f(r["baseline_ttft_p90_s"], ".2f"))
    t.add_row("TBT p90 (ms)", f(r["tbt_p90_ms"], ".1f"), f(r["baseline_tbt_p90_ms"], ".1f"))
    t.add_row("TTFT prediction error p50 (|pred - obs| / obs)", f(r["ttft_prediction_error_p50"], ".1%"),
              f(r["baseline_ttft_prediction_error_p50"], ".1%"))
    console.print(t)
    console.print(f"wall time {r['wall_s']}s; logs in {r['logs']}")
    if not r["stack_kept"]:
        # The topics went with the broker the demo started and stopped: an explain line would fail.
        console.print("to audit a decision with `conductor explain`, keep the topics: run `conductor dev up`, "
                      "then this demo again (it uses that stack, leaves it running, and prints the commands)",
                      soft_wrap=True, highlight=False)
        return
    examples = [(run["topic_prefix"], rid) for run in r["runs"] for rid in run["example_request_ids"]]
    if examples:
        console.print("audit a decision (re-derived from the topics alone):")
    for prefix, rid in examples:
        console.print(f"  CONDUCTOR_TOPIC_PREFIX={prefix} conductor explain {rid}", soft_wrap=True, highlight=False)
