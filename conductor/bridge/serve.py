"""``conductor bridge`` as one call: :class:`BridgeServeConfig` (the command's options) → :func:`serve`.

One engine (one bridge per data-parallel rank) onto ``kv-events`` and ``heartbeats``, with the
bridges' counters as OpenTelemetry instruments and, with ``execute_commands``, the node's
``kv-commands`` (:func:`commands_for`) carried out against a real vLLM
(:mod:`conductor.bridge.commands`). The one module of the bridge that reads the settings and
opens Kafka clients.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from conductor.bridge.commands import VllmCommandExecutor
from conductor.bridge.runner import Bridge, BridgeConfig, endpoint_of_metrics, kafka_sink, rank_configs
from conductor.errors import ConfigError
from conductor.settings import Settings
from schemas import KvCommand
from streams.follow import Earliest, Follower, OnBad
from streams.kafka import KAFKA_FETCH_WAIT_MS, QUIET_STEPS, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

EngineRole = Literal["prefill", "decode", "both"]
ENGINE_ROLES: tuple[EngineRole, ...] = get_args(EngineRole)
_BASE_URL = re.compile(r"https?://[^\s/?#]+")


def engine_role(text: str) -> EngineRole:
    """``text`` as an engine's role; :class:`ConfigError` naming ``--role`` otherwise."""
    for role in ENGINE_ROLES:
        if text == role:
            return role
    raise ConfigError(f"--role must be one of {', '.join(ENGINE_ROLES)}, not {text!r}")


@dataclass(frozen=True)
class BridgeServeConfig:
    """What ``conductor bridge`` is told about the engine it follows (one field per option).
    Checked on construction: a bad combination raises :class:`ConfigError` naming the option."""

    zmq_endpoint: str | None
    """The engine's KV-event PUB socket; None only with ``kv_events=False``."""
    node_id: str
    role: EngineRole
    replay_endpoint: str | None = None
    heartbeat_s: float = 1.0
    """Heartbeat the node this often while the engine answers; 0: the engine heartbeats itself."""
    model: str = "default"
    metrics_url: str | None = None
    dp_size: int = 1
    default_prompt_tokens: int = 0
    rack: str | None = None
    zone: str | None = None
    engine_url: str | None = None
    kv_transfer: bool | None = None
    bootstrap_port: int | None = None
    execute_commands: bool = False
    max_tracked_blocks: int | None = None
    """Engine hashes each rank's translator remembers; None: from the engine's KV capacity (else 1,000,000)."""
    kv_events: bool = True
    """False (``--no-events``): the engine publishes no KV events; heartbeats (and ``/metrics``) only."""

    def __post_init__(self) -> None:
        if self.kv_events and not self.zmq_endpoint:
            raise ConfigError("--zmq (the engine's KV-event socket) is required, unless the engine publishes "
                              "none (--no-events)")
        if not self.kv_events:
            self._check_no_events()
        if self.max_tracked_blocks is not None and self.max_tracked_blocks < 1:
            raise ConfigError(f"--max-tracked-blocks must be at least 1, not {self.max_tracked_blocks}")
        if self.metrics_url and not self.heartbeat_s:
            raise ConfigError("--metrics-url needs --heartbeat-s > 0 (the scrape interval)")
        if self.engine_url is not None and not _BASE_URL.fullmatch(self.engine_url.rstrip("/")):
            raise ConfigError(f"--engine-url must be http(s)://HOST:PORT, not {self.engine_url!r}")
        if self.execute_commands and (self.served_url is None or self.dp_size > 1):
            raise ConfigError("--execute-commands needs the engine's URL (--engine-url or --metrics-url) "
                              "and one rank (no --dp-size)")

    def _check_no_events(self) -> None:
        given = [o for o, v in (("--zmq", self.zmq_endpoint), ("--replay", self.replay_endpoint),
                                ("--max-tracked-blocks", self.max_tracked_blocks)) if v is not None]
        if given:
            raise ConfigError(f"--no-events follows no KV-event stream: drop {' and '.join(given)}")
        if not self.heartbeat_s:
            raise ConfigError("--no-events needs --heartbeat-s > 0 (heartbeats are all such a bridge publishes)")
        if self.execute_commands:
            raise ConfigError("--execute-commands needs the engine's KV events (they prove a command was carried "
                              "out): not with --no-events")

    @property
    def served_url(self) -> str | None:
        """The engine's serving base URL: ``engine_url``, else the base of ``metrics_url``."""
        return self.engine_url.rstrip("/") if self.engine_url else endpoint_of_metrics(self.metrics_url)

    def rank_configs(self, block_size: int) -> list[BridgeConfig]:
        return rank_configs(
            node_id=self.node_id, role=self.role, zmq_endpoint=self.zmq_endpoint, replay_endpoint=self.replay_endpoint,
            block_size=block_size, heartbeat_s=self.heartbeat_s or None, model=self.model,
            metrics_url=self.metrics_url, dp_size=self.dp_size, default_prompt_tokens=self.default_prompt_tokens,
            rack=self.rack, zone=self.zone, endpoint=self.engine_url.rstrip("/") if self.engine_url else None,
            kv_transfer=self.kv_transfer, bootstrap_port=self.bootstrap_port,
            max_tracked_blocks=self.max_tracked_blocks, kv_events=self.kv_events,
        )


