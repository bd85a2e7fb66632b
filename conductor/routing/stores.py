"""The Redis stores a router reads and writes: the view reader, the shared reservations and the
decision index, each built from settings."""

from __future__ import annotations

import os
import socket
from typing import Any

from conductor.errors import ConfigError, ViewStoreError
from conductor.settings import Settings
from state.connect import HiredisPackedConnection, open_client
from state.decisions import RedisDecisionIndex
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from state.reservations import RedisReservations
from state.tracking import TrackingSnapshotReader


def default_router_id() -> str:
    """This process's name on the log when none is given: router-HOST-PID."""
    return f"router-{socket.gethostname()}-{os.getpid()}"


def redis_stores(settings: Settings, producer_id: str | None = None) -> tuple[Any, Any]:
    """The Redis view reader and reservation log of ``settings``, with short timeouts.

    Timeouts are short on purpose: a router that waits on a dead Redis answers nobody;
    one that fails fast answers from its last snapshot.
    """


    if not settings.redis_url:
        raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
    url = settings.redis().connection_url()
    client = open_client(
        url, decode_responses=False, **settings.redis().tls_options(), socket_timeout=0.5, socket_connect_timeout=0.5,
        health_check_interval=0, connection_class=HiredisPackedConnection,
    )
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
                              producer_id=producer_id or default_router_id()))


def decision_index(settings: Settings, client: Any = None) -> RedisDecisionIndex | None:
    """The decision index of ``settings`` (None when ``decision_index_ttl_s`` is 0), on ``client``
    (the reservations' connection, for a router) or on a connection of its own."""
    ttl_s = settings.decision_index_ttl_s
    if settings.audit_retention_ms >= 0:
        ttl_s = min(ttl_s, settings.audit_retention_ms / 1000)
    if ttl_s <= 0 or not settings.redis_url:
        return None
    if client is None:
        client = open_client(settings.redis().connection_url(), decode_responses=False,
                             **settings.redis().tls_options(), socket_timeout=5.0, socket_connect_timeout=5.0)
    return RedisDecisionIndex(client, settings.view_namespace, ttl_s)
