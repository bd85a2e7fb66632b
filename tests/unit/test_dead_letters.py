"""Dead letters of any record: built without fail, nothing silently lost, sent without stopping
the consumer (``schemas.DeadLetter.of``, ``streams.dead_letters``, the consumers' bad-record paths)."""

from __future__ import annotations

import asyncio
import hashlib
import os

import msgpack
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.admin.api import create_app
from conductor.admin.feed import DeadLetterRow, LogFeed
from conductor.gateway.replies import ReplyInbox
from conductor.routing.router import Router, Unreadable
from conductor.settings import load_settings
from schemas import SCHEMA_VERSIONS, DeadLetter, DecodeError, Heartbeat, decode, encode, envelope
from schemas.records import MAX_KEY_BYTES, MAX_ORIGINAL_BYTES, MAX_TEXT
from state.memory import InMemoryViewStore
from state.reservations import InMemoryReservations
from streams.dead_letters import DeadLetters
from streams.kafka import MIN_MESSAGE_BYTES
from streams.topics import topics

S = load_settings(topic_prefix="u.", kafka_url=None, redis_url=None)
T = topics(S.topic_config())


def test_a_dead_letter_of_a_mebibyte_of_random_bytes_and_a_key_that_is_not_utf8_is_built():
    value, key = os.urandom(1 << 20), b"\xff\xfe\x80" + os.urandom(5000)
    d = DeadLetter.of(T.requests.name, 3, 41, "malformed", "not msgpack", value, key)
    assert d.original == value[:MAX_ORIGINAL_BYTES] and d.original_size == 1 << 20
    assert d.original_sha256 == hashlib.sha256(value).hexdigest()
    assert d.key == key[:MAX_KEY_BYTES] and d.key_size == len(key) and not d.complete
    wire = encode(envelope(d, producer_id="router-1", producer_seq=1, ts_ms=1))
    assert len(wire) < MIN_MESSAGE_BYTES  # it fits every topic Conductor accepts
    assert decode(wire).body == d


def test_texts_out_of_bounds_are_cut_and_escaped_not_refused():
    d = DeadLetter.of("", -1, -5, "", "\udcff" * (MAX_TEXT + 10), b"", None)
    assert (d.source_topic, d.partition, d.offset, d.reason) == ("?", 0, 0, "unknown")
    assert len(d.error) == MAX_TEXT and d.error.startswith("\\udcff")
    assert d.key is None and d.original_size == 0 and d.complete
    encode(envelope(d, producer_id="x", producer_seq=0, ts_ms=0))


@settings(max_examples=200)
@given(topic=st.text(st.characters(min_codepoint=0, max_codepoint=0xE000, exclude_categories=()), max_size=400),
       partition=st.integers(-(2**40), 2**40), offset=st.integers(-(2**63), 2**63),
       reason=st.text(st.characters(exclude_categories=()), max_size=300),
       error=st.text(st.characters(min_codepoint=0xD000, max_codepoint=0xE000, exclude_categories=()), max_size=5000),
       value=st.none() | st.binary(max_size=70_000), key=st.none() | st.binary(max_size=1100))
def test_any_record_has_a_dead_letter_that_round_trips(topic, partition, offset, reason, error, value, key):
    d = DeadLetter.of(topic, partition, offset, reason, error, value, key)
    assert decode(encode(envelope(d, producer_id="p", producer_seq=0, ts_ms=0))).body == d
    assert d.original_size == len(value or b"") and d.complete == (len(value or b"") <= MAX_ORIGINAL_BYTES
                                                                    and len(key or b"") <= MAX_KEY_BYTES)


