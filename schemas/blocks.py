"""Block keys: the chained identity of fixed-size token blocks.

Block ``i`` of a prompt is named by a 64-bit key that covers the key of block
``i-1`` (its parent), the token ids of block ``i`` and optional extra keys (a
LoRA adapter name, a multimodal input hash...). Two prompts therefore share a
key exactly when they share the whole prefix up to and including that block,
which is what makes "longest cached prefix" a walk along the chain.

The keys are BLAKE2b digests of a fixed byte layout: the same on every process
and machine (no ``hash()``, no pickle, no seed to forget).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

ROOT_KEY = int.from_bytes(hashlib.blake2b(b"conductor/block-chain/v1", digest_size=8).digest(), "big")
"""The parent of every chain's first block."""

_PRECOMPUTED_SALT = b"conductor/precomputed/v1"


def _extra_text(x: object) -> str:
    if x is None or isinstance(x, (bool, int, float, str)):
        return f"{type(x).__name__}:{x!r}"
    if isinstance(x, (bytes, bytearray)):
        return f"bytes:{bytes(x).hex()}"  # prompt-embedding digests
    if isinstance(x, (tuple, list)):
        # Older vLLM multimodal keys: (mm_hash, offset); a list after msgpack is the same key.
        return "(" + ",".join(_extra_text(e) for e in x) + ")"
    raise TypeError(f"extra key of type {type(x).__name__} is not a scalar")


def _extras_bytes(extra_keys: Iterable[object]) -> bytes:
    return "\x1f".join(_extra_text(x) for x in extra_keys).encode()


def block_key(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Key of one block given its parent's key, its token ids and encoded extras."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    if extra:
        h.update(b"\x00")
        h.update(extra)
    return int.from_bytes(h.digest(), "big")


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int | None = None,
    lora_name: str | None = None,
    extra_keys: Sequence[object] = (),
) -> list[int]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block has no key.

    ``parent`` continues an existing chain (an engine reporting blocks that extend
    a prefix it reported before); by default the chain starts at :data:`ROOT_KEY`.
    ``lora_name`` then ``extra_keys`` are every block's extra keys, in vLLM's order.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    extras = list(extra_keys)
    if lora_name:
        extras = [lora_name, *extras]
    extra = _extras_bytes(extras)
    key = ROOT_KEY if parent is None else parent
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = block_key(key, token_ids[start : start + block_size], extra)
        keys.append(key)
    return keys


def chain_from_precomputed(ids: Sequence[int], *, namespace: str = "") -> list[int]:
    """Turn a precomputed chain (e.g. the Mooncake traces' ``hash_ids``) into block keys.

    The ids are already prefix-unique; chaining them once more spreads them over
    the 64-bit key space and keeps two traces in different namespaces apart.
    """
    key = ROOT_KEY
    salt = _PRECOMPUTED_SALT + namespace.encode()
    keys = []
    for i in ids:
        h = hashlib.blake2b(digest_size=8, key=salt[:64])
        h.update(key.to_bytes(8, "big"))
        h.update(int(i).to_bytes(8, "big", signed=True))
        key = int.from_bytes(h.digest(), "big")
        keys.append(key)
    return keys


def chain_keys_per_block(
    token_ids: Sequence[int],
    block_size: int,
    extras: Sequence[Sequence[object] | None],
    *,
    parent: int | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids`` where block ``i`` has its own extra keys ``extras[i]``.

    Exactly what an engine's ``BlockStored.extra_keys`` reports per block (vLLM >= 0.11);
    ``None`` or a missing entry means no extra keys for that block.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    key = ROOT_KEY if parent is None else parent
    keys = []
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = extras[i] if i < len(extras) else None
        key = block_key(key, token_ids[start : start + block_size], _extras_bytes(extra) if extra else b"")
        keys.append(key)
    return keys


def vllm_block_extras(
    n_tokens: int,
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_items: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
    prompt_embeds_digests: Sequence[bytes | None] = (),
) -> list[tuple[object, ...] | None]:
    """The extra keys vLLM puts into each full block's hash, in its order.

    Per block: the LoRA name; the identifier of every multimodal item
    (``(identifier, offset, length)`` in token positions, sorted by offset) whose
    placeholder range reaches into the block; the cache salt on the first block
    only; the block's prompt-embedding digest. ``None`` for a block with none.
    """
    items = sorted(mm_items, key=lambda m: m[1])
    out: list[tuple[object, ...] | None] = []
    for i in range(n_tokens // block_size):
        start, end = i * block_size, (i + 1) * block_size
        keys: list[object] = [lora_name] if lora_name else []
        # vLLM skips an item only once the block starts past offset + length.
        keys.extend(ident for ident, off, length in items if end > off and not start > off + length)
        if start == 0 and cache_salt:
            keys.append(cache_salt)
        if i < len(prompt_embeds_digests) and prompt_embeds_digests[i] is not None:
            keys.append(prompt_embeds_digests[i])
        out.append(tuple(keys) if keys else None)
    return out


def request_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_items: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
    extra_keys: Sequence[Sequence[object] | None] | None = None,
) -> list[int]:
    """A request's block keys, equal to the keys the bridge derives from the engine's events."""
    if extra_keys is not None:
        return chain_keys_per_block(token_ids, block_size, extra_keys)
    if not mm_items and not cache_salt:
        return chain_keys(token_ids, block_size, lora_name=lora_name)
    extras = vllm_block_extras(len(token_ids), block_size, lora_name=lora_name, mm_items=mm_items,
                               cache_salt=cache_salt)
    return chain_keys_per_block(token_ids, block_size, extras)
