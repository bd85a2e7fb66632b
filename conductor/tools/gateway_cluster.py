"""A gateway in front of emulated engines, as separate processes: for the tests, the bench and demos.

Starts a stream worker, a router, prefill and decode engines serving HTTP, and one gateway
(``conductor gateway``), waits until the view shows every engine live and the gateway
answers, and stops exactly the processes it started.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conductor.errors import ConductorError
from conductor.settings import Settings, child_environment
from conductor.tools.demo import Processes, ready_line
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
    report: bool = False
    """Engines print a JSON line per finished step (``--report``), collected in ``reports``."""
    reports: list[dict[str, Any]] = field(default_factory=list)
    engine_urls: dict[str, str] = field(default_factory=dict)
    engine_procs: dict[str, Any] = field(default_factory=dict)
    gateway_url: str = ""
    gateway_id: str = ""

    async def __aenter__(self) -> "GatewayCluster":
        s = self.settings
        await ensure_topics(s, topics(s).all())
        env = child_environment(s)
        self.procs = Processes(self.log_dir, cwd=None)
        try:
            await self.procs.start("worker", ["worker"], env)
            await self.procs.start("router", ["-v", "router"], env)
            for role, n in (("prefill", self.prefill), ("decode", self.decode)):
                for i in range(n):
                    node = f"{role}-{i}"
                    args = ["engine", "--role", role, "--node-id", node, "--http-port", "0",
                            "--time-scale", str(self.time_scale), "--heartbeat-s", "0.3"]
                    if self.report:
                        args.append("--report")
                    if self.max_output_tokens:
                        args += ["--max-output-tokens", str(self.max_output_tokens)]
                    self.engine_procs[node] = await self.procs.start(node, args, env, stdout_pipe=True)
            for node, proc in self.engine_procs.items():
                self.engine_urls[node] = (await self._ready_line(node, proc))["http"]
            await self._wait_live(set(self.engine_procs))
            self.gateway_id = f"gw-test-{time.time_ns() % 10**9}"
            args = ["gateway", "--port", "0", "--gateway-id", self.gateway_id, "--engine-protocol", self.protocol,
                    *[a for n, u in self.engine_urls.items() for a in ("--engine", f"{n}={u}")], *self.gateway_args]
            gw = await self.procs.start("gateway", args, env, stdout_pipe=True)
            self.gateway_url = (await self._ready_line("gateway", gw))["url"]
        except BaseException:
            await self.procs.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.procs.stop()

    async def _ready_line(self, name: str, proc: Any, timeout_s: float = 60.0) -> dict[str, Any]:
        row = await ready_line(proc, timeout_s)
        if row is not None:
            # Keep draining stdout so the process never blocks on a full pipe.
            asyncio.ensure_future(_drain(proc, self.reports))
            return row
        raise ClusterError(f"{name} did not start:\n{self.procs.log_tail(name)}")

    async def _wait_live(self, want: set[str], timeout_s: float = 60.0) -> None:
        view = RedisViewStore.from_settings(self.settings)
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


async def _drain(proc: Any, into: list[dict[str, Any]]) -> None:
    while line := await proc.stdout.readline():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            into.append(row)
