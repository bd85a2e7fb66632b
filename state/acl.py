"""The least privilege Conductor's processes need on the view's Redis: an ACL user's rules.

Every key of a namespace starts with its hash tag ``{ns}|`` (:mod:`state.keys`), so one key
pattern covers the view, the reservations stream and the decision index; the commands are
those the code sends, directly or from its Lua scripts (``state/lua/``: Redis checks a
script's calls against the user's rules too). Nothing administrative (no ``FLUSH*``,
``KEYS``, ``CONFIG``, ``DEBUG``, ``SHUTDOWN``), no Pub/Sub channel.

``tests/integration/test_redis_acl.py`` runs the worker, the router (raw and tracking
readers, reservations, the decision index), the gateway and the view's maintenance
(compaction, a rebuild's clear) as a user with exactly these rules, and checks that the
server logged no denial.
"""

from __future__ import annotations

CONNECTION = ("client|setinfo", "client|tracking", "ping")
"""redis-py's library name, the tracking reader's invalidations (``HELLO 3`` and ``AUTH`` need no
permission), health checks."""
SCRIPTS = ("evalsha", "script|load")
"""The view's Lua scripts by SHA, loaded on a NOSCRIPT."""
READS = ("time", "get", "mget", "exists", "hget", "hgetall", "hmget", "hlen", "smembers", "sismember", "zcard",
         "zrangebyscore", "xrange", "xread", "scan", "multi", "exec")
"""Snapshots (one MULTI/EXEC), the node hash, the reservations stream, compaction's and clear's SCAN."""
WRITES = ("set", "mset", "setrange", "append", "del", "unlink", "incr", "hset", "hdel", "hincrby", "sadd", "srem", "zadd",
          "zpopmin", "xadd")
"""The apply, compact, free, generation and rebuild scripts; reservations; the decision index; clear."""
MONITORING = ("info",)
"""The decision index's memory alert (``INFO memory``, at most once a minute: ``state.decisions``):
read-only server figures, no key and no setting."""
CLUSTER = ("cluster|slots", "command", "eval")
"""A Redis Cluster's slot map (redis-py's cluster client and the raw reader ask for it); the
command table (redis-py's cluster client learns where each command's keys are); the snapshot's
TIME as a script (a cluster pipeline sends every command to the slot's node)."""


def commands(*, cluster: bool = False, db: int = 0) -> tuple[str, ...]:
    """Every command (``name`` or ``name|subcommand``) a Conductor process may send: on a Redis
    Cluster (``cluster``) a few more; ``select`` only when the URL names a database other than 0."""
    return (CONNECTION + SCRIPTS + READS + WRITES + MONITORING + (CLUSTER if cluster else ())
            + (("select",) if db else ()))


def acl_rules(namespace: str, *, cluster: bool = False, db: int = 0) -> list[str]:
    """The rules of ``ACL SETUSER <user> on ><password> <rules...>`` for a Conductor user of
    ``namespace``: its keys only, no channels, these commands only."""
    return ["resetkeys", f"~{{{namespace}}}|*", "resetchannels", "-@all",
            *(f"+{c}" for c in commands(cluster=cluster, db=db))]


__all__ = ["acl_rules", "commands"]
