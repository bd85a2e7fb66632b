"""A gateway in front of emulated engines, as separate processes: for the tests, the bench and demos.

Starts a stream worker, a router, prefill and decode engines serving HTTP, and one gateway
(``conductor gateway``), waits until the view shows every engine live and the gateway
answers, and stops exactly the processes it started. With ``bridges`` the engines' KV
events reach the view through a ``conductor bridge`` process per engine, so the router sees
where the KV is; heartbeats are the engines' own.

:class:`SglangRouterCluster` puts the SGLang router (``sglang-router``, the ``peer`` extra)
in front of the same emulated engines instead, in P/D mode: the peer of ``conductor bench live``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
from pydantic import SecretStr

from conductor.errors import ConductorError
from conductor.harness.cpu import server_pids
from conductor.harness.demo import Processes, ready_line
from conductor.harness.devstack import free_port
from conductor.settings import Settings, child_environment
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics
from streams.topics import topics


class ClusterError(ConductorError):
    pass


@dataclass
class GatewayCluster:
    settings: Settings
    log_dir: Path
    prefill: int = 2
    decode: int = 2
    time_scale: float = 1.0
    max_output_tokens: int | None = None
    protocol: str = "vllm"
    gateway_args: list[str] = field(default_factory=list)
    _gateway_start_args: list[str] = field(default_factory=list, init=False, repr=False)
    """The options the gateway was started with (:meth:`restart_gateway` starts it again with them)."""
    report: bool = False
    """Engines print a JSON line per finished step (``--report``), collected in ``reports``."""
    reports: list[dict[str, Any]] = field(default_factory=list)
    engine_urls: dict[str, str] = field(default_factory=dict)
    engine_procs: dict[str, Any] = field(default_factory=dict)
    gateway_url: str = ""
    gateway_id: str = ""
    engine_heartbeat_s: float = 0.3
    """How often each engine heartbeats (tests: short, so engines are live soon; a deployment's bridge: 1 s)."""
    engine_args: list[str] = field(default_factory=list)
    """More ``conductor engine`` options, the same for every engine (e.g. ``--kv-blocks``)."""
    engine_dispatch: bool = False
    """Engines also follow ``dispatch`` (``--dispatch``). Off by default: every request reaches them by
    HTTP, as a real engine behind a gateway (the dispatch path skips a gateway's requests anyway), and
    their followers' fetches were about half the embedded broker's on an idle cluster."""
    bridges: bool = False
    """Carry each engine's KV events into ``kv-events`` (``conductor bridge`` per engine, a process each).
    Heartbeats stay the engines' own: bridges scraping ``/metrics`` from a busy process (the live bench's,
    when they ran in it) missed scrapes, and the engines looked dead (``no_live_instance``)."""
    ready_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    router: bool = True
    """Start a ``conductor router`` (it decides for doors that route through the log). A colocated
    gateway decides in its own process and needs none: the live A/B's Conductor side runs without
    one, as a deployment of colocated gateways would."""
    discover: bool = False
    """Start the gateway without ``--engine``: it finds the engines through the view (their
    bridges announce the URLs)."""
    api_key: str = ""
    """The gateway's API key (``CONDUCTOR_GATEWAY_API_KEY``): made up at start when empty; clients
    send it as ``Authorization: Bearer`` (:attr:`auth_headers`)."""

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def __aenter__(self) -> Self:
        await self._start_cluster()
        try:
            overrides = {} if self.discover else self.engine_urls
            await self._start_gateway(["--engine-protocol", self.protocol,
                                       *[a for n, u in overrides.items() for a in ("--engine", f"{n}={u}")]])
        except BaseException:
            await self._stop_all()
            raise
        return self

    async def _start_cluster(self) -> dict[str, str]:
        """Topics, the stream worker, a router, the engines (and their bridges), all live; the
        children's environment. Everything started is stopped again if a part fails."""
        s = self.settings
        await ensure_topics(s.kafka(), topics(s.topic_config()).all())
        env = child_environment(s)
        self.procs = Processes(self.log_dir, cwd=None)
        try:
            await self.procs.start("worker", ["worker"], env)
            if self.router:
                await self.procs.start("router", ["-v", "router"], env)
            await self._start_engines(env)
            if self.bridges:
                await self._start_bridges(env)
            await self._wait_live(set(self.engine_procs))
        except BaseException:
            await self._stop_all()
            raise
        return env

    async def _start_gateway(self, args: list[str]) -> None:
        """``conductor gateway`` with ``args`` and :attr:`gateway_args`, behind :attr:`api_key` (made up when empty)."""
        self.gateway_id = f"gw-test-{time.time_ns() % 10**9}"
        self._gateway_start_args = args
        await self._launch_gateway(args)

    async def restart_gateway(self) -> None:
        """Start the gateway again, under the same id and options (after it was killed: a container
        restarted with a fixed ``--gateway-id``); :attr:`gateway_url` becomes the new one's."""
        await self._launch_gateway(self._gateway_start_args)

    async def start_twin_gateway(self, name: str = "gateway-twin") -> asyncio.subprocess.Process:
        """Another gateway process under the running one's id and options (a second replica given
        the same fixed ``--gateway-id``); its process, its output in ``NAME.log`` (it exits at start)."""
        return await self.procs.start(name, self._gateway_argv(self._gateway_start_args), self._gateway_env())

    async def _launch_gateway(self, args: list[str]) -> None:
        gw = await self.procs.start("gateway", self._gateway_argv(args), self._gateway_env(), stdout_pipe=True)
        self.gateway_url = (await self._ready_line("gateway", gw))["url"]

    def _gateway_argv(self, args: list[str]) -> list[str]:
        return ["gateway", "--port", "0", "--gateway-id", self.gateway_id, *args, *self.gateway_args]

    def _gateway_env(self) -> dict[str, str]:
        self.api_key = self.api_key or f"sk-test-{secrets.token_urlsafe(18)}"
        return child_environment(self.settings.model_copy(update={"gateway_api_key": SecretStr(self.api_key)}))

    async def _start_engines(self, env: dict[str, str]) -> None:
        """Every prefill and decode engine, serving HTTP; their URLs in ``engine_urls``."""
        for role, n in (("prefill", self.prefill), ("decode", self.decode)):
            for i in range(n):
                node = f"{role}-{i}"
                args = ["engine", "--role", role, "--node-id", node, "--http-port", "0",
                        "--time-scale", str(self.time_scale), *self.engine_args]
                args += ["--heartbeat-s", str(self.engine_heartbeat_s)]
                if not self.engine_dispatch:
                    args.append("--no-dispatch")
                if self.report:
                    args.append("--report")
                if self.max_output_tokens:
                    args += ["--max-output-tokens", str(self.max_output_tokens)]
                self.engine_procs[node] = await self.procs.start(node, args, env, stdout_pipe=True)
        for node, proc in self.engine_procs.items():
            self.ready_info[node] = await self._ready_line(node, proc)
            self.engine_urls[node] = self.ready_info[node]["http"]

    async def _start_bridges(self, env: dict[str, str]) -> None:
        """``conductor bridge`` per engine, each its own process (as deployed): in the client's process,
        four bridges' decoding and hashing delayed the clients' own reads by seconds under load."""
        for node, info in self.ready_info.items():
            role = "prefill" if node.startswith("prefill") else "decode"
            await self.procs.start(f"bridge-{node}", ["bridge", "--zmq", info["zmq"], "--replay", info["replay"],
                                                      "--node-id", node, "--role", role, "--heartbeat-s", "0"], env)

    async def _stop_all(self) -> None:
        await self.procs.stop()

    async def __aexit__(self, *exc: object) -> None:
        await self._stop_all()

    async def _ready_line(self, name: str, proc: Any, timeout_s: float = 60.0) -> dict[str, Any]:
        row = await ready_line(proc, timeout_s)
        if row is not None:
            # Keep draining stdout so the process never blocks on a full pipe.
            asyncio.ensure_future(_drain(proc, self.reports))
            return row
        raise ClusterError(f"{name} did not start:\n{self.procs.log_tail(name)}")

    async def _wait_live(self, want: set[str], timeout_s: float = 60.0) -> None:
        view = RedisViewStore.connect(self.settings.redis(), self.settings.view_namespace)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                now = time.time_ns() // 1_000_000
                live = {n.node_id for n in await view.nodes() if n.is_live(now, self.settings.heartbeat_ttl_s)}
                # Ready means routable: while the worker reads partitions back, routers answer view_rebuilding.
                if want <= live and (await view.view_health())[0]:
                    return
                dead = self.procs.dead()
                if dead or time.monotonic() > deadline:
                    name = dead[0] if dead else "worker"
                    raise ClusterError(f"engines not live in the view (live: {sorted(live)}):\n"
                                       f"{self.procs.log_tail(name)}")
                await asyncio.sleep(0.2)
        finally:
            await view.close()

    def kill(self, node: str) -> None:
        """SIGKILL one engine (no goodbye: its heartbeats just stop)."""
        self.engine_procs[node].kill()

    def control_pids(self) -> dict[str, int | None]:
        """The control plane's processes by name: every process started here but the engines (worker,
        router, bridges, gateway, a picker), and the broker and Redis when they run on this machine."""
        engines = set(self.engine_procs)
        own: dict[str, int | None] = {n: p.pid for n, p in self.procs.procs if n not in engines}
        return {**own, **server_pids(self.settings.kafka_url, self.settings.redis_url)}  # a tree each: workers in

    def gateway_pids(self) -> dict[str, int | None]:
        """The gateway's process and, with ``--workers``, its workers (``gateway-w<i>``, in pid order; Linux /proc)."""
        parent = next((p.pid for n, p in reversed(self.procs.procs) if n == "gateway"), None)  # the latest
        if parent is None:
            return {}
        kids = sorted(child_pids(parent))
        return {"gateway": parent, **{f"gateway-w{i}": pid for i, pid in enumerate(kids)}}


async def _drain(proc: Any, into: list[dict[str, Any]]) -> None:
    while line := await proc.stdout.readline():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            into.append(row)


SGLANG_ROUTER_VERSION = "0.3.2"


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux /proc; none elsewhere)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            out.append(int(d.name))
    return out


