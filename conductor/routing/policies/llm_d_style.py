"""``llm-d-style``: llm-d's inference scheduler, a weighted sum of [0, 1] scorers.

Scorers: prefix match (cached blocks / chain blocks), queue (1 for the shortest
queue, 0 for the longest, min-max over the candidates) and KV utilisation (free /
total KV blocks). The highest weighted sum wins; ties go to the seeded generator
(llm-d itself draws them from a time-seeded global source). The same scorers pick
the decode instance, with the decode batch as its queue. Never rejects.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field

from conductor.routing.policies.base import (
    BasePolicy,
    Decision,
    PolicyParams,
    Rejection,
    local_placement,
    pick_lowest,
    split_roles,
)
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class LlmDStyleParams(PolicyParams):
    prefix_weight: float = Field(default=3.0, ge=0, description="weight of the prefix-match scorer")
    queue_weight: float = Field(default=2.0, ge=0, description="weight of the queue scorer")
    kv_utilization_weight: float = Field(default=2.0, ge=0, description="weight of the KV-utilisation scorer")


def _queue_scores(queues: Sequence[float]) -> list[float]:
    lo, hi = min(queues), max(queues)
    if hi <= lo:
        return [1.0] * len(queues)
    return [(hi - q) / (hi - lo) for q in queues]


def _kv_free(i: Instance) -> float:
    return i.free_kv_blocks / i.total_kv_blocks if i.total_kv_blocks > 0 else 1.0


class LlmDStyle(BasePolicy):
    name = "llm-d-style"
    summary = "weighted sum of [0,1] scorers: prefix match, queue, KV utilisation; highest wins"
    Params = LlmDStyleParams

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        prefill = self._pick(prefills, request, [float(i.queued_prefill_tokens) for i in prefills], rng)
        decode = self._pick(decodes, request, [float(d.batch_size) for d in decodes], rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)

    def _pick(self, items: Sequence[Instance], request: PolicyRequest, queues: list[float], rng: random.Random) -> Instance:
        p: LlmDStyleParams = self.p  # type: ignore[assignment]
        cap = request.chain_len
        qs = _queue_scores(queues)
        scores = []
        for i, q in zip(items, qs):
            prefix = min(i.prefix_blocks[2], cap) / cap if cap > 0 else 0.0
            scores.append(-(p.prefix_weight * prefix + p.queue_weight * q + p.kv_utilization_weight * _kv_free(i)))
        return pick_lowest(items, scores, rng)
