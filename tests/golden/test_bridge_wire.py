"""Wire compatibility with vLLM/SGLang KV-event payloads (golden bytes) and the translation to Conductor keys."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from conductor.bridge.translate import NodeTranslator
from conductor.bridge.wire import (
    BadEvent,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    UnknownEvent,
    WireError,
    decode_batch,
    encode_batch,
    normalize_hash,
    parse_seq,
    seq_frame,
)
from schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, chain_keys, request_keys

GOLDEN = Path(__file__).parent
TOKENS = tuple(range(1000, 1032))
H1, H2 = 0xFEDCBA9876543210, 0x0123456789ABCDEF


def golden(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


@pytest.mark.parametrize("name", ["vllm_map_form.msgpack", "vllm_map_form_plain.msgpack", "vllm_array_form.msgpack"])
def test_both_forms_decode_to_the_same_events(name: str) -> None:
    batch = decode_batch(golden(name))
    assert batch.ts == 1700000000.5
    group = 0 if name == "vllm_map_form.msgpack" else None  # the hybrid-model fields, when present
    assert batch.events == [
        EngineBlockStored(block_hashes=(H1, H2), parent_block_hash=None, token_ids=TOKENS, block_size=16, tier="hbm",
                          group_idx=group),
        EngineBlockRemoved(block_hashes=(H2,), tier="hbm", group_idx=group),
        EngineAllCleared(),
    ]
    assert batch.data_parallel_rank == (None if "array" in name else 0)


def test_bytes_hashes_and_cpu_medium() -> None:
    batch = decode_batch(golden("vllm_bytes_hashes.msgpack"))
    first, second, removed = batch.events
    assert isinstance(first, EngineBlockStored) and isinstance(second, EngineBlockStored)
    assert isinstance(first.block_hashes[0], bytes) and len(first.block_hashes[0]) == 32
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.tier == "dram"
    assert removed == EngineBlockRemoved(block_hashes=first.block_hashes, tier="hbm")
    assert batch.data_parallel_rank == 1


def test_sglang_signed_hashes_become_uint64_and_unknown_events_are_skipped() -> None:
    batch = decode_batch(golden("sglang_signed_hashes.msgpack"))
    stored, removed, unknown = batch.events
    assert isinstance(stored, EngineBlockStored)
    assert stored.block_hashes == (2**64 - 2, 2**63)
    assert removed == EngineBlockRemoved(block_hashes=(2**64 - 2,), tier="hbm")
    assert unknown == UnknownEvent("SomeFutureEvent")
    assert batch.data_parallel_rank == 3


def test_emulated_engine_encodes_exactly_the_map_form() -> None:
    events = decode_batch(golden("vllm_map_form_plain.msgpack")).events
    assert encode_batch(1700000000.5, events, 0) == golden("vllm_map_form_plain.msgpack")  # type: ignore[arg-type]


def test_signed_and_unsigned_spellings_of_a_hash_are_one_hash() -> None:
    assert normalize_hash(-1) == normalize_hash(2**64 - 1)
    with pytest.raises(ValueError):
        normalize_hash(2**64)
    with pytest.raises(ValueError):
        normalize_hash(True)
    with pytest.raises(ValueError):
        normalize_hash(b"")


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.packb("text"), msgpack.packb([1]), msgpack.packb({"ts": "x", "events": []}),
     msgpack.packb([1.0, "not a list"])],
)
def test_a_payload_that_is_not_a_batch_raises_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_a_bad_event_is_reported_and_the_others_still_decode() -> None:
    payload = msgpack.packb([0.0, [
        ["BlockStored", ["not-a-hash"], None, [1] * 16, 16, None, "GPU"],
        ["BlockStored", [5], None, [1] * 16, 16, None, "TAPE"],
        ["BlockStored", [5], None, [-1] * 16, 16, None, "GPU"],
        {"no": "tag"},
        ["BlockRemoved", [7], "GPU"],
    ]])
    events = decode_batch(payload).events
    assert [type(e) for e in events] == [BadEvent, BadEvent, BadEvent, BadEvent, EngineBlockRemoved]


def test_seq_frames() -> None:
    assert parse_seq(seq_frame(5)) == 5
    assert parse_seq(b"\xff" * 8) == -1
    with pytest.raises(WireError):
        parse_seq(b"\x00")


# --- translation -----------------------------------------------------------------


def test_stored_blocks_get_conductor_keys_derived_from_tokens() -> None:
    t = NodeTranslator(expected_block_size=16)
    out = t.translate(decode_batch(golden("vllm_array_form.msgpack")))
    want = chain_keys(TOKENS, 16)
    assert out == [
        BlocksStored(block_keys=want, parent_key=None, block_size=16, tier="hbm"),
        BlocksRemoved(block_keys=[want[1]], tier="hbm"),
        AllBlocksCleared(),
    ]
    assert len(t) == 0  # cleared


def test_a_child_event_chains_from_its_parents_conductor_key() -> None:
    t = NodeTranslator()
    out = t.translate(decode_batch(golden("vllm_bytes_hashes.msgpack")))
    want = chain_keys(TOKENS, 16)  # same as hashing the whole prompt at once
    assert out[0] == BlocksStored(block_keys=[want[0]], block_size=16, tier="hbm")
    assert out[1] == BlocksStored(block_keys=[want[1]], parent_key=want[0], block_size=16, tier="dram")
    assert out[2] == BlocksRemoved(block_keys=[want[0]], tier="hbm")
    # The first block left HBM only; the child still chains from it.
    assert not t.holders_of(decode_batch(golden("vllm_bytes_hashes.msgpack")).events[0].block_hashes[0])  # type: ignore[union-attr]


def test_an_unknown_parent_is_an_orphan_not_a_wrong_key() -> None:
    t = NodeTranslator()
    ev = EngineBlockStored(block_hashes=(9,), parent_block_hash=8, token_ids=TOKENS[:16], block_size=16, tier="hbm")
    assert t.translate_event(ev) == []
    assert t.counts["orphan_blocks"] == 1
    # ... and its descendants are orphans too, and removing them changes nothing.
    child = EngineBlockStored(block_hashes=(10,), parent_block_hash=9, token_ids=TOKENS[16:], block_size=16, tier="hbm")
    assert t.translate_event(child) == []
    assert t.translate_event(EngineBlockRemoved((9, 10), "hbm")) == []


def test_a_block_held_in_two_tiers_keeps_its_key_until_both_are_gone() -> None:
    t = NodeTranslator()
    t.translate_event(EngineBlockStored((1,), None, TOKENS[:16], 16, "hbm"))
    t.translate_event(EngineBlockStored((1,), None, TOKENS[:16], 16, "dram"))
    key = chain_keys(TOKENS[:16], 16)[0]
    assert t.translate_event(EngineBlockRemoved((1,), "hbm")) == [BlocksRemoved(block_keys=[key], tier="hbm")]
    assert t.translate_event(EngineBlockRemoved((1,), "hbm")) == []  # not in HBM any more
    assert t.translate_event(EngineBlockRemoved((1,), "dram")) == [BlocksRemoved(block_keys=[key], tier="dram")]
    assert len(t) == 0


def test_token_count_that_does_not_match_the_hashes_is_rejected() -> None:
    t = NodeTranslator()
    ev = EngineBlockStored((1, 2), None, TOKENS[:20], 16, "hbm")
    assert t.translate_event(ev) == []
    assert t.counts["bad_event"] == 1


def test_lora_and_per_block_extra_keys_change_the_keys_like_requests_do() -> None:
    t = NodeTranslator()
    lora = t.translate_event(EngineBlockStored((1,), None, TOKENS[:16], 16, "hbm", lora_name="ad"))
    assert lora[0].block_keys == chain_keys(TOKENS[:16], 16, lora_name="ad")  # type: ignore[attr-defined]
    plain = chain_keys(TOKENS[:16], 16)
    mm = t.translate_event(EngineBlockStored((2,), None, TOKENS[:16], 16, "hbm", extra_keys=(("img", 7),)))
    assert mm[0].block_keys == chain_keys(TOKENS[:16], 16, extra_keys=["img", 7]) != plain  # type: ignore[attr-defined]


def test_the_oldest_array_form_without_medium_decodes_as_gpu() -> None:
    # vLLM's first KV-event structs: BlockStored without medium, BlockRemoved with hashes only.
    payload = msgpack.packb([1.0, [["BlockStored", [H1], None, list(TOKENS[:16]), 16, None], ["BlockRemoved", [H1]]]])
    assert decode_batch(payload).events == [
        EngineBlockStored((H1,), None, TOKENS[:16], 16, "hbm"),
        EngineBlockRemoved((H1,), "hbm"),
    ]


# --- SGLang's fields after medium ----------------------------------------------------------------


def test_sglang_metadata_after_medium_is_the_salt_not_a_lora_name() -> None:
    # SGLang 0.5.18-0.5.19: BlockStoredWithMetadata, its keyword-only metadata map last.
    payload = msgpack.packb([1.0, [["BlockStored", [-3], None, list(TOKENS[:16]), 16, None, "GPU",
                                    {"cache_salt": "tenant-a"}]], 0])
    assert decode_batch(payload).events == [
        EngineBlockStored((2**64 - 3,), None, TOKENS[:16], 16, "hbm", cache_salt="tenant-a")]


@pytest.mark.parametrize("event", [
    # An array in SGLang's field order: cache_salt, session_id (a string where vLLM has extra_keys), lora_name.
    ["BlockStored", [7], None, list(TOKENS[:16]), 16, 2, "GPU", "tenant-a", "session-1", "sql-lora"],
    # The tagged map of SGLang >= 0.5.20 (lora_name from 0.5.22).
    {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": list(TOKENS[:16]),
     "block_size": 16, "lora_id": 2, "medium": "GPU", "cache_salt": "tenant-a", "session_id": "session-1",
     "lora_name": "sql-lora"},
])
def test_sglang_salt_and_session_are_read_by_name_in_both_forms(event: object) -> None:
    (ev,) = decode_batch(msgpack.packb([1.0, [event]])).events
    assert ev == EngineBlockStored((7,), None, TOKENS[:16], 16, "hbm", lora_name="sql-lora", cache_salt="tenant-a")
    # The salt goes on the chain's first block after the LoRA name, as on a salted request's.
    out = NodeTranslator().translate_event(ev)
    assert out[0].block_keys == request_keys(TOKENS[:16], 16, lora_name="sql-lora",  # type: ignore[attr-defined]
                                             cache_salt="tenant-a")


def test_vllm_array_lora_name_stays_a_lora_name_and_a_bad_salt_is_a_bad_event() -> None:
    vllm = ["BlockStored", [7], None, list(TOKENS[:16]), 16, None, "GPU", "sql-lora", None, 0]
    bad_salt = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": list(TOKENS[:16]),
                "block_size": 16, "lora_id": None, "cache_salt": 5}
    first, second = decode_batch(msgpack.packb([1.0, [vllm, bad_salt]])).events
    assert first == EngineBlockStored((7,), None, TOKENS[:16], 16, "hbm", lora_name="sql-lora", group_idx=0)
    assert isinstance(second, BadEvent)
