"""Every consumer survives any bytes: a fuzz run of random, oversized and misshapen records on
every topic each consumer reads, then a good record behind them.

The consumers: two routers and the stream worker as the processes an operator runs
(``conductor router``, ``conductor worker``), the balance worker, a gateway's reply inbox and
the admin feed in this process. Each bad record is dead-lettered once, with its reason, by its
topic's own consumer (routers: ``requests``; the worker: ``kv-events``, ``heartbeats``; the
inbox: its reply topic); the other readers skip it (streams/dead_letters.py). The counts tried
and the crashes are printed (``-s``) for the closing note.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from conductor.admin.feed import LogFeed
from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from conductor.gateway.replies import ReplyInbox
from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.settings import child_environment
from schemas import (
    BlocksStored,
    ControlCommand,
    DeadLetter,
    DecodeError,
    Heartbeat,
    RoutingDecision,
    RoutingRequest,
    decode,
    encode,
    envelope,
)
from schemas.records import MAX_KEY_BYTES, MAX_ORIGINAL_BYTES
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

BIG = 200 * 1024


@dataclass(frozen=True)
class Bad:
    why: str
    key: bytes | None
    value: bytes | None


def _wire(env_bytes: bytes, **body: object) -> bytes:
    """A valid record's bytes with its body changed (msgpack as on the wire, no validation)."""
    wire = msgpack.unpackb(env_bytes)
    wire["b"].update(body)
    return msgpack.packb(wire)


