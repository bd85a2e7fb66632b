"""Topologies: which link a transfer crosses, what it costs, and a bad file named at start-up."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from conductor.balance.planner import BalanceParams, Cooldown, plan
from conductor.costmodel.profiles import DEFAULT_PROFILE, load_profile
from conductor.errors import ConfigError
from conductor.harness.engine.serve import placed_heartbeats
from conductor.routing.policies import make_policy
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest
from conductor.settings import load_settings
from conductor.topology import flat_topology, load_topology, topology_from_dict
from schemas import Heartbeat, envelope
from state.view import NodeState, ViewSnapshot

PROFILE = load_profile(DEFAULT_PROFILE)

TOPO = {
    "name": "t",
    "links": {
        "same_rack": {"bandwidth_gbps": 800, "latency_us": 10},
        "cross_rack": {"bandwidth_gbps": 80, "latency_us": 100, "transport": "tcp"},
        "cross_zone": {"bandwidth_gbps": 8, "latency_us": 1000, "transport": "tcp"},
    },
    "racks": {"a": {"zone": "z1"}, "b": {"zone": "z1"}, "c": {"zone": "z2"}, "d": {"zone": "z2"}},
    "rack_pairs": [{"racks": ["c", "d"], "link": {"bandwidth_gbps": 400, "latency_us": 20}}],
    "nodes": {"n-fixed": {"rack": "c"}},
}


def node(node_id: str, rack: str | None = None, zone: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, rack=rack, zone=zone)


@pytest.mark.parametrize(
    "a,b,gbps,key",
    [
        (node("x", "a"), node("y", "a"), 800, ("pair", "x", "y")),
        (node("x", "a"), node("y", "b"), 80, ("racks", "a", "b")),  # zone z1 both
        (node("x", "a"), node("y", "c"), 8, ("zones", "z1", "z2")),
        (node("x", "c"), node("y", "d"), 400, ("racks", "c", "d")),  # the pair's own link beats the zone rule
        (node("x", "a"), node("n-fixed"), 8, ("zones", "z1", "z2")),  # the file places a silent node
        (node("x", "a"), node("y"), 80, ("racks", "", "a")),  # one rack unknown: cross-rack
        (node("x"), node("y"), 800, ("pair", "x", "y")),  # nothing known: one rack
        (node("x", "q", "z1"), node("y", "r", "z9"), 8, ("zones", "z1", "z9")),  # heartbeat zones
    ],
)
def test_the_link_between_two_nodes(a, b, gbps, key) -> None:
    t = topology_from_dict(TOPO)
    k, link = t.path(a, b)
    assert (k, link.bandwidth_gbps) == (key, gbps)
    assert t.link_between(b, a) == link


def test_link_seconds_by_hand() -> None:
    t = topology_from_dict(TOPO)
    link = t.links.cross_rack  # 80 Gb/s = 1e10 B/s, 100 us
    assert link.seconds(5e9) == pytest.approx(1e-4 + 0.5)
    assert link.seconds(5e9, read_s=2.0) == pytest.approx(1e-4 + 2.0)  # a slow source bounds it
    assert link.seconds(0) == 0.0


def test_flat_topology_costs_what_the_profile_did() -> None:
    flat = flat_topology(PROFILE)
    for same in (True, False):
        link = flat.links.same_rack if same else flat.links.cross_rack
        for toks in ((0, 4096, 0), (1024, 0, 8192), (512, 512, 512)):
            assert PROFILE.prefix_load_seconds(*toks, remote=True, link=link) == pytest.approx(
                PROFILE.prefix_load_seconds(*toks, remote=True, same_rack=same))


@pytest.mark.parametrize(
    "data,where",
    [
        ({"links": {"same_rack": {"bandwidth_gbps": 0}, "cross_rack": {"bandwidth_gbps": 1}}}, "links.same_rack.bandwidth_gbps"),
        ({"links": {"same_rack": {"bandwidth_gbps": 1}}}, "links.cross_rack"),
        ({**TOPO, "rack_pairs": [{"racks": ["a", "zz"], "link": {"bandwidth_gbps": 1}}]}, "rack_pairs"),
        ({**TOPO, "links": {**TOPO["links"], "same_rack": {"bandwidth_gbps": 1, "transport": "ib"}}}, "transport"),
    ],
)
def test_bad_topology_names_the_field(data, where) -> None:
    with pytest.raises(ConfigError, match=where.split(".")[0]) as e:
        topology_from_dict(data)
    assert where.split(".")[-1] in str(e.value) or "rack" in str(e.value)


def test_settings_fail_at_start_up_on_a_bad_topology_file(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "topo.json"
    bad.write_text(json.dumps({"links": {"same_rack": {"bandwidth_gbps": -1}, "cross_rack": {"bandwidth_gbps": 1}}}))
    monkeypatch.setenv("CONDUCTOR_TOPOLOGY_FILE", str(bad))
    with pytest.raises(ConfigError, match=r"topology_file \(CONDUCTOR_TOPOLOGY_FILE\).*bandwidth_gbps"):
        load_settings()
    monkeypatch.setenv("CONDUCTOR_TOPOLOGY_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="topology_file.*cannot read"):
        load_settings()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(TOPO))
    monkeypatch.setenv("CONDUCTOR_TOPOLOGY_FILE", str(good))
    assert load_settings().cluster_topology() == load_topology(good)


def test_the_policy_reads_a_prefix_over_the_cheapest_link() -> None:
    # Two holders of the same 64-block prefix: one across zones (8 Gb/s), one in a rack
    # paired with the prefill's rack (400 Gb/s). Recomputing costs more than either copy.
    t = topology_from_dict(TOPO)
    pol = make_policy("kvcache-centric", {}, PROFILE, t)
    far = Instance("far", "store", prefix_blocks=(64, 64, 64), rack="a")
    near = Instance("near", "store", prefix_blocks=(64, 64, 64), rack="d")
    p = Instance("p", "prefill", rack="c")
    d = Instance("d", "decode", rack="c")
    req = PolicyRequest("r", 64 * 16 + 100, 64, ttft_slo_s=60)
    out = pol.decide(req, ClusterSnapshot((far, near, p, d), 16), random.Random(0))
    assert out.reuse_source == "near"  # type: ignore[union-attr]
    nbytes = 64 * 16 * PROFILE.kv_bytes_per_token
    expect = t.rack_pairs[0].link.seconds(nbytes) + PROFILE.prefill_seconds(64 * 16 + 100, 64 * 16)
    assert out.predicted_ttft_s == pytest.approx(expect)  # type: ignore[union-attr]


def test_engine_heartbeats_get_the_rack_and_zone_flags() -> None:
    sent: list = []

    async def sink(envs):
        sent.extend(envs)

    placed = placed_heartbeats(sink, "rack-a", "zone-1")
    hb = envelope(Heartbeat(role="prefill"), producer_id="n1", producer_seq=0, ts_ms=1)
    own = envelope(Heartbeat(role="prefill", rack="mine"), producer_id="n1", producer_seq=1, ts_ms=2)
    asyncio.run(placed([hb, own]))
    assert [(e.body.rack, e.body.zone) for e in sent] == [("rack-a", "zone-1"), ("mine", "zone-1")]
    assert [e.producer_seq for e in sent] == [0, 1]
    assert placed_heartbeats(sink, None, None) is sink


def test_balance_copies_from_the_holder_with_the_cheapest_path() -> None:
    t = topology_from_dict(TOPO)
    chain = (1, 2, 3)
    nodes = (
        NodeState("h-far", "prefill", queued_prefill_tokens=50_000, rack="a", last_heartbeat_ms=1),
        NodeState("h-near", "prefill", queued_prefill_tokens=60_000, rack="d", last_heartbeat_ms=1),
        NodeState("target", "prefill", queued_prefill_tokens=0, rack="c", last_heartbeat_ms=1),
    )
    snap = ViewSnapshot(nodes=nodes, prefix={"h-far": (3, 3, 3), "h-near": (3, 3, 3)}, watermark={}, now_ms=1)
    params = BalanceParams(hot_threshold=1, overload_tokens=1000, overload_factor=1.0)
    kwargs = {"ttl_s": 1e9, "now_s": 0.0, "params": params}
    flat_cmd, = plan([(chain, 10.0)], [], {chain: snap}, cooldown=Cooldown(), **kwargs)
    assert flat_cmd.from_node == "h-far"  # least queued without a topology
    topo_cmd, = plan([(chain, 10.0)], [], {chain: snap}, cooldown=Cooldown(), topology=t,
                     kv_bytes_per_block=1e9, **kwargs)
    assert (topo_cmd.from_node, topo_cmd.to_node) == ("h-near", "target")
    assert "400 Gb/s" in topo_cmd.reason
