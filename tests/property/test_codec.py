"""Every record round-trips through the codec; anything else raises DecodeError and only that."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    BODY_TYPES,
    SCHEMA_VERSIONS,
    AllBlocksCleared,
    BlocksMigrated,
    BlocksRemoved,
    BlocksStored,
    ControlCommand,
    DeadLetter,
    DecodeError,
    Heartbeat,
    KvCommand,
    KvCommandResult,
    RequestOutcome,
    RoutingDecision,
    RoutingRejection,
    RoutingRequest,
    decode,
    encode,
    envelope,
    headers,
)
from schemas.codec import MAX_RECORD_BYTES
from schemas.records import CapacityPlan

u64 = st.integers(0, 2**64 - 1)
names = st.text(min_size=1, max_size=20)
tiers = st.sampled_from(["hbm", "dram", "ssd"])
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=64)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=10),
                    st.floats(allow_nan=False))
params = st.dictionaries(names, scalars, max_size=4)

BODY_STRATEGIES = [
    st.builds(BlocksStored, block_keys=st.lists(u64, max_size=40), parent_key=st.none() | u64,
              token_ids=st.none() | tokens, block_size=st.integers(1, 512), tier=tiers,
              lora_name=st.none() | names, extra_keys=st.lists(scalars, max_size=3)),
    st.builds(BlocksRemoved, block_keys=st.lists(u64, max_size=40), tier=tiers),
    st.builds(AllBlocksCleared),
    st.builds(BlocksMigrated, mode=st.sampled_from(["migrate", "replicate"]), block_keys=st.lists(u64, max_size=20),
              from_node=names, from_tier=tiers, to_node=names, to_tier=tiers),
    st.builds(Heartbeat, role=st.sampled_from(["prefill", "decode", "both", "store"]), model=names,
              queue_depth=st.integers(0, 10**6), queued_prefill_tokens=st.integers(0, 10**9),
              running_requests=st.integers(0, 10**4), batch_size=st.integers(0, 10**4),
              decode_context_tokens=st.integers(0, 10**9), free_kv_blocks=st.integers(0, 10**9),
              total_kv_blocks=st.integers(0, 10**9),
              tier_capacity=st.dictionaries(tiers, st.integers(0, 10**9)), rack=st.none() | names,
              zone=st.none() | names),
    st.builds(RoutingRequest, request_id=names, block_keys=st.lists(u64, max_size=40), token_ids=st.none(),
              prompt_tokens=st.integers(0, 10**5), expected_output_tokens=st.integers(0, 10**4),
              ttft_slo_s=st.none() | st.floats(0.01, 100), tbt_slo_ms=st.none() | st.floats(1, 1000),
              priority=st.integers(-100, 100), cache_salt=st.none() | names,
              exclude=st.lists(names, max_size=3), retry_of=st.none() | names, reply_to=st.none() | names),
    st.builds(RoutingDecision, request_id=names, prefill_instance=names, decode_instance=names,
              reused_tokens=st.integers(0, 10**6), reuse_source=st.none() | names, reuse_tier=st.none() | tiers,
              predicted_ttft_s=st.floats(0, 1e4), predicted_tbt_ms=st.floats(0, 1e4), policy=names, params=params,
              seed=u64, watermark=st.dictionaries(names, st.integers(0, 2**62), max_size=4), degraded=st.booleans(),
              snapshot_age_ms=st.floats(0, 1e6), control_offset=st.integers(-1, 2**62),
              block_size=st.none() | st.integers(1, 4096), model_profile=st.none() | names),
    st.builds(RoutingRejection, request_id=names,
              reason=st.sampled_from(["ttft_slo", "tbt_slo", "no_live_instance", "overloaded", "invalid_request",
                                      "view_unavailable"]),
              message=st.text(max_size=50), policy=st.none() | names, params=params, seed=u64),
    st.builds(RequestOutcome, request_id=names, gateway=names, status=st.integers(100, 599),
              error=st.none() | names, attempts=st.lists(names, max_size=3), prefill_instance=st.none() | names,
              prompt_tokens=st.integers(0, 10**5), output_tokens=st.integers(0, 10**5),
              ttft_s=st.none() | st.floats(0, 1e4), tbt_p99_ms=st.none() | st.floats(0, 1e4)),
    st.builds(KvCommand, command_id=names.map(lambda n: n[:128]), action=st.just("replicate"),
              block_keys=st.lists(u64, min_size=1, max_size=10), from_node=st.just("holder"), from_tier=tiers,
              to_node=st.just("target"), to_tier=tiers, deadline_ms=st.none() | st.integers(0, 2**50),
              reason=st.text(max_size=20)),
    st.builds(KvCommand, command_id=st.just("c-1"), action=st.just("evict"),
              block_keys=st.lists(u64, min_size=1, max_size=10), from_node=names, from_tier=tiers),
    st.builds(KvCommandResult, command_id=st.just("c-1"), action=st.sampled_from(["replicate", "evict"]),
              node=names, status=st.sampled_from(["done", "expired"]), blocks=st.integers(0, 100),
              bytes_moved=st.integers(0, 2**40), duration_ms=st.floats(0, 1e6)),
    st.builds(DeadLetter, source_topic=names, partition=st.integers(0, 1000), offset=st.integers(0, 2**62),
              reason=names, error=st.text(max_size=100), original=st.binary(max_size=200)),
    st.one_of(
        st.builds(ControlCommand, action=st.sampled_from(["set_policy", "set_params"]), policy=names, params=params,
                  reason=st.text(max_size=20), operator=st.none() | names),
        st.builds(ControlCommand, action=st.sampled_from(["cordon", "drain", "uncordon"]), node_id=names),
    ),
    st.builds(CapacityPlan, prefill=st.integers(1, 10**4), decode=st.integers(1, 10**4),
              predicted_slo_attainment=st.floats(0, 1), cluster_prefill=st.integers(1, 10**4),
              cluster_decode=st.integers(1, 10**4), cluster_slo_attainment=st.floats(0, 1),
              target=st.floats(0.01, 1), growth=st.floats(0.1, 100), ttft_slo_s=st.floats(0.01, 1e3),
              tbt_slo_ms=st.floats(0.01, 1e4), policy=names, model_profile=names,
              window_start_ms=st.integers(0, 2**50), window_end_ms=st.integers(0, 2**50),
              requests=st.integers(0, 10**7), goodput_rps=st.floats(0, 1e6), rejection_rate=st.floats(0, 1),
              headroom=st.none() | st.floats(0, 10), simulations=st.integers(0, 1000)),
]
bodies = st.one_of(*BODY_STRATEGIES)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, seq=st.integers(0, 2**62), epoch=st.integers(0, 2**31), ts=st.integers(0, 2**50))
def test_every_record_round_trips(body, seq, epoch, ts):
    env = envelope(body, producer_id="node-1", producer_seq=seq, epoch=epoch, ts_ms=ts)
    assert decode(encode(env)) == env


def test_every_kind_is_covered_by_the_strategy():
    from hypothesis import Phase, find

    # Any example tells its kind: no shrinking to the smallest one (that took seconds a strategy).
    first = settings(phases=[Phase.generate], database=None)
    assert {find(s, lambda _: True, settings=first).kind for s in BODY_STRATEGIES} == set(BODY_TYPES)


def test_headers_carry_content_type_and_version():
    env = envelope(Heartbeat(role="decode"), producer_id="d0", producer_seq=1, ts_ms=5)
    h = dict(headers(env))
    assert h["schema"] == b"heartbeat"
    assert h["schema-version"] == str(SCHEMA_VERSIONS["heartbeat"]).encode()
    assert h["content-type"].startswith(b"application/")


def _wire(kind: str, version: int, body: dict) -> bytes:
    return msgpack.packb({"s": kind, "v": version, "id": "e1", "p": "n1", "q": 3, "e": 0, "t": 7, "b": body})


def test_heartbeat_v1_is_upcast():
    rec = decode(_wire("heartbeat", 1, {"role": "prefill", "queued_tokens": 1234}))
    assert rec.schema_version == SCHEMA_VERSIONS["heartbeat"]
    assert rec.body.queued_prefill_tokens == 1234
    assert rec.body.decode_context_tokens == 0


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),  # a reserved msgpack byte
        (msgpack.packb([1, 2, 3]), "malformed"),
        (msgpack.packb({"s": "heartbeat"}), "unsupported_version"),
        (_wire("no_such_kind", 1, {}), "unknown_schema"),
        (_wire("heartbeat", 99, {"role": "prefill"}), "unsupported_version"),
        (_wire("heartbeat", 2, {"role": "gpu"}), "invalid"),
        (_wire("blocks_removed", 1, {"block_keys": [-1]}), "invalid"),
        (_wire("blocks_stored", 1, {"tier": "hbm"}), "invalid"),  # neither keys nor tokens
        (_wire("blocks_removed", 1, {"block_keys": list(range(20_000))}), "invalid"),  # over the list cap
        (_wire("heartbeat", 2, {"role": "prefill", "surprise": 1}), "invalid"),
        (_wire("heartbeat", 2, {"role": "prefill", "kind": "dead_letter"}), "invalid"),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "too_large"),
    ],
)
def test_bad_input_raises_decode_error_with_reason(data, reason):
    with pytest.raises(DecodeError) as exc:
        decode(data)
    assert exc.value.reason == reason


def test_truncated_records_raise_decode_error():
    env = envelope(BlocksStored(block_keys=list(range(50)), tier="dram"), producer_id="p", producer_seq=1, ts_ms=1)
    data = encode(env)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decode(data[:cut])


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_garbage_raises_only_decode_error(data):
    try:
        decode(data)
    except DecodeError:
        pass


@settings(max_examples=300)
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=5),
                              st.binary(max_size=5), st.floats()),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                    max_leaves=20))
def test_any_msgpack_value_raises_only_decode_error(value):
    try:
        decode(msgpack.packb(value))
    except DecodeError:
        pass


def test_encode_refuses_bare_bodies():
    with pytest.raises(TypeError):
        encode(Heartbeat(role="prefill"))  # type: ignore[arg-type]
