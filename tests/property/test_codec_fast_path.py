"""The codec's fast path for plain block events decides exactly as validation does: on any bytes,
``decode`` with it and without it return equal envelopes (same values, same fields set) or raise
the same ``DecodeError`` (reason and message)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from schemas import BlocksRemoved, BlocksStored, DecodeError, Envelope, codec, decode, encode, envelope
from schemas.records import MAX_BLOCKS, SCHEMA_VERSIONS

# Values that sit on either side of what validation takes: the bounds of a u64 (as far as msgpack goes), bools (ints to
# Python), floats that equal ints, strings of digits, None.
near_ints = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 2**64 - 1, 2**63, -1, -(2**63)]),
    st.booleans(),
    st.sampled_from([1.0, 2.5, float(2**40)]),
    st.sampled_from(["7", "", "x"]),
    st.none(),
)
mostly_keys = st.lists(st.one_of(st.integers(0, 2**64 - 1), near_ints), max_size=12)
names = st.one_of(st.text(max_size=3), st.sampled_from(["n" * 64, "n" * 65, "n" * 256, "n" * 257, "é" * 200]))
maybe = st.sampled_from(["absent", "value"])


@st.composite
def wire_records(draw: Any) -> dict[str, Any]:
    """An envelope as its producer put it on the wire (short field names), near a plain block
    event: each field present or absent, of the right or a wrong type."""
    kind = draw(st.sampled_from(["blocks_stored", "blocks_removed", "heartbeat", "all_blocks_cleared"]))
    body: dict[str, Any] = {}
    if draw(maybe) == "value":
        body["block_keys"] = draw(st.one_of(mostly_keys, mostly_keys.map(tuple), st.none(), st.integers(0, 3)))
    if draw(maybe) == "value":
        body["tier"] = draw(st.one_of(st.sampled_from(["hbm", "dram", "ssd", "HBM", "gpu", b"hbm"]), st.integers(0, 2)))
    if draw(maybe) == "value":
        body["kind"] = draw(st.sampled_from([kind, "blocks_stored", "blocks_removed", 3]))
    if draw(maybe) == "value":
        body["node"] = draw(st.one_of(names, st.none(), st.integers(0, 2)))
    if draw(maybe) == "value":
        body["block_size"] = draw(st.one_of(st.sampled_from([16, 0, 1, 4096, 4097]), near_ints))
    if draw(maybe) == "value":
        body["extra_keys"] = draw(st.sampled_from([[], [1], (), None, "x"]))
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.sampled_from(["token_ids", "parent_key", "lora_name", "extra"]))] = draw(near_ints)
    wire: dict[str, Any] = {"s": draw(st.sampled_from([kind, kind, "blocks_stored"])), "b": body}
    version = SCHEMA_VERSIONS[wire["s"]]
    wire["v"] = draw(st.sampled_from([version, version, version - 1 if version > 1 else version, True]))
    for short, values in (
        ("id", st.one_of(names, st.integers(0, 3))),
        ("p", st.one_of(names, st.integers(0, 3))),
        ("q", near_ints),
        ("e", near_ints),
        ("t", near_ints),
    ):
        if draw(st.integers(0, 4)) > 0:
            wire[short] = draw(values)
    return wire


def _slow_decode(data: bytes, monkeypatch: pytest.MonkeyPatch) -> Envelope | DecodeError:
    with monkeypatch.context() as m:
        m.setattr(codec, "_plain_block_event", lambda fields: None)
        return _outcome(data)


def _outcome(data: bytes) -> Envelope | DecodeError:
    try:
        return decode(data)
    except DecodeError as e:
        return e


def _same(fast: Envelope | DecodeError, slow: Envelope | DecodeError) -> None:
    if isinstance(slow, DecodeError):
        assert isinstance(fast, DecodeError), f"the fast path took what validation refuses ({slow})"
        assert (fast.reason, fast.message) == (slow.reason, slow.message)
        return
    assert isinstance(fast, Envelope), fast
    assert fast == slow
    assert fast.model_fields_set == slow.model_fields_set
    assert fast.body.model_fields_set == slow.body.model_fields_set
    assert fast.model_dump() == slow.model_dump()
    assert encode(fast) == encode(slow)


@settings(max_examples=600, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wire=wire_records())
@example(
    wire={
        "s": "blocks_stored",
        "v": SCHEMA_VERSIONS["blocks_stored"],
        "id": "e",
        "p": "a",
        "q": 0,
        "t": 0,
        "b": {"block_keys": [True]},
    }
)
@example(
    wire={
        "s": "blocks_stored",
        "v": SCHEMA_VERSIONS["blocks_stored"],
        "id": "e",
        "p": "a",
        "q": 0,
        "t": 0,
        "b": {"block_keys": [-1]},
    }
)
@example(
    wire={
        "s": "blocks_removed",
        "v": SCHEMA_VERSIONS["blocks_removed"],
        "id": "e",
        "p": "a",
        "q": 0,
        "b": {"block_keys": [1]},
    }
)
def test_the_fast_path_decides_as_validation_does(wire: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    data = msgpack.packb(wire, use_bin_type=True)
    _same(_outcome(data), _slow_decode(data, monkeypatch))


@given(
    keys=st.lists(st.integers(0, 2**64 - 1), max_size=40),
    tier=st.sampled_from(["hbm", "dram", "ssd"]),
    node=st.none() | st.text(min_size=1, max_size=8),
    removed=st.booleans(),
    epoch=st.integers(0, 2**40),
)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_records_a_producer_writes_take_the_fast_path(
    keys: list[int], tier: str, node: str | None, removed: bool, epoch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = BlocksRemoved(block_keys=keys, tier=tier, node=node) if removed else BlocksStored(block_keys=keys, tier=tier)  # type: ignore[arg-type]
    data = encode(envelope(body, producer_id="prefill-0", producer_seq=3, ts_ms=1, epoch=epoch))
    taken: list[Envelope | None] = []
    plain = codec._plain_block_event

    def spy(fields: dict[str, Any]) -> Envelope | None:
        taken.append(plain(fields))
        return taken[-1]

    with monkeypatch.context() as m:
        m.setattr(codec, "_plain_block_event", spy)
        fast = _outcome(data)
    assert taken and taken[0] is not None, "a plain block event went through validation"
    _same(fast, _slow_decode(data, monkeypatch))


def test_a_record_over_the_key_cap_is_refused_by_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = {
        "s": "blocks_stored",
        "v": SCHEMA_VERSIONS["blocks_stored"],
        "id": "e",
        "p": "a",
        "q": 0,
        "t": 0,
        "b": {"block_keys": list(range(MAX_BLOCKS + 1))},
    }
    data = msgpack.packb(wire, use_bin_type=True)
    fast = _outcome(data)
    assert isinstance(fast, DecodeError) and fast.reason == "invalid"
    _same(fast, _slow_decode(data, monkeypatch))
