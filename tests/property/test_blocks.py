"""The block-key chain: golden values, prefix property, and determinism across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.blocks import ROOT_KEY, block_key, chain_from_precomputed, chain_keys

# Pinned: changing the byte layout of a key silently splits every deployed view in two.
GOLDEN = {
    "root": 0xDF053DF657C40814,
    "range32_bs16": [0xD901A2B7F2CF208E, 0xBE2B0EEFBDED4D72],
    # The LoRA name is the block's first extra key, spelled as vLLM puts it into its own hashes.
    "range32_bs16_lora": [0x52F3909433C7C7D7, 0x5CA4E86DF0771A3C],
    "precomputed_012": [0xD8D7388946099417, 0x22F9F2CB17253869, 0xDB541B6473F78B73],
}


def test_golden_values():
    assert ROOT_KEY == GOLDEN["root"]
    assert chain_keys(list(range(32)), 16) == GOLDEN["range32_bs16"]
    assert chain_keys(list(range(32)), 16, lora_name="sql-lora") == GOLDEN["range32_bs16_lora"]
    assert chain_from_precomputed([0, 1, 2]) == GOLDEN["precomputed_012"]


def test_same_in_another_process_with_another_hash_seed():
    code = "from schemas.blocks import chain_keys; print(chain_keys(list(range(32)), 16))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert eval(out.stdout) == GOLDEN["range32_bs16"]


def test_partial_trailing_block_has_no_key():
    assert len(chain_keys(list(range(47)), 16)) == 2
    assert chain_keys(list(range(15)), 16) == []


def test_parent_continues_a_chain():
    whole = chain_keys(list(range(64)), 16)
    tail = chain_keys(list(range(32, 64)), 16, parent=whole[1])
    assert tail == whole[2:]


def test_each_key_covers_its_parent():
    a = chain_keys([1] * 16 + [2] * 16, 16)
    b = chain_keys([9] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first block


def test_extra_keys_separate_chains():
    toks = list(range(16))
    assert chain_keys(toks, 16) != chain_keys(toks, 16, extra_keys=["img:abc"])
    with pytest.raises(TypeError):
        chain_keys(toks, 16, extra_keys=[object()])


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        chain_keys([1, 2], 0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.lists(st.integers(0, 2**32 - 1), max_size=200),
       st.integers(1, 32))
def test_shared_prefix_means_shared_keys(common, tail, bs):
    a = chain_keys(common + tail, bs)
    b = chain_keys(common, bs)
    assert a[: len(b)] == b
    assert all(0 <= k < 2**64 for k in a)


def test_block_key_matches_chain():
    toks = list(range(16))
    assert block_key(ROOT_KEY, toks) == chain_keys(toks, 16)[0]
