"""Topics are created with the retention the recovery story needs; unsafe existing configs are reported."""

from __future__ import annotations

import logging

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from conductor.settings import Settings
from streams.kafka import ensure_topics, unsafe_topic_configs
from streams.topics import topics


async def test_created_with_retention_and_unsafe_ones_reported(settings: Settings,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    s = settings.model_copy(update={"kv_events_retention_ms": 3_600_000})
    tps = topics(s.topic_config())
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_url)
    await admin.start()
    try:
        # Someone created kv-events compacted with a short retention before Conductor started.
        await admin.create_topics([NewTopic(tps.kv_events.name, 1, 1,
                                            topic_configs={"cleanup.policy": "compact", "retention.ms": "1000"})])
        with caplog.at_level(logging.WARNING, logger="streams.kafka"):
            created = await ensure_topics(s.kafka(), tps.all())
        assert tps.kv_events.name not in created and tps.requests.name in created
        warnings = [r.getMessage() for r in caplog.records]
        assert any("compact" in w and tps.kv_events.name in w for w in warnings)
        assert any("1000 ms" in w for w in warnings)
        # The ones Conductor created carry its settings (the embedded broker keeps and describes them).
        assert await unsafe_topic_configs(admin, [tps.requests, tps.heartbeats, tps.dispatch]) == []
    finally:
        await admin.close()
