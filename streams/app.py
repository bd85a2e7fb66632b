"""The Faust app of a worker, configured by a :class:`streams.config.WorkerConfig` and its profile.

The ``embedded`` profile carries the Tansu work-arounds: short session, heartbeat and
rebalance timeouts (Tansu holds each group join for half the session timeout, so the
defaults take ~30 s to become ready) and no recovery consistency check (Tansu's reported
high watermarks of changelog topics are not trustworthy). ``production`` keeps Faust's
defaults. The web server binds ``bind_host``, on ``web_port`` or, when that
is unset, on the first free port from :data:`WEB_PORT` up (:func:`bind_web_port`), so a second
worker on one host does not die on the first one's port.

Two more embedded work-arounds need a subclass. Tansu answers a fetch only when its
max-wait expires (it does not return early when records arrive), and Faust hard-codes a
1.5 s max-wait, which made records wait ~400 ms on average: the embedded app's consumer
asks for :data:`TANSU_FETCH_MAX_WAIT_MS` instead. And Tansu reports a partition's end as
the base offset of its last record batch plus one (see :func:`streams.kafka.end_offsets`):
a table recovered up to that "highwater" lost the rest of the changelog's last batch (the
balance worker's restart test caught heat counts restored one batch short). The embedded
consumer answers Faust's highwater question with the end probed from the last batch.

A 10 ms wait is a hundred fetches a second whether or not anything is written (the worker's
consumer thread and the broker were most of an idle stack's CPU), so the embedded consumer's
wait is paced (:class:`streams.kafka.FetchPace`): 10 ms while records come at 50 a second or
more, longer while they trickle in (a wait that brings about half a record, at most 50 ms: a
live cluster's few requests a second are ~10 KV records a second, and nine in ten 10 ms fetches
came back empty, the worker's and the broker's largest share of the control plane's CPU on the
live A/B), 500 ms after 2 s without one (two fetches a second; Tansu looks again half-way
through a wait of 250 ms or more, so a record that comes during a 500 ms wait is answered
within about 250 ms). Records
of ``quiet_topics`` do not count as coming: the worker names ``heartbeats``, which arrive
every second or so per engine and whose staleness is measured against the liveness TTL (5 s
by default), so an idle cluster's heartbeats alone keep the long wait. A spell counts as quiet from
the later of the last record and the last batch folded (``EmbeddedApp.folded_at``): a worker that
fetched a burst at once and folds it for seconds is busy, not idle (two workers sharing a burst
were: the first records after it waited out a 500 ms fetch). The first KV event
after a quiet spell reaches the view up to ~250 ms later than under load; decisions made
meanwhile count the blocks they placed themselves (pending blocks, state/pending.py).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import faust
from aiohttp.web_runner import BaseSite, SockSite
from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.web.drivers import aiohttp as faust_aiohttp

from schemas.errors import ConfigError

from .config import KafkaConnection, WorkerConfig
from .kafka import IDLE_AFTER_S, FetchPace, end_offsets, security_options, ssl_context

TANSU_FETCH_MAX_WAIT_MS = 10
TANSU_IDLE_FETCH_WAIT_MS = 500
"""The embedded consumer's fetch wait after 2 s without a record of a topic that is not quiet."""
TANSU_TRICKLE_FETCH_WAIT_MS = 50
"""Its longest wait while records trickle in (fewer than one per two 10 ms fetches:
:class:`streams.kafka.FetchPace`'s ``trickle_max_ms``)."""

WEB_PORT = 6066
"""Faust's web port when ``web_port`` is unset (Faust's own default)."""
WEB_PORT_TRIES = 64
"""Ports tried from :data:`WEB_PORT` up before any free one will do."""


def bind_web_port(host: str, port: int | None) -> socket.socket:
    """A listening socket for a Faust web server on ``host``: on ``port``, or (``None``) on the first
    free one of WEB_PORT, WEB_PORT + 1, ... (then any). Bound and listening at once, so two workers
    starting together cannot both choose the same port. A taken ``port`` raises :class:`ConfigError`
    naming CONDUCTOR_WEB_PORT."""
    if port is not None:
        try:
            return _listening_socket(host, port)
        except OSError as e:
            raise ConfigError(
                f"web_port (CONDUCTOR_WEB_PORT): cannot serve on {host}:{port} ({e.strerror or e}; another worker?); "
                "leave CONDUCTOR_WEB_PORT unset and each worker takes a free port"
            ) from None
    for p in range(WEB_PORT, WEB_PORT + WEB_PORT_TRIES):
        with contextlib.suppress(OSError):
            return _listening_socket(host, p)
    return _listening_socket(host, 0)  # any free port


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: TIME_WAIT owns no port
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _TansuConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    _pace: FetchPace | None = None

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = TANSU_FETCH_MAX_WAIT_MS  # read by AIOKafkaConsumer.start()
        self._pace = FetchPace(TANSU_FETCH_MAX_WAIT_MS, steps=((IDLE_AFTER_S, TANSU_IDLE_FETCH_WAIT_MS),),
                               trickle_max_ms=TANSU_TRICKLE_FETCH_WAIT_MS)
        return consumer

    async def _fetch_records(self, consumer: Any, active_partitions: Any, timeout: float | None = None,
                             max_records: int | None = None) -> Any:
        records = await super()._fetch_records(consumer, active_partitions, timeout=timeout, max_records=max_records)
        if self._pace is not None:
            app = self.app
            quiet, busy_at = (app.quiet_topics, app.folded_at) if isinstance(app, EmbeddedApp) else (frozenset(), 0.0)
            n = sum(len(msgs) for tp, msgs in records.items() if tp.topic not in quiet)
            self._pace.after_fetch(consumer, n > 0, n, busy_at=busy_at)
        return records

    async def _highwaters(self, partitions: list[Any]) -> Mapping[Any, int]:
        # Faust recovers a table's changelog up to these offsets: probe the real ends with a
        # consumer of our own (Faust's consumer's positions must not move).
        if not partitions:
            return {}
        app = self.app
        assert isinstance(app, EmbeddedApp) and app.kafka is not None  # (only EmbeddedApp's transport makes us)
        probe = AIOKafkaConsumer(bootstrap_servers=app.kafka.bootstrap_servers, group_id=None, enable_auto_commit=False,
                                 fetch_max_wait_ms=TANSU_FETCH_MAX_WAIT_MS, **security_options(app.kafka))
        await probe.start()
        try:
            tps = {TopicPartition(tp.topic, tp.partition): tp for tp in partitions}
            probe.assign(list(tps))
            ends = await end_offsets(probe, list(tps))
        finally:
            await probe.stop()
        return {tps[tp]: end for tp, end in ends.items()}


