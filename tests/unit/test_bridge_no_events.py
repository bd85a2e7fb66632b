"""``conductor bridge --no-events``: heartbeats only, no ZMQ socket, the node marked in the view."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from conductor.bridge.runner import Bridge, BridgeConfig, rank_configs
from conductor.bridge.serve import BridgeServeConfig
from conductor.errors import ConfigError
from schemas import SCHEMA_VERSIONS, AllBlocksCleared, Envelope, Heartbeat, decode, encode, envelope
from state.memory import InMemoryViewStore


class NoSockets:
    """A ZMQ context that fails the test if a socket is asked of it."""

    def socket(self, *_: object) -> None:
        raise AssertionError("a --no-events bridge opened a ZMQ socket")


class Out:
    def __init__(self) -> None:
        self.events: list[Envelope] = []
        self.heartbeats: list[Envelope] = []

    async def sink(self, envs: list[Envelope]) -> None:
        self.events.extend(envs)

    async def hb(self, envs: list[Envelope]) -> None:
        self.heartbeats.extend(envs)


async def test_a_bridge_without_events_heartbeats_the_node_as_such_and_opens_no_socket() -> None:
    out = Out()
    cfg = BridgeConfig(node_id="h0", role="both", zmq_endpoint=None, heartbeat_s=0.02, kv_events=False,
                       endpoint="http://10.0.0.9:8000")
    bridge = Bridge(cfg, out.sink, out.hb, clock_ms=lambda: 5_000, context=NoSockets())  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    await asyncio.wait_for(bridge.ready.wait(), 5)
    for _ in range(200):
        if len(out.heartbeats) >= 3:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert len(out.heartbeats) >= 3
    hb = out.heartbeats[-1].body
    assert isinstance(hb, Heartbeat)
    assert (hb.kv_events, hb.endpoint, hb.role) == (False, "http://10.0.0.9:8000", "both")
    # Its kv-events stream is the epoch's opening clear and nothing else: no block of it is confirmed.
    assert [(type(e.body), e.producer_seq) for e in out.events] == [(AllBlocksCleared, 0)]
    view = InMemoryViewStore()
    await view.apply([(e, None) for e in [*out.events, *out.heartbeats]])
    (node,) = await view.nodes()
    assert (node.node_id, node.kv_events, node.publishes_kv_events, node.blocks) == ("h0", False, False, {})


async def test_a_failing_heartbeat_sink_ends_the_bridge_with_its_error() -> None:
    async def broken(_: list[Envelope]) -> None:
        raise RuntimeError("sink gone")

    out = Out()
    cfg = BridgeConfig(node_id="h0", role="both", zmq_endpoint=None, heartbeat_s=0.01, kv_events=False)
    with pytest.raises(RuntimeError, match="sink gone"):
        await asyncio.wait_for(Bridge(cfg, out.sink, broken, context=NoSockets()).run(), 5)  # type: ignore[arg-type]


def test_a_bridge_with_events_announces_nothing_new() -> None:
    cfg = BridgeConfig(node_id="p", role="prefill", zmq_endpoint="tcp://h:1")
    assert cfg.announced()["kv_events"] is None  # its heartbeats stay as every v3 producer's
    assert [c.kv_events for c in rank_configs(node_id="e", dp_size=2, zmq_endpoint=None, replay_endpoint=None,
                                              role="both", heartbeat_s=1.0, kv_events=False)] == [False, False]
    with pytest.raises(ValueError, match="zmq_endpoint"):
        BridgeConfig(node_id="p", role="prefill", zmq_endpoint=None)
    with pytest.raises(ValueError, match="heartbeat_s"):
        BridgeConfig(node_id="p", role="prefill", zmq_endpoint=None, kv_events=False, heartbeat_s=None)


@pytest.mark.parametrize("kw, message", [
    ({}, "--zmq"),
    ({"kv_events": False, "zmq_endpoint": "tcp://h:5557"}, "drop --zmq"),
    ({"kv_events": False, "replay_endpoint": "tcp://h:5558"}, "drop --replay"),
    ({"kv_events": False, "max_tracked_blocks": 10}, "drop --max-tracked-blocks"),
    ({"kv_events": False, "heartbeat_s": 0.0}, "--heartbeat-s"),
    ({"kv_events": False, "execute_commands": True, "engine_url": "http://h:8000"}, "--execute-commands"),
])
def test_the_options_are_checked_against_no_events(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BridgeServeConfig(**{"zmq_endpoint": None, "node_id": "n", "role": "both", **kw})  # type: ignore[arg-type]


def test_no_events_config_reaches_every_rank() -> None:
    cfg = BridgeServeConfig(zmq_endpoint=None, node_id="n", role="decode", kv_events=False, dp_size=2,
                            metrics_url="http://h:8000/metrics")
    assert [(c.node_id, c.zmq_endpoint, c.kv_events) for c in cfg.rank_configs(16)] == [
        ("n-dp0", None, False), ("n-dp1", None, False)]


def test_the_flag_crosses_the_wire_and_a_v3_heartbeat_reads_as_publishing() -> None:
    hb = Heartbeat(role="both", total_kv_blocks=2048, kv_events=False)
    env = decode(encode(envelope(hb, producer_id="h0", producer_seq=1, ts_ms=5)))
    assert env.body == hb and env.schema_version == SCHEMA_VERSIONS["heartbeat"] == 4
    v3 = msgpack.packb({"s": "heartbeat", "v": 3, "id": "e1", "p": "h0", "q": 3, "e": 0, "t": 7,
                        "b": {"role": "both", "total_kv_blocks": 64}})
    old = decode(v3)
    assert isinstance(old.body, Heartbeat) and old.body.kv_events is None and old.schema_version == 4
