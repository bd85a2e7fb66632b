"""The routing worker's decision path on the in-memory view (no broker, no Redis)."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import pytest

from conductor.errors import ConfigError, ViewStoreError
from conductor.routing.router import Router, request_seed
from conductor.routing.snapshot import Instance
from conductor.settings import load_settings
from schemas import (
    BlocksStored,
    Heartbeat,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    chain_keys,
    encode,
    envelope,
)
from state.memory import InMemoryViewStore
from state.reservations import InMemoryReservations, Load, Reservation, placement_reservations

BS = 16
_seq = itertools.count()


def now_ms() -> int:
    return int(time.time() * 1000)


def heartbeat(store: InMemoryViewStore, node: str, role: str = "prefill", ts: int | None = None, **kw) -> None:
    store.apply_sync(envelope(Heartbeat(role=role, **kw), producer_id=node, producer_seq=next(_seq),
                              ts_ms=ts or now_ms()))


def stored(store: InMemoryViewStore, node: str, keys: list[int], tier: str = "hbm") -> None:
    store.apply_sync(envelope(BlocksStored(block_keys=keys, tier=tier), producer_id=node,
                              producer_seq=next(_seq), ts_ms=now_ms()))


def make_router(policy: str = "kvcache-centric", params: dict | None = None, **kw):
    settings = load_settings(block_size=BS, policy=policy, policy_params=params or {}, seed=7, **kw)
    view = InMemoryViewStore()
    resv = InMemoryReservations(settings.reservation_ttl_s)
    return Router(settings, view, resv), view, resv


TOKENS = list(range(1000, 1000 + 64 * BS))


def token_request(rid: str = "r1", tokens: list[int] = TOKENS, **kw) -> RoutingRequest:
    return RoutingRequest(request_id=rid, token_ids=tokens, prompt_tokens=len(tokens), **kw)


async def test_token_request_goes_to_the_prefix_holder() -> None:
    router, view, _ = make_router()
    for n in ("p0", "p1", "p2"):
        heartbeat(view, n)
    heartbeat(view, "d0", "decode")
    stored(view, "p1", chain_keys(TOKENS, BS))
    out = await router.route(token_request())
    assert isinstance(out, RoutingDecision)
    assert (out.prefill_instance, out.decode_instance) == ("p1", "d0")
    assert out.reused_tokens == len(TOKENS) and out.reuse_source == "p1" and out.reuse_tier == "hbm"
    assert out.policy == "kvcache-centric" and out.params["kvcache_balancing_threshold"] == 1.0
    assert out.seed == request_seed(7, "r1") and not out.degraded


async def test_chain_request_and_lora_change_the_keys() -> None:
    router, view, _ = make_router()
    heartbeat(view, "p0")
    heartbeat(view, "p1")
    heartbeat(view, "d0", "decode")
    keys = chain_keys(TOKENS, BS)
    stored(view, "p0", keys)
    by_chain = await router.route(RoutingRequest(request_id="c", block_keys=keys, prompt_tokens=len(TOKENS)))
    assert isinstance(by_chain, RoutingDecision) and by_chain.prefill_instance == "p0"
    lora = await router.route(token_request("l", lora_name="adapter-1"))
    assert isinstance(lora, RoutingDecision) and lora.reused_tokens == 0  # other keys: no match


async def test_reservations_spread_a_burst_the_view_has_not_seen() -> None:
    router, view, resv = make_router("least-loaded")
    before = now_ms() - 1000  # heartbeats older than the decisions: they do not show them
    for n in ("p0", "p1", "p2"):
        heartbeat(view, n, ts=before)
    heartbeat(view, "d0", "decode", ts=before)
    heartbeat(view, "d1", "decode", ts=before)
    outs = [await router.route(token_request(f"b{i}")) for i in range(6)]
    assert Counter(o.prefill_instance for o in outs) == {"p0": 2, "p1": 2, "p2": 2}
    assert Counter(o.decode_instance for o in outs) == {"d0": 3, "d1": 3}
    pend = resv.pending_sync({"p0": 0, "d0": 0}, now_ms())
    assert pend["p0"] == Load(prefill_tokens=2 * len(TOKENS), prefill_requests=2)
    assert pend["d0"].decode_requests == 3


async def test_a_newer_heartbeat_releases_the_reservations() -> None:
    router, view, _resv = make_router("least-loaded")
    heartbeat(view, "p0", ts=now_ms() - 1000)
    heartbeat(view, "d0", "decode", ts=now_ms() - 1000)
    await router.route(token_request("x"))
    await router.route(token_request("y"))  # the second read already counts the first

    async def picture() -> dict[str, Instance]:
        snap, pending = await router.read([])
        return {i.node_id: i for i in router.cluster(snap, pending, token_request("q").model, 0.0).instances}

    assert (await picture())["p0"].queued_requests == 2
    heartbeat(view, "p0", ts=now_ms() + 1000)  # the engine now reports its queue itself
    heartbeat(view, "d0", "decode", ts=now_ms() + 1000)
    await router.route(token_request("z"))
    after = await picture()
    assert after["p0"].queued_requests == 0 and after["d0"].batch_size == 0


def test_reservations_expire_after_the_ttl() -> None:
    r = InMemoryReservations(ttl_s=1.0)
    r.reserve_sync([Reservation("p0", Load(prefill_tokens=100, prefill_requests=1))], 10_000)
    r.reserve_sync([Reservation("p0", Load(prefill_tokens=50, prefill_requests=1))], 10_500)
    assert r.pending_sync({"p0": 0}, 10_600)["p0"] == Load(150, 2)
    assert r.pending_sync({"p0": 10_200}, 10_600)["p0"] == Load(50, 1)
    assert r.pending_sync({"p0": 0}, 11_200)["p0"] == Load(50, 1)  # the first one is past the ttl
    assert "p0" not in r.pending_sync({"p0": 0}, 12_000)


def test_placement_on_one_node_merges_its_reservations() -> None:
    (one,) = placement_reservations("b0", "b0", prefill_tokens=10, context_tokens=20, kv_blocks=3)
    assert one.load == Load(10, 1, 1, 20, 3)
    assert len(placement_reservations("p0", "d0", prefill_tokens=10, context_tokens=20, kv_blocks=3)) == 2


@pytest.mark.parametrize(
    "request_kw,match",
    [
        ({"block_keys": [1, 2, 3], "block_size": 32, "prompt_tokens": 96}, "block size 32"),
        ({"block_keys": [1, 2, 3, 4], "prompt_tokens": 50}, "longer than the 50-token prompt"),
    ],
)
async def test_invalid_requests_are_rejected_with_the_reason(request_kw: dict, match: str) -> None:
    router, view, _ = make_router()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    out = await router.route(RoutingRequest(request_id="bad", **request_kw))
    assert isinstance(out, RoutingRejection) and out.reason == "invalid_request" and match in out.message


async def test_undecodable_records_are_rejected_by_key_or_dead_lettered() -> None:
    router, _view, _ = make_router()
    key, out = await router.handle(b"\x93not a record", b"req-9")
    assert key == "req-9" and isinstance(out, RoutingRejection) and out.reason == "invalid_request"
    wrong = envelope(Heartbeat(role="prefill"), producer_id="x", producer_seq=0, ts_ms=1)
    key, out = await router.handle(encode(wrong), b"req-10")
    assert out.reason == "invalid_request" and "heartbeat" in out.message
    key, out = await router.handle(b"garbage", None)
    assert key == "" and getattr(out, "reason", "") == "malformed"


async def test_policy_rejections_carry_reason_seed_and_watermark() -> None:
    router, view, _ = make_router()
    heartbeat(view, "p0")
    out = await router.route(token_request("nodecode"))
    assert isinstance(out, RoutingRejection) and out.reason == "no_live_instance"
    assert out.seed == request_seed(7, "nodecode") and out.policy == "kvcache-centric"
    heartbeat(view, "d0", "decode")
    slow = await router.route(token_request("slow", ttft_slo_s=0.001))
    assert isinstance(slow, RoutingRejection) and slow.reason == "ttft_slo"


async def test_stale_nodes_are_not_live() -> None:
    router, view, _ = make_router(heartbeat_ttl_s=2.0)
    heartbeat(view, "p0", ts=now_ms() - 60_000)
    heartbeat(view, "d0", "decode")
    out = await router.route(token_request())
    assert isinstance(out, RoutingRejection) and out.reason == "no_live_instance"


class FlakyView:
    """The in-memory view, unreachable on demand (the Redis-down case)."""

    def __init__(self, inner: InMemoryViewStore) -> None:
        self.inner = inner
        self.down = False

    async def snapshot(self, chain, *, now_ms=None):
        if self.down:
            raise ViewStoreError("view read failed: connection refused")
        return await self.inner.snapshot(chain, now_ms=now_ms)


async def test_unreachable_view_degrades_then_rejects() -> None:
    settings = load_settings(block_size=BS, max_snapshot_age_s=5.0, policy="least-loaded")
    inner = InMemoryViewStore()
    heartbeat(inner, "p0")
    heartbeat(inner, "d0", "decode")
    view = FlakyView(inner)
    t = [100.0]
    router = Router(settings, view, InMemoryReservations(10.0), clock=lambda: t[0])
    view.down = True
    first = await router.route(token_request("a"))
    assert isinstance(first, RoutingRejection) and first.reason == "view_unavailable"
    view.down = False
    assert isinstance(await router.route(token_request("b")), RoutingDecision)
    view.down = True
    t[0] += 2.0
    degraded = await router.route(token_request("c"))
    assert isinstance(degraded, RoutingDecision) and degraded.degraded
    assert degraded.snapshot_age_ms == pytest.approx(2000.0)
    t[0] += 4.0
    gone = await router.route(token_request("d"))
    assert isinstance(gone, RoutingRejection) and gone.reason == "view_unavailable" and "6.0s old" in gone.message


def test_bad_policy_settings_fail_at_start() -> None:
    settings = load_settings(policy="kvcache-centric", policy_params={"slo_margin": 0})
    with pytest.raises(ConfigError, match="slo_margin"):
        Router(settings, InMemoryViewStore(), InMemoryReservations(1.0))
    with pytest.raises(ConfigError, match="model profile"):
        Router(load_settings(model_profile="gpt-17"), InMemoryViewStore(), InMemoryReservations(1.0))


def test_request_seed_is_stable_and_per_request() -> None:
    assert request_seed(0, "a") == request_seed(0, "a")
    assert len({request_seed(0, "a"), request_seed(1, "a"), request_seed(0, "b")}) == 3
    assert 0 <= request_seed(5, "x") < 2**64


async def test_metrics_are_exported() -> None:
    from conductor.telemetry import scrape, setup_metrics

    setup_metrics("conductor-test")
    router, view, _ = make_router()
    heartbeat(view, "p0")
    await router.route(token_request("m1"))  # no decode instance: a rejection
    heartbeat(view, "d0", "decode")
    await router.route(token_request("m2"))
    text = scrape()
    assert "conductor_router_decision_latency" in text
    assert "conductor_router_reused_prefix_ratio" in text
    assert 'reason="no_live_instance"' in text
    assert 'prefill="p0"' in text


def test_router_command_exits_with_the_bad_policy_param() -> None:
    from typer.testing import CliRunner

    from conductor.cli import app

    env = {"CONDUCTOR_KAFKA_URL": "127.0.0.1:1", "CONDUCTOR_REDIS_URL": "redis://127.0.0.1:1/0",
           "CONDUCTOR_POLICY": "dynamo-style", "CONDUCTOR_POLICY_PARAMS": '{"temprature": 0.5}'}
    res = CliRunner().invoke(app, ["router"], env=env)
    assert res.exit_code == 2
    assert "unknown parameter 'temprature'" in res.output


def test_policies_and_profile_fit_commands(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from conductor.cli import app
    from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile

    runner = CliRunner()
    res = runner.invoke(app, ["policies", "--json"])
    assert res.exit_code == 0
    assert {p["name"] for p in json.loads(res.output)} >= {"kvcache-centric", "llm-d-style"}
    prof = load_profile(DEFAULT_PROFILE).model_copy(update={"a": 5.0, "b": 20.0})
    csv = tmp_path / "t.csv"
    csv.write_text("tokens,cached,seconds\n" + "".join(
        f"{n},{c},{prof.prefill_seconds(n, c)}\n" for n, c in [(512, 0), (2048, 0), (8192, 1024), (16384, 0), (30000, 8000)]))
    out = tmp_path / "fit.json"
    res = runner.invoke(app, ["profile", "fit", "--csv", str(csv), "--out", str(out)])
    assert res.exit_code == 0, res.output
    fit = json.loads(res.output)
    assert fit["a"] == pytest.approx(5.0, rel=1e-3) and fit["b"] == pytest.approx(20.0, rel=1e-3)
    assert load_profile(str(out)).a == pytest.approx(5.0, rel=1e-3)
    bad = runner.invoke(app, ["profile", "fit", "--csv", str(csv), "--base", "nope"])
    assert bad.exit_code == 2 and "unknown model profile 'nope'" in bad.output


async def test_a_policy_bug_rejects_the_request_and_the_worker_goes_on() -> None:
    router, view, _ = make_router()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")

    class Broken:
        name, params = "broken", {}

        def decide(self, *a):
            raise ZeroDivisionError("oops")

    good = router.policy
    router.policy = Broken()
    req = envelope(token_request("boom"), producer_id="gw", producer_seq=0, ts_ms=1)
    key, out = await router.handle(encode(req), b"boom")
    assert key == "boom" and out.reason == "invalid_request" and "ZeroDivisionError" in out.message
    router.policy = good
    key, out = await router.handle(encode(req), b"boom")
    assert isinstance(out, RoutingDecision) and key == "p0"


class RebuildingView:
    """The in-memory view behind a health flag: lost or rebuilt from the log until told otherwise."""

    def __init__(self, store: InMemoryViewStore) -> None:
        self.store, self.health = store, (True, "")

    async def snapshot(self, chain, *, now_ms=None):
        return await self.store.snapshot(chain, now_ms=now_ms)

    async def view_health(self):
        return self.health


async def test_a_lost_or_rebuilding_view_is_not_the_truth() -> None:
    """An empty view after Redis came back empty is not "no live instance": the router answers
    from its last snapshot, degraded with the reason, and says view_rebuilding without one."""
    router, store, _ = make_router()
    clock = [0.0]
    router.clock = lambda: clock[0]
    view = RebuildingView(store)
    router.view = view
    view.health = (False, "view_lost: the view has no generation")
    out = await router.route(token_request("r0"))
    assert isinstance(out, RoutingRejection) and out.reason == "view_rebuilding"
    assert "view_lost" in out.message
    view.health = (True, "")
    clock[0] += 1
    heartbeat(store, "p0")
    heartbeat(store, "d0", "decode")
    ok = await router.route(token_request("r1"))
    assert isinstance(ok, RoutingDecision) and not ok.degraded and ok.view_now_ms is not None
    store.clear_sync()  # Redis flushed: empty, and the workers are reading it back from the log
    view.health = (False, "view_rebuilding: 4 partitions are being read back from the log")
    clock[0] += 1
    out = await router.route(token_request("r2"))
    assert isinstance(out, RoutingDecision) and out.degraded and out.prefill_instance == "p0"
    assert out.degraded_reason.startswith("view_rebuilding")


async def test_a_request_of_a_million_token_ids_at_block_size_1_is_refused() -> None:
    settings = load_settings(block_size=1, seed=7)
    router = Router(settings, InMemoryViewStore(), InMemoryReservations(settings.reservation_ttl_s))
    tokens = list(range(1_048_576))
    out = await router.route(RoutingRequest(request_id="huge", token_ids=tokens, prompt_tokens=len(tokens)))
    assert isinstance(out, RoutingRejection) and out.reason == "invalid_request" and "at most" in out.message


async def test_reads_that_come_back_out_of_order_still_decide_in_log_order() -> None:
    """The worker keeps several reads in flight; the first request's read is the slowest here.
    Each decision must still see the reservations of every request before it in the log (what
    `explain` re-derives), not of whichever read happened to return first."""
    import asyncio
    from types import SimpleNamespace

    from conductor.routing.worker import RouterWorker

    router, view, _resv = make_router("least-loaded")
    before = now_ms() - 1000
    for n in ("p0", "p1", "p2"):
        heartbeat(view, n, ts=before)
    heartbeat(view, "d0", "decode", ts=before)
    real = view.snapshot
    delays = iter([0.06, 0.04, 0.02, 0.0])

    async def slow_snapshot(chain, **kw):
        snap = await real(chain, **kw)
        await asyncio.sleep(next(delays))  # later requests' reads come back first
        return snap

    view.snapshot = slow_snapshot
    decided: list[tuple[str, int]] = []
    decide = router.policy.decide

    def record_decide(preq, cluster, rng):  # the heartbeats queue nothing: what is queued is reserved
        decided.append((preq.request_id, sum(i.queued_requests for i in cluster.instances)))
        return decide(preq, cluster, rng)

    router.policy.decide = record_decide
    worker = RouterWorker(router.settings, router, router_id="t")
    recs = [SimpleNamespace(value=encode(envelope(token_request(f"o{i}"), producer_id="gw", producer_seq=i,
                                                  ts_ms=now_ms())), key=f"o{i}".encode(), offset=i)
            for i in range(4)]
    outs = await worker._decide(recs)  # type: ignore[arg-type]
    # the i-th request of the log was decided i-th and saw the i reservations before it
    assert decided == [("o0", 0), ("o1", 1), ("o2", 2), ("o3", 3)]
    assert [o[1].request_id for o in outs] == ["o0", "o1", "o2", "o3"]
    assert Counter(o[1].prefill_instance for o in outs[:3]) == {"p0": 1, "p1": 1, "p2": 1}


async def test_the_view_reader_is_chosen_by_settings_and_a_tracking_reader_needs_plain_resp():
    from conductor.routing.stores import redis_stores
    from state.reader import RawSnapshotReader
    from state.tracking import TrackingSnapshotReader

    plain = load_settings(redis_url="redis://127.0.0.1:1/0")
    for reader, kind in (("raw", RawSnapshotReader), ("tracking", TrackingSnapshotReader)):
        view, _resv = redis_stores(plain.model_copy(update={"view_reader": reader, "view_cache_keys": 10}))
        assert type(view) is kind and getattr(view, "cache_keys", 10) == 10
        await view.close()
    with pytest.raises(ConfigError, match="CONDUCTOR_VIEW_READER"):
        redis_stores(load_settings(redis_url="rediss://127.0.0.1:1/0", view_reader="tracking"))
    with pytest.raises(ConfigError, match="view_reader"):
        load_settings(view_reader="cached")


async def test_a_gateway_request_names_only_engines_the_gateway_can_reach() -> None:
    router, view, _ = make_router()
    heartbeat(view, "p-hidden")  # announces no URL, and holds the whole prompt: the policy's favourite
    heartbeat(view, "p-seen", endpoint="http://10.0.0.2:8000", dp_rank=1)
    heartbeat(view, "d0", "decode", endpoint="http://10.0.0.3:8000")
    stored(view, "p-hidden", chain_keys(TOKENS, BS))
    # Not from a gateway (no reachable list): the holder wins.
    any_ = await router.route(token_request("r-any"))
    assert isinstance(any_, RoutingDecision) and any_.prefill_instance == "p-hidden"
    assert set(any_.endpoints) == {"d0"}
    # From a gateway that knows no URL for it: never named; the decision says where the others are.
    gw = await router.route(token_request("r-gw", reachable=[]))
    assert isinstance(gw, RoutingDecision) and gw.prefill_instance == "p-seen"
    assert gw.endpoints["p-seen"].url == "http://10.0.0.2:8000" and gw.endpoints["p-seen"].dp_rank == 1
    assert gw.endpoints["d0"].url == "http://10.0.0.3:8000"
    # A gateway with an --engine override for it may be sent there.
    ov = await router.route(token_request("r-ov", reachable=["p-hidden"]))
    assert isinstance(ov, RoutingDecision) and ov.prefill_instance == "p-hidden"
    # Nothing reachable at all: the rejection says why.
    router2, view2, _ = make_router()
    heartbeat(view2, "p0")
    heartbeat(view2, "d0", "decode")
    out = await router2.route(token_request("r-none", reachable=[]))
    assert isinstance(out, RoutingRejection) and out.reason == "no_live_instance"
    assert "not reachable by the gateway" in out.message, out.message