class _TansuConsumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return _TansuConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _TansuTransport(faust_aiokafka.Transport):
    Consumer = _TansuConsumer


class _BoundWeb(faust_aiohttp.Web):
    """Faust's aiohttp web server, serving on the socket :func:`bind_web_port` bound."""

    def _new_transport_tcp(self) -> BaseSite:
        app = self.app
        assert isinstance(app, ConductorApp) and app.web_socket is not None  # (only then does ConductorApp make us)
        return SockSite(self._runner, app.web_socket, ssl_context=app.conf.web_ssl_context)


class ConductorApp(faust.App):
    """A Faust app whose web server serves on ``web_socket`` when one is given (make_app)."""

    web_socket: socket.socket | None = None

    def _new_web(self) -> Any:
        return super()._new_web() if self.web_socket is None else _BoundWeb(self)


class EmbeddedApp(ConductorApp):
    """A Faust app whose consumer does not sit out Tansu's fetch max-wait and recovers
    tables up to the changelogs' real ends."""

    kafka: KafkaConnection | None = None
    """The brokers and credentials of the highwater probe (set by make_app)."""
    quiet_topics: frozenset[str] = frozenset()
    """Topics whose records do not keep the consumer's fetch wait short (see the module docstring)."""
    folded_at: float = 0.0
    """When (``time.monotonic()``) the worker last finished folding a batch of a topic that is not
    quiet: the consumer is not idle while what it fetched is still being folded."""

    def _new_transport(self) -> Any:
        return _TansuTransport(self.conf.broker_consumer, self)


def broker_urls(kafka_url: str | None) -> list[str]:
    if not kafka_url:
        raise ConfigError("kafka_url is not set (start the embedded stack with `conductor dev up`)")
    return [f"kafka://{h.strip()}" for h in kafka_url.split(",") if h.strip()]


def broker_credentials(kafka: KafkaConnection) -> faust.SSLCredentials | faust.SASLCredentials | None:
    """Faust's form of the Kafka security settings (the same as every aiokafka client's)."""
    if kafka.security_protocol == "PLAINTEXT":
        return None
    ctx = ssl_context(kafka) if kafka.tls else None
    if kafka.security_protocol == "SSL":
        return faust.SSLCredentials(ctx)
    return faust.SASLCredentials(
        username=kafka.sasl_username,
        password=kafka.sasl_password.get_secret_value() if kafka.sasl_password is not None else None,
        mechanism=kafka.sasl_mechanism,
        ssl_context=ctx,
    )


def make_app(config: WorkerConfig, *, app_id: str | None = None, web_socket: socket.socket | None = None,
             quiet_topics: frozenset[str] = frozenset(), **overrides: Any) -> faust.App:
    """A Faust app for ``config``; its id (and so its consumer group and changelog topic
    names) derives from the topic prefix unless ``app_id`` is given. Its web server serves on
    ``web_socket`` (from :func:`bind_web_port`) when given, else binds ``config.web_port``.
    ``quiet_topics``: on the embedded broker, records of these topics do not keep the fetch
    wait short (the module docstring)."""
    app_id = app_id or f"{config.topics.prefix}stream-worker"
    datadir = Path(config.data_dir).resolve() / "faust" / app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust creates only the last level
    opts: dict[str, Any] = {
        "broker": broker_urls(config.kafka.bootstrap_servers),
        # Faust writes a data directory; keep it under ours, never in the working directory.
        "datadir": str(datadir),
        "store": "memory://",
        "topic_partitions": config.topics.partitions,
        "topic_replication_factor": config.topics.replication_factor,
        "web_host": config.bind_host,
        "web_bind": config.bind_host,
        "web_port": web_socket.getsockname()[1] if web_socket is not None else config.web_port or WEB_PORT,
        "consumer_auto_offset_reset": "earliest",
        "value_serializer": "json",
        "key_serializer": "raw",
    }
    if config.kafka.profile == "embedded":
        opts.update(
            broker_session_timeout=2,
            broker_heartbeat_interval=0.5,
            broker_rebalance_timeout=2,
            recovery_consistency_check=False,
        )
    credentials = broker_credentials(config.kafka)
    if credentials is not None:
        opts["broker_credentials"] = credentials
    opts.update(overrides)
    app: ConductorApp
    if config.kafka.profile != "embedded":
        app = ConductorApp(app_id, **opts)
    else:
        app = EmbeddedApp(app_id, **opts)
        app.kafka = config.kafka  # the highwater probe's broker and credentials
        app.quiet_topics = quiet_topics
    app.web_socket = web_socket
    return app
