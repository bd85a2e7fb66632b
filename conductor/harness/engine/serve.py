"""``conductor engine`` as one call: :class:`EngineServeConfig` (the command's options) → :func:`serve`.

One emulated instance as a node of the cluster: its KV events on a ZMQ publisher (for a bridge),
the decisions naming it read from ``dispatch``, its heartbeats on ``heartbeats`` (placed in a
rack and zone), and optionally its vLLM-compatible HTTP face, a ``/metrics`` port of its own,
its node's KV commands and a shared KV pool (Mooncake Store).

:func:`engine_node` is the same wiring as an async context manager, for callers that need the
running engine itself (tests submit work to it, read its publisher's endpoints); :func:`serve`
runs one until ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TextIO

from prometheus_client import start_http_server

from conductor import web
from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Sink, kafka_sink
from conductor.bridge.serve import EngineRole, commands_for, run_until_stopped
from conductor.costmodel.profiles import ModelProfile, load_profile
from conductor.errors import ConfigError
from conductor.harness.dispatch import decisions_for
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.executor import EngineCommandExecutor
from conductor.harness.engine.http import engine_app
from conductor.harness.engine.metrics import engine_registry
from conductor.harness.engine.pool import POOL_NODE, MooncakePool, PoolError, PoolIndex, PoolLink
from conductor.settings import Settings
from schemas import Envelope, Heartbeat
from streams.kafka import ensure_topics, producer
from streams.topics import Topics, topics

log = logging.getLogger(__name__)

CLOCK_SLACK_MS = 2_000
"""Decisions are read from a little before the engine's start: the router's clock may lag ours."""


@dataclass(frozen=True)
class PoolOptions:
    """Joining a Mooncake Store as the shared KV pool (``--mooncake-master`` and the ``--pool-*`` options)."""

    master: str
    """``HOST:PORT`` of the pool's master."""
    node_id: str = POOL_NODE
    """The pool's node id in the view."""
    segment_mb: int = 256
    """Memory this engine mounts into the pool."""
    block_bytes: int | None = None
    """Bytes per block object (``None``: the profile's KV bytes per token x the block size)."""


@dataclass(frozen=True)
class EngineServeConfig:
    """What ``conductor engine`` is told (one field per option; the pool's as :class:`PoolOptions`)."""

    node_id: str
    role: EngineRole
    zmq_port: int = 0
    """KV-event PUB port on the settings' bind host (0: a free one); ``replay_port`` likewise."""
    replay_port: int = 0
    kv_blocks: int = 16_384
    dram_blocks: int = 0
    time_scale: float = 1.0
    max_output_tokens: int | None = None
    heartbeat_s: float = 0.5
    report: bool = False
    """Write one JSON line per finished request (to stdout unless told otherwise)."""
    http_port: int | None = None
    """Serve vLLM's OpenAI HTTP API here (0: a free port; ``None``: no HTTP)."""
    model: str = "default"
    metrics_port: int | None = None
    """Serve ``/metrics`` on a port of its own (0: a free one; ``None``: none, or on the HTTP port)."""
    self_heartbeat: bool = True
    rack: str | None = None
    zone: str | None = None
    kv_commands: bool = True
    dispatch: bool = True
    """Carry out the decisions naming this node on ``dispatch`` (the closed-world path); off: requests
    come by HTTP only, as to a real engine behind a gateway (no ``dispatch`` follower fetching)."""
    pool: PoolOptions | None = None
    tokenizer: str | None = None
    """A ``tokenizer.json`` for text prompts (``/tokenize`` and generation), as a real engine's; default: one id per word."""

    def engine_config(self, settings: Settings) -> EngineConfig:
        return EngineConfig(
            node_id=self.node_id, role=self.role, block_size=settings.block_size, kv_blocks=self.kv_blocks,
            dram_blocks=self.dram_blocks, time_scale=self.time_scale, heartbeat_s=self.heartbeat_s,
            max_output_tokens=self.max_output_tokens, seed=settings.seed, model=self.model,
        )


@dataclass
class EngineNode:
    """One emulated instance, started by :func:`engine_node`, and what it runs with."""

    config: EngineServeConfig
    settings: Settings
    engine: EmulatedEngine
    publisher: EventPublisher
    command_results: Sink
    started_ms: int
    sock: socket.socket | None
    ready: dict[str, Any]
    """The ``ready`` line ``conductor engine`` prints first: node, role, ZMQ endpoints, metrics and HTTP URLs."""

    async def run(self, stop: asyncio.Event) -> None:
        """Carry out this node's decisions (and its KV commands, and serve HTTP) until ``stop`` or
        until one of them fails (its error is raised)."""
        s, cfg = self.settings, self.config
        stream = (decisions_for(s, cfg.node_id, since_ms=self.started_ms - CLOCK_SLACK_MS, stop=stop)
                  if cfg.dispatch else _none_until(stop))
        tasks = [asyncio.create_task(self.engine.run(stream))]
        if self.sock is not None:
            app = engine_app(self.engine, s.bind_host, self.sock.getsockname()[1], tokenizer=cfg.tokenizer)
            tasks.append(asyncio.create_task(web.serve(app, self.sock, stop)))
        if cfg.kv_commands and cfg.role != "decode":
            executor = EngineCommandExecutor(self.engine, self.command_results)
            tasks.append(asyncio.create_task(executor.run(commands_for(s, cfg.node_id, stop))))
        await run_until_stopped(stop, *tasks)