def hostile(rng: random.Random, good: bytes, wrong_kind: bytes, n_random: int) -> list[Bad]:
    """The bad records sent to one topic: ``good`` is a valid record of the topic (to break),
    ``wrong_kind`` a valid record of another topic."""
    future = msgpack.unpackb(good)
    future["v"] = 999
    out = [
        Bad("200 KiB of random bytes, a key that is not UTF-8", b"\xff\xfe\xfd" + rng.randbytes(13), rng.randbytes(BIG)),
        Bad("an empty value", b"empty", b""),
        Bad("no value at all (a tombstone)", b"tombstone", None),
        Bad("huge msgpack: a 150,000-token request body", b"huge",
            _wire(good, token_ids=list(range(150_000)), prompt_tokens=1)),
        Bad("msgpack nested 100,000 deep", b"deep", b"\x91" * 100_000 + b"\xc0"),
        Bad("valid msgpack of the wrong shape (a list)", b"shape", msgpack.packb([1, "two", {"3": 4}])),
        Bad("a msgpack string that is not UTF-8", b"utf8", b"\xa2\xff\xfe"),
        Bad("a map with no envelope", None, msgpack.packb({"zz": 1, "b": {}})),
        Bad("a valid record of another topic", b"kind", wrong_kind),
        Bad("a valid envelope, a body that breaks its schema", b"body", _wire(good, kind="nonsense", extra=[1] * 10)),
        Bad("a schema version from the future", b"future", msgpack.packb(future)),
        Bad("a 10 KiB key", b"k" * 10_240, rng.randbytes(64)),
        Bad("the first half of a valid record", b"half", good[: len(good) // 2]),
    ]
    for i in range(n_random):
        key = rng.choice([None, rng.randbytes(rng.randint(1, 40)), f"r{i}".encode()])
        out.append(Bad("random bytes", key, rng.randbytes(rng.randint(1, 2000))))
    return out


async def _send(prod, topic: str, records: list[Bad], partition: int) -> dict[int, Bad]:
    """Each record at the offset the broker gave it."""
    out = {}
    for b in records:
        md = await prod.send_and_wait(topic, b.value, key=b.key, partition=partition)
        out[md.offset] = b
    return out


def _start_router(settings, router_id: str, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-c", "from conductor.cli import main; main()", "router", "--router-id", router_id],
            env=child_environment(settings), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def test_every_consumer_survives_any_bytes(settings, tmp_path):
    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0, "web_port": free_port()})
    t = topics(s.topic_config())
    await kafka.ensure_topics(s.kafka(), t.all())
    rng = random.Random(27)
    now = int(time.time() * 1000)

    def env(body, producer="fuzz", seq=0, ts=now):
        return encode(envelope(body, producer_id=producer, producer_seq=seq, ts_ms=ts))

    request = RoutingRequest(request_id="shape", token_ids=list(range(64)), prompt_tokens=64)
    heartbeat = Heartbeat(role="prefill")
    decision = RoutingDecision(request_id="shape", prefill_instance="p-0", decode_instance="d-0", reused_tokens=0,
                               predicted_ttft_s=0.1, predicted_tbt_ms=10.0, policy="kvcache-centric")
    control = ControlCommand(action="cordon", node_id="ghost")
    letter = DeadLetter.of("elsewhere", 0, 1, "malformed", "a good dead letter", b"x")
    # (topic, partition) → the bad records sent there, by offset
    sent: dict[tuple[str, int], dict[int, Bad]] = {}
    gateway_id = "fuzz-gw"
    reply_topic = t.replies(gateway_id).name
    owned = {t.requests.name, t.kv_events.name, t.heartbeats.name, reply_topic}  # dead-lettered by their consumer

    routers = [_start_router(s, f"fuzz-router-{i}", tmp_path / f"router-{i}.log") for i in range(2)]
    worker = start_worker_process(s, tmp_path / "worker.log")
    stop = asyncio.Event()
    balancer = Balancer(s, BalanceParams(hot_threshold=1_000_000), producer_id="fuzz-balance")
    balance = asyncio.create_task(balancer.run(interval_s=1.0, stop=stop))
    inbox = ReplyInbox(s, gateway_id)
    inbox_task = asyncio.create_task(inbox.run(stop))
    feed = LogFeed(s)
    await feed.start()
    prod = kafka.producer(s.kafka(), max_request_size=2 << 20)
    await prod.start()
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    dl = kafka.consumer(s.kafka(), t.dead_letter.name, group_id=None)
    dispatch = kafka.consumer(s.kafka(), t.dispatch.name, group_id=None)
    await dl.start()
    await dispatch.start()
    letters: dict[tuple[str, int, int], list[tuple[str, DeadLetter]]] = {}
    answers: dict[str, object] = {}
    try:
        await inbox.wait_ready(30)
        plan = [
            (t.requests.name, p, hostile(rng, env(request), env(heartbeat), 8)) for p in range(t.requests.partitions)
        ] + [
            (t.heartbeats.name, p, hostile(rng, env(heartbeat), env(request), 8)) for p in range(t.heartbeats.partitions)
        ] + [
            (t.kv_events.name, 0, hostile(rng, env(BlocksStored(block_keys=[1, 2])), env(request), 8)),
            (reply_topic, 0, hostile(rng, env(decision), env(heartbeat), 8)),
            (t.control.name, 0, hostile(rng, env(control), env(request), 4)),
            (t.dispatch.name, 0, hostile(rng, env(decision), env(request), 4)),
            (t.dead_letter.name, 0, hostile(rng, env(letter), env(request), 4)),
        ]
        for topic, part, bad in plan:
            sent[(topic, part)] = await _send(prod, topic, bad, part)
        # The good records, behind the bad ones on the same partitions.
        good_requests = []
        for p in range(t.requests.partitions):
            req = RoutingRequest(request_id=f"good-{p}", token_ids=list(range(1000, 1064)), prompt_tokens=64)
            good_requests.append(req.request_id)
            await prod.send_and_wait(t.requests.name, env(req, "gw", p, now + 60_000), key=req.request_id.encode(),
                                     partition=p)
        for p, (node, role) in enumerate((("p-0", "prefill"), ("d-0", "decode"))):
            await prod.send_and_wait(t.heartbeats.name, env(Heartbeat(role=role), node), key=node.encode(),
                                     partition=p % t.heartbeats.partitions)
        answered = inbox.expect("shape")
        await prod.send_and_wait(reply_topic, env(decision), key=b"shape", partition=0)
        await prod.send_and_wait(t.control.name, env(control, "admin"), key=b"ghost", partition=0)
        await prod.send_and_wait(t.dead_letter.name, env(letter), key=b"elsewhere", partition=0)

        expected = {(topic, part, off) for (topic, part), offs in sent.items() if topic in owned for off in offs}
        deadline = time.monotonic() + 120
        while True:
            for msgs in (await dl.getmany(timeout_ms=300)).values():
                for m in msgs:
                    try:
                        got = decode(m.value)
                    except DecodeError:
                        continue  # the garbage this test wrote on the dead-letter topic itself
                    if isinstance(got.body, DeadLetter):
                        d = got.body
                        letters.setdefault((d.source_topic, d.partition, d.offset), []).append((got.producer_id, d))
            for msgs in (await dispatch.getmany(timeout_ms=10)).values():
                for m in msgs:
                    with_id = _try_decode(m.value)
                    if with_id is not None:
                        answers[with_id.request_id] = with_id
            nodes = {n.node_id for n in await view.nodes()}
            done = (expected <= set(letters) and all(r in answers for r in good_requests) and {"p-0", "d-0"} <= nodes
                    and answered.done() and balancer.now_s() * 1000 >= now + 60_000 and "ghost" in feed.control.cordoned
                    and any(r.letter.source_topic == "elsewhere" for r in feed.dead_letters)
                    and all(r in {d.request_id for d in feed.decisions} for r in good_requests))
            crashed = [p for p in (*routers, worker) if p.poll() is not None]
            if done or crashed or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        alive = {f"router-{i}": p.poll() is None for i, p in enumerate(routers)} | {"worker": worker.poll() is None}
        alive |= {"balance": not balance.done(), "inbox": not inbox_task.done(),
                  "admin feed": feed.error == "" and feed._task is not None and not feed._task.done()}
        for p in routers:
            _stop(p)
        stop_worker_process(worker)
        await asyncio.wait_for(balance, 20)
        await asyncio.wait_for(inbox_task, 10)
        await feed.stop()
        await dl.stop()
        await dispatch.stop()
        await prod.stop()
        await view.clear()
        await view.close()

    tried = {
        "routers (2)": sum(len(v) for (tp, _), v in sent.items() if tp in (t.requests.name, t.control.name)),
        "stream worker": sum(len(v) for (tp, _), v in sent.items() if tp in (t.kv_events.name, t.heartbeats.name)),
        "balance worker": sum(len(v) for (tp, _), v in sent.items() if tp == t.requests.name),
        "gateway inbox": len(sent[(reply_topic, 0)]),
        "admin feed": sum(len(v) for (tp, _), v in sent.items()
                          if tp in (t.requests.name, t.dispatch.name, t.dead_letter.name, t.control.name)),
    }
    crashes = sum(not a for a in alive.values())
    print(f"\nfuzz: records tried per consumer {tried}; {sum(len(v) for v in sent.values())} bad records in all, "
          f"largest {max(len(b.value or b'') for v in sent.values() for b in v.values())} bytes; crashes {crashes} "
          f"({alive}); dead letters {sum(len(v) for v in letters.values())} from "
          f"{sorted({p for v in letters.values() for p, _ in v})}")
    for name in ("router-0", "router-1", "worker"):
        log = tmp_path / (f"{name}.log")
        assert alive[name], f"{name} died:\n" + (log.read_text()[-3000:] if log.exists() else "")
    assert crashes == 0, alive

    # Each bad record of an owned topic is on the dead-letter topic with its reason and all it was.
    missing = sorted(k for k in ((tp, p, o) for (tp, p), offs in sent.items() if tp in owned for o in offs)
                     if k not in letters)
    assert missing == [], missing
    for (topic, part), offs in sent.items():
        for off, bad in offs.items():
            if topic not in owned:
                assert (topic, part, off) not in letters  # skipped by its readers, never set aside twice
                continue
            _, d = letters[(topic, part, off)][0]
            value = bad.value or b""
            assert d.reason and d.error, d
            assert d.original == value[:MAX_ORIGINAL_BYTES] and d.original_size == len(value)
            assert d.original_sha256 == hashlib.sha256(value).hexdigest()
            assert d.key == (None if bad.key is None else bad.key[:MAX_KEY_BYTES])
            if bad.why.startswith("200 KiB"):
                assert d.reason == "malformed" and len(d.original) == MAX_ORIGINAL_BYTES and not d.complete
            if bad.why == "a valid record of another topic":
                assert d.reason == "wrong_kind", d
    # ... and the good records behind them were taken.
    assert all(r in answers for r in good_requests), answers
    assert answered.result().prefill_instance == "p-0"
    assert sum(feed.skipped.values()) > 0, feed.skipped


def _try_decode(value: bytes | None):
    try:
        return decode(value or b"").body
    except DecodeError:
        return None
