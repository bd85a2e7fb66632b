"""A worker SIGKILLed mid-stream and restarted: the view ends exactly as if nothing happened.

Faust re-delivers what was not committed and its tables may lag the view; the offset fence
in the view's atomic writes must make that harmless.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest
from kvstream import KvStream, caught_up

from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.settings import load_settings
from schemas import encode
from state.memory import InMemoryViewStore
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.replay import diff_dumps, replay_into
from streams.topics import topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_sigkill_mid_stream_then_restart(stack, tmp_path):
    tag = uuid.uuid4().hex[:8]
    s = load_settings(
        kafka_url=stack.kafka_url, redis_url=stack.redis_url, profile="embedded", topic_prefix=f"k{tag}.",
        view_namespace=f"k{tag}", partitions=2, web_port=free_port(), data_dir=tmp_path / "d",
    )
    t = topics(s.topic_config())
    await ensure_topics(s.kafka(), t.all())
    envs = KvStream(seed=3).take(3000)

    store = RedisViewStore.connect(s.redis(), s.view_namespace)
    prod = producer(s.kafka())
    await prod.start()
    worker = start_worker_process(s, tmp_path / "w1.log")
    try:
        for e in envs:
            await prod.send(t.kv_events.name, encode(e), key=e.producer_id.encode())
        await prod.flush()
        # kill it once it has applied part of the stream
        deadline = time.monotonic() + 60
        while sum((await store.watermark()).values()) < 200:
            assert time.monotonic() < deadline, "the first worker never got going"
            await asyncio.sleep(0.01)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        partial = sum((await store.watermark()).values())
        worker = start_worker_process(s, tmp_path / "w2.log")
        await caught_up(store, worker, len(envs))
        assert partial < len(envs)  # the kill really happened mid-stream
        # The reference is the log as the broker holds it, folded by one uninterrupted reader:
        # the killed-and-restarted worker must have built exactly that view. (Without an
        # idempotent producer, which the embedded broker lacks, a retried send may land out
        # of order; the view must then show the same gap the log shows, not the sent order.)
        ref = InMemoryViewStore()
        replayed = await replay_into(s.kafka(), s.topic_config(), ref)
        assert replayed.records >= len(envs)  # every send landed (a retried one may land twice)
        got, want = await store.dump(), ref.dump_sync()
        assert got["watermark"] == want["watermark"]
        assert got["blocks"] == want["blocks"]
        assert got["nodes"] == want["nodes"], (diff_dumps(got, want), worker_log_lines(tmp_path, "gap", "moved under"))
    finally:
        stop_worker_process(worker)
        await prod.stop()
        await store.clear()
        await store.close()


def worker_log_lines(tmp_path, *words):
    """The workers' log lines mentioning any of ``words`` (for a failure message)."""
    return [
        f"{name}: {line}"
        for name in ("w1.log", "w2.log")
        if (tmp_path / name).exists()
        for line in (tmp_path / name).read_text(errors="replace").splitlines()
        if any(w in line for w in words)
    ][:20]
