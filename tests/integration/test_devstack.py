"""The embedded stack: both servers answer, and `down` leaves nothing behind."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from conductor.harness.devstack import EmbeddedStack

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


async def _roundtrip(bootstrap: str) -> bytes:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait("devstack-smoke", b"ping", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer("devstack-smoke", bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 10)
    finally:
        await consumer.stop()
    return msg.value


def test_up_answers_and_down_leaves_no_process(tmp_path):
    stack = EmbeddedStack(tmp_path)
    st = stack.up()
    try:
        assert stack.status()["running"] is True
        assert stack.up().broker_pid == st.broker_pid  # idempotent: the running stack is reused
        assert redis.Redis.from_url(st.redis_url).ping() is True
        assert asyncio.run(_roundtrip(st.kafka_url)) == b"ping"
    finally:
        stopped = stack.down()
    assert sorted(stopped) == sorted([st.broker_pid, st.redis_pid])
    assert not _alive(st.broker_pid) and not _alive(st.redis_pid)
    assert stack.status() == {"running": False}
    assert stack.down() == []


def test_down_never_kills_a_recycled_pid(tmp_path):
    stack = EmbeddedStack(tmp_path)
    st = stack.up()
    stack.down()
    # Pretend the pid file points at this test process: `down` must refuse to kill it.
    import json

    data = dict(st.__dict__, broker_pid=os.getpid(), redis_pid=os.getpid())
    stack.state_path.write_text(json.dumps(data))
    assert stack.down() == []
    assert _alive(os.getpid())


def test_servers_die_with_a_killed_owner(tmp_path):
    """A test session or demo that is SIGKILLed must not leave its servers running."""
    import json
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys, time; from conductor.harness.devstack import EmbeddedStack; "
        f"EmbeddedStack({str(tmp_path)!r}).up(die_with_parent=True); print('up', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        st = json.loads((tmp_path / "stack.json").read_text())
        assert _alive(st["broker_pid"]) and _alive(st["redis_pid"])
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_alive(st["broker_pid"]) or _alive(st["redis_pid"])):
        time.sleep(0.05)
    assert not _alive(st["broker_pid"]) and not _alive(st["redis_pid"])
