"""The shared KV pool on a real Mooncake Store (marker ``mooncake``: `scripts/test -m mooncake`).

Needs ``pip install '.[mooncake]'`` (the non-CUDA wheel) and Debian's ``libibverbs1``; every
test here is skipped, with the reason, when the client does not load. The same engine paths
with a dict in place of the store: tests/unit/test_pool.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conductor.bridge.publisher import EventPublisher
from conductor.bridge.runner import Bridge, BridgeConfig, kafka_sink
from conductor.bridge.serve import commands_for
from conductor.costmodel.profiles import load_profile
from conductor.harness.dispatch import Assignment, decisions_for
from conductor.harness.engine.emulated import EmulatedEngine, EngineConfig
from conductor.harness.engine.executor import EngineCommandExecutor
from conductor.harness.engine.pool import POOL_NODE, LocalMaster, MooncakePool, PoolIndex, PoolLink, object_key
from conductor.settings import Settings
from schemas import (
    KvCommand,
    KvCommandResult,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
    envelope,
    headers,
)
from state.redis_view import RedisViewStore
from streams.kafka import consumer, ensure_topics, producer
from streams.topics import topics
from tests.integration import waiting
from tests.integration.test_balance_loop import _stop
from tests.integration.test_e2e import _start

pytestmark = [pytest.mark.mooncake]

MB = 1 << 20


def _client_loads() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or OSError for a missing libibverbs.so.1)
        return f"the Mooncake Store client does not load ({e}): pip install '.[mooncake]'; apt-get install libibverbs1"
    return None


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    """A mooncake_master on free loopback ports, leases of 200 ms (so a test can watch one end)."""
    why = _client_loads()
    if why is not None:
        pytest.skip(why)
    m = LocalMaster(lease_ms=200, log_path=tmp_path / "master.log")
    try:
        yield m.start()
    finally:
        m.stop()


def test_the_client_puts_reads_and_removes_real_blocks(master: str) -> None:
    pool = MooncakePool.connect(master, block_size_bytes=MB, segment_bytes=16 * MB)
    try:
        keys = [0x1000 + i for i in range(4)]
        assert pool.put_blocks(keys) == (keys, False)
        assert pool.read_prefix(keys) == 4 and pool.holds(keys) == [True] * 4
        assert pool.read_prefix([keys[0], 0xDEAD, keys[2]]) == 1  # a prefix stops at the first block missing
        assert pool.store.get_size(object_key(keys[0])) == MB
        assert pool.remove_blocks(keys[:2]) == keys[:2]  # forced: the fresh objects' lease would refuse
        assert pool.holds(keys) == [False, False, True, True]
        # More than the segment holds: the pool answers -200 and the client stops there.
        many = [0x2000 + i for i in range(40)]
        done, full = pool.put_blocks(many)
        assert full and 0 < len(done) < len(many) and done == many[: len(done)]
    finally:
        pool.close()


def test_two_clients_share_the_pool(master: str) -> None:
    """What one engine puts, another reads back (objects are named by Conductor's block keys)."""
    a = MooncakePool.connect(master, block_size_bytes=MB, segment_bytes=16 * MB)
    b = MooncakePool.connect(master, block_size_bytes=MB, segment_bytes=16 * MB)
    try:
        keys = [0x3000 + i for i in range(3)]
        a.put_blocks(keys)
        assert b.read_prefix(keys) == 3
    finally:
        a.close()
        b.close()


@pytest.mark.integration
async def test_an_offloaded_prefix_is_indexed_in_the_view_and_read_back_from_the_pool(
    master: str, settings: Settings, tmp_path: Path
) -> None:
    """p0 (8 HBM blocks, no host memory) computes prefix A, then B evicts A into the pool: the
    view shows A on the store node; the next request for A is routed to read it from the pool
    and the engine reads its bytes back (the model's real block size)."""
    s = settings.model_copy(update={"policy": "kvcache-centric"})
    procs = _start(s, tmp_path, ["worker"], ["router"])
    tps = topics(s.topic_config())
    await ensure_topics(s.kafka(), tps.all())
    prod = producer(s.kafka())
    await prod.start()
    profile = load_profile(s.model_profile)
    bs = s.block_size
    block = bs * profile.kv_bytes_per_token
    stop = asyncio.Event()
    tasks: list[asyncio.Task[object]] = []
    pubs: list[EventPublisher] = []
    reports = {n: io.StringIO() for n in ("p0", "d0")}
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    client = MooncakePool.connect(master, block_size_bytes=block, segment_bytes=256 * MB)
    link = PoolLink(client, PoolIndex("p0", epoch=int(time.time() * 1000), capacity_blocks=client.capacity_blocks,
                                      heartbeat_s=0.3),
                    events=kafka_sink(prod, tps.kv_events.name), heartbeats=kafka_sink(prod, tps.heartbeats.name))
    watch = consumer(s.kafka(), tps.dispatch.name, group_id=None, fetch_max_wait_ms=50)
    engines: dict[str, EmulatedEngine] = {}

    async def wait_for(what: str, probe, timeout: float = 40.0):  # type: ignore[no-untyped-def]
        return await waiting.wait_for(what, probe, dict(zip(("worker", "router"), procs)), tmp_path, timeout=timeout)

    def done(node: str, rid: str) -> dict | None:  # type: ignore[type-arg]
        for line in reports[node].getvalue().splitlines():
            row = json.loads(line)
            if row["event"] == "prefill_done" and row["request_id"] == rid:
                return row  # type: ignore[no-any-return]
        return None

    try:
        for node, role in (("p0", "prefill"), ("d0", "decode")):
            pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            pubs.append(pub)
            eng = engines[node] = EmulatedEngine(
                EngineConfig(node_id=node, role=role, block_size=bs, kv_blocks=8 if node == "p0" else 4096,  # type: ignore[arg-type]
                             time_scale=100.0, heartbeat_s=0.3, max_output_tokens=2),
                profile, pub, heartbeat_sink=kafka_sink(prod, tps.heartbeats.name), report=reports[node],
                pool=link if node == "p0" else None,
            )
            bridge = Bridge(BridgeConfig(node_id=node, role=role, zmq_endpoint=pub.endpoint,  # type: ignore[arg-type]
                                         replay_endpoint=pub.replay_endpoint, block_size=bs, heartbeat_s=None),
                            kafka_sink(prod, tps.kv_events.name))
            tasks.append(asyncio.create_task(eng.run(decisions_for(s, node, stop=stop))))
            tasks.append(asyncio.create_task(bridge.run(stop)))

        async def live() -> bool:
            now = time.time_ns() // 1_000_000
            live = {n.node_id for n in await view.nodes() if n.is_live(now, s.heartbeat_ttl_s)}
            return live >= {"p0", "d0", POOL_NODE} and (await view.view_health())[0]

        await wait_for("p0, d0 and the pool live in the view", live)
        a = [(13 * i + 1) % 30_000 for i in range(8 * bs)]
        b = [(17 * i + 3) % 30_000 for i in range(8 * bs)]
        for rid, toks in (("a", a), ("b", b)):  # accepted work: B pushes A out of HBM, into the pool
            req = RoutingRequest(request_id=rid, token_ids=toks, prompt_tokens=len(toks))
            d = RoutingDecision(request_id=rid, prefill_instance="p0", decode_instance="d0", reused_tokens=0,
                                predicted_ttft_s=0.0, predicted_tbt_ms=20, policy="test")
            engines["p0"].submit(Assignment(d, req, 0, 0, prefill=True, decode=False))
        keys = chain_keys(a, bs)

        async def in_pool() -> bool:
            snap = await view.snapshot(keys)
            return snap.prefix.get(POOL_NODE, (0, 0, 0))[1] == len(keys) and snap.prefix.get("p0", (0, 0, 0))[1] == 0

        await wait_for("A in the pool (and no longer on p0) in the view", in_pool)
        assert client.holds(keys) == [True] * len(keys) and link.counts["blocks_put"] == len(keys)

        await watch.start()
        req = RoutingRequest(request_id="again", token_ids=a + [5, 5], prompt_tokens=len(a) + 2,
                             expected_output_tokens=2)
        env = envelope(req, producer_id="pool-test", producer_seq=0, ts_ms=time.time_ns() // 1_000_000)
        await prod.send_and_wait(tps.requests.name, encode(env), key=b"again", headers=headers(env))
        decisions: dict[str, RoutingDecision] = {}

        async def decided() -> RoutingDecision | None:
            for recs in (await watch.getmany(timeout_ms=100)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    assert not isinstance(body, RoutingRejection), body
                    if isinstance(body, RoutingDecision):
                        decisions[body.request_id] = body
            return decisions.get("again")

        dec = await wait_for("the decision", decided)
        assert (dec.prefill_instance, dec.reuse_source, dec.reused_tokens) == ("p0", POOL_NODE, len(a)), dec
        row = await wait_for("the prefill", lambda: asyncio.sleep(0, done("p0", "again")))
        assert row["pool_cached_tokens"] == len(a) and row["cached_tokens"] == len(a)
        assert link.counts["blocks_read"] == len(keys) and link.counts["blocks_missing"] == 0
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await watch.stop()
        for p in pubs:
            await p.close()
        await prod.stop()
        await view.close()
        client.close()
        _stop({str(i): p for i, p in enumerate(procs)})


class PoolCluster:
    """The stream worker and router (and whatever else ``commands`` names) as real commands,
    prefill engines p0 and p1 both joined to the pool (each with its own segment, bridge and
    KV command executor) and decode engine d0, all in this process; and a watch on
    ``dispatch``, ``kv-commands`` and ``kv-command-results``."""

    def __init__(self, master: str, s: Settings, tmp_path: Path, *commands: list[str]) -> None:
        self.master, self.s, self.tmp_path = master, s, tmp_path
        self.procs = _start(s, tmp_path, ["worker"], ["router"], *commands)
        self.names = ["worker", "router", *(c[0] for c in commands)]
        self.tps = topics(s.topic_config())
        self.prod = producer(s.kafka())
        self.profile = load_profile(s.model_profile)
        self.block = s.block_size * self.profile.kv_bytes_per_token
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[object]] = []
        self.pubs: list[EventPublisher] = []
        self.reports = {n: io.StringIO() for n in ("p0", "p1", "d0")}
        self.view = RedisViewStore.connect(s.redis(), s.view_namespace)
        self.clients: dict[str, MooncakePool] = {}
        self.links: dict[str, PoolLink] = {}
        self.engines: dict[str, EmulatedEngine] = {}
        self.watch = consumer(s.kafka(), self.tps.dispatch.name, self.tps.kv_commands.name, self.tps.kv_command_results.name,
                              group_id=None, fetch_max_wait_ms=50)
        self.decisions: dict[str, RoutingDecision] = {}
        self.commands: list[KvCommand] = []
        self.results: list[KvCommandResult] = []

    async def start(self) -> None:
        s, tps = self.s, self.tps
        await ensure_topics(s.kafka(), tps.all())
        await self.prod.start()
        await self.watch.start()
        epoch = int(time.time() * 1000)
        for node, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
            pool = None
            if role == "prefill":
                client = self.clients[node] = MooncakePool.connect(self.master, block_size_bytes=self.block,
                                                                   segment_bytes=128 * MB)
                pool = self.links[node] = PoolLink(
                    client, PoolIndex(node, epoch=epoch, capacity_blocks=client.capacity_blocks, heartbeat_s=0.3),
                    events=kafka_sink(self.prod, tps.kv_events.name),
                    heartbeats=kafka_sink(self.prod, tps.heartbeats.name))
            pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            self.pubs.append(pub)
            eng = self.engines[node] = EmulatedEngine(
                EngineConfig(node_id=node, role=role, block_size=s.block_size, kv_blocks=4096,  # type: ignore[arg-type]
                             time_scale=100.0, heartbeat_s=0.3, max_output_tokens=2),
                self.profile, pub, heartbeat_sink=kafka_sink(self.prod, tps.heartbeats.name),
                report=self.reports[node], pool=pool,
            )
            bridge = Bridge(BridgeConfig(node_id=node, role=role, zmq_endpoint=pub.endpoint,  # type: ignore[arg-type]
                                         replay_endpoint=pub.replay_endpoint, block_size=s.block_size,
                                         heartbeat_s=None),
                            kafka_sink(self.prod, tps.kv_events.name))
            self.tasks.append(asyncio.create_task(eng.run(decisions_for(s, node, stop=self.stop))))
            self.tasks.append(asyncio.create_task(bridge.run(self.stop)))
            if role == "prefill":
                executor = EngineCommandExecutor(eng, kafka_sink(self.prod, tps.kv_command_results.name))
                self.tasks.append(asyncio.create_task(executor.run(commands_for(s, node, stop=self.stop))))

        async def live() -> bool:
            now = time.time_ns() // 1_000_000
            live = {n.node_id for n in await self.view.nodes() if n.is_live(now, s.heartbeat_ttl_s)}
            return live >= {"p0", "p1", "d0", POOL_NODE} and (await self.view.view_health())[0]

        await self.wait_for("p0, p1, d0 and the pool live in the view", live)

    async def close(self) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.watch.stop()
        for p in self.pubs:
            await p.close()
        await self.prod.stop()
        await self.view.close()
        for c in self.clients.values():
            c.close()
        _stop({str(i): p for i, p in enumerate(self.procs)})

    async def wait_for(self, what: str, probe, timeout: float = 40.0):  # type: ignore[no-untyped-def]
        async def read_then_probe():  # type: ignore[no-untyped-def]
            await self.read_watch()
            return await probe()

        return await waiting.wait_for(what, read_then_probe, dict(zip(self.names, self.procs)), self.tmp_path,
                                      timeout=timeout)

    async def read_watch(self) -> None:
        for recs in (await self.watch.getmany(timeout_ms=50)).values():
            for rec in recs:
                body = decode(rec.value).body
                assert not isinstance(body, RoutingRejection), body
                if isinstance(body, RoutingDecision):
                    self.decisions[body.request_id] = body
                elif isinstance(body, KvCommand):
                    self.commands.append(body)
                elif isinstance(body, KvCommandResult):
                    self.results.append(body)

    def prefill_done(self, node: str, rid: str) -> dict | None:  # type: ignore[type-arg]
        for line in self.reports[node].getvalue().splitlines():
            row = json.loads(line)
            if row["event"] == "prefill_done" and row["request_id"] == rid:
                return row  # type: ignore[no-any-return]
        return None

    async def compute(self, node: str, rid: str, tokens: list[int]) -> None:
        """``node`` prefills ``tokens`` (work it accepted, not routed); wait until the view has them."""
        req = RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens))
        d = RoutingDecision(request_id=rid, prefill_instance=node, decode_instance="d0", reused_tokens=0,
                            predicted_ttft_s=0.0, predicted_tbt_ms=20, policy="test")
        self.engines[node].submit(Assignment(d, req, 0, 0, prefill=True, decode=False))
        keys = chain_keys(tokens, self.s.block_size)

        async def there() -> bool:
            return (await self.view.snapshot(keys)).prefix.get(node, (0, 0, 0))[0] == len(keys)

        await self.wait_for(f"{rid} in {node}'s HBM in the view", there)

    async def send(self, topic: str, body: object, key: bytes, seq: int = 0) -> None:
        env = envelope(body, producer_id="pool-test", producer_seq=seq, ts_ms=time.time_ns() // 1_000_000)
        await self.prod.send_and_wait(topic, encode(env), key=key, headers=headers(env))

    async def in_pool(self, keys: list[int]) -> bool:
        return (await self.view.snapshot(keys)).prefix.get(POOL_NODE, (0, 0, 0))[1] == len(keys)


@pytest.mark.integration
async def test_a_replicate_into_the_pool_is_pushed_by_the_holder_and_read_by_another_instance(
    master: str, settings: Settings, tmp_path: Path
) -> None:
    """The balance executor's replicate to the pool is real puts: p0 computes prefix A; a
    ``replicate`` A → the pool (by p0, its holder) on ``kv-commands``, delivered twice, is
    carried out once by p0's executor (puts into the Mooncake Store) and answered ``done``
    twice on ``kv-command-results``; the view shows A on the pool node (p0 keeps its copy); a
    request that must not go to p0 (its ``exclude``, so p0's HBM is no source either) is
    decided on p1 reading A from the pool, and p1 reads the bytes back."""
    c = PoolCluster(master, settings.model_copy(update={"policy": "kvcache-centric"}), tmp_path)
    try:
        await c.start()
        bs = settings.block_size
        a = [(13 * i + 1) % 30_000 for i in range(8 * bs)]
        keys = chain_keys(a, bs)
        await c.compute("p0", "a", a)
        cmd = KvCommand(command_id="rep-pool-it", action="replicate", block_keys=keys, from_node="p0", from_tier="hbm",
                        to_node=POOL_NODE, to_tier="dram", by_node="p0",
                        deadline_ms=time.time_ns() // 1_000_000 + 30_000, reason="integration test")
        for i in range(2):  # delivered twice: carried out once
            await c.send(c.tps.kv_commands.name, cmd, cmd.executor.encode(), seq=i)

        async def answered() -> list[KvCommandResult] | None:
            got = [r for r in c.results if r.command_id == cmd.command_id]
            return got if len(got) >= 2 else None

        first, second = await c.wait_for("two kv-command-results for the command", answered)
        assert (first.node, first.status, first.blocks, first.bytes_moved) == ("p0", "done", len(keys),
                                                                               len(keys) * c.block), first
        assert second == first  # the repeat got the first answer
        assert c.clients["p0"].holds(keys) == [True] * len(keys)
        assert c.links["p0"].counts["blocks_put"] == len(keys)  # put once

        async def in_pool_and_on_p0() -> bool:
            return await c.in_pool(keys) and (await c.view.snapshot(keys)).prefix["p0"][0] == len(keys)

        await c.wait_for("A on the pool node (and still on p0) in the view", in_pool_and_on_p0)

        again = RoutingRequest(request_id="elsewhere", token_ids=a + [5, 5], prompt_tokens=len(a) + 2,
                               expected_output_tokens=2, exclude=["p0"])
        await c.send(c.tps.requests.name, again, b"elsewhere")
        dec = await c.wait_for("the decision", lambda: asyncio.sleep(0, c.decisions.get("elsewhere")))
        assert (dec.prefill_instance, dec.reuse_source, dec.reuse_tier, dec.reused_tokens) == (
            "p1", POOL_NODE, "dram", len(a)), dec
        row = await c.wait_for("p1's prefill", lambda: asyncio.sleep(0, c.prefill_done("p1", "elsewhere")))
        assert row["pool_cached_tokens"] == len(a) and row["cached_tokens"] == len(a)
        assert c.links["p1"].counts["blocks_read"] == len(keys) and c.links["p1"].counts["blocks_missing"] == 0
    finally:
        await c.close()


@pytest.mark.integration
async def test_the_balance_worker_copies_a_prefix_hot_on_two_instances_into_the_pool(
    master: str, settings: Settings, tmp_path: Path
) -> None:
    """The closed loop with the real ``conductor balance``: A is held whole by p0 and p1 and
    requested six times (over the hot threshold of 4, so that requests straddling a heat window's
    boundary still count past it); the planner's pool rule (held by two instances)
    publishes a ``replicate`` into the pool keyed by the least loaded holder, which pushes it
    (real puts), answers ``done``, and the view shows A on the pool node."""
    s = settings.model_copy(update={"policy": "kvcache-centric",
                                    "balance_params": {"hot_threshold": 4, "cooldown_s": 120}})
    c = PoolCluster(master, s, tmp_path, ["balance", "--interval", "0.3"])
    try:
        await c.start()
        bs = settings.block_size
        a = [(7 * i + 5) % 30_000 for i in range(8 * bs)]
        keys = chain_keys(a, bs)
        await c.compute("p0", "a0", a)
        await c.compute("p1", "a1", a)
        for i in range(6):
            req = RoutingRequest(request_id=f"hot-{i}", token_ids=a + [i, i], prompt_tokens=len(a) + 2,
                                 expected_output_tokens=2)
            await c.send(c.tps.requests.name, req, req.request_id.encode(), seq=i)

        async def copied() -> KvCommandResult | None:
            cmds = [x for x in c.commands if x.to_node == POOL_NODE]
            ids = {x.command_id for x in cmds}
            return next((r for r in c.results if r.command_id in ids), None)

        result = await c.wait_for("a replicate into the pool, answered", copied)
        [cmd] = [x for x in c.commands if x.command_id == result.command_id]
        assert (cmd.action, cmd.block_keys, cmd.to_tier) == ("replicate", keys, "dram")
        assert cmd.by_node in ("p0", "p1") and cmd.executor == cmd.by_node == cmd.from_node
        assert "held by 2 instances" in cmd.reason
        assert (result.node, result.status, result.blocks) == (cmd.by_node, "done", len(keys)), result
        assert c.clients[cmd.by_node].holds(keys) == [True] * len(keys)
        await c.wait_for("A on the pool node in the view", lambda: c.in_pool(keys))
    finally:
        await c.close()
