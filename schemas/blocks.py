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


def _extras_bytes(extra_keys: Iterable[object]) -> bytes:
    parts = []
    for x in extra_keys:
        if x is None or isinstance(x, (bool, int, float, str)):
            parts.append(f"{type(x).__name__}:{x!r}")
        else:
            raise TypeError(f"extra key of type {type(x).__name__} is not a scalar")
    return "\x1f".join(parts).encode()


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
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    extras = list(extra_keys)
    if lora_name:
        extras = [f"lora={lora_name}", *extras]
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