async def serve(config: BridgeServeConfig, settings: Settings, *, stop: asyncio.Event) -> Counter[str]:
    """Bridge the engine (a bridge per rank) until ``stop``, or until a bridge fails (its error is
    raised); with ``execute_commands``, carry out the node's kv-commands meanwhile. The bridges'
    counts, summed. Their instruments report to the meter provider the caller set up."""
    tps = topics(settings.topic_config())
    commands = (tps.kv_commands, tps.kv_command_results) if config.execute_commands else ()
    await ensure_topics(settings.kafka(), (tps.kv_events, tps.heartbeats, *commands))
    prod = producer(settings.kafka())
    await prod.start()
    events = kafka_sink(prod, tps.kv_events.name)
    bridges = [Bridge(cfg, events, kafka_sink(prod, tps.heartbeats.name))
               for cfg in config.rank_configs(settings.block_size)]
    bridge_instruments(bridges)
    tasks = [asyncio.create_task(b.run(stop)) for b in bridges]
    executor = None
    if config.execute_commands:
        assert config.served_url is not None  # checked by the config
        executor = VllmCommandExecutor.from_settings(settings, config.node_id, config.served_url,
                                                     kafka_sink(prod, tps.kv_command_results.name),
                                                     model=None if config.model == "default" else config.model)
        tasks.append(asyncio.create_task(executor.run(commands_for(settings, config.node_id, stop))))
    try:
        await run_until_stopped(stop, *tasks)
        await events.flush()
    finally:
        forget_bridges(bridges)
        if executor is not None:
            await executor.close()
        await prod.stop()
    total: Counter[str] = Counter()
    for b in bridges:
        total += b.counts + b.translator.counts
    return total


async def commands_for(settings: Settings, node_id: str, stop: asyncio.Event | None = None) -> AsyncIterator[KvCommand]:
    """The commands on ``kv-commands`` whose executor is ``node_id`` (other nodes' are skipped).

    Read in the node's own consumer group; offsets are committed after the commands were handed
    over (the generator resumed): at-least-once, made safe by the commands' ids. After 10 s
    without a command it fetches once a second instead of twice (:data:`streams.kafka.QUIET_STEPS`:
    the first command after such a spell waits up to ~250 ms longer on the embedded broker)."""
    t = topics(settings.topic_config())
    # kv-commands' owner (the balancer's side) sets bad records aside: a node logs them and goes on.
    follower = Follower(settings.kafka(), [(t.kv_commands, Earliest())], on_bad=OnBad.LOG_AND_SKIP,
                        name=f"kv-exec-{node_id}", group=f"{settings.topic_prefix}kv-exec-{node_id}",
                        fetch_wait_ms=KAFKA_FETCH_WAIT_MS, idle_steps=QUIET_STEPS)
    async with follower:
        async for batches in follower.polls(stop or asyncio.Event()):
            for batch in batches:
                for rec in batch.records:
                    body = rec.env.body if rec.env is not None else None
                    if isinstance(body, KvCommand) and body.executor == node_id:
                        yield body
            if batches:
                await follower.commit()


