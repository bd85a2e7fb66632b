"""Balance worker on the real broker and Redis: hot requests in → a replicate command out."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from conductor.settings import Settings, inherited_environment, settings_env
from schemas import BlocksStored, Heartbeat, KvCommand, RoutingRequest, decode, encode, envelope
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration


async def test_hot_prefix_on_overloaded_holder_is_replicated(settings):
    now = int(time.time() * 1000)
    store = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    chain = [101, 102, 103, 104]
    records = [
        (envelope(Heartbeat(role="prefill", queued_prefill_tokens=50_000), producer_id="p-busy", producer_seq=0,
                  ts_ms=now), None),
        (envelope(Heartbeat(role="prefill", queued_prefill_tokens=100), producer_id="p-idle", producer_seq=0,
                  ts_ms=now), None),
        (envelope(Heartbeat(role="decode"), producer_id="d-0", producer_seq=0, ts_ms=now), None),
        (envelope(BlocksStored(block_keys=chain), producer_id="p-busy", producer_seq=0, ts_ms=now), None),
    ]
    await store.apply(records)
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    producer = kafka.producer(settings.kafka())
    await producer.start()
    for i in range(12):
        req = RoutingRequest(request_id=f"r{i}", block_keys=chain, prompt_tokens=64)
        await producer.send(t.requests.name, encode(envelope(req, producer_id="gw", producer_seq=i, ts_ms=now + i)))
    await producer.send(t.requests.name, b"\x00not a record")  # carries no heat, breaks nothing
    await producer.stop()

    stop = asyncio.Event()
    balancer = Balancer(settings, BalanceParams(hot_threshold=8, overload_tokens=1000, cooldown_s=60))
    task = asyncio.create_task(balancer.run(interval_s=0.3, stop=stop))
    consumer = kafka.consumer(settings.kafka(), t.kv_commands.name, group_id=None)
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 20)
    finally:
        stop.set()
        await consumer.stop()
        await asyncio.wait_for(task, 10)
        await store.close()
    cmd = decode(msg.value).body
    assert isinstance(cmd, KvCommand)
    assert (cmd.action, cmd.from_node, cmd.to_node, cmd.block_keys) == ("replicate", "p-busy", "p-idle", chain)
    assert msg.key == b"p-idle"  # keyed by the executor: the target pulls the prefix
    assert cmd.command_id and cmd.deadline_ms is not None


def _balance_env(settings: Settings, params: dict[str, object]) -> dict[str, str]:
    env = inherited_environment(lambda k: k.startswith("CONDUCTOR_"))
    env.update(settings_env(settings.model_copy(update={"balance_params": params})))
    return env


def _start_balance(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "from conductor.cli import main; main()", "balance", "--interval", "0.3"],
        env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, cwd=log_path.parent,
    )


def _stop(p: subprocess.Popen[bytes]) -> int:
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


async def _changelog_keys(settings: Settings, table: str) -> set[str]:
    """The keys written to a balance table's changelog so far."""
    name = f"{settings.topic_prefix}balance-{table}-changelog"
    c = kafka.consumer(settings.kafka(), group_id=None)
    await c.start()
    try:
        if name not in await c.topics():
            return set()
        tps = [TopicPartition(name, p) for p in c.partitions_for_topic(name) or ()]
        c.assign(tps)
        ends = await kafka.end_offsets(c, tps)
        for tp in tps:
            c.seek(tp, 0)
        keys: set[str] = set()
        while [tp for tp in tps if await c.position(tp) < ends[tp]]:
            for recs in (await c.getmany(timeout_ms=200)).values():
                keys.update(json.loads(r.key) if r.key else "" for r in recs)
        return keys
    finally:
        await c.stop()


