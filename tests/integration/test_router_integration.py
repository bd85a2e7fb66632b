"""The routing worker on the real broker and Redis: requests in → decisions on ``dispatch``."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.errors import ViewStoreError
from conductor.routing.router import Router, request_seed
from conductor.routing.stores import redis_stores
from conductor.routing.worker import RouterWorker
from schemas import (
    BlocksStored,
    DeadLetter,
    Heartbeat,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    chain_keys,
    decode,
    encode,
    envelope,
)
from state.redis_view import RedisViewStore
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration

TOKENS = list(range(5000, 5000 + 32 * 16))


async def test_requests_become_decisions_on_dispatch(settings) -> None:
    # The heartbeats are written once: a long TTL keeps the nodes live however slow the start (a busy machine).
    settings = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    now = int(time.time() * 1000)
    view, resv = redis_stores(settings, producer_id="router-test")
    hb = [("p-cold", "prefill"), ("p-warm", "prefill"), ("d-0", "decode"), ("d-1", "decode")]
    records = [(envelope(Heartbeat(role=role, rack="r0"), producer_id=n, producer_seq=0, ts_ms=now - 500), None)
               for n, role in hb]
    records.append((envelope(BlocksStored(block_keys=chain_keys(TOKENS, settings.block_size)),
                             producer_id="p-warm", producer_seq=1, ts_ms=now - 500), None))
    await view.apply(records)

    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    requests = [
        RoutingRequest(request_id="warm", token_ids=TOKENS, prompt_tokens=len(TOKENS)),
        RoutingRequest(request_id="cold", token_ids=list(range(9000, 9000 + 256)), prompt_tokens=256),
        RoutingRequest(request_id="chain", block_keys=chain_keys(TOKENS, settings.block_size)[:8], prompt_tokens=128),
        RoutingRequest(request_id="too-long", block_keys=[1, 2, 3, 4, 5], prompt_tokens=16),
        RoutingRequest(request_id="slo", token_ids=TOKENS, prompt_tokens=len(TOKENS), ttft_slo_s=1e-6),
    ]
    prod = kafka.producer(settings.kafka())
    await prod.start()
    for i, req in enumerate(requests):
        await prod.send(t.requests.name, encode(envelope(req, producer_id="gw", producer_seq=i, ts_ms=now)),
                        key=req.request_id.encode())
    await prod.send(t.requests.name, b"\x00garbage", key=b"garbled")
    await prod.send(t.requests.name, b"\x00garbage, no key")
    await prod.stop()

    router = Router(settings, view, resv)
    worker = RouterWorker(settings, router, router_id="router-test")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    cons = kafka.consumer(settings.kafka(), t.dispatch.name, t.dead_letter.name, group_id=None)
    await cons.start()
    got: dict[str, tuple[bytes, object]] = {}
    dead: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + 30
        while len(got) < 6 or not dead:
            assert time.monotonic() < deadline, f"only {sorted(got)} and {len(dead)} dead letters arrived"
            for recs in (await cons.getmany(timeout_ms=500)).values():
                for rec in recs:
                    body = decode(rec.value).body
                    if isinstance(body, DeadLetter):
                        dead.append(body)
                    else:
                        got[body.request_id] = (rec.key, body)
    finally:
        stop.set()
        await cons.stop()
        await asyncio.wait_for(task, 15)
        await resv.clear()
        await view.close()

    key, warm = got["warm"]
    # p-warm, or p-cold reading p-warm's copy when an earlier decision queued work on p-warm
    assert isinstance(warm, RoutingDecision) and key == warm.prefill_instance.encode()
    assert warm.decode_instance in ("d-0", "d-1")
    assert warm.reused_tokens == len(TOKENS) and warm.reuse_source == "p-warm"
    assert warm.seed == request_seed(settings.seed, "warm") and warm.policy == "kvcache-centric"
    assert warm.watermark == {} and not warm.degraded  # the view was written without positions

    _, cold = got["cold"]
    assert isinstance(cold, RoutingDecision) and cold.reused_tokens == 0
    _, chain = got["chain"]
    assert isinstance(chain, RoutingDecision) and chain.reuse_source == "p-warm" and chain.reused_tokens == 128
    for rid, reason, key in (("too-long", "invalid_request", b"too-long"), ("slo", "ttft_slo", b"slo"),
                             ("garbled", "invalid_request", b"garbled")):
        k, rej = got[rid]
        assert isinstance(rej, RoutingRejection) and rej.reason == reason and k == key, (rid, rej)
    assert dead[0].source_topic == t.requests.name and dead[0].reason == "malformed"
    assert worker.routed == 6


async def test_bench_route_runs_small(settings) -> None:
    from conductor.harness.bench.route import run_route_bench

    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    out = await run_route_bench(s, decisions=150, target_blocks=5000, seed=3, heartbeat_rate=200.0)
    assert out["instances"] == 32 and out["blocks"] >= 5000 and out["chain_blocks"] == 128
    assert 0 < out["mget128_ms_p50"] <= out["mget128_ms_p99"] and out["view_bytes_per_block"] > 0
    # (the ratio is of the unrounded percentiles)
    assert out["decision_over_mget_p50"] == pytest.approx(out["decision_ms_p50"] / out["mget128_ms_p50"], rel=1e-3)
    assert sum(out["outcomes"].values()) == 150
    assert 0 < out["decision_ms_p50"] <= out["decision_ms_p99"] and out["decisions_per_s"] > 0
    assert 0 < out["reused_prefix_ratio_mean"] < 1  # shared prefixes are found, questions are new
    assert 1 <= out["prefix_holders_mean"] <= 32  # the stores hold every other tenant's documents


async def test_bench_route_with_a_warm_tracking_reader_decides_without_round_trips(settings) -> None:
    from conductor.harness.bench.route import run_route_bench

    s = settings.model_copy(update={"heartbeat_ttl_s": 3600.0})
    out = await run_route_bench(s, decisions=150, target_blocks=5000, seed=3, heartbeat_rate=0.0, reader="tracking",
                                distinct_prompts=20)
    assert out["reader"] == "tracking" and out["distinct_prompts"] == 20 and sum(out["outcomes"].values()) == 150
    # Nothing is written during the run and every prompt was decided once in the warm-up.
    assert out["cached_reads_ratio"] > 0.9 and out["cache_hit_ratio"] == 1.0, out


async def test_raw_snapshot_reader_matches_the_view_store(settings) -> None:
    from state.reader import RawSnapshotReader

    reader, _resv = redis_stores(settings, producer_id="raw-test")
    assert isinstance(reader, RawSnapshotReader)
    view = reader.view
    now = int(time.time() * 1000)
    chain = chain_keys(TOKENS, settings.block_size)
    await view.apply([
        (envelope(Heartbeat(role="prefill", queued_prefill_tokens=7, rack="r1"), producer_id="p0", producer_seq=0,
                  ts_ms=now), None),
        (envelope(Heartbeat(role="store"), producer_id="s0", producer_seq=0, ts_ms=now), None),
        (envelope(BlocksStored(block_keys=chain[:10]), producer_id="p0", producer_seq=1, ts_ms=now), None),
        (envelope(BlocksStored(block_keys=chain, tier="ssd"), producer_id="s0", producer_seq=1, ts_ms=now), None),
    ])
    try:
        for c in (chain, chain[:3], [], [123456789]):
            a = await reader.snapshot(c, now_ms=now)
            b = await view.snapshot(c, now_ms=now)
            assert a == b
        assert (await reader.snapshot(chain, now_ms=now)).prefix == {"p0": (10, 10, 10), "s0": (0, 0, 32)}
        await reader._drop()  # a lost connection is re-opened by the next read
        assert (await reader.snapshot(chain[:1])).prefix["p0"] == (1, 1, 1)
    finally:
        await view.clear()
        await reader.close()
    dead = RawSnapshotReader("redis://127.0.0.1:1/0", settings.view_namespace, timeout_s=0.2)
    with pytest.raises(ViewStoreError, match="view read failed"):
        await dead.snapshot(chain)


async def test_raw_reader_sees_node_changes_after_caching_them(settings) -> None:
    """The reader skips the node hash while its version holds: every kind of change must move it."""
    reader, _ = redis_stores(settings, producer_id="raw-cache-test")
    view = reader.view
    now = int(time.time() * 1000)
    chain = chain_keys(TOKENS, settings.block_size)

    async def same() -> None:
        a, b = await reader.snapshot(chain, now_ms=now), await view.snapshot(chain, now_ms=now)
        assert a == b

    hb = lambda q, seq: (envelope(Heartbeat(role="prefill", queued_prefill_tokens=q), producer_id="p0",
                                  producer_seq=seq, ts_ms=now), None)
    try:
        await view.apply([hb(1, 0)])
        await same()
        await same()  # served from the cache
        await view.apply([hb(99, 1)])
        assert {n.node_id: n.queued_prefill_tokens for n in (await reader.snapshot(chain, now_ms=now)).nodes} == {"p0": 99}
        await view.apply([(envelope(BlocksStored(block_keys=chain[:4]), producer_id="p0", producer_seq=2, ts_ms=now),
                           None)])
        await same()
        await view.clear()  # a fresh namespace: nothing cached may survive it
        await same()
        await view.apply([hb(5, 0)])
        await same()
        await reader.client.script_flush()  # the reader reloads its script after NOSCRIPT
        with pytest.raises(ViewStoreError, match="NOSCRIPT"):
            await reader.snapshot(chain)
        await same()
    finally:
        await view.clear()
        await reader.close()


async def test_concurrent_reads_still_see_each_others_reservations(settings) -> None:
    """With several view reads in flight, a burst must still spread: each decision sees the
    reservations of the decisions before it."""
    from collections import Counter

    reader, resv = redis_stores(settings, producer_id="burst-test")
    now = int(time.time() * 1000)
    await reader.view.apply([
        (envelope(Heartbeat(role=role, rack="r0"), producer_id=n, producer_seq=0, ts_ms=now), None)
        for n, role in (("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"), ("p3", "prefill"), ("d0", "decode"))
    ])
    router = Router(settings.model_copy(update={"policy": "least-loaded"}), reader, resv)
    await router.start()
    try:
        burst = [RoutingRequest(request_id=f"b{i}", token_ids=list(range(i * 1000, i * 1000 + 512)), prompt_tokens=512)
                 for i in range(8)]
        out = await asyncio.gather(*(router.route(r) for r in burst))
    finally:
        await router.close()
        await reader.view.clear()
        await reader.close()
    assert all(isinstance(d, RoutingDecision) for d in out)
    assert Counter(d.prefill_instance for d in out) == {"p0": 2, "p1": 2, "p2": 2, "p3": 2}


async def test_raw_reader_logs_in_with_the_urls_user_and_password(settings) -> None:
    """``redis://user:password@host/db``: the raw reader sends ``AUTH user password`` (the
    password URL-decoded), and a wrong one fails at set-up with the server's reason."""
    from urllib.parse import quote, urlparse

    import redis.asyncio as aioredis

    from conductor.errors import ViewStoreError
    from state.reader import RawSnapshotReader

    admin = aioredis.from_url(settings.redis_url)
    user, password = f"reader-{settings.view_namespace}", "s3cret:@/x"
    u = urlparse(settings.redis_url)

    def url(pw: str) -> str:
        return f"redis://{user}:{quote(pw, safe='')}@{u.hostname}:{u.port}{u.path}"

    await admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all")
    writer = RedisViewStore.connect(settings.redis(), settings.view_namespace)
    reader = RawSnapshotReader(url(password), settings.view_namespace)
    wrong = RawSnapshotReader(url("nope"), settings.view_namespace, timeout_s=0.5)
    try:
        now = int(time.time() * 1000)
        await writer.apply([(envelope(Heartbeat(role="decode"), producer_id="d0", producer_seq=0, ts_ms=now), None)])
        assert [n.node_id for n in (await reader.snapshot([1], now_ms=now)).nodes] == ["d0"]
        with pytest.raises(ViewStoreError, match="set-up failed"):
            await wrong.snapshot([1])
    finally:
        await reader.close()
        await wrong.close()
        await writer.clear()
        await writer.close()
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()


async def test_redis_stores_reads_tls_urls_through_redis_py(settings) -> None:
    reader, _ = redis_stores(settings.model_copy(update={"redis_url": "rediss://127.0.0.1:1/0"}))
    assert isinstance(reader, RedisViewStore)
    await reader.close()
