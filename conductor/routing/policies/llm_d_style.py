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

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import (
    PickEachPolicy,
    batch_size,
    kv_free_share,
    pick_lowest,
    prefix_share,
    queued_tokens,
    shortest_first,
)
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class LlmDStyleParams(PolicyParams):
    prefix_weight: float = Field(default=3.0, ge=0, description="weight of the prefix-match scorer")
    queue_weight: float = Field(default=2.0, ge=0, description="weight of the queue scorer")
    kv_utilization_weight: float = Field(default=2.0, ge=0, description="weight of the KV-utilisation scorer")


class LlmDStyle(PickEachPolicy[LlmDStyleParams]):
    name = "llm-d-style"
    summary = "weighted sum of [0,1] scorers: prefix match, queue, KV utilisation; highest wins"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        return self._pick(prefills, request, [queued_tokens(i) for i in prefills], rng)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        return self._pick(decodes, request, [batch_size(d) for d in decodes], rng)

    def _pick(self, items: Sequence[Instance], request: PolicyRequest, queues: list[float], rng: random.Random) -> Instance:
        p = self.p
        scores = [
            -(p.prefix_weight * prefix_share(i, request) + p.queue_weight * q + p.kv_utilization_weight * kv_free_share(i))
            for i, q in zip(items, shortest_first(queues))
        ]
        return pick_lowest(items, scores, rng)
