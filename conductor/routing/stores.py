"""The Redis stores a router reads and writes: the view reader, the shared reservations, the
decision-time records (pending blocks, in-flight ledger) and the decision index, each built from
settings."""

from __future__ import annotations

import os
import secrets
import socket
import weakref
from typing import Any

from opentelemetry import metrics

from conductor.errors import ConfigError, ViewStoreError
from conductor.settings import Settings
from state.connect import HiredisPackedConnection, RedisConnection, open_client
from state.decisions import RedisDecisionIndex
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.reservations import RedisReservations
from state.shared_log import EventSeq, LogGroup, RedisInflight, RedisPendingBlocks
from state.tracking import TrackingSnapshotReader

INCARNATION = secrets.token_hex(3)
"""Six hex digits drawn once per process: a container restarted with the same host name and PID 1
still writes under a producer id of its own (ids repeating across restarts would mix two
processes' sequence numbers)."""


def default_router_id() -> str:
    """This process's name on the log when none is given: router-HOST-PID-INCARNATION."""
    return f"router-{socket.gethostname()}-{os.getpid()}-{INCARNATION}"


FOLLOW_READ_TIMEOUT_S = 2.0
"""The read timeout of the shared logs' followers' own client: room for a 1 s ``XREAD`` block
(``state.reservations.FOLLOW_BLOCK_MS``) and its answer's trip back. On the router's 0.5 s
client they blocked 400 ms: three reads every 400 ms on an idle stack instead of one a second.
A follower waits in the background (a decision never waits on it), so its longer timeout
delays nothing but its own reconnect to a Redis that went silent."""


def redis_stores(settings: Settings, producer_id: str | None = None) -> tuple[Any, Any]:
    """The Redis view reader and reservation log of ``settings``, with short timeouts.

    Timeouts are short on purpose: a router that waits on a dead Redis answers nobody;
    one that fails fast answers from its last snapshot. The followers of the shared logs
    (the reservations', and the decision-time stores' given ``follow_client``) read on a client
    of their own (``reservations.follow_client``, :data:`FOLLOW_READ_TIMEOUT_S`), closed with
    the reservations.
    """

    if not settings.redis_url:
        raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
    url = settings.redis().connection_url()
    client = open_client(
        url, decode_responses=False, **settings.redis().tls_options(), socket_timeout=0.5, socket_connect_timeout=0.5,
        health_check_interval=0, connection_class=HiredisPackedConnection,
    )
    follow_client = open_client(
        url, decode_responses=False, **settings.redis().tls_options(), socket_timeout=FOLLOW_READ_TIMEOUT_S,
        socket_connect_timeout=0.5, health_check_interval=0)
    view = RedisViewStore(client, settings.view_namespace)
    # The raw reader speaks plain RESP (with AUTH user password), to one server or to the
    # primary of the namespace's one slot of a Redis Cluster; TLS (rediss://) and unix sockets
    # read through redis-py.
    raw = url.startswith(("redis://", "redis+cluster://"))
    if settings.view_reader == "tracking":
        if not raw:
            raise ConfigError("view_reader (CONDUCTOR_VIEW_READER) 'tracking' needs a redis:// or redis+cluster:// "
                              f"URL (CONDUCTOR_REDIS_URL is {url.split('://')[0]}://); use 'raw'")
        reader: Any = TrackingSnapshotReader(url, settings.view_namespace, cache_keys=settings.view_cache_keys,
                                             store=view)
    else:
        reader = RawSnapshotReader(url, settings.view_namespace, store=view) if raw else view
    return (reader,
            RedisReservations(client, settings.view_namespace, settings.reservation_ttl_s,
                              producer_id=producer_id or default_router_id(), follow_client=follow_client))


def decision_time_stores(settings: Settings, client: Any, producer_id: str | None = None, *,
                         follow_client: Any = None) -> tuple[RedisPendingBlocks, RedisInflight]:
    """The pending blocks and the in-flight ledger of ``settings``, shared through the view's
    Redis on ``client`` (the reservations' connection): what every router, gateway and picker
    writes at decision time and reads from memory (``state.shared_log``). ``follow_client``: what
    their followers read with (the reservations' ``follow_client``; default ``client``)."""
    pid = producer_id or default_router_id()
    events = EventSeq()  # one numbering for both: a placement's blocks and its charge are one event
    group = LogGroup(client, follow_client=follow_client)  # one append and one read for both
    return (RedisPendingBlocks(client, settings.view_namespace, max(int(settings.pending_ttl_s * 1000), 1),
                               producer_id=pid, events=events, group=group),
            RedisInflight(client, settings.view_namespace, max(int(settings.inflight_lease_s * 1000), 1),
                          producer_id=pid, events=events, group=group,
                          dead_after_ms=max(int(settings.inflight_lost_after_s * 1000), 1),
                          keepalive_ms=max(int(settings.inflight_lost_after_s * 200), 1)))


def decision_index(settings: Settings, client: Any = None) -> RedisDecisionIndex | None:
    """The decision index of ``settings`` (None when ``decision_index_ttl_s`` is 0): in its own Redis
    when ``decision_index_url`` is set, else on ``client`` (the reservations' connection, for a
    router) or on a connection of its own to the view's Redis."""
    ttl_s = settings.decision_index_ttl_s
    if settings.audit_retention_ms >= 0:
        ttl_s = min(ttl_s, settings.audit_retention_ms / 1000)
    own = settings.decision_index_url
    if ttl_s <= 0 or not (own or settings.redis_url):
        return None
    if own or client is None:
        conn = (RedisConnection(own, settings.redis_username, settings.redis_password, settings.redis_ssl_ca_certs)
                if own else settings.redis())
        client = open_client(conn.connection_url(), decode_responses=False, **conn.tls_options(),
                             socket_timeout=5.0, socket_connect_timeout=5.0)
    index = RedisDecisionIndex(client, settings.view_namespace, ttl_s,
                               memory_alert_bytes=settings.decision_index_memory_alert_bytes)
    _watched.add(index)
    return index


_watched: weakref.WeakSet[RedisDecisionIndex] = weakref.WeakSet()
"""The indexes open in this process (an explain's closes and goes)."""


def _observe_index(_: Any) -> list[metrics.Observation]:
    live = [i for i in _watched if i.used_memory is not None]
    return [metrics.Observation(max(i.used_memory or 0 for i in live))] if live else []


metrics.get_meter(__name__).create_observable_gauge(
    "conductor_decision_index_redis_bytes", callbacks=[_observe_index], unit="By",
    description="used memory of the decision index's Redis (INFO memory, read at most once a minute)")
