"""Followers nobody waits on (``control``, ``kv-commands``) fetch once a second after 10 s
without a record, twice a second before and again with the first record."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Self

import pytest
from aiokafka import TopicPartition

import conductor.bridge.serve
import conductor.routing.control_follow
from conductor.routing.control_follow import ControlFollower
from conductor.settings import load_settings
from streams.config import KafkaConnection
from streams.follow import Earliest, Follower, OnBad
from streams.kafka import DEEP_IDLE_AFTER_S, KAFKA_FETCH_WAIT_MS, QUIET_FETCH_WAIT_MS, QUIET_STEPS, FetchPace
from streams.topics import TopicConfig, topics

T = topics(TopicConfig(prefix="t.", partitions=1))


def test_a_quiet_pace_waits_a_second_only_after_ten_quiet_seconds() -> None:
    now = [0.0]
    pace = FetchPace(KAFKA_FETCH_WAIT_MS, steps=QUIET_STEPS, clock=lambda: now[0])
    seen = []
    for t, got in [(2.0, False), (DEEP_IDLE_AFTER_S - 0.1, False), (DEEP_IDLE_AFTER_S, False), (11.0, True),
                   (12.0, False)]:
        now[0] = t
        pace.saw(got)
        seen.append(pace.wait_ms)
    # no 100 ms step below Kafka's 500 ms: such a follower never fetches more often than today
    assert seen == [KAFKA_FETCH_WAIT_MS, KAFKA_FETCH_WAIT_MS, QUIET_FETCH_WAIT_MS, KAFKA_FETCH_WAIT_MS,
                    KAFKA_FETCH_WAIT_MS]


class _Fetcher:
    _fetch_max_wait_ms = KAFKA_FETCH_WAIT_MS


class _Consumer:
    def __init__(self) -> None:
        self._fetcher = _Fetcher()

    async def getmany(self, timeout_ms: int, max_records: int | None) -> dict[TopicPartition, list[Any]]:
        return {}


async def test_a_follower_takes_its_idle_steps() -> None:
    f = Follower(KafkaConnection("127.0.0.1:1", "embedded"), [(T.control, Earliest())], on_bad=OnBad.SKIP,
                 name="t", fetch_wait_ms=KAFKA_FETCH_WAIT_MS, idle_steps=((0.0, QUIET_FETCH_WAIT_MS),))
    c = _Consumer()
    f._consumer = c
    await f.fetch()
    assert c._fetcher._fetch_max_wait_ms == QUIET_FETCH_WAIT_MS


class _Recorded:
    """Stands in for :class:`Follower`: keeps what it was made with; caught up, nothing to read."""

    made: ClassVar[list[dict[str, Any]]] = []
    caught_up = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.made.append(kwargs)

    async def start(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None: ...

    async def polls(self, stop: Any) -> Any:
        return
        yield


@pytest.mark.parametrize("who", ["control", "kv-commands"])
async def test_control_and_kv_command_followers_are_paced_quietly(monkeypatch: pytest.MonkeyPatch, who: str) -> None:
    _Recorded.made = []
    settings = load_settings(kafka_url="127.0.0.1:1")
    if who == "control":
        monkeypatch.setattr(conductor.routing.control_follow, "Follower", _Recorded)
        await ControlFollower(settings, router=None).start()  # type: ignore[arg-type]
    else:
        monkeypatch.setattr(conductor.bridge.serve, "Follower", _Recorded)
        async for _ in conductor.bridge.serve.commands_for(settings, "prefill-0", asyncio.Event()):
            pass
    [kwargs] = _Recorded.made
    assert (kwargs["fetch_wait_ms"], kwargs["idle_steps"]) == (KAFKA_FETCH_WAIT_MS, QUIET_STEPS)
