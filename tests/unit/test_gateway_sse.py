"""The relay's scan of a decode stream (conductor/gateway/sse.py): bytes forwarded as they came, whole
events, tokens counted, the usage chunk parsed once and dropped when the client did not ask for it."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conductor.gateway.sse import EventTooLong, SseScan


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKENS = [_event({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}) for i in range(5)]
FINISH = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                        "prompt_tokens_details": {"cached_tokens": 4}}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(TOKENS) + FINISH + USAGE + DONE


def _run(scan: SseScan, chunks: list[bytes]) -> tuple[bytes, int, list[dict[str, object]]]:
    out, tokens, usages = b"", 0, []
    for c in chunks:
        sent, n = scan.feed(c)
        out += sent
        tokens += n
        if scan.usage is not None:
            usages.append(scan.usage)
            scan.usage = None
    return out, tokens, usages


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40), st.booleans())
def test_any_chunking_forwards_whole_events_counts_every_token_and_reads_usage_once(cuts: list[int],
                                                                                    drop: bool) -> None:
    out, tokens, usages = _run(SseScan(drop_usage=drop, max_event_bytes=1 << 20), _split(STREAM, cuts))
    assert out == (STREAM.replace(USAGE, b"") if drop else STREAM)
    assert tokens == len(TOKENS)
    assert len(usages) == 1 and usages[0]["usage"] == json.loads(USAGE[6:])["usage"]


def test_nothing_is_held_when_chunks_end_on_event_boundaries() -> None:
    scan = SseScan(drop_usage=True, max_event_bytes=1 << 20)
    for ev in TOKENS:
        assert scan.feed(ev) == (ev, 1)  # the very bytes, at once
    assert scan.feed(FINISH) == (FINISH, 0)


def test_a_usage_chunk_that_also_carries_a_token_is_kept_and_counted() -> None:
    both = _event({"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}})
    scan = SseScan(drop_usage=True, max_event_bytes=1 << 20)
    assert scan.feed(both) == (both, 1)
    assert scan.usage is not None and scan.usage["usage"] == {"completion_tokens": 1}


def test_an_event_that_never_ends_is_refused_past_the_bound() -> None:
    scan = SseScan(drop_usage=False, max_event_bytes=64)
    assert scan.feed(b"data: {" + b"x" * 40) == (b"", 0)
    with pytest.raises(EventTooLong, match="longer than 64 bytes"):
        scan.feed(b"y" * 40)
