"""The live bench's text prompts keep the trace's prefix sharing, in words, tokens and block keys."""

from __future__ import annotations

from conductor.harness.bench.live import block_words, text_prompt
from conductor.harness.demo import TRACE_BLOCK_TOKENS
from conductor.harness.engine.http import emulated_tokens
from schemas import chain_keys


def test_a_shared_trace_block_is_the_same_text_and_the_same_tokens() -> None:
    a = text_prompt((0, 1, 2), 1300, index=0)
    b = text_prompt((0, 1, 7), 1500, index=1)
    wa, wb = a.split(" "), b.split(" ")
    assert len(wa) == 1300 and len(wb) == 1500
    assert wa[:1024] == wb[:1024] == [*block_words(0), *block_words(1)]
    assert wa[1024:1100] != wb[1024:1100]
    assert len(block_words(5)) == TRACE_BLOCK_TOKENS and block_words(5) == block_words(5)
    # The SGLang router matches characters: the shared text is exactly the shared blocks' text.
    shared = len(" ".join(wa[:1024]))
    assert a[:shared] == b[:shared] and a[shared + 1 : shared + 6] != b[shared + 1 : shared + 6]
    # The emulated engine makes one token per word: Conductor sees exactly the shared 1,024 tokens.
    ta, tb = emulated_tokens(a), emulated_tokens(b)
    assert len(ta) == 1300 and ta[:1024] == tb[:1024]
    ka, kb = chain_keys(ta, 64), chain_keys(tb, 64)
    assert ka[:16] == kb[:16] and ka[16] != kb[16]


def test_past_the_trace_blocks_the_prompt_is_the_requests_own() -> None:
    one, two = text_prompt((3,), 600, index=1).split(" "), text_prompt((3,), 600, index=2).split(" ")
    assert one[:512] == two[:512] and one[512:] != two[512:]
    assert not set(one[512:]) & set(block_words(3))
    assert text_prompt((3,), 600, index=1, seed=1) != text_prompt((3,), 600, index=1)