async def _none_until(stop: asyncio.Event) -> AsyncIterator[Any]:
    """No assignment, until ``stop`` (what an engine that does not follow ``dispatch`` runs on)."""
    await stop.wait()
    return
    yield


async def serve(config: EngineServeConfig, settings: Settings, *, stop: asyncio.Event,
                on_ready: Callable[[dict[str, Any]], None] = lambda _: None) -> None:
    """Run one emulated instance until ``stop``; ``on_ready`` gets its ready line once it listens."""
    async with engine_node(config, settings) as node:
        on_ready(node.ready)
        await node.run(stop)


@contextlib.asynccontextmanager
async def engine_node(config: EngineServeConfig, settings: Settings, *,
                      report_to: TextIO | None = None) -> AsyncIterator[EngineNode]:
    """The instance ``config`` describes, listening (ZMQ, HTTP, metrics) but not yet running;
    everything it opened is closed on exit. ``report_to``: where ``config.report`` writes (stdout)."""
    profile = _profile(settings)
    tps = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), tps.all())
    host = settings.bind_host
    async with contextlib.AsyncExitStack() as opened:
        prod = producer(settings.kafka())
        await prod.start()
        opened.push_async_callback(prod.stop)
        pub = EventPublisher(f"tcp://{host}:{config.zmq_port}", f"tcp://{host}:{config.replay_port}")
        opened.push_async_callback(pub.close)
        started_ms = time.time_ns() // 1_000_000
        pool = None
        if config.pool is not None:
            pool = await _join_pool(config, config.pool, settings, profile, prod, tps, started_ms)
            opened.callback(pool.close)
        heartbeats = kafka_sink(prod, tps.heartbeats.name) if config.self_heartbeat else None
        engine = EmulatedEngine(config.engine_config(settings), profile, pub,
                                heartbeat_sink=placed_heartbeats(heartbeats, config.rack, config.zone)
                                if heartbeats else None,
                                report=(report_to or sys.stdout) if config.report else None, pool=pool)
        metrics_url = None
        if config.metrics_port is not None:
            # prometheus_client's own server (a thread), for an engine run without --http-port.
            server, _ = start_http_server(config.metrics_port, addr=host, registry=engine_registry(engine))
            opened.callback(server.shutdown)
            metrics_url = f"http://{host}:{server.server_port}/metrics"
        sock = web.bind(host, config.http_port) if config.http_port is not None else None
        ready: dict[str, Any] = {"event": "ready", "node_id": config.node_id, "role": config.role,
                                 "zmq": pub.endpoint, "replay": pub.replay_endpoint, "metrics": metrics_url}
        if sock is not None:
            opened.callback(sock.close)
            ready["http"] = f"http://{host}:{sock.getsockname()[1]}"
            ready["metrics"] = metrics_url or ready["http"] + "/metrics"  # as vLLM: on the API port
        yield EngineNode(config, settings, engine, pub, kafka_sink(prod, tps.kv_command_results.name), started_ms,
                         sock, ready)


def _profile(settings: Settings) -> ModelProfile:
    try:
        return load_profile(settings.model_profile)
    except ValueError as e:  # a profile file that does not validate
        raise ConfigError(str(e)) from None


async def _join_pool(config: EngineServeConfig, opts: PoolOptions, settings: Settings, profile: ModelProfile,
                     prod: Any, tps: Topics, started_ms: int) -> PoolLink:
    size = opts.block_bytes or settings.block_size * profile.kv_bytes_per_token
    try:
        client = await asyncio.to_thread(MooncakePool.connect, opts.master, block_size_bytes=size,
                                         segment_bytes=opts.segment_mb << 20, local_host=settings.bind_host,
                                         model=config.model)
    except PoolError as e:
        raise PoolError(f"--mooncake-master: {e}") from e
    index = PoolIndex(config.node_id, opts.node_id, epoch=started_ms, capacity_blocks=client.capacity_blocks,
                      heartbeat_s=config.heartbeat_s)
    log.info("engine %s joined the KV pool at %s as %s (%d blocks of %d bytes)", config.node_id, opts.master,
             opts.node_id, client.capacity_blocks, size)
    return PoolLink(client, index, events=kafka_sink(prod, tps.kv_events.name),
                    heartbeats=kafka_sink(prod, tps.heartbeats.name))


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
