"""End to end: emulated engine → ZMQ → bridge → Kafka → stream worker → Redis → router → dispatch → engine.

Two prefill instances and one decode instance. The first request is computed from
scratch; the engine's KV events travel through the whole pipeline into the view,
so the second request, which shares the first one's prefix, is routed to the
instance that holds it and reuses it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.serve import BridgeServeConfig, EngineRole
from conductor.bridge.serve import serve as serve_bridge
from conductor.harness.devstack import free_port
from conductor.harness.engine.serve import EngineServeConfig, engine_node
from conductor.settings import Settings, settings_env
from schemas import RoutingDecision, RoutingRequest, chain_keys, decode, encode, envelope, headers
from state.redis_view import RedisViewStore
from streams.kafka import consumer, ensure_topics, producer
from streams.topics import topics
from tests.integration import waiting

pytestmark = [pytest.mark.integration]


def conductor_env(s: Settings) -> dict[str, str]:
    """The test's settings, as the CONDUCTOR_* variables of a child process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    env.update(settings_env(s.model_copy(update={"web_port": free_port(), "policy": "kvcache-centric"})))
    return env


def _start(settings: Settings, tmp_path: Path, *commands: list[str]) -> list[subprocess.Popen[bytes]]:
    env = conductor_env(settings)
    procs = []
    for cmd in commands:
        with open(tmp_path / f"{cmd[0]}.log", "wb") as log:  # the child writes to its own copy
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "from conductor.cli import main; main()", *cmd],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=tmp_path,
            ))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture
