"""The pipeline end to end: records on the real embedded broker → `conductor worker` → Redis view.

One worker subprocess serves the whole module (it takes a few seconds to join); each test
uses node ids of its own and waits until the view's watermark covers what it published.
The last tests compare the whole view: a replay over it changes nothing, and
`conductor view rebuild` into an empty namespace gives the same view key by key.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conductor.cli import app as cli_app
from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.settings import load_settings
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, Heartbeat, decode, encode, envelope
from state.redis_view import RedisViewStore
from streams.kafka import consumer, ensure_topics, producer
from streams.replay import replay_into
from streams.topics import topics

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def pipe_settings(stack, tmp_path_factory):
    tag = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_url=stack.kafka_url, redis_url=stack.redis_url, profile="embedded",
        topic_prefix=f"p{tag}.", view_namespace=f"p{tag}", partitions=2,
        web_port=free_port(), heartbeat_ttl_s=5.0, data_dir=tmp_path_factory.mktemp("pipe"),
    )


@pytest.fixture(scope="module")
async def worker(pipe_settings, tmp_path_factory):
    await ensure_topics(pipe_settings.kafka(), topics(pipe_settings.topic_config()).all())
    log = Path(tmp_path_factory.mktemp("worker")) / "worker.log"
    proc = start_worker_process(pipe_settings, log)
    yield proc
    stop_worker_process(proc)


@pytest.fixture(scope="module")
async def store(pipe_settings):
    s = RedisViewStore.connect(pipe_settings.redis(), pipe_settings.view_namespace)
    yield s
    await s.clear()
    await s.close()


@pytest.fixture(scope="module")
async def prod(pipe_settings):
    p = producer(pipe_settings.kafka())
    await p.start()
    yield p
    await p.stop()


def now_ms() -> int:
    return int(time.time() * 1000)


async def publish(prod, topic, envs_or_bytes, key=None):
    """Send in order; return {topic:partition: last offset}."""
    last = {}
    for x in envs_or_bytes:
        value = x if isinstance(x, bytes) else encode(x)
        k = key if key is not None else x.producer_id.encode()
        md = await prod.send_and_wait(topic, value, key=k)
        last[f"{md.topic}:{md.partition}"] = max(last.get(f"{md.topic}:{md.partition}", -1), md.offset)
    return last


async def wait_applied(store, worker, want, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        wm = await store.watermark()
        if all(wm.get(k, -1) >= v for k, v in want.items()):
            return
        assert worker.poll() is None, "the worker died"
        assert time.monotonic() < deadline, f"not applied within {timeout_s}s: want {want}, have {wm}"
        await asyncio.sleep(0.02)


def kv(node, seq, body, epoch=0):
    return envelope(body, producer_id=node, producer_seq=seq, epoch=epoch, ts_ms=now_ms())


async def test_events_in_expected_view_out(pipe_settings, worker, store, prod):
    t = topics(pipe_settings.topic_config())
    envs = [
        kv("ev-a", 0, BlocksStored(block_keys=[11, 12, 13])),
        kv("ev-a", 1, BlocksStored(block_keys=[14], tier="dram")),
        kv("ev-b", 0, BlocksStored(block_keys=[11, 12])),
        kv("ev-a", 2, BlocksRemoved(block_keys=[13])),
    ]
    hbs = [envelope(Heartbeat(role="decode", batch_size=7), producer_id="ev-b", producer_seq=0, ts_ms=now_ms())]
    want = await publish(prod, t.kv_events.name, envs)
    want |= await publish(prod, t.heartbeats.name, hbs)
    await wait_applied(store, worker, want)
    snap = await store.snapshot([11, 12, 13, 14])
    assert snap.prefix["ev-a"] == (2, 2, 2) and snap.prefix["ev-b"] == (2, 2, 2)
    by = {n.node_id: n for n in snap.nodes}
    assert by["ev-a"].blocks == {"hbm": 2, "dram": 1} and by["ev-a"].last_seq == 2
    assert by["ev-b"].role == "decode" and by["ev-b"].batch_size == 7
    # Live = a heartbeat within the TTL of the view's clock; a node with KV events only is never live.
    # The TTL covers the time the heartbeat took to be applied (a worker starting on a busy machine).
    ttl_s = max(5.0, (snap.now_ms - hbs[0].ts_ms) / 1000 + 1.0)
    assert [n.node_id for n in snap.live_nodes(ttl_s)] == ["ev-b"]


async def test_duplicates_change_nothing(pipe_settings, worker, store, prod):
    t = topics(pipe_settings.topic_config())
    envs = [kv("dup", 0, BlocksStored(block_keys=[21, 22])), kv("dup", 1, BlocksRemoved(block_keys=[22]))]
    await wait_applied(store, worker, await publish(prod, t.kv_events.name, envs))
    # an engine (or bridge) re-publishing: new offsets, same producer sequence numbers
    await wait_applied(store, worker, await publish(prod, t.kv_events.name, envs))
    snap = await store.snapshot([21, 22])
    assert snap.prefix["dup"] == (1, 1, 1)
    assert {n.node_id: n for n in snap.nodes}["dup"].blocks == {"hbm": 1}


async def test_reordering_across_nodes(pipe_settings, worker, store, prod):
    """Nodes' records interleave arbitrarily (different partitions, different orders); only
    per-node order matters."""
    t = topics(pipe_settings.topic_config())
    a = [kv("ro-a", i, BlocksStored(block_keys=[100 + i])) for i in range(5)]
    b = [kv("ro-b", i, BlocksStored(block_keys=[100 + i])) for i in range(3)] + [kv("ro-b", 3, BlocksRemoved(block_keys=[100]))]
    interleaved = [x for pair in zip(b, a) for x in pair] + a[4:]
    await wait_applied(store, worker, await publish(prod, t.kv_events.name, interleaved))
    snap = await store.snapshot([100, 101, 102, 103, 104])
    assert snap.prefix["ro-a"] == (5, 5, 5)
    assert "ro-b" not in snap.prefix  # it evicted the chain's first block
    assert (await store.snapshot([101, 102])).prefix["ro-b"] == (2, 2, 2)


async def test_gap_epoch_change_and_cleared(pipe_settings, worker, store, prod):
    t = topics(pipe_settings.topic_config())
    envs = [
        kv("gap", 0, BlocksStored(block_keys=[31])),
        kv("gap", 5, BlocksStored(block_keys=[32])),  # seqs 1-4 lost: a gap, still applied
        kv("restart", 0, BlocksStored(block_keys=[31, 32])),
        kv("restart", 0, BlocksStored(block_keys=[33]), epoch=1),  # engine restarted: 31, 32 gone
        kv("restart", 1, BlocksStored(block_keys=[34]), epoch=0),  # a straggler of the old epoch
        kv("clear", 0, BlocksStored(block_keys=[31, 32])),
        kv("clear", 1, AllBlocksCleared()),
    ]
    await wait_applied(store, worker, await publish(prod, t.kv_events.name, envs))
    snap = await store.snapshot([31, 32])
    assert snap.prefix["gap"] == (2, 2, 2)
    assert "restart" not in snap.prefix and "clear" not in snap.prefix
    by = {n.node_id: n for n in snap.nodes}
    assert by["gap"].seq_gaps == 1
    assert by["restart"].epoch == 1 and by["restart"].blocks == {"hbm": 1}
    assert by["clear"].blocks == {}
    assert (await store.snapshot([33])).prefix["restart"] == (1, 1, 1)
    assert "restart" not in (await store.snapshot([34])).prefix


def test_heartbeat_ttl_expiry_in_view_show(pipe_settings, worker, store, prod):
    async def go():
        t = topics(pipe_settings.topic_config())
        hbs = [
            envelope(Heartbeat(role="prefill"), producer_id="ttl-fresh", producer_seq=0, ts_ms=now_ms()),
            envelope(Heartbeat(role="prefill"), producer_id="ttl-old", producer_seq=0, ts_ms=now_ms() - 60_000),
        ]
        p = producer(pipe_settings.kafka())
        await p.start()
        try:
            want = await publish(p, t.heartbeats.name, hbs)
        finally:
            await p.stop()
        s = RedisViewStore.connect(pipe_settings.redis(), pipe_settings.view_namespace)
        try:
            await wait_applied(s, worker, want)
        finally:
            await s.close()

    asyncio.run(go())
    res = CliRunner().invoke(cli_app, ["view", "show", "--json"], env=_env(pipe_settings))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    by = {n["node_id"]: n for n in out["nodes"]}
    assert by["ttl-fresh"]["live"] is True
    assert by["ttl-old"]["live"] is False and by["ttl-old"]["heartbeat_age_s"] >= 59
    assert out["totals"]["live_nodes"] == sum(1 for n in out["nodes"] if n["live"])


async def test_malformed_records_go_to_dead_letter_and_worker_goes_on(pipe_settings, worker, store, prod):
    t = topics(pipe_settings.topic_config())
    bad = [
        b"\x00not msgpack",
        encode(envelope(Heartbeat(role="prefill"), producer_id="dl", producer_seq=0, ts_ms=now_ms())),  # wrong topic
    ]
    await publish(prod, t.kv_events.name, bad, key=b"dl")
    good = [kv("dl", 0, BlocksStored(block_keys=[41]))]
    await wait_applied(store, worker, await publish(prod, t.kv_events.name, good))
    assert worker.poll() is None
    assert (await store.snapshot([41])).prefix["dl"] == (1, 1, 1)
    c = consumer(pipe_settings.kafka(), t.dead_letter.name, group_id=None)
    await c.start()
    try:
        letters = []
        deadline = time.monotonic() + 20
        while len(letters) < 2 and time.monotonic() < deadline:
            for msgs in (await c.getmany(timeout_ms=500)).values():
                letters += [decode(m.value).body for m in msgs]
    finally:
        await c.stop()
    reasons = sorted(d.reason for d in letters)
    assert reasons == ["malformed", "wrong_kind"]
    assert {d.original for d in letters} == set(bad)
    assert all(d.source_topic == t.kv_events.name and d.offset >= 0 for d in letters)


async def test_replay_over_the_live_view_changes_nothing(pipe_settings, worker, store):
    before = await store.dump()
    res = await replay_into(pipe_settings.kafka(), pipe_settings.topic_config(), store)
    assert res.records > 0 and res.applied == 0
    assert await store.dump() == before


def test_rebuild_into_an_empty_namespace_equals_the_live_view(pipe_settings, worker):
    target = pipe_settings.view_namespace + "-rb"
    res = CliRunner().invoke(
        cli_app, ["view", "rebuild", "--namespace", target, "--compare", "--json"], env=_env(pipe_settings)
    )
    try:
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["equal"] is True and out["differences"] == []
        assert out["records"] > 10 and out["dead_letters"] == {"malformed": 1, "wrong_kind": 1}
    finally:
        async def cleanup():
            s = RedisViewStore.connect(pipe_settings.redis(), target)
            await s.clear()
            await s.close()

        asyncio.run(cleanup())


def _env(s):
    return {
        "CONDUCTOR_KAFKA_URL": s.kafka_url, "CONDUCTOR_REDIS_URL": s.redis_url, "CONDUCTOR_PROFILE": "embedded",
        "CONDUCTOR_TOPIC_PREFIX": s.topic_prefix, "CONDUCTOR_VIEW_NAMESPACE": s.view_namespace,
        "CONDUCTOR_PARTITIONS": str(s.partitions), "CONDUCTOR_HEARTBEAT_TTL_S": str(s.heartbeat_ttl_s),
    }
