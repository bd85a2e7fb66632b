"""One conversion from a view read + reservations to the policy's ClusterSnapshot, used by
the router, ``explain`` and the simulator."""

from __future__ import annotations

import asyncio
import math

from conductor.costmodel.profiles import load_profile
from conductor.harness.sim import engine
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.engine import Outcome, Simulation
from conductor.harness.sim.view import view_ms
from conductor.routing import explain
from conductor.routing.policies import make_policy
from conductor.routing.router import Router
from conductor.routing.snapshot import ClusterSnapshot, Instance, build_cluster
from conductor.settings import load_settings
from schemas import BlocksStored, Heartbeat, envelope
from state.memory import InMemoryViewStore
from state.reservations import InMemoryReservations, Load

BS = 16


def view_with(now: int) -> InMemoryViewStore:
    store = InMemoryViewStore()
    hbs = [("p0", Heartbeat(role="prefill", queue_depth=2, queued_prefill_tokens=900, rack="r0")),
           ("d0", Heartbeat(role="decode", batch_size=3, decode_context_tokens=7000, free_kv_blocks=50,
                            total_kv_blocks=80)),
           ("other", Heartbeat(role="prefill", model="another-model")),
           ("s0", Heartbeat(role="store", model="another-model"))]
    for node, hb in hbs:
        store.apply_sync(envelope(hb, producer_id=node, producer_seq=0, ts_ms=now))
    store.apply_sync(envelope(BlocksStored(block_keys=[1, 2, 3], tier="dram"), producer_id="p0", producer_seq=0,
                              ts_ms=now))
    return store


def test_build_cluster_adds_reservations_filters_model_and_liveness() -> None:
    now = 10_000
    snap = view_with(now).snapshot_sync([1, 2, 3, 4], now)
    pending = {"p0": Load(prefill_tokens=100, prefill_requests=1), "d0": Load(decode_requests=1, kv_blocks=60)}
    c = build_cluster(snap, pending, block_size=BS, ttl_s=5.0, model="default", age_ms=3.0)
    by = {i.node_id: i for i in c.instances}
    assert set(by) == {"p0", "d0", "s0"}  # another model's prefill is out; a store serves every model
    assert by["p0"] == Instance("p0", "prefill", (0, 3, 3), 1000, 3, rack="r0")
    assert (by["d0"].batch_size, by["d0"].free_kv_blocks, by["d0"].total_kv_blocks) == (4, 0, 80)
    assert (c.block_size, c.age_ms, c.watermark) == (BS, 3.0, snap.watermark)
    assert build_cluster(snap, pending, block_size=BS, ttl_s=5.0, model=None).instances[2].node_id == "other"
    later = view_with(now).snapshot_sync([1], now + 6_000)
    assert build_cluster(later, {}, block_size=BS, ttl_s=5.0).instances == ()  # every heartbeat too old


def test_memo_returns_equal_snapshots() -> None:
    snap = view_with(1_000).snapshot_sync([1, 2], 1_000)
    memo: dict = {}
    a = build_cluster(snap, {}, block_size=BS, ttl_s=5.0, memo=memo)
    b = build_cluster(snap, {"p0": Load(prefill_tokens=1)}, block_size=BS, ttl_s=5.0, memo=memo)
    c = build_cluster(snap, {}, block_size=BS, ttl_s=5.0, memo=memo)
    assert a == c == build_cluster(snap, {}, block_size=BS, ttl_s=5.0) and a != b


def test_router_and_explain_and_simulator_call_the_one_builder(monkeypatch) -> None:
    calls: list[tuple[str, ClusterSnapshot]] = []
    real = build_cluster

    def spy(where: str):
        def wrapped(*a, **kw):
            out = real(*a, **kw)
            calls.append((where, out))
            return out
        return wrapped

    # The router (and explain, which runs the router's own ``cluster``) ...
    import conductor.routing.router as router_mod
    monkeypatch.setattr(router_mod, "build_cluster", spy("router"))
    settings = load_settings(block_size=BS, seed=1)
    now = 10_000
    store = view_with(now)
    router = Router(settings, explain._ViewAt(store, now), InMemoryReservations(settings.reservation_ttl_s),
                    incremental=False)
    snap, pending = asyncio.run(router.read([1, 2, 3]))
    assert router.cluster(snap, pending, "default", 0.0) == real(
        snap, pending, block_size=BS, ttl_s=settings.heartbeat_ttl_s, model="default")
    # A live router keeps the same picture incrementally (conductor.routing.index): equal to the builder's.
    live = Router(settings, explain._ViewAt(store, now), InMemoryReservations(settings.reservation_ttl_s))
    snap2, none = asyncio.run(live.read([1, 2, 3]))
    assert none is None and live.cluster(snap2, none, "default", 0.0) == real(
        snap2, {}, block_size=BS, ttl_s=settings.heartbeat_ttl_s, model="default")

    # ... and the simulator, on a view its nodes fed through the fold.
    monkeypatch.setattr(engine, "build_cluster", spy("sim"))
    cluster = ClusterProfile(name="t", prefill_instances=1, decode_instances=1, block_size=BS, view_delay_ms=0.0)
    profile = load_profile("llama3-70b-a800x8")
    sim = Simulation(cluster, profile, make_policy("least-loaded", {}, profile), [], seed=0)
    sim.run()
    o = Outcome(0, 0.0, 64, 8, [1, 2, 3, 4])
    got = sim._snapshot(o)
    vs = sim.view.snapshot(o.chain, 0.0)
    assert got == real(vs, {}, block_size=BS, ttl_s=math.inf, age_ms=0.0)
    assert {i.node_id for i in got.instances} == {"prefill-0", "decode-0"}
    assert vs.now_ms == view_ms(0.0) and all(n.last_heartbeat_ms == view_ms(0.0) for n in vs.nodes)
    assert [w for w, _ in calls] == ["router", "sim"]