def services(settings: Settings, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The stream worker and the router, as the real commands."""
    procs = _start(settings, tmp_path, ["worker"], ["router"])
    try:
        yield procs
    finally:
        _stop(procs)


async def test_an_engines_events_make_the_next_request_reuse_its_prefix(
    settings: Settings, services: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    tps = topics(settings.topic_config())
    await ensure_topics(settings.kafka(), tps.all())
    prod = producer(settings.kafka())
    await prod.start()
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    reports: dict[str, io.StringIO] = {}
    nodes = contextlib.AsyncExitStack()
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    cons = consumer(settings.kafka(), tps.dispatch.name, group_id=None, fetch_max_wait_ms=50)
    try:
        # Each engine and its bridge started as `conductor engine` and `conductor bridge` start them.
        roles: tuple[tuple[str, EngineRole], ...] = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
        for node, role in roles:
            reports[node] = io.StringIO()
            config = EngineServeConfig(node_id=node, role=role, kv_blocks=4096, time_scale=100.0, heartbeat_s=0.3,
                                       max_output_tokens=8, report=True, kv_commands=False)
            eng = await nodes.enter_async_context(engine_node(config, settings, report_to=reports[node]))
            bridge = BridgeServeConfig(zmq_endpoint=eng.publisher.endpoint, node_id=node, role=role,
                                       replay_endpoint=eng.publisher.replay_endpoint, heartbeat_s=0)
            tasks.append(asyncio.create_task(eng.run(stop)))
            tasks.append(asyncio.create_task(serve_bridge(bridge, settings, stop=stop)))

        async def wait_for(what: str, pred, timeout: float = 40.0):  # type: ignore[no-untyped-def]
            return await waiting.wait_for(what, pred, dict(zip(("worker", "router"), services)), tmp_path,
                                          timeout=timeout, every=0.2)

        async def all_live() -> bool:
            now = time.time_ns() // 1_000_000
            live = {n.node_id for n in await view.nodes() if n.is_live(now, settings.heartbeat_ttl_s)}
            # and the view healthy: while the worker reads partitions back, routers answer view_rebuilding
            return live >= {"p0", "p1", "d0"} and (await view.view_health())[0]

        await wait_for("every engine live in the view and the view healthy", all_live)

        await cons.start()
        decisions: dict[str, RoutingDecision] = {}

        async def decision(rid: str):  # type: ignore[no-untyped-def]
            for recs in (await cons.getmany(timeout_ms=100)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    assert isinstance(body, RoutingDecision), body
                    decisions[body.request_id] = body
            return decisions.get(rid)

        def done(node: str, rid: str) -> dict | None:  # type: ignore[type-arg]
            for line in reports[node].getvalue().splitlines():
                row = json.loads(line)
                if row["request_id"] == rid and row["event"] == "prefill_done":
                    return row
            return None

        bs = settings.block_size
        prefix = [(7 * i) % 30_000 for i in range(8 * bs)]

        async def send(rid: str, tokens: list[int], seq: int) -> None:
            req = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), expected_output_tokens=8)
            env = envelope(req, producer_id="e2e", producer_seq=seq, ts_ms=time.time_ns() // 1_000_000)
            await prod.send_and_wait(tps.requests.name, encode(env), key=rid.encode(), headers=headers(env))

        await send("r1", prefix + [1, 2, 3], 1)
        first = await wait_for("the first decision", lambda: decision("r1"))
        assert first.reused_tokens == 0 and first.decode_instance == "d0"
        holder = first.prefill_instance
        row1 = await wait_for("the first prefill", lambda: asyncio.sleep(0, done(holder, "r1")))
        assert row1["cached_tokens"] == 0

        # The engine's events reach the view through the bridge, Kafka and the worker.
        chain = chain_keys(prefix, bs)

        async def view_has_prefix() -> bool:
            snap = await view.snapshot(chain)
            return snap.prefix.get(holder, (0, 0, 0))[0] == len(chain)

        await wait_for("the first request's blocks in the view", view_has_prefix)

        await send("r2", prefix + [9, 9, 9, 9], 2)
        second = await wait_for("the second decision", lambda: decision("r2"))
        # Reused from the instance that holds it: locally, or (if the policy judged that
        # instance busier) read remotely by the other one.
        assert second.reused_tokens == len(prefix)
        assert second.reuse_source == holder
        row2 = await wait_for("the second prefill", lambda: asyncio.sleep(0, done(second.prefill_instance, "r2")))
        assert row2["cached_tokens"] == len(prefix)  # really reused by the engine, not just predicted
        if second.prefill_instance == holder:
            assert row2["local_cached_tokens"] == len(prefix)
    finally:
        await cons.stop()
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nodes.aclose()
        await prod.stop()
        await view.close()


@pytest.mark.slow  # `scripts/test -m slow`
async def test_the_bridge_command_brings_an_engine_that_does_not_heartbeat_into_the_view(
    settings: Settings, tmp_path: Path
) -> None:
    """What an operator does with a real vLLM: `conductor bridge` against its ZMQ sockets, then `view show`."""
    from conductor.bridge.wire import EngineBlockStored

    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")  # stands for vLLM: events only, no heartbeats
    pub.start()
    bs = settings.block_size
    tokens = list(range(100, 100 + 5 * bs))
    hashes = tuple(range(-5, 0))  # signed, as SGLang may send them
    await pub.publish(time.time(), [EngineBlockStored(hashes, None, tuple(tokens), bs, "hbm")])  # before the bridge
    procs = _start(settings, tmp_path, ["worker"], ["bridge", "--zmq", pub.endpoint, "--replay", str(pub.replay_endpoint),
                                                     "--node-id", "vllm-0", "--role", "prefill", "--heartbeat-s", "0.3"])
    view = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    try:
        deadline = time.monotonic() + 40
        while True:
            assert all(p.poll() is None for p in procs), (tmp_path / "bridge.log").read_text()[-2000:]
            # In a thread: the in-process "engine" must keep answering the bridge's probes and replay meanwhile.
            out = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", "from conductor.cli import main; main()", "view", "show", "--json"],
                env=conductor_env(settings), capture_output=True, timeout=30)
            assert out.returncode == 0, out.stderr.decode()[-2000:]
            nodes = {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}
            node = nodes.get("vllm-0")
            if node and node["live"] and node["blocks"].get("hbm") == 5:
                break
            assert time.monotonic() < deadline, f"view: {nodes}"
            await asyncio.sleep(0.3)
        assert node["role"] == "prefill" and node["seq_gaps"] == 0
        snap = await view.snapshot(chain_keys(tokens, bs))
        assert snap.prefix["vllm-0"][0] == 5  # Conductor's own keys: a request with these tokens matches
    finally:
        _stop(procs)
        await pub.close()
        await view.close()
