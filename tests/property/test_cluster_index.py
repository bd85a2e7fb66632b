"""The router's incremental cluster picture (``conductor.routing.index``) against the builder.

Over random sequences of reads (node states changing, heartbeats aging past the TTL, nodes
joining and leaving, reservations made and expiring, the clock moving), the index's snapshot
is ``build_cluster``'s of the same read and reservations, instance for instance; and
``kvcache-centric`` deciding with the index (holders and shortest queues only) decides exactly
as it does over every instance, seed for seed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.routing.index import ClusterIndex
from conductor.routing.policies import make_policy
from conductor.routing.snapshot import PolicyRequest, build_cluster
from state.reservations import InMemoryReservations, Load, Reservation
from state.view import NodeState, ViewSnapshot

PROFILE = load_profile(DEFAULT_PROFILE)
BS = 512
TTL_S = 2.0
ROLES = ["prefill", "prefill", "prefill", "decode", "decode", "store", "both"]
PLACES = [("r0", "z0"), ("r1", "z0"), ("r2", "z1"), (None, None), ("r3", None)]


def node_state(rng: random.Random, node: str, role: str, now: int) -> NodeState:
    rack, zone = rng.choice(PLACES) if not node.endswith("x") else PLACES[0]
    depth = rng.choice([0, 0, 1, 3])
    return NodeState(
        node_id=node, role=role,  # type: ignore[arg-type]
        model=rng.choice(["m", "m", "m", "other"]),
        last_heartbeat_ms=now - rng.choice([0, 0, 500, 1500, 2500]),
        queue_depth=depth, queued_prefill_tokens=depth * rng.choice([0, 512, 4000, 30_000]),
        batch_size=rng.choice([0, 8, 8, 32]), decode_context_tokens=rng.choice([0, 50_000, 400_000]),
        free_kv_blocks=rng.choice([10, 20_000, 60_000]), total_kv_blocks=rng.choice([0, 80_000]),
        rack=rack, zone=zone,
    )


def prefix(rng: random.Random) -> tuple[int, int, int]:
    return rng.choice([(0, 0, 0), (16, 16, 16), (0, 8, 8), (2, 2, 40), (64, 64, 64), (0, 0, 3)])


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 40))
def test_the_index_is_the_builders_picture_read_after_read(seed: int, size: int) -> None:
    rng = random.Random(seed)
    now = 1_000_000
    names = [f"n{i:02d}" for i in range(size)]
    states = {n: node_state(rng, n, rng.choice(ROLES), now) for n in names}
    nodes = tuple(states[n] for n in sorted(states))
    resv = InMemoryReservations(ttl_s=1.5)
    ix = ClusterIndex(PROFILE, block_size=BS, ttl_s=TTL_S, model="m", exclude={"n01"})
    policy = make_policy("kvcache-centric", {"prefill_tie_s": rng.choice([0.0, 1e-6, 0.05]),
                                             "early_rejection": rng.random() < 0.8,
                                             "queue_wait_safety": rng.choice([1.0, 2.0])}, PROFILE)
    answers: list[dict] = []
    for _ in range(25):
        step = rng.random()
        if step < 0.4:  # some nodes report (new state objects); the others are handed out as they were
            for n in rng.sample(sorted(states), k=min(rng.randint(1, 3), len(states))):
                role = states[n].role if rng.random() < 0.9 else rng.choice(ROLES)  # a restart in another role
                states[n] = node_state(rng, n, role, now)
            nodes = tuple(states[n] for n in sorted(states))
        elif step < 0.5:  # a node joins or leaves
            if rng.random() < 0.5 and len(states) > 2:
                del states[rng.choice(sorted(states))]
            else:
                n = f"n{rng.randint(0, 99):02d}x"
                states[n] = node_state(rng, n, rng.choice(ROLES), now)
            nodes = tuple(states[n] for n in sorted(states))
        for n in rng.sample(sorted(states), k=min(rng.randint(0, 2), len(states))):  # decisions reserve
            resv.reserve_sync([Reservation(n, Load(rng.choice([512, 9000]), 1, 1, 4000, 20))],
                              now - rng.choice([0, 0, 300]))
        now += rng.choice([0, 1, 200, 700, 1600])
        if answers and rng.random() < 0.4:  # a hot chain read again: the reader's walk hands out its answer
            found = rng.choice(answers)
        else:
            found = {n: prefix(rng) for n in rng.sample(sorted(states), k=min(4, len(states)))}
            answers.append(found)
        view = ViewSnapshot(now, nodes, found, {"kv-events:0": now})
        ix.touch(resv.take_touched())
        ix.update(view, resv.pending_one)
        got = ix.snapshot(view)
        pending = resv.pending_sync({n.node_id: n.last_heartbeat_ms for n in nodes}, now)
        want = build_cluster(view, pending, block_size=BS, ttl_s=TTL_S, model="m", exclude={"n01"})
        assert got == want
        holders = got.index.holders
        for rack, _ in PLACES:
            assert list(got.index.rack_holders.get(rack, ())) == [i for i, h in enumerate(holders) if h.rack == rack]
        assert got.index.prefill_shapes == {s for h, s in zip(holders, got.index.shapes) if h.role in ("prefill", "both")}
        tokens = rng.choice([600, 9000, 40_000, 70_000])
        req = PolicyRequest("r", tokens, min(tokens // BS, 80), ttft_slo_s=rng.choice([0.5, 2.0, 30.0]),
                            tbt_slo_ms=rng.choice([40.0, 100.0]), priority=rng.choice([-100, -30, 0, 0, 70, 100]))
        s = rng.getrandbits(32)
        assert policy.decide(req, got, random.Random(s)) == policy.decide(req, want, random.Random(s))
    assert ix.rebuilds >= 1


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 160))
def test_the_decode_band_from_the_index_is_the_exhaustive_one(seed: int, decodes: int) -> None:
    """Many decode instances, loads drawn from few values (exact ties, and TBTs on the edge of
    the low-load band), some without room or all with it: the pick from the index's load order, which
    computes TBTs only near the band's edge, equals the exhaustive scan's, seed for seed."""
    rng = random.Random(seed)
    now = 1_000_000
    band = rng.choice([0.0, 0.001, 0.05, 0.1, 0.5, 5.0])
    policy = make_policy("kvcache-centric", {"decode_low_load_band": band,
                                             "early_rejection": rng.random() < 0.8}, PROFILE)
    full = make_policy("kvcache-centric", {"decode_low_load_band": band,
                                           "early_rejection": policy.p.early_rejection}, PROFILE)
    full.prune_candidates = False
    batches = [rng.randint(0, 64) for _ in range(3)]
    frees = [10, 60_000, 60_000] if rng.random() < 0.5 else [60_000]  # or every instance has room
    contexts = [rng.choice([0, 1, 4096, 50_000, 400_000, 400_000, -100_000]) for _ in range(3)]  # < 0: not from heartbeats
    nodes = [NodeState(node_id="p0", role="prefill", model="m", last_heartbeat_ms=now)]
    for i in range(decodes):
        nodes.append(NodeState(
            node_id=f"d{rng.randint(0, 10**6):07d}-{i}", role=rng.choice(["decode", "decode", "both"]), model="m",
            last_heartbeat_ms=now, batch_size=rng.choice(batches), decode_context_tokens=rng.choice(contexts),
            free_kv_blocks=rng.choice(frees), total_kv_blocks=rng.choice([0, 80_000, 80_000]),
        ))
    rng.shuffle(nodes)  # a read's node order need not be the node-id order ties are picked in
    view = ViewSnapshot(now, tuple(nodes), {}, {"kv-events:0": now})
    ix = ClusterIndex(PROFILE, block_size=BS, ttl_s=TTL_S, model="m")
    resv = InMemoryReservations(ttl_s=1.5)
    ix.update(view, resv.pending_one)
    got = ix.snapshot(view)
    want = build_cluster(view, resv.pending_sync({n.node_id: now for n in nodes}, now), block_size=BS, ttl_s=TTL_S,
                         model="m")
    for _ in range(5):
        tokens = rng.choice([600, 9000, 40_000, 70_000])
        req = PolicyRequest("r", tokens, tokens // BS, ttft_slo_s=30.0, tbt_slo_ms=rng.choice([20.0, 40.0, 100.0, 1e4]),
                            priority=rng.choice([-100, 0, 0, 100]))
        s = rng.getrandbits(32)
        assert policy.decide(req, got, random.Random(s)) == full.decide(req, want, random.Random(s))


def test_decode_instances_exactly_on_the_bands_edge_are_in_it_when_all_have_room() -> None:
    """Two load levels, the band as wide as the higher level's TBT over the lower one's (so the
    higher instances sit on its edge) and room on every instance: the index's pick (the band's
    inside read as id ranks, the edge computed) is the exhaustive one, and both levels win."""
    now = 1_000_000
    req = PolicyRequest("r", 9000, 9000 // BS, ttft_slo_s=30.0, tbt_slo_ms=1e4)
    low = {"batch_size": 8, "decode_context_tokens": 20_000}
    high = {"batch_size": 24, "decode_context_tokens": 90_000}
    probe = make_policy("kvcache-centric", {}, PROFILE)
    tbt = [probe.costs.tbt_ms(build_cluster(ViewSnapshot(now, (NodeState(node_id="x", role="decode", model="m",
                                                                           last_heartbeat_ms=now, **kw),), {}, {}),
                                            {}, block_size=BS, ttl_s=TTL_S, model="m").instances[0], req)
           for kw in (low, high)]
    band = tbt[1] / tbt[0] - 1.0
    policy = make_policy("kvcache-centric", {"decode_low_load_band": band}, PROFILE)
    full = make_policy("kvcache-centric", {"decode_low_load_band": band}, PROFILE)
    full.prune_candidates = False
    nodes = [NodeState(node_id="p0", role="prefill", model="m", last_heartbeat_ms=now)]
    nodes += [NodeState(node_id=f"d{i}", role="decode", model="m", last_heartbeat_ms=now, free_kv_blocks=60_000,
                        total_kv_blocks=80_000, **(low if i % 3 else high)) for i in range(12)]
    view = ViewSnapshot(now, tuple(nodes), {}, {"kv-events:0": now})
    ix = ClusterIndex(PROFILE, block_size=BS, ttl_s=TTL_S, model="m")
    ix.update(view, InMemoryReservations(ttl_s=1.5).pending_one)
    got = ix.snapshot(view)
    want = build_cluster(view, {}, block_size=BS, ttl_s=TTL_S, model="m")
    picked = set()
    for s in range(60):
        d = policy.decide(req, got, random.Random(s))
        assert d == full.decide(req, want, random.Random(s))
        picked.add(d.decode)
    assert {"d0", "d3"} & picked and {"d1", "d2"} & picked  # the edge's instances and the inside's


def test_a_remembered_holder_set_follows_a_holder_changing_rack_or_role() -> None:
    """The index remembers a hot chain's holders (per answer object, while the node order
    stands); a holder restarting in another rack or role is seen at the next read."""
    now = 1_000_000
    nodes = [NodeState(node_id="a", role="prefill", model="m", last_heartbeat_ms=now, rack="r0"),
             NodeState(node_id="b", role="store", model="m", last_heartbeat_ms=now, rack="r1"),
             NodeState(node_id="d", role="decode", model="m", last_heartbeat_ms=now, rack="r0")]
    found = {"a": (4, 4, 4), "b": (0, 8, 8)}  # one answer object, read again and again
    ix = ClusterIndex(PROFILE, block_size=BS, ttl_s=TTL_S, model="m")
    resv = InMemoryReservations(ttl_s=1.5)

    def read(states: list[NodeState]):
        view = ViewSnapshot(now, tuple(states), found, {"kv-events:0": now})
        ix.update(view, resv.pending_one)
        return ix.snapshot(view).index

    first = read(nodes)
    assert first.prefill_shapes == {(4, 4, 4)} and dict(first.rack_holders) == {"r0": (0,), "r1": (1,)}
    assert read(list(nodes)).groups is first.groups  # unchanged: remembered
    role = [nodes[0], NodeState(node_id="b", role="prefill", model="m", last_heartbeat_ms=now, rack="r1"), nodes[2]]
    again = read(role)
    assert again.prefill_shapes == {(4, 4, 4), (0, 8, 8)} and dict(again.rack_holders) == {"r0": (0,), "r1": (1,)}
    rack = [role[0], NodeState(node_id="b", role="prefill", model="m", last_heartbeat_ms=now, rack="r0"), nodes[2]]
    assert dict(read(rack).rack_holders) == {"r0": (0, 1)}
