"""Decision-time knowledge in routing (issue 34): pending blocks seen by the next decision, the
router's own in-flight load instead of reservations, capacity groups, and the stay rule."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conductor.costmodel.costs import Costs
from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.routing.local import LocalRouter, LogUnavailable
from conductor.routing.own_load import OwnLoads, own_extra, shared
from conductor.routing.policies.parts import pick_lowest
from conductor.routing.policies.prefill_plan import (
    PendingCopy,
    ReusePlanner,
    fits_in_cache,
    spill_in_group,
    stay_on_holder,
)
from conductor.routing.router import Router
from conductor.routing.snapshot import Instance, PolicyRequest
from conductor.settings import load_settings
from conductor.topology import Topology, topology_from_dict
from schemas import BlocksRemoved, RoutingDecision, RoutingRequest, chain_keys, envelope
from state.inflight import InMemoryInflight, InstanceLoad
from state.memory import InMemoryViewStore
from state.pending import InMemoryPendingBlocks
from state.reservations import InMemoryReservations
from state.view import NodeState
from tests.unit.test_router import BS, heartbeat, now_ms, stored, token_request

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
    router, view, pending, ledger = make(incremental)
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


def test_a_group_mates_work_counts_whole_on_every_member() -> None:
    """The device runs the group's queue whichever member holds it: an idle member beside a busy
    one looks as busy as the busy one, so moving inside a group never looks cheaper."""
    busy = InstanceLoad(requests=3, prefill_requests=3, prefill_tokens=1_500, decode_requests=2,
                        decode_context_tokens=4_000)
    idle = InstanceLoad()
    on_idle = shared(idle, [busy])
    on_busy = shared(busy, [idle])
    assert on_idle == on_busy == busy
    both = shared(busy, [busy])
    assert (both.prefill_tokens, both.prefill_requests, both.decode_requests, both.requests) == (3_000, 6, 4, 6)


def test_a_members_heartbeat_counts_on_its_group_mates() -> None:
    """A heartbeat that still shows work the ledger has released (or traffic Conductor did not
    send) is the device's load: every member shows it, not only the one that reported it."""
    topo = topology_from_dict({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                               "capacity_groups": {"core1": ["a", "b"]}})
    own = OwnLoads(InMemoryInflight(1_000), topo.capacity_group)
    a = NodeState("a", "both", queue_depth=2, queued_prefill_tokens=900, batch_size=3, decode_context_tokens=700)
    b, c = NodeState("b", "both"), NodeState("c", "both", queue_depth=1, queued_prefill_tokens=50)
    assert own.hear((a, b, c)) == {"a", "b"}
    assert own.hear((a, b, c)) == set()  # the same snapshot: nothing new
    e = own.extra(b, 10)
    assert e is not None and (e.prefill_tokens, e.prefill_requests, e.decode_requests, e.decode_context_tokens) == \
        (900, 2, 3, 700)
    assert own.extra(a, 10) is None and own.extra(c, 10) is None  # its own heartbeat; no group
    assert own.hear((NodeState("a", "both"), b, c)) == {"a", "b"}
    assert own.extra(b, 10) is None


def test_ties_inside_a_capacity_group_go_to_one_member() -> None:
    """Equal TTFTs: across devices the seed picks (work spreads), inside one group the first
    member in node-id order takes them all (work gathers where one engine batches it)."""
    topo = topology_from_dict({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                               "capacity_groups": {"core1": ["b", "a"]}})
    nodes = ["b", "a", "c"]
    grouped = {pick_lowest(nodes, [1.0, 1.0, 1.0], random.Random(s), node_id=str, group_of=topo.capacity_group)
               for s in range(40)}
    assert grouped == {"a", "c"}
    assert {pick_lowest(nodes, [1.0, 1.0, 1.0], random.Random(s), node_id=str) for s in range(40)} == {"a", "b", "c"}
    # Not a tie: the lower score wins, group or not.
    assert pick_lowest(nodes, [0.5, 1.0, 1.0], random.Random(0), node_id=str, group_of=topo.capacity_group) == "b"


