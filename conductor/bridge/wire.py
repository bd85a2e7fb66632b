"""The engines' KV-event wire format: vLLM's (and SGLang's) ZMQ publisher payloads.

This is the one module that knows that format (Conductor's own wire lives in
``schemas.codec``). A ZMQ message is ``[topic, seq (8 bytes, big-endian), payload]``;
the payload is msgpack of a batch, either an array ``[ts, events, dp_rank?]``
(vLLM <= 0.23 and SGLang) or a map ``{"ts", "events", "data_parallel_rank"}``
(newer vLLM). Each event is either a tagged array
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]``
or a tagged map ``{"type": "BlockStored", "block_hashes": ..., ...}``.

After ``medium`` the engines differ. vLLM's array form goes on with ``lora_name``,
``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``.
SGLang (``sglang/srt/disaggregation/kv_events.py``): up to 0.5.17 nothing follows
``medium``; 0.5.18-0.5.19 add, for a salted request only, a ``metadata`` map
``{"cache_salt": ...}``; from 0.5.20 events are tagged maps whose ``BlockStored`` has
``cache_salt`` and ``session_id`` (0.5.22: ``lora_name``) after ``medium``. An array whose
8th field is a map is SGLang's metadata; one whose 9th is a string (vLLM's ``extra_keys``
never is) follows SGLang's field order (``cache_salt``, ``session_id``, ``lora_name``).
``session_id`` only says which session stored the blocks (the hash does not depend on it):
ignored.

Decoding is pure and never raises on a bad *event*: it is returned as a
:class:`BadEvent` so the batch's other events still apply. Only a payload that is
not a batch at all raises :class:`WireError`. The field readers raise ``ValueError`` for
any bad value, a field of the wrong type included: to this format both are one error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import Tier
from schemas.codec import pack_foreign, unpack_foreign

MASK64 = (1 << 64) - 1
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_HASH_BYTES = 64
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-stream marker."""

EngineHash = int | bytes
"""An engine's own block hash: a uint64, or raw digest bytes."""


