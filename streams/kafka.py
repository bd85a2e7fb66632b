"""aiokafka clients configured for the settings' profile.

The ``embedded`` profile carries the work-arounds the Tansu broker needs (no
idempotent producer, no trustworthy "latest" offset, slow group joins with the
default timeouts); ``production`` keeps Kafka's safe defaults. No correctness
rests on either: the view is protected by our own offset-fenced writes.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from .topics import Topic


def _bootstrap(settings: Any) -> str:
    if not settings.kafka_url:
        raise ValueError("kafka_url is not set (start the embedded stack with `conductor dev up`)")
    return settings.kafka_url


def producer(settings: Any, **overrides: Any) -> AIOKafkaProducer:
    opts: dict[str, Any] = dict(bootstrap_servers=_bootstrap(settings), linger_ms=2, max_batch_size=1 << 20)
    if settings.profile == "production":
        opts.update(acks="all", enable_idempotence=True)
    else:
        opts.update(acks=1, enable_idempotence=False)  # Tansu refuses InitProducerId
    opts.update(overrides)
    return AIOKafkaProducer(**opts)


def consumer(settings: Any, *topic_names: str, group_id: str | None, **overrides: Any) -> AIOKafkaConsumer:
    opts: dict[str, Any] = dict(
        bootstrap_servers=_bootstrap(settings),
        group_id=group_id,
        enable_auto_commit=False,
        # Tansu's "latest" is wrong, and a new group must see every record anyway.
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=32 << 20,
    )
    if settings.profile == "embedded":
        # Tansu holds a join for half the session timeout: keep it short.
        opts.update(session_timeout_ms=6000, heartbeat_interval_ms=500, rebalance_timeout_ms=4000)
    opts.update(overrides)
    return AIOKafkaConsumer(*topic_names, **opts)


async def ensure_topics(settings: Any, wanted: tuple[Topic, ...]) -> list[str]:
    """Create the topics that do not exist yet; return the names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=_bootstrap(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(t.name, num_partitions=t.partitions, replication_factor=t.replication_factor)
            for t in wanted
            if t.name not in existing
        ]
        if new:
            try:
                await admin.create_topics(new)
            except Exception as e:  # a concurrent creator won the race
                if "TopicAlreadyExists" not in type(e).__name__ and "already exists" not in str(e).lower():
                    raise
        return [t.name for t in new]
    finally:
        await admin.close()