def test_a_group_gathers_on_the_first_member_whose_cache_takes_the_request() -> None:
    """Tied inside a group: the first member in node-id order that ``fits``, else the first."""
    topo = topology_from_dict({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                               "capacity_groups": {"core1": ["a", "b", "c"]}})
    nodes = ["c", "b", "a"]
    pick = lambda fits, s=0: pick_lowest(nodes, [1.0, 1.0, 1.0], random.Random(s), node_id=str,
                                         group_of=topo.capacity_group, fits=fits)
    assert pick(lambda n: True) == "a"
    assert pick(lambda n: n != "a") == "b"
    assert pick(lambda n: n == "c") == "c"
    assert pick(lambda n: False) == "a"  # every cache full: the group evicts where it gathers
    # Not a tie: the lower score wins even where it does not fit.
    assert pick_lowest(nodes, [1.0, 0.5, 1.0], random.Random(0), node_id=str, group_of=topo.capacity_group,
                       fits=lambda n: n != "b") == "b"


def test_a_request_fits_where_its_new_blocks_go_in_beside_the_cached_ones() -> None:
    inst = Instance("a", "both", prefix_blocks=(4, 4, 4), total_kv_blocks=100, resident_blocks=90)
    assert fits_in_cache(inst, 14) and not fits_in_cache(inst, 15)  # 10 new blocks fit, 11 do not
    assert fits_in_cache(Instance("a", "both", total_kv_blocks=100), 500)  # nothing known cached
    assert fits_in_cache(Instance("a", "both", resident_blocks=90), 500)  # no KV size reported


def grouped_router(tmp_path: Any, incremental: bool) -> tuple[Router, InMemoryViewStore]:
    """A router (and its view) that knows e0 and e1 as one capacity group."""
    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                                "capacity_groups": {"core1": ["e0", "e1"]}}))
    settings = load_settings(block_size=BS, policy="kvcache-centric", seed=7, topology_file=str(topo))
    view = InMemoryViewStore()
    return Router(settings, view, InMemoryReservations(settings.reservation_ttl_s), pending=InMemoryPendingBlocks(5_000),
                  inflight=InMemoryInflight(300_000), incremental=incremental), view


@pytest.mark.parametrize("incremental", [True, False])
async def test_a_groups_work_moves_to_the_next_member_once_the_first_ones_cache_is_full(incremental: bool,
                                                                                        tmp_path: Any) -> None:
    """The group's KV capacity is every member's cache: once e0 holds as many blocks as its KV
    size (its KV events say so), unrelated prompts gather on e1 instead of evicting e0's."""
    router, view = grouped_router(tmp_path, incremental)
    for n in ("e0", "e1"):
        heartbeat(view, n, "both", total_kv_blocks=40, free_kv_blocks=40)
    prompt = lambda i: list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BS))
    first = await router.route(gw_request("r0", prompt(0)))
    assert isinstance(first, RoutingDecision) and first.prefill_instance == "e0"
    stored(view, "e0", list(range(900_000, 900_035)))  # 35 of 40 blocks cached: 8 more do not fit
    heartbeat(view, "e0", "both", total_kv_blocks=40, free_kv_blocks=40)  # vLLM counts cached blocks free
    placed = []
    for i in range(1, 4):
        d = await router.route(gw_request(f"r{i}", prompt(i)))
        assert isinstance(d, RoutingDecision)
        placed.append(d.prefill_instance)
    assert placed == ["e1"] * 3
    # Both caches full: the group evicts on the first member again.
    stored(view, "e1", list(range(800_000, 800_035)))
    d = await router.route(gw_request("r9", prompt(9)))
    assert isinstance(d, RoutingDecision) and d.prefill_instance == "e0"


def test_a_full_cache_spills_to_a_group_mate_only_within_the_margin() -> None:
    group = {"a": ("a", "b"), "b": ("a", "b"), "c": ("c",)}.__getitem__
    full = Instance("a", "both", prefix_blocks=(2, 2, 2), total_kv_blocks=100, resident_blocks=95)
    room = Instance("b", "both", total_kv_blocks=100, resident_blocks=10)
    other = Instance("c", "both", total_kv_blocks=100)
    # A short shared prefix on a: b costs 10 % more, within the 25 % margin: spill, and say why.
    at, why = spill_in_group([full, room, other], [1.0, 1.1, 0.5], 20, 0, 0.25, group)
    assert at == 1 and why is not None and why.startswith("cache full on a (95 of 100 blocks held, 18 more needed)")
    # A long prefix on a (b would cost twice as much): stay, and evict there.
    assert spill_in_group([full, room], [1.0, 2.0], 20, 0, 0.25, group) == (0, None)
    # Room on a, or no group, or no mate in the group with room: nothing moves.
    assert spill_in_group([full, room], [1.0, 1.1], 5, 0, 0.25, group) == (0, None)
    assert spill_in_group([full, room], [1.0, 1.1], 20, 0, 0.25, None) == (0, None)
    assert spill_in_group([full, other], [1.0, 1.0], 20, 0, 0.25, group) == (0, None)