class WireError(ValueError):
    """A payload that is not an engine event batch. ``reason`` is a short code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: Tier
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    """One entry per block (vLLM >= 0.11): LoRA name, multimodal ids, cache salt... or None."""
    group_idx: int | None = None
    """KV-cache group of a hybrid model (vLLM); None = the only group."""
    cache_salt: str | None = None
    """SGLang: the salt of the request that stored the blocks (vLLM puts it in ``extra_keys`` instead)."""
    sliding_window: bool = False
    """The group holds only a window of the prefix (sliding-window or local attention, Mamba state)."""

    @property
    def placeholder(self) -> bool:
        """No tokens: a copy of blocks already reported on another tier (vLLM's CPU offload)."""
        return not self.token_ids


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    tier: Tier
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllCleared:
    pass


@dataclass(frozen=True, slots=True)
class BadEvent:
    """An event that could not be read; ``reason`` says why. Counted, never fatal."""

    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event type this bridge does not know (a newer engine): ignored, counted."""

    type_name: str


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared | BadEvent | UnknownEvent


@dataclass(frozen=True, slots=True)
class EngineBatch:
    ts: float
    events: list[EngineEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


# Medium names as engines spell them → Conductor's tiers (the table is in the README).
_TIERS: dict[str, Tier] = {
    "gpu": "hbm", "cuda": "hbm", "hbm": "hbm", "device": "hbm", "xpu": "hbm", "npu": "hbm",
    "cpu": "dram", "dram": "dram", "host": "dram", "cpu_tier": "dram", "pinned": "dram",
    "cpu_pinned": "dram", "host_pinned": "dram",
    "disk": "ssd", "ssd": "ssd", "local_disk": "ssd", "nvme": "ssd", "file": "ssd", "storage": "ssd",
    "external": "ssd", "remote": "ssd", "shared": "ssd", "mooncake": "ssd", "lmcache": "ssd", "l3": "ssd",
}

# Field order of the array form, after the tag (vLLM's struct field order).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_SGLANG_STORED_FIELDS = (*_STORED_FIELDS[:6], "cache_salt", "session_id", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_WINDOWED_KINDS = ("sliding", "local", "chunked", "mamba", "window")


def tier_of(medium: object) -> Tier:
    """Map an engine's ``medium`` (None means GPU) to a tier; raise ValueError if unknown."""
    if medium is None:
        return "hbm"
    if not isinstance(medium, str):
        raise ValueError(f"medium must be a string, got {type(medium).__name__}")  # noqa: TRY004 — a bad wire value
    try:
        return _TIERS[medium.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown medium {medium[:40]!r}") from None


def medium_of(tier: Tier) -> str:
    """The vLLM spelling of a tier (what an emulated engine publishes)."""
    return {"hbm": "GPU", "dram": "CPU", "ssd": "DISK"}[tier]


def normalize_hash(h: object) -> EngineHash:
    """One canonical form per hash: signed int64 (SGLang) becomes its uint64 twin."""
    if isinstance(h, bool):
        raise ValueError("a block hash cannot be a bool")  # noqa: TRY004 — a bad wire value
    if isinstance(h, int):
        if -(1 << 63) <= h < 0:
            return h & MASK64
        if 0 <= h <= MASK64:
            return h
        raise ValueError(f"block hash {h} does not fit 64 bits")
    if isinstance(h, (bytes, bytearray)):
        if not 0 < len(h) <= MAX_HASH_BYTES:
            raise ValueError(f"raw block hash of {len(h)} bytes")
        return bytes(h)
    raise ValueError(f"block hash of type {type(h).__name__}")


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise ValueError("block_hashes is not a list")  # noqa: TRY004 — a bad wire value
    return tuple(normalize_hash(h) for h in v)


def _as_fields(raw: list[Any] | dict[Any, Any], names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw  # extra keys are ignored by the readers below
    return dict(zip(names, raw[1:]))


def _stored_fields(raw: list[Any] | dict[Any, Any]) -> dict[str, Any]:
    """A ``BlockStored``'s fields by name, whichever engine's array layout it has (see the module's docstring)."""
    if isinstance(raw, dict):
        return raw
    after_medium = raw[7:]
    if after_medium and isinstance(after_medium[0], dict):  # SGLang 0.5.18-0.5.19: the metadata map
        meta = after_medium[0]
        return {**dict(zip(_STORED_FIELDS[:6], raw[1:7])), "cache_salt": meta.get("cache_salt")}
    if len(after_medium) > 1 and isinstance(after_medium[1], str):  # SGLang's order: cache_salt, session_id
        return dict(zip(_SGLANG_STORED_FIELDS, raw[1:]))
    return dict(zip(_STORED_FIELDS, raw[1:]))


def _stored(f: dict[str, Any]) -> EngineBlockStored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    tokens = f.get("token_ids")
    if tokens is None:
        tokens = []
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 0xFFFFFFFF for t in tokens
    ):
        raise ValueError("token_ids is not a list of uint32")
    bs = f.get("block_size")
    # An offload placeholder (no tokens) may say block_size 0: its blocks are known by hash.
    if not isinstance(bs, int) or isinstance(bs, bool) or not (0 if not tokens else 1) <= bs <= 4096:
        raise ValueError(f"bad block_size {bs!r}"[:80])
    lora_name = f.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError("lora_name is not a string")
    salt = f.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError("cache_salt is not a string")
    lora_id = f.get("lora_id")
    if lora_name is None and isinstance(lora_id, int) and not isinstance(lora_id, bool):
        # Old engines name adapters by id only; requests must then use the same spelling.
        lora_name = f"lora-id:{lora_id}"
    extra = f.get("extra_keys")
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise ValueError("extra_keys must hold one entry per block")
        extra_keys = tuple(None if e is None else tuple(e) if isinstance(e, list) else (e,) for e in extra)
    kind = f.get("kv_cache_spec_kind")
    window = f.get("kv_cache_spec_sliding_window")
    windowed = (isinstance(window, int) and not isinstance(window, bool) and window > 0) or (
        isinstance(kind, str) and any(w in kind.lower() for w in _WINDOWED_KINDS)
    )
    return EngineBlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else normalize_hash(parent),
        token_ids=tuple(tokens),
        block_size=bs,
        tier=tier_of(f.get("medium")),
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=_group(f.get("group_idx")),
        cache_salt=salt or None,
        sliding_window=windowed,
    )


def _group(g: object) -> int | None:
    if g is None:
        return None
    if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < 1024:
        raise ValueError(f"bad group_idx {g!r}"[:80])
    return g


def decode_event(raw: object) -> EngineEvent:
    """Read one event of either form; never raises."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag: object = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        return BadEvent("not_an_event", f"{type(raw).__name__}")
    try:
        if tag == "BlockStored":
            return _stored(_stored_fields(raw))
        if tag == "BlockRemoved":
            f = _as_fields(raw, _REMOVED_FIELDS)
            return EngineBlockRemoved(_hashes(f.get("block_hashes")), tier_of(f.get("medium")), _group(f.get("group_idx")))
        if tag == "AllBlocksCleared":
            return EngineAllCleared()
    except ValueError as e:
        return BadEvent("invalid_event", f"{tag}: {e}"[:300])
    if isinstance(tag, str):
        return UnknownEvent(tag[:80])
    return BadEvent("not_an_event", "no type tag")


def decode_batch(payload: bytes) -> EngineBatch:
    """Decode one ZMQ payload; raise :class:`WireError` if it is not a batch."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError("too_large", f"{len(payload)} bytes")
    try:
        raw = unpack_foreign(payload)
    except (ValueError, TypeError) as e:  # msgpack's errors are ValueErrors; an unhashable map key a TypeError
        raise WireError("malformed", f"not msgpack: {type(e).__name__}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise WireError("malformed", f"a batch is an array or a map, got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise WireError("malformed", "batch needs a numeric ts and a list of events")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        rank = None
    return EngineBatch(float(ts), [decode_event(e) for e in events], rank)


def parse_seq(frame: bytes) -> int:
    """A big-endian 8-byte sequence number (-1 is the replay end marker)."""
    if len(frame) != 8:
        raise WireError("bad_seq", f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


# --- encoding (what an emulated engine publishes: the newer map form) -----------


def _event_map(ev: EngineBlockStored | EngineBlockRemoved | EngineAllCleared) -> dict[str, Any]:
    # Key order follows the struct's field order, tag first, defaults omitted (as msgspec does).
    if isinstance(ev, EngineBlockStored):
        m: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": medium_of(ev.tier),
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            m["extra_keys"] = [None if e is None else list(e) for e in ev.extra_keys]
        if ev.group_idx is not None:
            m["group_idx"] = ev.group_idx
        if ev.cache_salt is not None:
            m["cache_salt"] = ev.cache_salt
        return m
    if isinstance(ev, EngineBlockRemoved):
        r: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes),
                             "medium": medium_of(ev.tier)}
        if ev.group_idx is not None:
            r["group_idx"] = ev.group_idx
        return r
    return {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float,
    events: Sequence[EngineBlockStored | EngineBlockRemoved | EngineAllCleared],
    data_parallel_rank: int | None = 0,
) -> bytes:
    """Encode a batch in vLLM's map form."""
    batch: dict[str, Any] = {"ts": ts, "events": [_event_map(e) for e in events]}
    if data_parallel_rank is not None:
        batch["data_parallel_rank"] = data_parallel_rank
    return pack_foreign(batch)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)
