"""A balance command carried out by real vLLM engines: a hot prefix replicated over NIXL.

The session's P/D pair (both ``kv_both`` on the NixlConnector), each followed by a
``conductor bridge`` process whose heartbeats announce the engine's endpoint (run as ``both``
with a KV connector). A prompt goes to engine A only; a ``replicate`` A → B with the prompt's
full blocks is published on ``kv-commands`` (twice: at-least-once delivery), and B's bridge,
started with ``--execute-commands`` (``conductor.bridge.commands``), carries it out: A prefills
with ``do_remote_decode``, B pulls the KV over NIXL and caches it. Checked from the engines
and the log: one result ``done`` per delivery, the same both times; one NIXL transfer on B;
the prefix on B in the view, from B's own KV events; and the prompt, sent to B later, hits
B's prefix cache.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conductor.harness.demo import Processes
from conductor.harness.vllm_kit import BLOCK_SIZE, VllmEngine
from conductor.settings import Settings, child_environment
from schemas import KvCommand, KvCommandResult, chain_keys, decode, encode, envelope, headers
from state.redis_view import RedisViewStore
from streams.kafka import consumer, producer
from streams.topics import topics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

A, B = "vllm-bal-a", "vllm-bal-b"


def metric(text: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def scrape(http: httpx.AsyncClient, engine: VllmEngine) -> str:
    r = await http.get(engine.metrics_url)
    r.raise_for_status()
    return r.text


async def until(what: str, probe: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := await probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return got


@pytest.fixture
async def bridged(vllm_pd: tuple[VllmEngine, VllmEngine], vllm_settings: Settings, view_worker: RedisViewStore,
                  tmp_path: Path) -> AsyncIterator[tuple[VllmEngine, VllmEngine, Processes]]:
    """The P/D pair as A and B, each followed by a `conductor bridge` process (events, scraped heartbeats
    with the endpoint, ``both`` with a KV connector); B's also carries out B's KV commands."""
    procs = Processes(tmp_path / "logs")
    env = child_environment(vllm_settings)
    try:
        for node, eng, more in ((A, vllm_pd[0], []), (B, vllm_pd[1], ["--execute-commands"])):
            await procs.start(f"bridge-{node}", [
                "bridge", "--zmq", eng.zmq, "--replay", eng.replay, "--node-id", node, "--role", "both",
                "--kv-transfer", "--model", eng.model, "--metrics-url", eng.metrics_url, "--heartbeat-s", "0.5",
                *more], env)
        yield vllm_pd[0], vllm_pd[1], procs
    finally:
        await procs.stop()


async def results_for(settings: Settings, command_id: str, count: int, wait_s: float = 240.0) -> list[KvCommandResult]:
    cons = consumer(settings.kafka(), topics(settings.topic_config()).kv_command_results.name, group_id=None, fetch_max_wait_ms=50)
    await cons.start()
    found: list[KvCommandResult] = []
    try:
        deadline = time.monotonic() + wait_s
        while len(found) < count and time.monotonic() < deadline:
            for recs in (await cons.getmany(timeout_ms=200)).values():
                found += [b for r in recs if isinstance(b := decode(r.value).body, KvCommandResult)
                          and b.command_id == command_id]
    finally:
        await cons.stop()
    assert len(found) == count, f"{len(found)} of {count} results for {command_id}"
    return found


async def test_a_replicate_is_pulled_over_nixl_and_proven_by_the_targets_own_events(
    bridged: tuple[VllmEngine, VllmEngine, Any], vllm_settings: Settings, view_worker: RedisViewStore,
    http: httpx.AsyncClient, unique_text: str,
) -> None:
    a, b, procs = bridged
    s, view, tps = vllm_settings, view_worker, topics(vllm_settings.topic_config())

    async def endpoints() -> bool:
        assert not procs.dead(), procs.log_tail(f"bridge-{B}") + procs.log_tail(f"bridge-{A}")
        now = time.time_ns() // 1_000_000
        live = {n.node_id: n.endpoint for n in await view.nodes() if n.is_live(now, s.heartbeat_ttl_s)}
        return live.get(A) == a.url and live.get(B) == b.url

    await until("both engines live in the view, their endpoints announced", endpoints)

    # The prompt on A only; a tail past the last full block, so a later hit can cover every block.
    text = unique_text + "a hot system prompt that the balancer copies to a second engine " * 6
    tokens = (await http.post(f"{a.url}/tokenize", json={"model": a.model, "prompt": text})).json()["tokens"]
    blocks = len(tokens) // BLOCK_SIZE
    if len(tokens) % BLOCK_SIZE == 0:
        blocks -= 1
    prefix = tokens[: blocks * BLOCK_SIZE]
    chain = chain_keys(prefix, BLOCK_SIZE)
    assert blocks >= 4
    r = await http.post(f"{a.url}/v1/completions", json={"model": a.model, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text

    async def held(node: str) -> int:
        return (await view.snapshot(chain)).prefix.get(node, (0, 0, 0))[0]

    await until("the prefix on A in the view", lambda: _eq(held(A), blocks))
    assert await held(B) == 0

    # B's bridge reads B's commands from kv-commands; the replicate is delivered twice.
    b0 = await scrape(http, b)
    cmd = KvCommand(command_id=f"replicate-{uuid.uuid4().hex[:8]}", action="replicate", block_keys=chain,
                    from_node=A, to_node=B, to_tier="hbm", token_ids=prefix, block_size=BLOCK_SIZE,
                    deadline_ms=time.time_ns() // 1_000_000 + 120_000, reason="test: hot prefix")
    prod = producer(s.kafka())
    await prod.start()
    try:
        for seq in range(2):
            env = envelope(cmd, producer_id="test-balance", producer_seq=seq, ts_ms=time.time_ns() // 1_000_000)
            await prod.send_and_wait(tps.kv_commands.name, encode(env), key=cmd.executor.encode(), headers=headers(env))
    finally:
        await prod.stop()
    first, second = await results_for(s, cmd.command_id, 2)
    assert (first.status, first.error, first.node, first.blocks) == ("done", None, B, blocks), first.reason
    assert second == first  # the repeat: the first result again, nothing carried out twice
    print(f"\nreplicate of {blocks} blocks ({blocks * BLOCK_SIZE} tokens) A -> B over NIXL: {first.duration_ms:.0f} ms "
          f"{first.reason}")

    # B pulled the prefix over NIXL, once (the second delivery pulled nothing), computing none of it.
    # On a loaded machine the first pull from A may fail its NIXL handshake (5 s in vLLM): then
    # the executor tried once more, and says so.
    b1 = await scrape(http, b)
    retried = "second attempt" in first.reason
    xfers = metric(b1, "vllm:nixl_xfer_time_seconds_count") - metric(b0, "vllm:nixl_xfer_time_seconds_count")
    assert xfers == 1 or (retried and xfers == 2), (xfers, first.reason)
    pulled = metric(b1, "vllm:external_prefix_cache_hits_total") - metric(b0, "vllm:external_prefix_cache_hits_total")
    assert pulled == len(prefix) or (retried and pulled == 2 * len(prefix)), (pulled, first.reason)

    # The view shows the copy on B: the executor published no KV event, B's bridge did (B's own events).
    await until("the prefix on B in the view, from B's events", lambda: _eq(held(B), blocks), timeout=30)
    assert await held(A) == blocks

    # The prompt on B now hits B's own prefix cache for every replicated block.
    r = await http.post(f"{b.url}/v1/completions", json={"model": b.model, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    b2 = await scrape(http, b)
    hits = metric(b2, "vllm:prefix_cache_hits_total") - metric(b1, "vllm:prefix_cache_hits_total")
    assert hits == len(prefix)
    assert metric(b2, "vllm:nixl_xfer_time_seconds_count") == metric(b1, "vllm:nixl_xfer_time_seconds_count")


async def _eq(value: Any, expected: Any) -> bool:
    return await value == expected