@pytest.mark.parametrize("incremental", [True, False])
@pytest.mark.parametrize("role", ["both", "prefill"])
async def test_a_shared_prefix_holder_with_a_full_cache_spills_to_its_group_mate(incremental: bool, role: str,
                                                                                 tmp_path: Any) -> None:
    """Every prompt starts with the same short system prompt, held by e0 alone, whose cache is
    full: the next prompt goes to its mate e1 (a few blocks more to compute, nothing evicted),
    aggregated or as a P/D prefill, with the reason in ``left_holder``; a conversation whose long
    context is on e0 stays there."""
    router, view = grouped_router(tmp_path, incremental)
    for n in ("e0", "e1"):
        heartbeat(view, n, role, total_kv_blocks=60, free_kv_blocks=60)
    if role == "prefill":
        heartbeat(view, "d0", "decode")
    system = list(range(1, 1 + 2 * BS))
    context = system + list(range(50_000, 50_000 + 30 * BS))
    stored(view, "e0", chain_keys(context, BS))  # 32 blocks: the system prompt and one long context
    stored(view, "e0", list(range(900_000, 900_025)))  # 57 of 60 held
    heartbeat(view, "e0", role, total_kv_blocks=60, free_kv_blocks=60)
    d = await router.route(gw_request("new", system + list(range(70_000, 70_000 + 8 * BS))))
    assert isinstance(d, RoutingDecision) and d.prefill_instance == "e1"
    assert d.left_holder is not None and d.left_holder.startswith("cache full on e0 (57 of 60 blocks held")
    turn = await router.route(gw_request("turn", context + list(range(80_000, 80_000 + 4 * BS))))
    assert isinstance(turn, RoutingDecision) and turn.prefill_instance == "e0" and turn.left_holder is None


