"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block)."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conductor.harness.sim.errors import TraceError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, with its arrival already spread and scaled."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    keyed: bool = False
    """``hash_ids`` are already the router's block keys (recorded traffic), not trace ids to chain."""
    path_s: float = 0.0
    """Seconds of its TTFT spent outside the engines (see :attr:`TraceRecord.path_s`)."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One raw trace line, validated."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    keyed: bool = False
    """``hash_ids`` are already block keys (``schemas.request_chain_keys``), used as they are."""
    path_s: float = 0.0
    """Seconds of its TTFT spent outside the engines, as recorded (gateway, the log's round trip to the
    decision, the hand-off): counted against the TTFT SLO on top of the simulated TTFT. 0 for a trace."""


def _int_field(obj: dict[str, Any], name: str, where: str, *, minimum: int) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: field {name!r} must be >= {minimum}, got {v}")
    return v


def parse_lines(lines: Iterable[str], source: str = "<trace>") -> list[TraceRecord]:
    """Validate every non-blank line; the first bad one raises :class:`TraceError` naming it."""
    out: list[TraceRecord] = []
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a non-negative number of ms, got {ts!r}")
        input_length = _int_field(obj, "input_length", where, minimum=1)
        output_length = _int_field(obj, "output_length", where, minimum=1)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
        out.append(TraceRecord(n, float(ts), input_length, output_length, tuple(ids)))
    if not out:
        raise TraceError(f"{source}: the trace has no requests")
    return out


def read_trace(path: str | Path) -> list[TraceRecord]:
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            return parse_lines(f, str(p))
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from None


def schedule(
    records: Sequence[TraceRecord], *, speed: float = 1.0, bucket_ms: float = 1000.0, limit: int | None = None
) -> list[TraceRequest]:
    """Arrival times in seconds, sorted, ``speed`` times faster than recorded.

    Traces record time coarsely (the Mooncake ones to the second), so the ``k``
    requests sharing one timestamp arrive evenly spaced within its ``bucket_ms``
    instead of as one burst.
    """
    if speed <= 0:
        raise TraceError(f"speed must be > 0, got {speed}")
    recs = sorted(records[:limit] if limit else records, key=lambda r: (r.timestamp_ms, r.line))
    if not recs:
        return []
    t0 = recs[0].timestamp_ms
    out: list[TraceRequest] = []
    i = 0
    while i < len(recs):
        j = i
        while j < len(recs) and recs[j].timestamp_ms == recs[i].timestamp_ms:
            j += 1
        k = j - i
        for m in range(i, j):
            t_ms = recs[m].timestamp_ms - t0 + (m - i) * bucket_ms / k
            r = recs[m]
            out.append(TraceRequest(len(out), t_ms / 1000.0 / speed, r.input_length, r.output_length, r.hash_ids,
                                    r.keyed, r.path_s))
        i = j
    return out


def reuse_upper_bound(requests: Sequence[TraceRequest], block_size: int) -> float:
    """Reused tokens / input tokens with an infinite cache shared by every instance:
    each request reuses the longest prefix of its chain any earlier request computed."""
    seen: set[int] = set()
    reused = total = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        reused += min(n * block_size, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return reused / total if total else 0.0


def long_context(
    records: Sequence[TraceRecord],
    *,
    sample: int = 20,
    min_tokens: int = 32_768,
    max_tokens: int = 131_072,
    factor: int = 8,
    block_size: int = 512,
) -> list[TraceRecord]:
    """A long-context workload with the shape of ``records`` (e.g. the conversation trace).

    * every ``sample``-th request is kept, at its own timestamp (long prompts cost tens of
      seconds each, so the full rate would swamp any cluster);
    * its prompt length moves to ``[min_tokens, max_tokens]`` by its rank in the trace:
      the request at quantile ``q`` of the input lengths gets ``min * (max/min) ** q``
      tokens (log-uniform, order kept: the trace's long requests stay the longest);
    * its prefix sharing keeps its structure: each original block id becomes ``factor``
      derived ids (so a prefix two requests shared is still shared, ``factor`` times
      longer), cut to the new length or padded with ids of its own;
    * its output length is unchanged.
    """
    if not records:
        return []
    lengths = sorted(r.input_length for r in records)
    n = len(lengths)
    top = max((max(r.hash_ids, default=0) for r in records), default=0)
    fresh = (top + 1) * factor
    ratio = max_tokens / min_tokens
    out: list[TraceRecord] = []
    for i, r in enumerate(records):
        if i % max(sample, 1):
            continue
        lo = bisect.bisect_left(lengths, r.input_length)
        hi = bisect.bisect_right(lengths, r.input_length)
        q = ((lo + hi - 1) / 2) / (n - 1) if n > 1 else 0.0
        tokens = round(min_tokens * ratio**q)
        blocks = -(-tokens // block_size)
        chain = [h * factor + k for h in r.hash_ids for k in range(factor)][:blocks]
        while len(chain) < blocks:
            chain.append(fresh)
            fresh += 1
        out.append(TraceRecord(r.line, r.timestamp_ms, tokens, r.output_length, tuple(chain)))
    return out
