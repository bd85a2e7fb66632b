"""Every topic, declared once: name, key, the record kinds it carries, partitions.

No other module writes a topic name; they ask :func:`topics` for the
:class:`Topic` and use ``.name``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _TopicSettings(Protocol):
    topic_prefix: str
    partitions: int
    replication_factor: int


@dataclass(frozen=True, slots=True)
class Topic:
    name: str
    key: str
    """What the record key is (so one key's records stay in order in one partition)."""
    kinds: frozenset[str]
    """Record kinds (``Envelope.schema_name``) this topic accepts; others are dead-lettered."""
    partitions: int
    replication_factor: int


@dataclass(frozen=True, slots=True)
class Topics:
    kv_events: Topic
    heartbeats: Topic
    requests: Topic
    dispatch: Topic
    kv_commands: Topic
    kv_command_results: Topic
    dead_letter: Topic

    def all(self) -> tuple[Topic, ...]:
        return (self.kv_events, self.heartbeats, self.requests, self.dispatch, self.kv_commands, self.kv_command_results,
                self.dead_letter)

    def by_name(self, name: str) -> Topic:
        for t in self.all():
            if t.name == name:
                return t
        raise KeyError(name)


def topics(settings: _TopicSettings) -> Topics:
    p, n, rf = settings.topic_prefix, settings.partitions, settings.replication_factor

    def t(name: str, key: str, *kinds: str, partitions: int | None = None) -> Topic:
        return Topic(f"{p}{name}", key, frozenset(kinds), partitions or n, rf)

    return Topics(
        kv_events=t("kv-events", "node id", "blocks_stored", "blocks_removed", "all_blocks_cleared", "blocks_migrated"),
        heartbeats=t("heartbeats", "node id", "heartbeat"),
        requests=t("requests", "request id", "routing_request"),
        dispatch=t("dispatch", "prefill instance id (rejections: request id)", "routing_decision", "routing_rejection"),
        kv_commands=t("kv-commands", "executing node id (KvCommand.executor)", "kv_command"),
        kv_command_results=t("kv-command-results", "executing node id", "kv_command_result"),
        dead_letter=t("dead-letter", "source topic", "dead_letter"),
    )
