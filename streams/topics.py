"""Every topic, declared once: name, key, the record kinds it carries, partitions.

No other module writes a topic name; they ask :func:`topics` for the
:class:`Topic` and use ``.name``.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from schemas import Envelope, decode, encode, headers

DAY_MS = 86_400_000


class Producer(Protocol):
    """What a topic sends with (``aiokafka.AIOKafkaProducer``): queue one record, get its delivery."""

    def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None,
             timestamp_ms: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> Awaitable[Any]: ...


@dataclass(frozen=True, slots=True)
class Encoded:
    """An envelope as it crosses the wire: its msgpack value and its Kafka headers (made once,
    when one record goes to two topics)."""

    value: bytes
    headers: list[tuple[str, bytes]]

    @classmethod
    def of(cls, env: Envelope) -> Encoded:
        return cls(encode(env), headers(env))


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """How the topics are laid out: their names' prefix, partitions, replication, retention."""

    prefix: str
    partitions: int
    replication_factor: int = 1
    kv_events_retention_ms: int = 7 * DAY_MS
    """-1: forever (as every retention here)."""
    heartbeats_retention_ms: int = DAY_MS
    audit_retention_ms: int = 30 * DAY_MS
    """Of requests, dispatch and request outcomes (what ``conductor explain`` audits)."""


@dataclass(frozen=True, slots=True)
class Topic:
    name: str
    key: str
    """What the record key is (so one key's records stay in order in one partition)."""
    kinds: frozenset[str]
    """Record kinds (``Envelope.schema_name``) this topic accepts; others are dead-lettered."""
    partitions: int
    replication_factor: int
    configs: tuple[tuple[str, str], ...] = ()
    """Topic configs it is created with (``retention.ms``, ``cleanup.policy``...)."""

    def send(self, producer: Producer, record: Envelope | Encoded, key: str, *,
             partition: int | None = None) -> Awaitable[Any]:
        """Queue ``record`` under ``key`` (what :attr:`key` says); await it for the delivery future.
        Every record is written here: its value, key and headers made in one place."""
        wire = record if isinstance(record, Encoded) else Encoded.of(record)
        return producer.send(self.name, wire.value, key=key.encode(), partition=partition, headers=wire.headers)

    def decode(self, value: bytes | None) -> Envelope:
        """One record's value as its envelope; :class:`~schemas.DecodeError` when it is none (a
        record with no value included). Every reader decodes here."""
        return decode(value if value is not None else b"")


@dataclass(frozen=True, slots=True)
class Topics:
    kv_events: Topic
    heartbeats: Topic
    requests: Topic
    dispatch: Topic
    kv_commands: Topic
    kv_command_results: Topic
    dead_letter: Topic
    request_outcomes: Topic
    control: Topic
    """Operators' runtime changes (policy, params, cordon/drain); one partition, so every
    router applies them in one order and a decision can name the offset it was made under."""
    plans: Topic
    """``conductor planner``'s capacity plans (advice for autoscalers, kept to audit them); one
    partition: the plans in the order they were made."""
    reply_prefix: str
    replication_factor: int

    def all(self) -> tuple[Topic, ...]:
        """The shared topics (per-gateway reply topics are named by :meth:`replies`)."""
        return (self.kv_events, self.heartbeats, self.requests, self.dispatch, self.kv_commands,
                self.kv_command_results, self.dead_letter, self.request_outcomes, self.control, self.plans)

    def replies(self, gateway_id: str) -> Topic:
        """The reply topic of one gateway: the decisions of the requests it sent (``reply_to``).

        One partition: a gateway reads all of it, and nobody else's. Routers still write
        every decision to ``dispatch`` too (the audit log ``explain`` reads).
        """
        if not gateway_id or not all(c.isalnum() or c in "._-" for c in gateway_id) or len(gateway_id) > 120:
            raise ValueError(f"gateway id {gateway_id!r}: use 1-120 letters, digits, '.', '_' or '-'")
        return Topic(f"{self.reply_prefix}{gateway_id}", "request id",
                     frozenset({"routing_decision", "routing_rejection"}), 1, self.replication_factor)

    def by_name(self, name: str) -> Topic:
        for t in self.all():
            if t.name == name:
                return t
        raise KeyError(name)


def _retention(ms: int) -> tuple[tuple[str, str], ...]:
    # Time-based deletion only: compaction would keep one record per node and break the fold's replay.
    return (("cleanup.policy", "delete"), ("retention.ms", str(ms)))


def _compacted(lag_ms: int) -> tuple[tuple[str, str], ...]:
    # The last record of each key kept for good, every record for ``lag_ms`` (-1: all kept, never compacted).
    if lag_ms < 0:
        return _retention(-1)
    return (("cleanup.policy", "compact"), ("min.compaction.lag.ms", str(lag_ms)), ("segment.ms", str(DAY_MS)))


def topics(config: TopicConfig) -> Topics:
    p, n, rf = config.prefix, config.partitions, config.replication_factor
    kv_ms, hb_ms, audit_ms = config.kv_events_retention_ms, config.heartbeats_retention_ms, config.audit_retention_ms

    def t(name: str, key: str, *kinds: str, partitions: int | None = None, retention_ms: int | None = None) -> Topic:
        configs = _retention(retention_ms) if retention_ms is not None else ()
        return Topic(f"{p}{name}", key, frozenset(kinds), partitions or n, rf, configs)

    return Topics(
        kv_events=t("kv-events", "node id", "blocks_stored", "blocks_removed", "all_blocks_cleared", "blocks_migrated",
                    retention_ms=kv_ms),
        heartbeats=t("heartbeats", "node id", "heartbeat", retention_ms=hb_ms),
        requests=t("requests", "request id", "routing_request", retention_ms=audit_ms),
        dispatch=t("dispatch", "prefill instance id (rejections: request id)", "routing_decision", "routing_rejection",
                   retention_ms=audit_ms),
        kv_commands=t("kv-commands", "executing node id (KvCommand.executor)", "kv_command"),
        kv_command_results=t("kv-command-results", "executing node id", "kv_command_result"),
        dead_letter=t("dead-letter", "source topic", "dead_letter"),
        request_outcomes=t("request-outcomes", "request id", "request_outcome", retention_ms=audit_ms),
        reply_prefix=f"{p}replies.",
        replication_factor=rf,
        # Compacted, never before a decision can be audited: `explain` folds control from offset 0 to
        # the offset a decision names (conductor/routing/control.py: one key per part of the state).
        control=Topic(f"{p}control", "part of the state (policy, params, profile, node:<id>)", frozenset({"control"}),
                      1, rf, _compacted(audit_ms)),
        plans=t("plans", "planner id", "capacity_plan", partitions=1, retention_ms=audit_ms),
    )
