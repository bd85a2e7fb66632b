"""Which Redis client a URL means: one server, or a Redis Cluster.

``redis://`` / ``rediss://`` / ``unix://`` name one server (a primary, or whatever a proxy or
Sentinel-managed address points at). ``redis+cluster://[user:password@]host:port[,host:port...]``
(``rediss+cluster://`` with TLS) names a Redis Cluster by one or more seed nodes: the client
learns the slot map from them and follows MOVED redirects and failovers. The scheme, not a
separate flag, says "cluster", so the one URL every process and tool already takes cannot
disagree with a second setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import hiredis
import redis
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster

from schemas.errors import ViewStoreError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

Command = tuple[str | int | float | bytes, ...]
"""A Redis command and its arguments."""
pack_command = cast("Callable[[Command], bytes]", hiredis.pack_command)
"""hiredis's packer (C): a command in RESP. (Its stub declares a one-element tuple.)"""
_sync_cluster_node: Callable[[str, int], SyncClusterNode] = SyncClusterNode
"""(redis-py leaves this class's ``__init__`` unannotated.)"""


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(seed nodes, username, password) of a ``redis+cluster://`` URL; ``ValueError`` names
    what is wrong (no host, a bad port, a database other than 0)."""
    u = urlsplit(url)
    if u.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"not a cluster URL: {u.scheme}://")
    userinfo, _, hosts = u.netloc.rpartition("@")
    user, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    seeds = []
    for part in hosts.split(","):
        part = part.strip()
        if part.startswith("["):  # [v6]:port
            host, _, rest = part[1:].partition("]")
            port_s = rest.lstrip(":")
        else:
            host, _, port_s = part.partition(":")
        if not host:
            raise ValueError("a cluster URL needs host:port of at least one node (redis+cluster://host:port[,host:port])")
        try:
            port = int(port_s) if port_s else 6379
        except ValueError:
            raise ValueError(f"bad port {port_s!r} in the cluster URL") from None
        if not 0 < port < 65536:
            raise ValueError(f"bad port {port} in the cluster URL")
        seeds.append((host, port))
    if u.path.strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0 (drop the /db from the URL)")
    if u.query:
        raise ValueError("query options are not taken in a cluster URL")
    return seeds, (unquote(user) or None), (unquote(password) if userinfo and ":" in userinfo else None)


_CLUSTER_DROPS = ("connection_class", "db")
"""Options of a one-server client a cluster client does not take."""


def _cluster_kwargs(url: str, options: dict[str, Any]) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    seeds, user, password = cluster_seeds(url)
    kw = {k: v for k, v in options.items() if k not in _CLUSTER_DROPS}
    if user:
        kw.setdefault("username", user)
    if password is not None:
        kw.setdefault("password", password)
    if urlsplit(url).scheme == "rediss+cluster":
        kw["ssl"] = True
    return seeds, kw


def open_client(url: str, **options: Any) -> aioredis.Redis | RedisCluster:
    """An asyncio client of ``url``: :class:`redis.asyncio.RedisCluster` for a cluster URL
    (``connection_class`` is then ignored), else ``redis.asyncio.Redis.from_url``."""
    if is_cluster_url(url):
        seeds, kw = _cluster_kwargs(url, options)
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], **kw)
    return aioredis.from_url(url, **options)


def read_timeout_s(client: Any) -> float | None:
    """How long ``client`` waits for an answer before it drops the connection (its
    ``socket_timeout``; None: no limit, or a client this cannot tell)."""
    kwargs = getattr(client, "connection_kwargs", None)  # RedisCluster
    if kwargs is None:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    return float(timeout) if timeout else None


BLOCK_SHARE = 0.8
"""The share of a client's read timeout a blocking read may take (the rest: the answer's trip back)."""


def block_ms_within(want_ms: int, timeout_s: float | None) -> int:
    """How long a blocking read (XREAD BLOCK) may block on a client whose read timeout is
    ``timeout_s``: ``want_ms``, cut to :data:`BLOCK_SHARE` of the timeout (at least 1 ms).

    A read that blocks as long as the client waits, or longer, is given up by the client: the
    connection is dropped and made again (HELLO, CLIENT SETINFO) and the read sent once more.
    Followers blocking 1 s on the router's 0.5 s client did that twice a second each: ~9 new
    Redis connections a second on an idle stack (``conductor bench idle``)."""
    if timeout_s is None or timeout_s <= 0:
        return want_ms
    return max(1, min(want_ms, int(timeout_s * 1000 * BLOCK_SHARE)))


def follower_read(client: Any, follow_client: Any, want_ms: int) -> tuple[Any, int]:
    """What a shared log's follower reads with (``follow_client``, else ``client``) and how long
    each of its blocking reads may block there (``want_ms`` within that client's read timeout)."""
    reader = follow_client if follow_client is not None else client
    return reader, block_ms_within(want_ms, read_timeout_s(reader))


def open_sync_client(url: str, **options: Any) -> redis.Redis | SyncRedisCluster:
    """The blocking client of ``url`` (command-line checks)."""
    if is_cluster_url(url):
        seeds, kw = _cluster_kwargs(url, options)
        return SyncRedisCluster(startup_nodes=[_sync_cluster_node(h, p) for h, p in seeds], **kw)
    return redis.Redis.from_url(url, **options)


@dataclass(frozen=True, slots=True)
class RedisConnection:
    """Where the view's Redis is and how to log in to it."""

    url: str | None = field(repr=False)
    """``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` (seed nodes); ``None``
    when not configured. Not shown in a repr: a URL can carry a password."""
    username: str | None = None
    """ACL user, put into the URL in place of its own."""
    password: SecretStr | None = field(default=None, repr=False)
    """Its password, put into the URL in place of its own."""
    ssl_ca_certs: Path | None = None
    """CA bundle a ``rediss://`` server's certificate is verified against."""

    def connection_url(self) -> str:
        """The URL to connect with: :attr:`url` with :attr:`username` and :attr:`password` put in,
        when set apart from it. Carries the password: never log it. :class:`ViewStoreError` when
        no URL is configured."""
        if self.url is None:
            raise ViewStoreError("redis_url is not set (start the embedded stack with `conductor dev up`)")
        if self.username is None and self.password is None:
            return self.url
        u = urlsplit(self.url)
        userinfo, _, hosts = u.netloc.rpartition("@")  # hosts: host[:port], or a cluster's list of them
        old_user, _, old_pw = userinfo.partition(":")
        user = quote(self.username if self.username is not None else unquote(old_user), safe="")
        pw = self.password.get_secret_value() if self.password else unquote(old_pw)
        return urlunsplit(u._replace(netloc=f"{user}:{quote(pw, safe='')}@{hosts}"))

    def tls_options(self) -> dict[str, Any]:
        """redis-py options for a ``rediss://`` server verified against :attr:`ssl_ca_certs`."""
        if self.ssl_ca_certs is None or not str(self.url).startswith(("rediss://", "rediss+cluster://")):
            return {}
        return {"ssl_ca_certs": str(self.ssl_ca_certs)}


class HiredisPackedConnection(Connection):
    """An asyncio redis-py connection that packs commands with hiredis (C) instead of Python.

    The routing read sends a 128-key MGET per request and a view write declares every block
    key it touches; redis-py's asyncio client packs them argument by argument in Python, which
    was the largest single cost of a decision. (One server only: a cluster client makes its
    own connections.)
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str) and " " in first:  # e.g. "SCRIPT LOAD": separate words
            args = (*first.split(), *args[1:])
        return [pack_command(args)]
