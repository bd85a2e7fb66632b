"""The pure fold: table-driven cases and the duplicate-prefix property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    TIERS,
    AllBlocksCleared,
    BlocksMigrated,
    BlocksRemoved,
    BlocksStored,
    Heartbeat,
    RoutingRequest,
    chain_keys,
    envelope,
)
from state.fold import AddBlocks, ClearNode, NodeStream, RemoveBlocks, SetHeartbeat, SetStream, UnfoldableRecord, fold
from state.memory import InMemoryViewStore
from state.view import NodeState, Outcome

APPLIED, DUPLICATE, OLD_EPOCH = Outcome.APPLIED, Outcome.DUPLICATE, Outcome.OLD_EPOCH


def env(body, seq=0, epoch=0, node="n1", ts=100):
    return envelope(body, producer_id=node, producer_seq=seq, epoch=epoch, ts_ms=ts)


S = BlocksStored(block_keys=[1, 2])


@pytest.mark.parametrize(
    "stream, seq, epoch, outcome, gap, clears",
    [
        (NodeStream(), 0, 0, APPLIED, 0, False),  # first record
        (NodeStream(), 3, 0, APPLIED, 3, False),  # first record of an epoch above 0: a gap
        (NodeStream(epoch=0, seq=4), 5, 0, APPLIED, 0, False),  # in order
        (NodeStream(epoch=0, seq=4), 4, 0, DUPLICATE, 0, False),
        (NodeStream(epoch=0, seq=4), 2, 0, DUPLICATE, 0, False),
        (NodeStream(epoch=0, seq=4), 9, 0, APPLIED, 4, False),  # gap of 4
        (NodeStream(epoch=1, seq=4), 9, 0, OLD_EPOCH, 0, False),  # straggler from before a restart
        (NodeStream(epoch=1, seq=4), 0, 2, APPLIED, 0, True),  # restart: old blocks dropped
    ],
)
def test_kv_ordering(stream, seq, epoch, outcome, gap, clears):
    f = fold(env(S, seq=seq, epoch=epoch), stream)
    assert f.outcome == outcome
    assert f.gap == gap
    assert (ClearNode("n1") in f.ops) == clears
    if outcome == APPLIED:
        assert f.stream.epoch == epoch and f.stream.seq == seq
        assert f.stream.gaps == stream.gaps + (gap > 0) and f.stream.missed == stream.missed + gap
        assert f.ops[-1] == SetStream("n1", f.stream, prev=stream)
        assert AddBlocks("n1", 0, (1, 2)) in f.ops
    else:
        assert f.ops == () and f.stream == stream


def test_bodies_to_ops():
    assert fold(env(BlocksRemoved(block_keys=[3], tier="ssd"))).ops[0] == RemoveBlocks("n1", 2, (3,))
    assert fold(env(AllBlocksCleared())).ops[0] == ClearNode("n1")
    mig = fold(env(BlocksMigrated(block_keys=[5], from_node="a", from_tier="hbm", to_node="b", to_tier="dram"))).ops
    assert mig[:2] == (RemoveBlocks("a", 0, (5,)), AddBlocks("b", 1, (5,)))
    rep = fold(env(BlocksMigrated(mode="replicate", block_keys=[5], from_node="a", from_tier="hbm", to_node="b", to_tier="dram"))).ops
    assert rep[:1] == (AddBlocks("b", 1, (5,)),) and len(rep) == 2
    # a migration onto itself is a no-op move, not a removal
    same = fold(env(BlocksMigrated(block_keys=[5], from_node="a", from_tier="hbm", to_node="a", to_tier="hbm"))).ops
    assert same[:1] == (AddBlocks("a", 0, (5,)),)


def test_keys_derived_from_tokens():
    tokens = list(range(50))
    f = fold(env(BlocksStored(token_ids=tokens, block_size=16, parent_key=99, lora_name="x", tier="dram")))
    assert f.ops[0] == AddBlocks("n1", 1, tuple(chain_keys(tokens, 16, parent=99, lora_name="x")))
    assert len(f.ops[0].keys) == 3  # the trailing partial block has no key
    assert fold(env(BlocksStored(token_ids=[1, 2], block_size=16))).ops == (SetStream("n1", NodeStream(0, 0), prev=NodeStream()),)


def test_heartbeat_order_is_its_own():
    hb = Heartbeat(role="decode", batch_size=3, rack="r")
    s = NodeStream(epoch=0, seq=10)  # KV stream far ahead: heartbeats are not compared to it
    f = fold(env(hb, seq=0, ts=1234), s)
    assert f.outcome == APPLIED
    (set_hb, set_stream) = f.ops
    assert isinstance(set_hb, SetHeartbeat) and set_hb.state["last_heartbeat_ms"] == 1234
    assert set_hb.state["role"] == "decode" and set_hb.state["batch_size"] == 3
    assert set_stream.stream == NodeStream(epoch=0, seq=10, hb_epoch=0, hb_seq=0) and set_stream.part == "hb"
    assert fold(env(hb, seq=0), f.stream).outcome == DUPLICATE
    assert fold(env(hb, seq=0, epoch=1), f.stream).outcome == APPLIED  # a restarted engine


@pytest.mark.parametrize("said, stored", [(False, False), (True, True), (None, "absent")])
def test_a_heartbeat_says_whether_its_node_publishes_kv_events(said, stored):
    """``kv_events`` reaches the view only when a heartbeat says it (v4): a node that says nothing
    is stored as before v4, and reads None (it publishes them)."""
    (set_hb, _) = fold(env(Heartbeat(role="both", total_kv_blocks=512, kv_events=said))).ops
    assert isinstance(set_hb, SetHeartbeat)
    assert set_hb.state.get("kv_events", "absent") == stored and set_hb.state["total_kv_blocks"] == 512
    node = NodeState(node_id="n1", **set_hb.state)
    assert node.kv_events is said and node.publishes_kv_events is (said is not False)


def test_wrong_kind_is_unfoldable():
    with pytest.raises(UnfoldableRecord) as e:
        fold(env(RoutingRequest(request_id="r", block_keys=[1], prompt_tokens=16)))
    assert e.value.reason == "wrong_kind"


def test_the_in_memory_store_keeps_the_stream_state():
    store = InMemoryViewStore()
    assert store.apply_sync(env(S, seq=0)) == APPLIED
    assert store.apply_sync(env(S, seq=0)) == DUPLICATE
    assert store.streams_sync(["n1"])["n1"].seq == 0


# --- the property: re-delivering any prefix of a stream changes nothing ------------

NODES = ("a", "b", "c")
keys_st = st.lists(st.integers(0, 30), min_size=1, max_size=5)


@st.composite
def event_streams(draw):
    """A per-node ordered stream of KV events and heartbeats, interleaved across nodes."""
    n = draw(st.integers(1, 40))
    seq = {x: 0 for x in NODES}
    hb_seq = {x: 0 for x in NODES}
    epoch = {x: 0 for x in NODES}
    out = []
    for _ in range(n):
        node = draw(st.sampled_from(NODES))
        kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared", "migrated", "heartbeat", "restart"]))
        if kind == "heartbeat":
            body = Heartbeat(role="prefill", queue_depth=draw(st.integers(0, 5)))
            out.append(envelope(body, producer_id=node, producer_seq=hb_seq[node], ts_ms=draw(st.integers(1, 10**6))))
            hb_seq[node] += 1
            continue
        if kind == "restart":
            epoch[node] += 1
            seq[node] = draw(st.integers(0, 1))
            body = BlocksStored(block_keys=draw(keys_st))
        elif kind == "stored":
            body = BlocksStored(block_keys=draw(keys_st), tier=draw(st.sampled_from(TIERS)))
        elif kind == "removed":
            body = BlocksRemoved(block_keys=draw(keys_st), tier=draw(st.sampled_from(TIERS)))
        elif kind == "cleared":
            body = AllBlocksCleared()
        else:
            body = BlocksMigrated(
                mode=draw(st.sampled_from(["migrate", "replicate"])), block_keys=draw(keys_st),
                from_node=node, from_tier=draw(st.sampled_from(TIERS)),
                to_node=draw(st.sampled_from(NODES)), to_tier=draw(st.sampled_from(TIERS)),
            )
        out.append(envelope(body, producer_id=node, producer_seq=seq[node], epoch=epoch[node], ts_ms=1))
        seq[node] += draw(st.sampled_from([1, 1, 1, 3]))  # sometimes a gap
    return out


def folded_view(envs):
    store = InMemoryViewStore()
    for e in envs:
        store.apply_sync(e)  # no positions: only the fold's own dedupe protects the view
    return store.dump_sync()


@settings(max_examples=150, deadline=None)
@given(event_streams(), st.data())
def test_duplicated_prefix_folds_like_once(envs, data):
    k = data.draw(st.integers(0, len(envs)))
    assert folded_view(envs[:k] + envs) == folded_view(envs)


@settings(max_examples=100, deadline=None)
@given(event_streams(), st.data())
def test_each_record_redelivered_later_changes_nothing(envs, data):
    """A redelivery may come any time after the original, per node (keys keep per-node order)."""
    redelivered = list(envs)
    for i in data.draw(st.lists(st.integers(0, max(len(envs) - 1, 0)), max_size=10)):
        if envs:
            first = next(p for p, x in enumerate(redelivered) if x is envs[i])
            redelivered.insert(data.draw(st.integers(first + 1, len(redelivered))), envs[i])
    assert folded_view(redelivered) == folded_view(envs)
