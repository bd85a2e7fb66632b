"""The decision index is bounded (issue 36, item 8): an hour by default, a Redis of its own when
asked, and a warning when the Redis it lives in grows past the alert."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Self

import pytest

from conductor.routing.stores import decision_index, default_router_id
from conductor.settings import Settings
from state.decisions import MEMORY_CHECK_S, DecisionPosition, RedisDecisionIndex


class FakePipeline:
    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store
        self.ops: list[tuple[str, bytes]] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def set(self, key: str, value: bytes, px: int) -> None:
        self.ops.append((key, value))

    async def execute(self) -> Sequence[Any]:
        self.store.update(self.ops)
        return [True] * len(self.ops)


class FakeRedis:
    def __init__(self, used: Any) -> None:
        self.used = used
        self.store: dict[str, bytes] = {}
        self.infos = 0

    def pipeline(self, transaction: bool = False) -> FakePipeline:
        return FakePipeline(self.store)

    async def info(self, section: str) -> dict[str, Any]:
        self.infos += 1
        return self.used if isinstance(self.used, dict) and "used_memory" not in self.used else {"used_memory": self.used}


def position(i: int) -> DecisionPosition:
    return DecisionPosition(f"r{i}", 0, i, 1000 + i, 0, i)


async def test_the_index_warns_when_its_redis_passes_the_alert(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    client = FakeRedis(3 << 30)
    index = RedisDecisionIndex(client, "cv", 3600, memory_alert_bytes=1 << 30, clock=lambda: now[0])  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="state.decisions"):
        await index.record([position(1)])
    assert index.used_memory == 3 << 30 and client.infos == 1
    assert "above the 1024 MB alert" in caplog.text and "decision_index_url" in caplog.text
    # Read at most once a minute: a busy router does not ask INFO on every batch.
    await index.record([position(2)])
    assert client.infos == 1
    now[0] += MEMORY_CHECK_S
    await index.record([position(3)])
    assert client.infos == 2 and len(client.store) == 3


async def test_no_warning_below_the_alert_and_a_cluster_reports_its_largest_node(
        caplog: pytest.LogCaptureFixture) -> None:
    client = FakeRedis({"a:1": {"used_memory": 10}, "b:2": {"used_memory": 500}})
    index = RedisDecisionIndex(client, "cv", 3600, memory_alert_bytes=1 << 30)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="state.decisions"):
        await index.record([position(1)])
    assert index.used_memory == 500 and "alert" not in caplog.text


def test_an_hour_by_default_and_a_redis_of_its_own() -> None:
    s = Settings(redis_url="redis://view:6379/0")
    assert s.decision_index_ttl_s == 3600
    shared = decision_index(s)
    assert shared is not None and shared.ttl_ms == 3_600_000
    assert shared.client.connection_pool.connection_kwargs["host"] == "view"  # type: ignore[union-attr]
    own = decision_index(s.model_copy(update={"decision_index_url": "redis://index:6380/0"}), client=object())
    assert own is not None and own.client.connection_pool.connection_kwargs["host"] == "index"  # type: ignore[union-attr]
    alone = decision_index(Settings(decision_index_url="redis://index:6380/0"))
    assert alone is not None
    with pytest.raises(ValueError, match="must start with redis://"):
        Settings(decision_index_url="http://index")


def test_router_ids_carry_an_incarnation() -> None:
    host_pid, _, incarnation = default_router_id().rpartition("-")
    assert host_pid.startswith("router-") and len(incarnation) == 6 and int(incarnation, 16) >= 0
