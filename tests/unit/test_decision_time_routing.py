"""Decision-time knowledge in routing (issue 34): pending blocks seen by the next decision, the
router's own in-flight load instead of reservations, capacity groups, and the stay rule."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.routing.own_load import OwnLoads, own_extra
from conductor.routing.policies.prefill_plan import stay_on_holder
from conductor.routing.router import Router
from conductor.settings import load_settings
from conductor.topology import Topology, topology_from_dict
from schemas import RoutingDecision, RoutingRequest, chain_keys
from state.inflight import InMemoryInflight, InstanceLoad
from state.memory import InMemoryViewStore
from state.pending import InMemoryPendingBlocks
from state.reservations import InMemoryReservations
from state.view import NodeState
from tests.unit.test_router import BS, heartbeat, stored, token_request

PROMPT = list(range(5000, 5000 + 32 * BS))


def gw_request(*args: Any, **kwargs: Any) -> RoutingRequest:
    """A request as a gateway sends it: it will release its work (``releases``)."""
    return token_request(*args, **kwargs).model_copy(update={"releases": True})


def make(incremental: bool = True, **params: object) -> tuple[Router, InMemoryViewStore, InMemoryPendingBlocks,
                                                              InMemoryInflight]:
    settings = load_settings(block_size=BS, policy="kvcache-centric", policy_params=dict(params), seed=7)
    view = InMemoryViewStore()
    pending = InMemoryPendingBlocks(5_000)
    ledger = InMemoryInflight(300_000)
    router = Router(settings, view, InMemoryReservations(settings.reservation_ttl_s), pending=pending,
                    inflight=ledger, incremental=incremental)
    return router, view, pending, ledger


@pytest.mark.parametrize("incremental", [True, False])
async def test_a_second_request_follows_the_first_ones_pending_blocks(incremental: bool) -> None:
    # remote_reuse off: a copy of a pending prefix from its holder is not modelled as waiting for it yet
    router, view, pending, ledger = make(incremental, remote_reuse=False)
    for n in ("p0", "p1", "p2"):
        heartbeat(view, n)
    heartbeat(view, "d0", "decode")
    first = await router.route(gw_request("r1", PROMPT))
    assert isinstance(first, RoutingDecision) and first.reused_tokens == 0
    assert first.pending_ttl_ms == 5_000 and first.inflight_lease_ms == 300_000
    # No KV event came back: the placement alone tells the next request where the prefix is.
    second = await router.route(gw_request("r2", PROMPT + list(range(64))))
    assert isinstance(second, RoutingDecision)
    assert second.prefill_instance == first.prefill_instance
    assert second.reused_tokens == len(PROMPT) and second.reuse_source == first.prefill_instance
    assert second.view_now_ms is not None and first.view_now_ms is not None
    assert second.view_now_ms >= first.view_now_ms
    # Its queue: the first request's uncached tokens, charged at decision.
    assert second.queued_tokens_ahead == len(PROMPT)
    assert ledger.load(first.prefill_instance, second.view_now_ms).prefill_tokens == len(PROMPT) + 64
    assert ledger.load("d0", second.view_now_ms).decode_requests == 2
    assert pending.holds(first.prefill_instance, chain_keys(PROMPT, BS)[-1], second.view_now_ms)


async def test_a_failed_request_releases_its_blocks_and_its_work() -> None:
    router, view, pending, ledger = make()
    for n in ("p0", "p1"):
        heartbeat(view, n)
    heartbeat(view, "d0", "decode")
    first = await router.route(gw_request("r1", PROMPT))
    assert isinstance(first, RoutingDecision) and first.view_now_ms is not None
    ledger.finish("r1", first.view_now_ms)
    pending.release("r1", first.view_now_ms)
    second = await router.route(gw_request("r2", PROMPT))
    assert isinstance(second, RoutingDecision)
    assert second.reused_tokens == 0 and second.queued_tokens_ahead == 0


async def test_the_ledger_replaces_reservations_and_heartbeats_add_only_what_it_lacks() -> None:
    router, view, _, ledger = make()
    heartbeat(view, "p0", queued_prefill_tokens=10_000, queue_depth=3)
    heartbeat(view, "p1")
    heartbeat(view, "d0", "decode")
    snap = await view.snapshot([])
    ledger.charge("x", "p1", "d0", 4_000, 4_000, snap.now_ms)
    ledger.charge("y", "p0", "d0", 2_000, 2_000, snap.now_ms)
    cluster = router.cluster(snap, None, "default", 0.0)
    by = {i.node_id: i for i in cluster.instances}
    assert by["p0"].queued_prefill_tokens == 10_000 and by["p0"].queued_requests == 3  # the heartbeat's, larger
    assert by["p1"].queued_prefill_tokens == 4_000 and by["p1"].queued_requests == 1  # the ledger's
    assert by["d0"].batch_size == 2 and by["d0"].decode_context_tokens == 6_000
    # A first token releases the prefill part at once, not at the next heartbeat.
    ledger.first_token("x", snap.now_ms)
    by = {i.node_id: i for i in router.cluster(snap, None, "default", 0.0).instances}
    assert by["p1"].queued_prefill_tokens == 0 and by["d0"].batch_size == 2


def test_a_capacity_group_counts_its_members_work() -> None:
    topo = topology_from_dict({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                               "capacity_groups": {"gpu0": ["a", "b"]}})
    assert topo.capacity_group("a") == ("a", "b") and topo.capacity_group("c") == ("c",)
    ledger = InMemoryInflight(1_000)
    own = OwnLoads(ledger, topo.capacity_group)
    ledger.charge("r", "a", "a", 500, 500, 10)
    assert own.load("b", 10).prefill_tokens == 500 and own.load("c", 10).prefill_tokens == 0
    assert own.take_touched(10) == {"a", "b"}
    assert own.take_touched(10) == set()
    ledger.finish("r", 20)
    assert own.take_touched(20) == {"a", "b"}
    with pytest.raises(ValueError, match="capacity groups"):
        Topology.model_validate({"links": topo.links.model_dump(), "capacity_groups": {"x": ["a"], "y": ["a"]}})


def test_own_extra_is_what_makes_each_quantity_the_larger() -> None:
    node = NodeState("n", "both", queue_depth=2, queued_prefill_tokens=100, batch_size=5, decode_context_tokens=50)
    assert own_extra(node, InstanceLoad(1, 1, 80, 1, 40)) is None
    e = own_extra(node, InstanceLoad(4, 3, 300, 2, 900))
    assert e is not None
    assert (e.prefill_tokens, e.prefill_requests, e.decode_requests, e.decode_context_tokens) == (200, 1, 0, 850)


@pytest.mark.parametrize(("ttfts", "held", "chosen", "want", "left"), [
    ([1.0, 0.9], [10, 0], 1, 0, False),      # 0.1 s better: inside 25 % of 1.0 s, stay
    ([1.0, 0.5], [10, 0], 1, 1, True),       # 0.5 s better: leave, and say why
    ([1.0, 0.5], [0, 0], 1, 1, False),       # no holder
    ([1.0, 0.5], [10, 10], 1, 1, False),     # the pick holds as long a prefix
    ([1.2, 1.0, 0.95], [8, 8, 0], 2, 1, False),  # two holders: the faster one is the holder
])
def test_stay_on_holder(ttfts: list[float], held: list[int], chosen: int, want: int, left: bool) -> None:
    at, why = stay_on_holder(ttfts, held, [f"p{i}" for i in range(len(ttfts))], chosen, 0.25)
    assert at == want and (why is not None) == left
    if why:
        assert why.startswith("holder p0 predicted 1.000s, p1 0.500s: better by 0.500s > margin 0.250s")


async def test_a_decision_that_leaves_the_holder_says_why() -> None:
    router, view, _, _ = make()
    heartbeat(view, "p0", queued_prefill_tokens=400_000, queue_depth=40)
    heartbeat(view, "p1")
    heartbeat(view, "d0", "decode")
    stored(view, "p0", chain_keys(PROMPT[:4 * BS], BS))
    out = await router.route(gw_request("r1", PROMPT))
    assert isinstance(out, RoutingDecision) and out.prefill_instance == "p1"
    assert out.left_holder is not None and out.left_holder.startswith("holder p0 predicted")


async def test_a_request_nobody_will_release_is_not_charged() -> None:
    # A producer of requests that never reports a first token or an end (not a gateway) would hold
    # its charge for the whole lease: its work is left to the engines' heartbeats.
    router, view, _, ledger = make()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    d = await router.route(token_request("r1", PROMPT))
    assert isinstance(d, RoutingDecision) and d.view_now_ms is not None
    assert not ledger.loads(d.view_now_ms)
    charged = await router.route(gw_request("r2", PROMPT))
    assert isinstance(charged, RoutingDecision) and charged.view_now_ms is not None
    assert ledger.load("p0", charged.view_now_ms).prefill_requests == 1
