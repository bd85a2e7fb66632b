"""Records passed over by their Kafka headers: a request decided where it arrived carries
``decided-by``, and a follower given ``skip`` never decodes it; one without the header (written
before it existed) is handed over and decoded as before."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition

import streams.follow
import streams.kafka
import streams.topics
from conductor.routing.router import DECIDED, Router
from conductor.settings import Settings
from schemas import DECIDED_BY_HEADER, RoutingRequest, decided_by, encode, envelope, headers
from streams.config import KafkaConnection
from streams.follow import Earliest, Follower, OnBad
from streams.topics import TopicConfig, topics

T = topics(TopicConfig(prefix="t.", partitions=1))


def request(rid: str, by: str | None) -> RoutingRequest:
    return RoutingRequest(request_id=rid, token_ids=[1, 2, 3], prompt_tokens=3, expected_output_tokens=4, decided_by=by)


@dataclass
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp: int = 0


class Consumer:
    """What a follower reads through: one fetch of ``messages``, then nothing."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages

    async def getmany(self, timeout_ms: int, max_records: int | None) -> dict[TopicPartition, list[Message]]:
        out, self.messages = self.messages, []
        return {TopicPartition(T.requests.name, 0): out} if out else {}

    def highwater(self, tp: TopicPartition) -> int:
        return 3


def message(offset: int, req: RoutingRequest, *, with_headers: bool = True) -> Message:
    env = envelope(req, producer_id="gw-a", producer_seq=offset, ts_ms=1)
    hdrs = headers(env) if with_headers else [("schema", b"routing_request")]
    return Message(T.requests.name, 0, offset, req.request_id.encode(), encode(env), hdrs)


def test_a_decided_request_names_its_decider_in_the_headers() -> None:
    local = headers(envelope(request("a", "gw-a"), producer_id="gw-a", producer_seq=0, ts_ms=1))
    remote = headers(envelope(request("b", None), producer_id="gw-a", producer_seq=0, ts_ms=1))
    assert (DECIDED_BY_HEADER, b"gw-a") in local and decided_by(local) == "gw-a"
    assert decided_by(remote) is None and all(name != DECIDED_BY_HEADER for name, _ in remote)


@pytest.mark.parametrize("on_bad", [OnBad.SKIP, OnBad.LOG_AND_SKIP])
async def test_a_skipped_record_is_never_decoded(monkeypatch: pytest.MonkeyPatch, on_bad: OnBad) -> None:
    calls: Counter[str] = Counter()
    real = streams.topics.decode  # type: ignore[attr-defined]

    def counting(value: bytes) -> Any:
        calls["decode"] += 1
        return real(value)

    monkeypatch.setattr(streams.topics, "decode", counting)
    f = Follower(KafkaConnection("127.0.0.1:1", "production"), [(T.requests, Earliest())], on_bad=on_bad,
                 name="t", skip=lambda h: decided_by(h) is not None)
    f._consumer = Consumer([
        message(0, request("colocated", "gw-a")),
        message(1, request("routed", None)),
        message(2, request("old-colocated", "gw-a"), with_headers=False),  # written before the header existed
    ])
    (batch,) = await f.fetch()
    assert [r.offset for r in batch.records] == [1, 2]
    assert calls["decode"] == 2 and f.skipped == 1
    assert f.positions[(T.requests.name, 0)] == 3  # the skipped record's position moved on too
    old = batch.records[1].env
    assert old is not None and isinstance(old.body, RoutingRequest) and old.body.decided_by == "gw-a"


async def test_a_router_still_leaves_an_old_decided_request_alone() -> None:
    # No header (an older producer): the router decodes it and finds ``decided_by`` in the body.
    m = message(0, request("old-colocated", "gw-a"), with_headers=False)
    router = Router(Settings(), view=None, reservations=None)  # type: ignore[arg-type]
    key, out, reply_to = await router.handle_with_reply(m.value, m.key, 0)
    assert out is DECIDED and key == "" and reply_to is None


class Fetcher:
    _fetch_max_wait_ms = 5


async def test_a_short_wait_follower_waits_longer_once_idle_and_short_again_with_a_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams.kafka, "IDLE_AFTER_S", 0.0)
    f = Follower(KafkaConnection("127.0.0.1:1", "embedded"), [(T.requests, Earliest())], on_bad=OnBad.SKIP,
                 name="t", fetch_wait_ms=5)
    c = Consumer([])
    c._fetcher = Fetcher()  # type: ignore[attr-defined]
    f._consumer = c
    await f.fetch()  # nothing: idle at once (IDLE_AFTER_S = 0)
    assert c._fetcher._fetch_max_wait_ms == streams.kafka.IDLE_FETCH_WAIT_MS  # type: ignore[attr-defined]
    c.messages = [message(0, request("routed", None))]
    await f.fetch()
    assert c._fetcher._fetch_max_wait_ms == 5  # type: ignore[attr-defined]


async def test_records_passed_over_do_not_keep_a_paced_wait_short(monkeypatch: pytest.MonkeyPatch) -> None:
    # A router following requests that the gateways decided themselves has nothing to answer fast.
    monkeypatch.setattr(streams.kafka, "IDLE_AFTER_S", 0.0)
    f = Follower(KafkaConnection("127.0.0.1:1", "embedded"), [(T.requests, Earliest())], on_bad=OnBad.SKIP,
                 name="t", fetch_wait_ms=5, skip=lambda h: decided_by(h) is not None)
    c = Consumer([message(0, request("colocated", "gw-a"))])
    c._fetcher = Fetcher()  # type: ignore[attr-defined]
    f._consumer = c
    await f.fetch()
    assert f.skipped == 1
    assert c._fetcher._fetch_max_wait_ms == streams.kafka.IDLE_FETCH_WAIT_MS  # type: ignore[attr-defined]
    c.messages = [message(1, request("routed", None))]
    await f.fetch()
    assert c._fetcher._fetch_max_wait_ms == 5  # type: ignore[attr-defined]
