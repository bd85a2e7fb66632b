"""Fault scenarios against a real stream worker, checked pair by pair against an independent truth.

``conductor chaos --scenario NAME --json`` and the fault suite (``tests/faults``) run the same
scenarios. Each run starts a Valkey of its own (so it can be flushed, killed and restarted on
the same port without touching anyone else's data) beside a Kafka-compatible broker, a
``conductor worker`` subprocess, and :class:`TruthEngines`: engines that store and evict
random blocks and know, independently of Conductor, which (node, block) pairs must be in the
view. The fault is injected while the stream is being published; the run then waits until the
view holds exactly the true pairs and says it is healthy (``ns|gen`` present, nothing left in
``ns|rebuild``).

Reported per run: ``pairs_lost`` (true pairs missing from the view), ``pairs_extra`` (pairs in
the view that are not true), ``recovery_s`` (seconds from the fault to the view equal to the
truth and healthy; the rest of the stream is published meanwhile), ``converged``.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port, redis_ready
from conductor.harness.valkey_cluster import ValkeyProcess
from conductor.settings import load_settings
from schemas import BlocksRemoved, BlocksStored, DecodeError, Envelope, Heartbeat, decode, encode, envelope
from schemas.errors import ViewStoreError
from state.redis_view import RedisViewStore
from streams.kafka import ensure_topics, producer
from streams.topics import Topics, topics


class OwnValkey(ValkeyProcess):
    """A Valkey server of this run's own, started without blocking the loop: flushed, killed and
    restarted empty on the same port."""

    async def start(self) -> None:  # type: ignore[override]
        self.spawn()
        await redis_ready(self.url, 10.0)

    async def restart_empty(self, down_s: float = 1.0) -> None:
        """SIGKILL, stay down ``down_s``, start again on the same port with nothing in it."""
        self.kill()
        await asyncio.sleep(down_s)
        await self.start()

    async def flushall(self) -> None:
        c = aioredis.from_url(self.url)
        try:
            await c.flushall()
        finally:
            await c.aclose()


class Relay:
    """A TCP relay on a port of its own to a Valkey port: what a virtual IP or a Sentinel-managed
    name is to clients (:meth:`switch` points it elsewhere and drops the open connections), and a
    replication link that can be made to lag (:meth:`hold`: what the upstream sends is no longer
    passed on; a primary killed meanwhile takes it with it)."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.port, self.upstream = host, free_port(host), upstream_port
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._dropped = False

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.upstream)
        except OSError:
            writer.close()
            return
        self._conns |= {writer, up_w}
        try:
            await asyncio.gather(self._pipe(reader, up_w, held=False), self._pipe(up_r, writer, held=True))
        except asyncio.CancelledError:  # the run's loop is ending
            pass
        finally:
            for w in (writer, up_w):
                self._conns.discard(w)
                w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, held: bool) -> None:
        try:
            while data := await src.read(1 << 16):
                if held:
                    await self._flowing.wait()
                    if self._dropped:  # what was held back is never delivered
                        return
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            dst.close()

    def hold(self) -> None:
        self._flowing.clear()

    def switch(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self._flowing.set()
        for w in list(self._conns):
            w.close()

    def stop(self) -> None:
        self._dropped = True
        for w in list(self._conns):
            w.close()
        self._flowing.set()
        if self._server is not None:
            self._server.close()


class FailoverPair:
    """A primary and its replica (``REPLICAOF`` through a :class:`Relay` that can make it lag),
    and the one address clients use (another relay, on the primary until :meth:`fail_over`)."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        self.primary = OwnValkey(data_dir / "primary", host=host)
        self.replica = OwnValkey(data_dir / "replica", host=host)
        self.host = host
        self.link: Relay | None = None
        self.vip: Relay | None = None

    @property
    def url(self) -> str:
        assert self.vip is not None
        return self.vip.url

    async def start(self) -> None:
        await self.primary.start()
        await self.replica.start()
        self.link, self.vip = Relay(self.primary.port, self.host), Relay(self.primary.port, self.host)
        await self.link.start()
        await self.vip.start()
        r = aioredis.from_url(self.replica.url)
        try:
            await r.replicaof(self.host, self.link.port)
            deadline = time.monotonic() + 10
            while (await r.info("replication")).get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica never synced with its primary")
                await asyncio.sleep(0.05)
        finally:
            await r.aclose()

    async def wait_rebuilt(self, timeout_s: float = 60.0) -> None:
        """Until no view on the primary lists partitions being rebuilt."""
        p = aioredis.from_url(self.primary.url)
        try:
            deadline = time.monotonic() + timeout_s
            while [k async for k in p.scan_iter(match="*|rebuild")]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the view was still being rebuilt from the log")
                await asyncio.sleep(0.1)
        finally:
            await p.aclose()

    async def fail_over(self, lag_s: float = 0.5) -> dict[str, Any]:
        """Make the replica lag (the link held), let the primary take ``lag_s`` of writes, kill it,
        promote the replica (``REPLICAOF NO ONE``) and point the clients' address at it. Returns
        what the replica did not get: ``wait_acked`` (``WAIT 1 100`` on the primary: replicas that
        had everything) and ``fence_records_lost`` (fenced records the promoted view lacks)."""
        assert self.link is not None and self.vip is not None
        self.link.hold()
        await asyncio.sleep(lag_s)
        p = aioredis.from_url(self.primary.url, single_connection_client=True)
        try:
            await p.set("chaos|probe", 1)  # WAIT counts the replicas that have this client's last write
            acked = int(await p.wait(1, 100))
            before = _fence_total(await _all_fences(p))
        finally:
            await p.aclose()
        self.primary.kill()
        self.link.stop()
        r = aioredis.from_url(self.replica.url)
        try:
            await r.replicaof("NO", "ONE")
            after = _fence_total(await _all_fences(r))
            rebuilding = [k async for k in r.scan_iter(match="*|rebuild")]
        finally:
            await r.aclose()
        self.vip.switch(self.replica.port)
        return {"wait_acked": acked, "fence_records_lost": before - after, "rebuild_marked": len(rebuilding)}

    def stop(self) -> None:
        for relay in (self.vip, self.link):
            if relay is not None:
                relay.stop()
        self.primary.stop()
        self.replica.stop()


async def _all_fences(client: Any) -> dict[str, int]:
    """Every fence of every view namespace on one server."""
    out: dict[str, int] = {}
    async for key in client.scan_iter(match="*|wm"):
        for k, v in (await client.hgetall(key)).items():
            out[f"{key!r}:{k!r}"] = int(v)
    return out


def _fence_total(fences: dict[str, int]) -> int:
    return sum(v + 1 for v in fences.values())


class TruthEngines:
    """Engines storing random blocks and evicting their oldest, each node's sequence in order;
    :meth:`pairs` is what the view must hold, known without Conductor."""

    def __init__(self, seed: int, *, nodes: int = 6, max_store: int = 24, max_remove: int = 12,
                 node_prefix: str = "node-", clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.rng = random.Random(seed)
        self.held: dict[str, list[int]] = {f"{node_prefix}{i}": [] for i in range(nodes)}
        self.seq = dict.fromkeys(self.held, 0)
        self.max_store, self.max_remove = max_store, max_remove
        self.clock_ms = clock_ms

    def take(self, n: int) -> list[Envelope]:
        rng, out = self.rng, []
        for _ in range(n):
            node = rng.choice(sorted(self.held))
            held = self.held[node]
            if held and rng.random() < 0.3:
                body: Any = BlocksRemoved(block_keys=[held.pop(0) for _ in range(min(len(held), rng.randint(1, self.max_remove)))])
            else:
                keys = [rng.getrandbits(63) for _ in range(rng.randint(1, self.max_store))]
                held += keys
                body = BlocksStored(block_keys=keys)
            out.append(envelope(body, producer_id=node, producer_seq=self.seq[node], ts_ms=self.clock_ms()))
            self.seq[node] += 1
        return out

    def pairs(self) -> set[tuple[str, int]]:
        return {(node, k) for node, keys in self.held.items() for k in keys}


async def view_pairs(store: RedisViewStore) -> set[tuple[str, int]]:
    """Every (node, block) pair the view holds, in any tier."""
    dump = await store.dump()
    return {(node, int(k, 16)) for k, holders in dump["blocks"].items() for node in holders}


@dataclass
class RunResult:
    scenario: str
    pairs_lost: int = 0
    pairs_extra: int = 0
    recovery_s: float | None = None
    converged: bool = False
    records: int = 0
    true_pairs: int = 0
    generations: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


Fault = Callable[["Run"], Awaitable[None]]


@dataclass
class Run:
    valkey: OwnValkey
    settings: Any
    worker: subprocess.Popen[bytes]
    work_dir: Path
    prod: Any = None
    sent: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    """(topic, key, value) of every good record sent so far (the duplicates scenario re-sends them)."""
    bad: int = 0
    """Bad records injected (the bad-records scenario)."""
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Further workers of the same group (the two-workers scenario)."""
    silent: set[str] = field(default_factory=set)
    """Nodes that stopped heartbeating (the silent-node scenario)."""
    skew_ms: dict[str, int] = field(default_factory=dict)
    """Node → how far ahead its heartbeats are stamped (the skewed-clock scenario)."""
    publish: Callable[[int], Awaitable[None]] | None = None
    """Publish n more records of the truth (the failover scenarios write during the lag)."""
    detail: dict[str, Any] = field(default_factory=dict)
    """What the fault reports (into the result's detail)."""


CORPUS = Path(__file__).resolve().parents[2] / "tests" / "faults" / "corpus" / "bad_records.jsonl"
"""The checked-in corpus of hostile and broken records (``tests/faults/corpus/make_corpus.py``)."""
OVERSIZED_BYTES = 1_200_000


def bad_records(corpus: Path = CORPUS, seed: int = 0) -> list[tuple[str, bytes]]:
    """(``kv`` | ``hb``, bytes): the corpus, plus oversized records (> 1 MB: one that does not
    decode, one valid envelope padded past the limit) and fuzzed copies of valid ones."""
    rng = random.Random(seed)
    out = [(d["topic"], bytes.fromhex(d["hex"])) for d in map(json.loads, corpus.read_text().splitlines())]
    out.append(("kv", b"\x92" + rng.randbytes(OVERSIZED_BYTES)))
    pad = encode(envelope(BlocksStored(block_keys=[1]), producer_id="node-0", producer_seq=0, ts_ms=1))
    out.append(("kv", pad + b"\x00" * OVERSIZED_BYTES))
    good = encode(envelope(BlocksStored(block_keys=[7, 8, 9]), producer_id="node-1", producer_seq=1, ts_ms=1))
    fuzzed = 0
    while fuzzed < 50:  # bit flips of a valid record; a flip that still decodes is a valid record, not a bad one
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        try:
            decode(bytes(b))
        except DecodeError:
            out.append(("kv", bytes(b)))
            fuzzed += 1
    return out


async def _flushall(run: Run) -> None:
    await run.valkey.flushall()


async def _restart_empty(run: Run) -> None:
    await run.valkey.restart_empty()


async def _sigkill_worker(run: Run) -> None:
    run.worker.send_signal(signal.SIGKILL)
    run.worker.wait()
    run.worker = start_worker_process(run.settings, run.work_dir / "worker2.log")


async def _bad_records(run: Run) -> None:
    t = topics(run.settings.topic_config())
    big = producer(run.settings.kafka(), max_request_size=4 << 20)
    await big.start()
    try:
        for i, (topic, raw) in enumerate(bad_records()):
            name = t.kv_events.name if topic == "kv" else t.heartbeats.name
            await big.send(name, raw, key=f"node-{i % 6}".encode())
            run.bad += 1
        await big.flush()
    finally:
        await big.stop()


async def _duplicates(run: Run) -> None:
    for topic, key, value in list(run.sent):  # everything so far, once more
        await run.prod.send(topic, value, key=key)
    await run.prod.flush()


async def _kill_one_of_two(run: Run) -> None:
    run.worker.send_signal(signal.SIGKILL)  # its partitions go to the other worker at the rebalance
    run.worker.wait()
    run.worker = run.others.pop()


async def _silent_node(run: Run) -> None:
    run.silent.add("node-4")


async def _skewed_clock(run: Run) -> None:
    run.skew_ms["node-5"] = 3_600_000  # an hour ahead: it must not keep node-5 live


async def _failover(run: Run) -> None:
    """The replica lags while a burst is applied on the primary, which is then killed; the rest
    of the stream follows (``failover``: the first write after it does not continue from the
    promoted view's fence) or nothing more comes (``failover-quiet``: only the fences, moved
    back under the same generation, say the view lost that burst)."""
    assert isinstance(run.valkey, FailoverPair) and run.publish is not None
    assert run.valkey.link is not None
    await run.valkey.wait_rebuilt()  # else the replica would carry the start-up's own rebuild marks
    run.valkey.link.hold()
    await run.publish(300)
    run.detail.update(await run.valkey.fail_over(lag_s=1.5))


EXPECT_DEAD = {"silent-node": "node-4", "skewed-clock": "node-5"}
"""Scenarios after which a node must stop being live within the heartbeat TTL."""


SCENARIOS: dict[str, tuple[Fault, bool]] = {
    # name → (fault, injected while the stream is published (True) or after it was all applied (False))
    "redis-flushall": (_flushall, True),
    "redis-flushall-quiet": (_flushall, False),
    "redis-restart-empty": (_restart_empty, True),
    "worker-sigkill": (_sigkill_worker, True),
    "bad-records": (_bad_records, True),
    "duplicates": (_duplicates, True),
    "two-workers-one-killed": (_kill_one_of_two, True),
    "silent-node": (_silent_node, True),
    "skewed-clock": (_skewed_clock, True),
    "failover": (_failover, True),
    "failover-quiet": (_failover, False),
}
HEARTBEAT_TTL_S = 3.0


async def run_scenario(
    name: str, kafka_url: str, work_dir: Path, *, records: int = 3000, seed: int = 1, timeout_s: float = 120.0,
) -> RunResult:
    """One run of scenario ``name`` against the broker at ``kafka_url``; see the module docstring."""
    fault, mid_stream = SCENARIOS[name]
    tag = uuid.uuid4().hex[:8]
    valkey: Any = FailoverPair(work_dir / "valkey") if name.startswith("failover") else OwnValkey(work_dir / "valkey")
    await valkey.start()
    s = load_settings(kafka_url=kafka_url, redis_url=valkey.url, profile="embedded", topic_prefix=f"c{tag}.",
                      view_namespace=f"c{tag}", partitions=2, web_port=free_port(), data_dir=work_dir / "d",
                      heartbeat_ttl_s=HEARTBEAT_TTL_S)
    t = topics(s.topic_config())
    await ensure_topics(s.kafka(), t.all())
    truth = TruthEngines(seed)
    res = RunResult(name, records=records)
    store = RedisViewStore.connect(s.redis(), s.view_namespace)
    prod = producer(s.kafka())
    await prod.start()
    run = Run(valkey, s, start_worker_process(s, work_dir / "worker.log"), work_dir, prod)
    if name == "two-workers-one-killed":
        run.others.append(start_worker_process(s.model_copy(update={"web_port": free_port()}), work_dir / "worker-b.log"))
    try:
        publish = run.publish = _TruthPublisher(truth, t, run)
        first = records // 2 if mid_stream else records
        await publish(first)
        # the fault lands once the worker is busy applying (mid-batch) or, quiet, once all is applied
        await _wait_applied(store, t.kv_events.name, first // 3 if mid_stream else first, timeout_s, run)
        t_fault = time.monotonic()
        await fault(run)
        if mid_stream:
            await publish(records - first)
        want = truth.pairs()
        res.true_pairs = len(want)
        got = await _converge(store, want, t_fault, timeout_s, res)
        dead = EXPECT_DEAD.get(name)
        if dead is not None:
            await _expect_dead(store, dead, t_fault, res)
        await _tally(res, run, store, want, got)
    finally:
        for w in [run.worker, *run.others]:
            stop_worker_process(w)
        await prod.stop()
        try:
            await store.close()
        finally:
            valkey.stop()
    return res


class _TruthPublisher:
    """Publishes the truth's next records on ``kv-events`` (each good one noted in ``run.sent``),
    every engine but the silent ones heartbeating once per chunk, stamped with its skew."""

    def __init__(self, truth: TruthEngines, t: Topics, run: Run) -> None:
        self.truth, self.topics, self.run = truth, t, run
        self.hb_seq: dict[str, int] = {}

    async def __call__(self, n: int, chunk: int = 100) -> None:
        truth, run, prod = self.truth, self.run, self.run.prod
        kv_topic, hb_topic = self.topics.kv_events.name, self.topics.heartbeats.name
        for i in range(0, n, chunk):
            for e in truth.take(min(chunk, n - i)):
                raw, key = encode(e), e.producer_id.encode()
                run.sent.append((kv_topic, key, raw))
                await prod.send(kv_topic, raw, key=key)
            now = int(time.time() * 1000)
            for node in sorted(truth.held):  # every engine heartbeats once per chunk
                if node not in run.silent:
                    self.hb_seq[node] = self.hb_seq.get(node, -1) + 1
                    hb = envelope(Heartbeat(role="prefill"), producer_id=node, producer_seq=self.hb_seq[node],
                                  ts_ms=now + run.skew_ms.get(node, 0))
                    await prod.send(hb_topic, encode(hb), key=node.encode())
            await prod.flush()
            await asyncio.sleep(0.01)


async def _wait_applied(store: RedisViewStore, topic: str, want_applied: int, timeout_s: float, run: Run) -> None:
    """Until the view has applied ``want_applied`` records of ``topic``; RuntimeError past the
    timeout or when the worker exits."""
    deadline = time.monotonic() + timeout_s
    while await _applied(store, topic) < want_applied:
        if time.monotonic() > deadline or run.worker.poll() is not None:
            raise RuntimeError(f"the worker never applied {want_applied} records (see {run.work_dir / 'worker.log'})")
        await asyncio.sleep(0.02)


async def _converge(store: RedisViewStore, want: set[tuple[str, int]], t_fault: float, timeout_s: float,
                    res: RunResult) -> set[tuple[str, int]]:
    """Wait for a healthy view holding exactly ``want`` (``res.converged``, ``res.recovery_s``);
    the pairs it held last."""
    got: set[tuple[str, int]] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            healthy, why = await store.view_health()
            got = await view_pairs(store)
        except (ViewStoreError, OSError) as e:  # Redis still coming back
            healthy, why = False, str(e)
        if healthy and got == want:
            res.converged = True
            res.recovery_s = round(time.monotonic() - t_fault, 2)
            break
        res.detail["last_health"] = why
        await asyncio.sleep(0.2)
    return got


async def _expect_dead(store: RedisViewStore, dead: str, t_fault: float, res: RunResult) -> None:
    """``dead`` must stop being live within the TTL of the fault (plus apply time); else the run
    has not converged (``immortal_node``)."""
    res.detail["still_live_after_s"] = None
    limit = time.monotonic() + HEARTBEAT_TTL_S + 10
    while time.monotonic() < limit:
        snap = await store.snapshot([])
        if dead not in {n.node_id for n in snap.live_nodes(HEARTBEAT_TTL_S)}:
            res.detail["still_live_after_s"] = round(time.monotonic() - t_fault, 2)
            break
        await asyncio.sleep(0.2)
    else:
        res.converged = False
        res.detail["immortal_node"] = dead


async def _tally(res: RunResult, run: Run, store: RedisViewStore, want: set[tuple[str, int]],
                 got: set[tuple[str, int]]) -> None:
    """The pairs lost and extra, and what the worker's log and the fault reported."""
    work_dir = run.work_dir
    res.pairs_lost = len(want - got)
    res.pairs_extra = len(got - want)
    res.generations = _log_count(work_dir, "the view's generation is")
    res.detail["dead_letters"] = _log_count(work_dir, "dead-letter ")
    res.detail["fences_moved_back"] = _log_count(work_dir, "the view's fences moved back")
    res.detail["bad_records"] = run.bad
    res.detail.update(run.detail)
    ghosts = [n.node_id for n in await store.nodes() if not n.node_id.startswith("node-")]
    res.detail["unknown_nodes"] = ghosts
    if ghosts:  # a hostile record made a node appear: count it as extra
        res.pairs_extra += len(ghosts)


async def _applied(store: RedisViewStore, topic: str) -> int:
    """Records of ``topic`` the view has applied (offsets from 0)."""
    try:
        wm = await store.watermark()
    except (ViewStoreError, OSError):  # Redis down for the fault: nothing seen applied yet
        return 0
    return sum(v + 1 for k, v in wm.items() if k.rpartition(":")[0] == topic)


def _log_count(work_dir: Path, words: str) -> int:
    return sum(
        p.read_text(errors="replace").count(words) for p in work_dir.glob("worker*.log") if p.exists()
    )
