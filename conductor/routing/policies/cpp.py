"""Chunked pipeline parallelism (CPP): one long prefill split over a group of instances.

Mooncake (FAST'25 §5.1) prefills a long-context request on a group of prefill nodes
instead of using tensor parallelism across nodes: the prompt is cut into contiguous
chunks, member ``j`` computes chunk ``j`` and needs, layer by layer, the KV of every
token before its chunk, which member ``j-1`` hands on (its predecessors' KV and its
own). The pipeline runs layer-wise, so member ``j`` trails member ``j-1`` by about a
layer's compute plus a layer's hand-off, not by a whole chunk.

The model here (pure; the policy and the simulator both use it):

* chunks of equal prefill FLOPs (the attention term makes later tokens dearer, so
  later chunks hold fewer tokens), cut on block boundaries;
* member ``j`` is free after its queue wait (member 0 also loads the reused prefix);
* the layers are taken in ``stages`` groups; stage ``s`` of member ``j`` ends at
  ``max(own stage s-1 end, member j-1's stage s end + hand-off of stage s) + compute
  of one stage``, where a stage's hand-off moves ``1/stages`` of the KV before the chunk
  over the link between the two members;
* the first token is ready when the last member ends (it then holds the whole KV and
  passes it to the decode instance, as a single prefill instance would).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.costmodel.profiles import ModelProfile
from conductor.topology import Link

STAGES = 16
"""Layer groups of the pipeline model (a finer model changes TTFT by well under 1 %)."""


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A CPP plan: members in pipeline order, chunk ends, and the predicted finish."""

    members: tuple[str, ...]
    boundaries: tuple[int, ...]
    """End token of each member's chunk; the first chunk starts at ``start``."""
    start: int
    finish_s: float
    """When the last member holds the whole prompt's KV (from now)."""
    member_finish_s: tuple[float, ...]


def chunk_boundaries(profile: ModelProfile, start: int, total: int, k: int, block_size: int) -> tuple[int, ...]:
    """End tokens of ``k`` chunks of ``[start, total)`` with equal prefill FLOPs, on block
    boundaries (the last is ``total``). Fewer than ``k`` when a chunk would hold less than
    a block; every chunk holds at least one token."""
    if total <= start:
        return (total,)
    f0, f1 = profile.flops(start), profile.flops(total)
    qa = profile.l * profile.a * profile.d
    qb = profile.l * profile.b * profile.d * profile.d
    ends: list[int] = []
    prev = start
    for j in range(1, k):
        target = f0 + (f1 - f0) * j / k
        # l*(a*n^2*d + b*n*d^2) = target → n = (-qb + sqrt(qb^2 + 4 qa target)) / (2 qa)
        n = (-qb + math.sqrt(qb * qb + 4 * qa * target)) / (2 * qa) if qa > 0 else target / qb
        cut = round(n / block_size) * block_size
        if cut - prev >= block_size and total - cut >= block_size:
            ends.append(cut)
            prev = cut
    ends.append(total)
    return tuple(ends)


def pipeline_finish(
    profile: ModelProfile,
    start: int,
    boundaries: Sequence[int],
    ready_s: Sequence[float],
    links: Sequence[Link | None],
    stages: int = STAGES,
) -> tuple[float, ...]:
    """Finish time of each member of a pipeline over ``boundaries`` (see the module's model).

    ``ready_s[j]``: when member ``j`` can start (its queue wait; member 0's includes the
    prefix load). ``links[j]``: the path from member ``j-1`` to member ``j`` (``links[0]``
    is unused). Stage counts are capped by the model's layers.
    """
    stages = max(1, min(stages, profile.l))
    kv = profile.kv_bytes_per_token
    prev: list[float] | None = None
    out: list[float] = []
    lo = start
    for j, hi in enumerate(boundaries):
        tau = profile.prefill_seconds(hi, lo) / stages
        hand = 0.0
        if j > 0:
            link = links[j]
            hand = link.seconds(lo * kv / stages) if link is not None else 0.0
        cur: list[float] = []
        t = ready_s[j]
        for s in range(stages):
            if prev is not None:
                t = max(t, prev[s] + hand)
            t += tau
            cur.append(t)
        out.append(t)
        prev = cur
        lo = hi
    return tuple(out)


def plan_pipeline(
    profile: ModelProfile,
    members: Sequence[str],
    ready_s: Sequence[float],
    links: Sequence[Link | None],
    *,
    start: int,
    total: int,
    block_size: int,
) -> PipelinePlan:
    """The plan over ``members`` (pipeline order); fewer members when the prompt is too
    short to give each at least a block."""
    ends = chunk_boundaries(profile, start, total, len(members), block_size)
    k = len(ends)
    fin = pipeline_finish(profile, start, ends, ready_s[:k], links[:k])
    return PipelinePlan(tuple(members[:k]), ends, start, fin[-1], fin)