@pytest.mark.slow  # `scripts/test -m slow`
async def test_a_restarted_balance_worker_resumes_with_its_heat(settings: Settings, tmp_path: Path):
    """Heat counted by one run of `conductor balance` is restored from the tables' changelogs by
    the next run (which reads no request again), and a command is planned from it."""
    store = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    chain = [201, 202, 203, 204]
    load = {"p-busy": 100, "p-idle": 100}
    seqs = {"p-busy": 0, "p-idle": 0, "d-0": 0}

    async def heartbeats() -> None:
        while True:
            now = int(time.time() * 1000)
            recs = []
            for node, seq in seqs.items():
                role = "decode" if node == "d-0" else "prefill"
                hb = Heartbeat(role=role, queued_prefill_tokens=load.get(node, 0))
                recs.append((envelope(hb, producer_id=node, producer_seq=seq, ts_ms=now), None))
                seqs[node] = seq + 1
            await store.apply(recs)
            await asyncio.sleep(0.5)

    await store.apply([(envelope(BlocksStored(block_keys=chain), producer_id="p-busy", producer_seq=0,
                                 ts_ms=int(time.time() * 1000)), None)])
    beat = asyncio.create_task(heartbeats())
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    env = _balance_env(settings, {"hot_threshold": 8, "overload_tokens": 1000, "cooldown_s": 60})
    first = _start_balance(env, tmp_path / "balance-1.log")
    producer = kafka.producer(settings.kafka())
    await producer.start()
    now = int(time.time() * 1000)
    try:
        # Three bursts, so the changelogs hold several batches (Tansu misreports where a
        # partition ends by the size of its last batch: recovery must not stop short).
        for i in range(12):
            req = RoutingRequest(request_id=f"r{i}", block_keys=chain, prompt_tokens=64)
            await producer.send_and_wait(t.requests.name, encode(envelope(req, producer_id="gw", producer_seq=i,
                                                                          ts_ms=now + i)), key=f"r{i}".encode())
            if i % 4 == 3:
                await asyncio.sleep(1.0)
        deadline = time.monotonic() + 60
        while str(chain[-1]) not in await _changelog_keys(settings, "hot-blocks"):
            assert first.poll() is None, (tmp_path / "balance-1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the heat never reached the tables"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # the last round and the offset commit
        assert _stop(first) == 0, (tmp_path / "balance-1.log").read_text()[-3000:]
        log1 = (tmp_path / "balance-1.log").read_text()
        assert "replicate" not in log1  # nothing was overloaded yet

        # The first run committed every request: the second one reads none of them again.
        c = kafka.consumer(settings.kafka(), group_id=f"{settings.topic_prefix}balance")
        await c.start()
        try:
            tps = [TopicPartition(t.requests.name, p) for p in c.partitions_for_topic(t.requests.name) or ()]
            c.assign(tps)
            ends = await kafka.end_offsets(c, tps)
            committed = {tp: await c.committed(tp) or 0 for tp in tps}
        finally:
            await c.stop()
        assert committed == ends

        load["p-busy"] = 50_000  # the holder is overloaded now
        second = _start_balance(env, tmp_path / "balance-2.log")
        consumer = kafka.consumer(settings.kafka(), t.kv_commands.name, group_id=None)
        await consumer.start()
        try:
            msg = await asyncio.wait_for(consumer.getone(), 60)
        finally:
            await consumer.stop()
            code = _stop(second)
        log2 = (tmp_path / "balance-2.log").read_text()
        assert code == 0, log2[-3000:]
    finally:
        beat.cancel()
        await producer.stop()
        await store.close()
        for p in (first,):
            if p.poll() is None:
                p.kill()
    cmd = decode(msg.value).body
    assert isinstance(cmd, KvCommand)
    assert (cmd.action, cmd.from_node, cmd.to_node, cmd.block_keys) == ("replicate", "p-busy", "p-idle", chain)
    assert "(heat 12.0)" in cmd.reason  # all twelve accesses, none lost in the restart
    assert "heat tables recovered: 4 hot blocks" in log2