@pytest.mark.parametrize("incremental", [True, False])
async def test_unrelated_requests_gather_on_one_member_of_a_capacity_group(incremental: bool, tmp_path: Any) -> None:
    """Two aggregated engines on one device take a stream of unrelated prompts: grouped, every
    one lands on the same member (its queue is the device's, whoever holds it); as two devices
    they spread, the work in flight on one making the other the shorter queue."""
    def route_all(topology_file: str | None) -> Any:
        settings = load_settings(block_size=BS, policy="kvcache-centric", seed=7, topology_file=topology_file)
        view = InMemoryViewStore()
        router = Router(settings, view, InMemoryReservations(settings.reservation_ttl_s),
                        pending=InMemoryPendingBlocks(5_000), inflight=InMemoryInflight(300_000),
                        incremental=incremental)
        for n in ("e1", "e0"):
            heartbeat(view, n, "both")
        return router

    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": 100}, "cross_rack": {"bandwidth_gbps": 10}},
                                "capacity_groups": {"core1": ["e0", "e1"]}}))
    placed: dict[str | None, list[str]] = {}
    for name, path in (("grouped", str(topo)), ("apart", None)):
        router = route_all(path)
        placed[name] = []
        for i in range(8):
            d = await router.route(gw_request(f"r{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BS))))
            assert isinstance(d, RoutingDecision) and d.left_holder is None
            placed[name].append(d.prefill_instance)
    assert placed["grouped"] == ["e0"] * 8
    assert set(placed["apart"]) == {"e0", "e1"}


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


def removed(store: InMemoryViewStore, node: str, keys: list[int]) -> None:
    store.apply_sync(envelope(BlocksRemoved(block_keys=keys), producer_id=node, producer_seq=next(_removals),
                              ts_ms=now_ms()))


_removals = itertools.count(1_000_000)


async def test_a_block_the_view_shows_is_confirmed_so_its_eviction_is_believed_at_once() -> None:
    router, view, pending, _ = make(remote_reuse=False)
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    keys = chain_keys(PROMPT, BS)
    first = await router.route(gw_request("r1", PROMPT))
    assert isinstance(first, RoutingDecision) and first.prefill_instance == "p0"
    stored(view, "p0", keys)  # the engine's own KV event: the view holds the prompt on p0
    second = await router.route(gw_request("r2", PROMPT))
    assert isinstance(second, RoutingDecision) and second.view_now_ms is not None
    assert second.reused_tokens == len(PROMPT)
    assert not pending.holds("p0", keys[-1], second.view_now_ms)  # the read confirmed what it showed
    removed(view, "p0", keys)  # evicted within the pending TTL: believed at once, not a TTL later
    third = await router.route(gw_request("r3", PROMPT))
    assert isinstance(third, RoutingDecision) and third.reused_tokens == 0


def test_confirm_held_writes_only_what_is_still_pending() -> None:
    store = InMemoryPendingBlocks(5_000)
    chain = [11, 12, 13, 14]
    store.record("r1", {"p0": chain}, 100)
    assert store.confirm_held(chain, {"p1": 4}, 110) == []  # nothing pending on p1
    ops = store.confirm_held(chain, {"p0": 2}, 110)
    assert [(op.node, op.blocks) for op in ops] == [("p0", (11, 12))]
    assert store.confirm_held(chain, {"p0": 2}, 120) == []  # a read showing nothing new writes nothing
    assert store.prefixes(chain, 130, {"p0": 2})["p0"].length == 4  # the rest still pending
    assert store.prefixes(chain, 130, {}) == {}  # the confirmed head left the view: the run stops there


# Long enough that copying the prefix over the rack link beats computing it.
LONG = list(range(20_000, 20_000 + 512 * BS))


@pytest.mark.parametrize("incremental", [True, False])
async def test_a_pending_prefix_is_not_copied_before_its_holder_made_it(incremental: bool) -> None:
    router, view, _, _ = make(incremental, stay_margin=0.0)
    heartbeat(view, "p0")
    heartbeat(view, "p1", queued_prefill_tokens=1, queue_depth=1)  # p0 first
    heartbeat(view, "d0", "decode")
    first = await router.route(gw_request("r1", LONG))
    assert isinstance(first, RoutingDecision) and first.prefill_instance == "p0"
    # p0 is now busy (its own prefill of LONG is charged to it): p1 is the faster instance, but the
    # blocks r1 placed on p0 do not exist until p0 has computed them: waiting for that and copying
    # costs more than computing them on p1.
    second = await router.route(gw_request("r2", LONG))
    assert isinstance(second, RoutingDecision)
    assert second.prefill_instance == "p1" and second.reused_tokens == 0 and second.reuse_source is None
    # Once the engine reports them, they are there to copy.
    stored(view, "p0", chain_keys(LONG, BS))
    third = await router.route(gw_request("r3", LONG))
    assert isinstance(third, RoutingDecision)
    assert third.reuse_source == "p0" and third.reused_tokens > 0


async def test_a_decision_the_log_did_not_take_releases_its_work_and_blocks() -> None:
    router, view, pending, ledger = make()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    local = LocalRouter(router.settings, producer_id="gw-1", router=router)
    local._started = True

    async def refuse(req: RoutingRequest, out: object) -> None:
        raise LogUnavailable("the broker did not take it")

    local._log = refuse  # type: ignore[method-assign]
    with pytest.raises(LogUnavailable):
        await local.decide(gw_request("r1", PROMPT))
    now = router.decision_time.last_ms + 1
    assert not ledger.loads(now) and not pending.prefixes(chain_keys(PROMPT, BS), now)


async def test_a_request_that_fails_before_its_first_token_releases_everything() -> None:
    router, view, pending, ledger = make()
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    d = await router.route(gw_request("r1", PROMPT))
    assert isinstance(d, RoutingDecision) and d.view_now_ms is not None
    assert ledger.load("p0", d.view_now_ms).prefill_tokens == len(PROMPT)
    router.decision_time.end("r1", d.view_now_ms + 5, failed=True)
    assert not ledger.loads(d.view_now_ms + 5)
    assert not pending.prefixes(chain_keys(PROMPT, BS), d.view_now_ms + 5)
    # and one that never reports ends by itself: its blocks after the TTL, its work after the lease
    d2 = await router.route(gw_request("r2", PROMPT))
    assert isinstance(d2, RoutingDecision) and d2.view_now_ms is not None
    t = d2.view_now_ms
    assert pending.prefixes(chain_keys(PROMPT, BS), t + 4_999) and not pending.prefixes(chain_keys(PROMPT, BS), t + 5_000)
    assert ledger.loads(t + 299_999) and not ledger.loads(t + 300_000)


@pytest.mark.parametrize("ready_s", [0.0, 0.05, 100.0])
def test_a_pending_prefix_is_copied_only_after_its_holder_is_ready(ready_s: float) -> None:
    """The planner's side of the rule: a copy of a holder's pending prefix costs the time until its
    prefill made it (``PendingCopy.ready_s``) on top of the copy; what the view confirms copies as before."""
    profile = load_profile(DEFAULT_PROFILE)
    costs = Costs(profile)
    request = PolicyRequest("r", prompt_tokens=8192, chain_len=512)
    holder = Instance("p0", "prefill", prefix_blocks=(512, 512, 512))  # 128 confirmed, 384 pending
    target = Instance("p1", "prefill")
    confirmed = (128, 128, 128)
    plain = ReusePlanner(costs, lambda: -1).plan(request, [holder], 16, remote=True, threshold=1.0,
                                                shapes=[confirmed])[0](target)
    best, floor, _ = ReusePlanner(costs, lambda: -1).plan(request, [holder], 16, remote=True, threshold=1.0,
                                                          shapes=[confirmed],
                                                          pending=[PendingCopy(0, (512, 512, 512), ready_s)])
    got = best(target)
    full = costs.remote_plan((512, 512, 512), request, 16, costs.link_index(holder, target))
    assert full is not None
    if ready_s + full[2] < plain.cost_s:
        assert (got.blocks, got.source) == (512, "p0") and got.cost_s == pytest.approx(ready_s + full[2])
    else:
        assert got == plain  # waiting does not pay: only what the view confirms is copied
    assert floor <= got.cost_s  # the index walk's lower bound stays a lower bound
    assert (ready_s == 100.0) == (got == plain)


async def test_a_decision_the_log_did_not_take_gives_its_reservation_back() -> None:
    """Without an own-load ledger a decision reserves its load (shared with every replica); a
    decision the broker refused is never served, so the reservation is taken back at once rather
    than counted until the instances' next heartbeats."""
    settings = load_settings(block_size=BS, policy="kvcache-centric", seed=7)
    view = InMemoryViewStore()
    reservations = InMemoryReservations(settings.reservation_ttl_s)
    router = Router(settings, view, reservations)
    heartbeat(view, "p0")
    heartbeat(view, "d0", "decode")
    local = LocalRouter(settings, producer_id="gw-1", router=router)
    local._started = True

    served = await local._decide(gw_request("r0", PROMPT), None)  # served: keeps its reservation
    assert isinstance(served, RoutingDecision) and served.view_now_ms is not None
    since = {"p0": 0, "d0": 0}
    kept = reservations.pending_sync(since, served.view_now_ms)
    assert kept["p0"].prefill_requests == 1 and kept["d0"].decode_requests == 1

    async def refuse(req: RoutingRequest, out: object) -> None:
        raise LogUnavailable("the broker did not take it")

    local._log = refuse  # type: ignore[method-assign]
    with pytest.raises(LogUnavailable):
        await local.decide(gw_request("r1", PROMPT[: 8 * BS]))
    after = reservations.pending_sync(since, served.view_now_ms + 1)
    assert after == kept  # r1's reservation is gone, r0's stays


async def test_a_spill_is_counted_for_dashboards(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(metrics, "get_meter", lambda name, *a, **k: provider.get_meter(name))
    router, view = grouped_router(tmp_path, True)
    for n in ("e0", "e1"):
        heartbeat(view, n, "both", total_kv_blocks=60, free_kv_blocks=60)
    system = list(range(1, 1 + 2 * BS))
    stored(view, "e0", [*chain_keys(system, BS), *range(900_000, 900_055)])
    d = await router.route(gw_request("new", system + list(range(70_000, 70_000 + 8 * BS))))
    assert isinstance(d, RoutingDecision) and d.prefill_instance == "e1"
    data = reader.get_metrics_data()
    points = [(dict(p.attributes or {}), p.value) for rm in (data.resource_metrics if data else ())
              for sm in rm.scope_metrics for m in sm.metrics if m.name == "conductor_router_left_holder"
              for p in m.data.data_points]
    assert points == [({"reason": "cache_full"}, 1)]