async def run_until_stopped(stop: asyncio.Event, *tasks: asyncio.Task[Any]) -> None:
    """Wait for ``stop`` or for any task to end (an error in one stops all); re-raise errors."""
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    for t in tasks:
        if not t.done():
            t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    stopper.cancel()
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            raise r


# The bridges this process runs now. The instruments are made once per process and read this list
# at each collection: an instrument's name can be registered once per meter (OpenTelemetry keeps the
# first one and its callbacks), so a second set made for later bridges would never report.
_LIVE: list[Bridge] = []


def forget_bridges(bridges: list[Bridge]) -> None:
    """Stop reporting ``bridges`` (they stopped)."""
    for b in bridges:
        if b in _LIVE:
            _LIVE.remove(b)


def bridge_instruments(new_bridges: list[Bridge]) -> None:
    """Report ``new_bridges`` through the bridges' instruments (records, gaps, epochs, orphans,
    scrape failures, the engine's own prefix-cache counters...), made on the first call and read
    from every live bridge at each collection."""
    _LIVE.extend(b for b in new_bridges if b not in _LIVE)
    _make_instruments()


@functools.cache
def _make_instruments() -> None:
    """The bridges' instruments, once per process, over the live bridges."""
    bridges = _LIVE

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

    def evicted(_: CallbackOptions) -> list[Observation]:
        return [Observation(b.translator.counts["hashes_evicted"], {"node": b.config.node_id}) for b in bridges]

    def tracked(_: CallbackOptions) -> list[Observation]:
        return [Observation(len(b.translator), {"node": b.config.node_id, "what": "tracked"}) for b in bridges] + [
            Observation(b.translator.max_tracked, {"node": b.config.node_id, "what": "limit"}) for b in bridges]

    meter = metrics.get_meter(__name__)
    meter.create_observable_counter(
        "conductor_bridge_events", callbacks=[observe], description="bridge counters by node and kind"
    )
    meter.create_observable_counter(
        "conductor_bridge_hashes_evicted", callbacks=[evicted],
        description="engine hashes the translator forgot at its memory bound (their blocks left the view)",
    )
    meter.create_observable_gauge(
        "conductor_bridge_tracked_hashes", callbacks=[tracked],
        description="engine hashes the translator remembers (what=tracked) and its bound (what=limit)",
    )
    meter.create_observable_gauge(
        "conductor_bridge_engine_reachable", callbacks=[reachable],
        description="1 while the engine's /metrics answers (no heartbeats otherwise)",
    )
    for field, name, what in (
        ("prefix_hit_tokens", "conductor_bridge_engine_prefix_cache_hit_tokens",
         ("prompt tokens the engine served from its prefix cache (its own counter, e.g. "
          "vllm:prefix_cache_hits_total): the reuse realised, against conductor_router_predicted_reused_tokens")),
        ("prefix_query_tokens", "conductor_bridge_engine_prefix_cache_query_tokens",
         "prompt tokens the engine looked up in its prefix cache (vllm:prefix_cache_queries_total)"),
    ):
        meter.create_observable_counter(name, callbacks=[engine_counter(bridges, field)], description=what)


def engine_counter(bridges: list[Bridge], field: str) -> Callable[[CallbackOptions], list[Observation]]:
    """An observable-counter callback: ``field`` of each bridge's last scrape, by node."""

    def observe(_: CallbackOptions) -> list[Observation]:
        out = []
        for b in bridges:
            v = getattr(b.last_load, field, None)
            if v is not None:
                out.append(Observation(v, {"node": b.config.node_id}))
        return out

    return observe