def test_a_v1_dead_letter_still_reads():
    v1 = {"s": "dead_letter", "v": 1, "id": "e", "p": "worker", "q": 0, "e": 0, "t": 1,
          "b": {"source_topic": "x.kv-events", "partition": 0, "offset": 3, "reason": "malformed", "error": "e",
                "original": b"\x00"}}
    d = decode(msgpack.packb(v1, use_bin_type=True)).body
    assert isinstance(d, DeadLetter) and d.original == b"\x00" and d.original_size is None and d.key is None
    assert d.complete and SCHEMA_VERSIONS["dead_letter"] == 2


class FakeProducer:
    def __init__(self, refuse: bool = False) -> None:
        self.sent: list[tuple[str, bytes, bytes | None]] = []
        self.refuse = refuse

    async def send(self, topic, value, key=None, headers=None):
        if self.refuse:
            raise ValueError("MessageSizeTooLarge")
        self.sent.append((topic, value, key))
        done = asyncio.get_running_loop().create_future()
        done.set_result("ack")
        return done


async def test_letters_go_to_the_dead_letter_topic_and_a_refused_one_stops_nothing():
    prod = FakeProducer()
    letters = DeadLetters(S.kafka(), T.dead_letter, "router-1", producer=prod)  # type: ignore[arg-type]
    await (await letters.send(T.requests.name, 1, 9, "malformed", "bad", os.urandom(200 * 1024), b"\xff"))
    ((topic, value, key),) = prod.sent
    env = decode(value)
    assert topic == T.dead_letter.name and key == T.requests.name.encode() and env.producer_id == "router-1"
    assert env.body.offset == 9 and env.body.original_size == 200 * 1024
    refusing = DeadLetters(S.kafka(), T.dead_letter, "router-1", producer=FakeProducer(refuse=True))  # type: ignore[arg-type]
    assert await (await refusing.send(T.requests.name, 0, 1, "malformed", "bad", b"x")) is None
    assert refusing.counts == {"malformed": 1, "unsent": 1}


async def test_the_router_sets_aside_what_is_no_request_and_answers_a_readable_key():
    router = Router(S, InMemoryViewStore(), InMemoryReservations(S.reservation_ttl_s))
    key, out, reply = await router.handle_with_reply(os.urandom(200 * 1024), b"\xff\xfe")
    assert key == "" and isinstance(out, Unreadable) and out.rejection is None and out.error.reason == "malformed"
    key, out, _ = await router.handle_with_reply(b"", b"req-1")
    assert key == "req-1" and isinstance(out, Unreadable) and out.rejection is not None
    assert out.rejection.reason == "invalid_request" and reply is None


def test_the_reply_inbox_hands_back_what_it_cannot_take():
    inbox = ReplyInbox(S, "gw-1")
    assert isinstance(inbox.on_record(os.urandom(100)), DecodeError)
    wrong = inbox.on_record(encode(envelope(Heartbeat(role="prefill"), producer_id="n", producer_seq=0, ts_ms=1)))
    assert isinstance(wrong, DecodeError) and wrong.reason == "wrong_kind"
    assert inbox.counts["wrong_kind"] == 1


class ClosableView(InMemoryViewStore):
    async def close(self) -> None:
        pass


def test_the_admin_shows_a_cut_letter_whole_in_size_and_will_not_resend_its_part():
    feed = LogFeed(S)
    value = os.urandom(200 * 1024)
    letter = DeadLetter.of(T.requests.name, 1, 9, "malformed", "not msgpack", value, b"\xff\xfe")
    feed.dead_letters.append(DeadLetterRow(T.dead_letter.name, 0, 4, 1, letter))
    with TestClient(create_app(S, insecure=True, feed=feed, view=ClosableView())) as c:
        (row,) = c.get("/api/dead-letters").json()["dead_letters"]
        assert row["original_bytes"] == len(value) and row["original_sha256"] == hashlib.sha256(value).hexdigest()
        assert row["complete"] is False and row["key"] == "\\xff\\xfe"
        refused = c.post("/api/dead-letters/0/4/resend")
        assert refused.status_code == 409 and f"{T.requests.name}[1]@9" in refused.json()["detail"]
