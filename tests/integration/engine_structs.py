"""The engines' own KV-event structs, declared as each engine declares them (msgspec), for the tests.

Written from the engines' definitions — tags, field order, ``array_like``,
``omit_defaults`` — so that the bytes the tests publish are the bytes those
engines publish, not a hand-built approximation:

- ``V023``: vLLM <= 0.23 (``vllm/distributed/kv_events.py``): batch and events are
  arrays (``array_like=True``), events tagged by class name, defaults omitted.
- ``V026``: vLLM >= 0.26: maps (no ``array_like``), ``lora_name``, per-block
  ``extra_keys``, the hybrid-model fields ``group_idx``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``.
- ``SGLANG``: SGLang <= 0.5.17 (``sglang/srt/disaggregation/kv_events.py``): arrays, signed
  int64 hashes, ``medium`` one of GPU / CPU_PINNED / DISK / EXTERNAL, ``attn_dp_rank``.
- ``SGLANG_META``: SGLang 0.5.18-0.5.19: the same arrays (defaults no longer omitted); a salted
  request's store is ``BlockStoredWithMetadata``, whose keyword-only ``metadata`` (a map with
  ``cache_salt``) follows ``medium``.
- ``SGLANG_MAP``: SGLang >= 0.5.20: the batch still an array, events tagged maps with defaults
  omitted; ``BlockStored`` has ``cache_salt`` and ``session_id`` after ``medium``, and from
  0.5.22 ``lora_name`` after them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec

Hash = int | bytes


# --- vLLM <= 0.23: array form ---------------------------------------------------------


class _V023Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _V023Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _V023Stored(_V023Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _V023Removed(_V023Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None


class _V023Cleared(_V023Event, tag="AllBlocksCleared"):
    pass


# --- vLLM >= 0.26: map form -------------------------------------------------------------


class _V026Batch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _V026Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _V026Stored(_V026Event, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _V026Removed(_V026Event, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class _V026Cleared(_V026Event, tag="AllBlocksCleared"):
    pass


# --- SGLang: array form, signed hashes -----------------------------------------------------


class _SgBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class _SgEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _SgStored(_SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _SgRemoved(_SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SgCleared(_SgEvent, tag="AllBlocksCleared"):
    pass


# --- SGLang 0.5.18-0.5.19: arrays, a metadata map on salted stores -----------------------------


class _SgMetaEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _SgMetaStored(_SgMetaEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _SgMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class _SgMetaStoredWithMetadata(_SgMetaStored, tag="BlockStored", kw_only=True):
    metadata: _SgMetadata


class _SgMetaRemoved(_SgMetaEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SgMetaCleared(_SgMetaEvent, tag="AllBlocksCleared"):
    pass


def _sg_meta_stored(*args: Any, cache_salt: str | None = None, **kw: Any) -> _SgMetaStored:
    """What SGLang's scheduler builds: the plain struct, or the metadata one for a salted request."""
    if cache_salt is None:
        return _SgMetaStored(*args, **kw)
    return _SgMetaStoredWithMetadata(*args, metadata=_SgMetadata(cache_salt), **kw)


# --- SGLang >= 0.5.20: an array batch of tagged-map events ---------------------------------------


class _SgMapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _SgMapStored(_SgMapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SgMapRemoved(_SgMapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SgMapCleared(_SgMapEvent, tag="AllBlocksCleared"):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def _engine(batch: type, stored: Callable[..., Any], removed: type, cleared: type) -> SimpleNamespace:
    def encode(ts: float, events: list[Any], rank: int | None = None) -> bytes:
        return _ENCODER.encode(batch(ts, events, rank))

    return SimpleNamespace(Batch=batch, Stored=stored, Removed=removed, Cleared=cleared, encode=encode)


V023 = _engine(_V023Batch, _V023Stored, _V023Removed, _V023Cleared)
V026 = _engine(_V026Batch, _V026Stored, _V026Removed, _V026Cleared)
SGLANG = _engine(_SgBatch, _SgStored, _SgRemoved, _SgCleared)
SGLANG_META = _engine(_SgBatch, _sg_meta_stored, _SgMetaRemoved, _SgMetaCleared)
SGLANG_MAP = _engine(_SgBatch, _SgMapStored, _SgMapRemoved, _SgMapCleared)