def sglang_router_missing() -> str | None:
    """Why the SGLang router cannot run here (None when it can)."""
    if importlib.util.find_spec("sglang_router") is None:
        return (f"sglang-router is not installed: pip install -e '.[peer]' (sglang-router=={SGLANG_ROUTER_VERSION}), "
                "or .venv/bin/pip install sglang-router")
    return None


@dataclass
class SglangRouterCluster(GatewayCluster):
    """The SGLang router (``python -m sglang_router.launch_router``) in front of emulated engines, in P/D mode.

    The engines are started exactly as :class:`GatewayCluster` starts them (a fresh topic
    prefix: nothing reads their events); the router gets ``--pd-disaggregation``, each prefill
    as ``--prefill URL BOOTSTRAP_PORT`` (the emulated engine serves its bootstrap on its HTTP
    port) and each decode as ``--decode URL``, and ``policy`` for both. ``gateway_url`` is the
    router's. Ready when its ``/workers`` lists every engine healthy.
    """

    policy: str = "cache_aware"

    async def __aenter__(self) -> Self:
        why = sglang_router_missing()
        if why:
            raise ClusterError(why)
        s = self.settings
        await ensure_topics(s.kafka(), topics(s.topic_config()).all())
        env = child_environment(s)
        self.procs = Processes(self.log_dir, cwd=None)
        try:
            await self._start_engines(env)
            port = free_port(s.bind_host)
            args = ["--host", s.bind_host, "--port", str(port), "--pd-disaggregation", "--policy", self.policy,
                    "--prometheus-host", s.bind_host, "--prometheus-port", str(free_port(s.bind_host)),
                    "--log-level", "warn"]
            for node, url in self.engine_urls.items():
                if node.startswith("prefill"):
                    args += ["--prefill", url, url.rsplit(":", 1)[1]]
                else:
                    args += ["--decode", url]
            self.gateway_id = "sglang-router"
            await self.procs.start("sglang-router", args, env,
                                   program=[sys.executable, "-m", "sglang_router.launch_router"])
            self.gateway_url = f"http://{s.bind_host}:{port}"
            await self._wait_workers()
        except BaseException:
            await self._stop_all()
            raise
        return self

    def control_pids(self) -> dict[str, int | None]:
        """The router's process only: it needs no broker and no Redis."""
        return {n: p.pid for n, p in self.procs.procs if n == "sglang-router"}

    async def _wait_workers(self, timeout_s: float = 60.0) -> None:
        want = len(self.engine_urls)
        deadline = time.monotonic() + timeout_s
        seen: Any = None
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.procs.dead():
                    break
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    seen = (await client.get(self.gateway_url + "/workers")).json()
                    healthy = [w for w in seen.get("workers", []) if w.get("is_healthy")]
                    if len(healthy) >= want:
                        return
                await asyncio.sleep(0.3)
        raise ClusterError(f"the SGLang router did not list {want} healthy workers (last: {str(seen)[:300]}):\n"
                           f"{self.procs.log_tail('sglang-router')}")
