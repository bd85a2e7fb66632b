"""The view on a real 3-primary Valkey Cluster (``redis+cluster://``): the store passes the view
contract, a namespace lives in one slot on one primary, and the whole path works on it — the
stream worker folds into the cluster view, the router routes from it, ``explain`` re-derives."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import tests.contract.test_view_contract as contract
from conductor.harness.bench.ingest import start_worker_process, stop_worker_process
from conductor.harness.devstack import free_port
from conductor.routing.explain import explain
from conductor.routing.router import Router
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from conductor.settings import load_settings
from schemas import BlocksStored, Heartbeat, RoutingDecision, RoutingRequest, chain_keys, decode, encode, envelope
from state.reader import RawSnapshotReader
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration


def _on_cluster(stack, valkey_cluster, tmp_path):
    tag = uuid.uuid4().hex[:8]
    return load_settings(kafka_url=stack.kafka_url, redis_url=valkey_cluster.url, profile="embedded",
                         topic_prefix=f"t{tag}.", view_namespace=f"t{tag}", partitions=2, data_dir=tmp_path / "data")


class TestClusterViewStore(contract.TestRedisViewStore):
    """The whole view contract (writes, fences, generations, compaction, reads) on the cluster."""

    @pytest.fixture
    def settings(self, stack, valkey_cluster, tmp_path):
        return _on_cluster(stack, valkey_cluster, tmp_path)


class TestClusterRawReader(contract.TestRawSnapshotReader):
    """The router's raw reader, connected to the primary of the namespace's slot."""

    @pytest.fixture
    def settings(self, stack, valkey_cluster, tmp_path):
        return _on_cluster(stack, valkey_cluster, tmp_path)

    async def test_it_reads_from_the_slots_primary_found_from_any_seed(self, store, valkey_cluster):
        await self.feed(store, [contract.stored("a", 0, [1, 2])])
        assert (await store.snapshot([1, 2], now_ms=0)).prefix == {"a": (2, 2, 2)}
        owner = valkey_cluster.owner_of(store.keys.generation)
        assert (store.host, store.port) == (owner.host, owner.port)
        other = next(n for n in valkey_cluster.nodes if n is not owner)
        await store._drop()
        store.host, store.port = other.host, other.port  # as if the slot had moved away from where it read
        store.seeds = [(other.host, other.port)]
        assert (await store.snapshot([1, 2], now_ms=0)).prefix == {"a": (2, 2, 2)}  # asked the slot map again
        assert store.port == owner.port


async def test_a_namespace_lives_in_one_slot_on_one_primary(cluster_settings, valkey_cluster):
    store = RedisViewStore.connect(cluster_settings.redis(), cluster_settings.view_namespace)
    try:
        await contract.ViewStoreContract().feed(store, [contract.stored("a", 0, list(range(1, 300))),
                                                      contract.heartbeat("a", 0, 1_000)])
        await store.compact()
        owner = valkey_cluster.owner_of(store.keys.generation)
        with owner.client() as c:
            keys = list(c.scan_iter(match=store.keys.all_pattern, count=1000))
            slots = {int(c.execute_command("CLUSTER", "KEYSLOT", k)) for k in keys}
        assert len(keys) >= 299 + 4  # the blocks, the node hash, fences, generation, version...
        assert len(slots) == 1
        for other in valkey_cluster.nodes:
            if other is not owner:
                with other.client() as c:
                    assert list(c.scan_iter(match=store.keys.all_pattern)) == []
    finally:
        await store.clear()
        await store.close()


@pytest.mark.slow  # `scripts/test -m slow`
async def test_worker_folds_into_the_cluster_and_the_router_routes_from_it(cluster_settings, tmp_path):
    s = cluster_settings.model_copy(update={"web_port": free_port(), "heartbeat_ttl_s": 600.0})  # worker start-up is slow
    t = topics(s.topic_config())
    await kafka.ensure_topics(s.kafka(), t.all())
    now = int(time.time() * 1000)
    shared = list(range(5000, 5000 + 16 * 16))
    keys = chain_keys(shared, s.block_size)
    prod = kafka.producer(s.kafka())
    await prod.start()
    worker = start_worker_process(s, tmp_path / "worker.log")
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    reader, resv = redis_stores(s, producer_id="cluster-test")
    assert isinstance(reader, RawSnapshotReader) and reader.seeds  # the fast reader, on the slot's primary
    stop = asyncio.Event()
    task = None
    try:
        for n, role, q in (("p-holder", "prefill", 0), ("p-other", "prefill", 0), ("d-0", "decode", 0)):
            hb = Heartbeat(role=role, rack="r0", queued_prefill_tokens=q, total_kv_blocks=10_000, free_kv_blocks=10_000)
            await prod.send_and_wait(t.heartbeats.name, encode(envelope(hb, producer_id=n, producer_seq=0, ts_ms=now)),
                                     key=n.encode())
        await prod.send_and_wait(t.kv_events.name, encode(envelope(BlocksStored(block_keys=keys), producer_id="p-holder",
                                                                   producer_seq=0, ts_ms=now)), key=b"p-holder")
        deadline = time.monotonic() + 30
        while True:  # the worker's fold lands in the cluster view, and it says it is the truth
            snap = await view.snapshot(keys, now_ms=now)
            held = snap.prefix.get("p-holder", (0, 0, 0))[0] == len(keys) and len(snap.nodes) == 3
            if held and (await view.view_health())[0]:
                break
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            await asyncio.sleep(0.1)

        router = RouterWorker(s, Router(s, reader, resv), router_id="cluster-test")
        task = asyncio.create_task(router.run(stop))
        reqs = [RoutingRequest(request_id=f"c{i}", token_ids=shared + list(range(100 * i, 100 * i + 32)),
                               prompt_tokens=len(shared) + 32) for i in range(3)]
        for i, r in enumerate(reqs):
            # One key, one partition: decided in the order sent, so c0 is the first (across partitions
            # a later request could be decided first and take the idle holder).
            await prod.send_and_wait(t.requests.name, encode(envelope(r, producer_id="gw", producer_seq=i, ts_ms=now)),
                                     key=b"gw")
        cons = kafka.consumer(s.kafka(), t.dispatch.name, group_id=None)
        await cons.start()
        got: dict[str, RoutingDecision] = {}
        try:
            deadline = time.monotonic() + 30
            while len(got) < len(reqs):
                assert time.monotonic() < deadline, f"only {sorted(got)} were routed"
                for recs in (await cons.getmany(timeout_ms=300)).values():
                    for rec in recs:
                        body = decode(rec.value).body
                        got[body.request_id] = body
        finally:
            await cons.stop()
        assert got["c0"].prefill_instance == "p-holder"  # the holder, idle: the cheapest (later ones see c0's reservation)
        for r in reqs:
            d = got[r.request_id]
            assert isinstance(d, RoutingDecision), d
            assert d.reused_tokens == len(keys) * s.block_size, d  # the shared prefix the cluster view holds
            assert not d.degraded
            ex = await explain(s, r.request_id)
            assert ex.matches, ex.differences
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 10)
        await reader.close()
        await prod.stop()
        stop_worker_process(worker)
        await view.clear()
        await view.close()
