"""``conductor epp`` as one call: :func:`epp_config` (the command's options checked into an
:class:`~conductor.epp.service.EppConfig`), then :func:`serve` until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conductor.epp.protocol import BODY_MODES
from conductor.epp.service import EppConfig, ExternalProcessor, OutcomeSink, Picker
from conductor.errors import ConfigError
from conductor.frontdoor.decide import ROUTINGS, Decider, Routing, make_decider, parse_routing
from conductor.frontdoor.directory import EngineDirectory
from conductor.frontdoor.protocol import default_bounds
from conductor.frontdoor.tokenizer import EngineTokenizer, ModelFilesTokenizer, prompt_tokenizer
from conductor.settings import Settings
from schemas import RequestOutcome, envelope
from state.connect import open_client
from state.redis_view import RedisViewStore
from streams.kafka import acknowledged, ensure_topics, producer
from streams.topics import topics

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
"""Served while a decision can be made (the protocol's readiness); ``liveness`` while the process answers."""
HEALTH_EVERY_S = 1.0


def default_epp_id() -> str:
    """``epp-HOST-PID``: unique per process, and a valid topic name."""
    return f"epp-{socket.gethostname()}-{os.getpid()}".replace("_", "-")[:120]


@dataclass(frozen=True)
class Tls:
    """The server's certificate chain and private key (PEM bytes), read at start-up."""

    cert: bytes
    key: bytes


def tls_config(cert: Path | None, key: Path | None) -> Tls | None:
    """``--tls-cert`` and ``--tls-key`` read (both or neither); :class:`ConfigError` naming the one at fault."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigError("--tls-cert and --tls-key go together (a PEM certificate chain and its private key)")
    out = []
    for name, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{name} {path}: {e.strerror or e}") from None
        if b"-----BEGIN" not in data:
            raise ConfigError(f"{name} {path}: not PEM")
        out.append(data)
    return Tls(cert=out[0], key=out[1])


def epp_config(settings: Settings, *, epp_id: str | None, engines: dict[str, str], base_model: str | None = None,
               routing: str = "colocated", decision_timeout_s: float = 5.0, body_mode: str = "full-duplex",
               max_body_bytes: int = 16 * 1024 * 1024, max_streams: int = 256) -> EppConfig:
    """The picker's configuration; :class:`ConfigError` naming the option at fault."""
    eid = epp_id or default_epp_id()
    try:
        topics(settings.topic_config()).replies(eid)  # the id names a reply topic in log mode
    except ValueError as e:
        raise ConfigError(f"--epp-id: {e}") from None
    if routing not in ROUTINGS:
        raise ConfigError(f"--routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
    if body_mode not in BODY_MODES:
        raise ConfigError(f"--body-mode must be one of {', '.join(BODY_MODES)}, not {body_mode!r}")
    if max_streams < 0:
        raise ConfigError(f"--max-streams must be 0 (no bound) or more, not {max_streams}")
    return EppConfig(epp_id=eid, engines=engines, base_model=base_model, routing=routing,
                     decision_timeout_s=decision_timeout_s, body_mode=body_mode, max_body_bytes=max_body_bytes,
                     max_streams=max_streams,
                     bounds=default_bounds(settings), trust_bounds_header=settings.epp_trust_bounds_header)


def _routing(text: str) -> Routing:
    mode = parse_routing(text)
    if mode is None:
        raise ConfigError(f"--routing must be one of {', '.join(ROUTINGS)}")
    return mode


class OutcomeWriter:
    """The picker's ``request_outcome`` records (only for decisions it made but did not deliver:
    :meth:`~conductor.epp.service.Picker.abandon`), on a producer of its own, started on the first."""

    def __init__(self, settings: Settings, producer_id: str) -> None:
        self.settings = settings
        self.producer_id = producer_id
        self.topic = topics(settings.topic_config()).request_outcomes
        self._prod: Any = None
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, outcome: RequestOutcome) -> None:
        task = asyncio.get_running_loop().create_task(self._send(outcome))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, outcome: RequestOutcome) -> None:
        try:
            if self._prod is None:
                await ensure_topics(self.settings.kafka(), (self.topic,))
                self._prod = producer(self.settings.kafka(), linger_ms=5)
                await self._prod.start()
            self._seq += 1
            env = envelope(outcome, producer_id=self.producer_id, producer_seq=self._seq,
                           ts_ms=time.time_ns() // 1_000_000)
            await acknowledged(self._prod, [await self.topic.send(self._prod, env, outcome.request_id)],
                               warn_after_s=1.0, what=f"outcome {outcome.request_id}")
        except Exception as e:  # noqa: BLE001 - the release itself is done; only the record is missing
            log.warning("the outcome of %s was not written: %s", outcome.request_id, e)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        if self._prod is not None:
            with contextlib.suppress(Exception):
                await self._prod.stop()


async def serve(config: EppConfig, settings: Settings, *, port: int, stop: asyncio.Event, tls: Tls | None = None,
                health_service: bool = True, tokenizer_path: str | None = None,
                on_ready: Callable[[dict[str, Any]], None] = lambda _: None, decider: Decider | None = None,
                outcomes: OutcomeSink | None = None, reuse_port: bool = False) -> None:
    """Serve the picker (and gRPC health) on ``port`` of the settings' bind host (0: a free one) until
    ``stop``. ``on_ready`` gets the ready line (id, address, TLS, routing) once decisions can be made.
    ``decider``: one to use instead of the configured routing's (tests); ``outcomes``: where undelivered
    decisions are recorded (default: the ``request-outcomes`` topic); ``reuse_port``: share the port
    with the other workers of ``--workers`` (SO_REUSEPORT)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    client = httpx.AsyncClient(timeout=httpx.Timeout(connect=settings.gateway_connect_timeout_s,
                                                     read=settings.gateway_first_byte_timeout_s or None,
                                                     write=10.0, pool=settings.gateway_connect_timeout_s))
    view = None
    if settings.redis_url:
        view = RedisViewStore(open_client(settings.redis().connection_url(), decode_responses=False,
                                          **settings.redis().tls_options(), socket_timeout=1.0,
                                          socket_connect_timeout=1.0), settings.view_namespace)
    directory = EngineDirectory(config.engines, view.nodes if view is not None else None,
                                ttl_s=settings.heartbeat_ttl_s)
    engine_tok = EngineTokenizer(client, directory)
    tok, how = prompt_tokenizer(engine_tok, tokenizer_path, config.base_model)
    log.info("picker %s: %s", config.epp_id, how)
    if decider is None:
        # Envoy sends the picker no response phases: it never sees an answer end, so it charges
        # no in-flight work it could not release (reservations cleared by heartbeats count it).
        decider = make_decider(settings, _routing(config.routing), producer_id=config.epp_id,
                               timeout_s=config.decision_timeout_s, sees_answers=False)
    writer = OutcomeWriter(settings, config.epp_id) if outcomes is None else None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
    picker = Picker(config, decider, tok, directory, outcomes=outcomes or writer)
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    checks = health.aio.HealthServicer()
    if health_service:
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    address = f"{settings.bind_host}:{port}"
    health_task: asyncio.Task[None] | None = None
    warming: asyncio.Future[None] | None = None
    try:
        try:
            bound = (server.add_secure_port(address, grpc.ssl_server_credentials([(tls.key, tls.cert)]))
                     if tls is not None else server.add_insecure_port(address))
        except RuntimeError as e:
            raise ConfigError(f"--port {port}: cannot listen on {address}: {e}") from None
        await directory.refresh(force=True)
        if not len(directory):
            log.warning("no engine known yet: none announces an endpoint in the view and no --engine was given")
        await decider.start()
        if isinstance(tok, ModelFilesTokenizer):  # the model's files looked for now, not by the first requests
            warming = asyncio.ensure_future(tok.warm())
        await server.start()
        if health_service:
            await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
            health_task = asyncio.create_task(_keep_health(checks, decider.problem, stop))
        on_ready({"event": "ready", "epp_id": config.epp_id, "address": f"{settings.bind_host}:{bound}",
                  "port": bound, "tls": tls is not None, "routing": config.routing, "body_mode": config.body_mode,
                  "health": health_service})
        await stop.wait()
    finally:
        if health_service:
            await checks.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        if health_task is not None:
            health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health_task
        if warming is not None:
            warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await warming
        await decider.close()
        if writer is not None:
            await writer.close()
        await client.aclose()
        if view is not None:
            with contextlib.suppress(Exception):
                await view.close()


async def _keep_health(checks: Any, problem: Callable[[], str | None], stop: asyncio.Event) -> None:
    """Readiness follows the decider: NOT_SERVING (the reason logged once) while it cannot decide."""
    last: str | None = ""
    while not stop.is_set():
        why = problem()
        if why != last:
            status = health_pb2.HealthCheckResponse.SERVING if why is None else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in HEALTH_SERVICES:
                await checks.set(name, status)
            if why is not None:
                log.warning("not ready: %s", why)
            last = why
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HEALTH_EVERY_S)
