"""``least-loaded``: the shortest prefill queue and the smallest decode batch, cache-blind."""

from __future__ import annotations

import random
from collections.abc import Sequence

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, lowest, queued_tokens
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class LeastLoaded(PickEachPolicy[PolicyParams]):
    name = "least-loaded"
    summary = "fewest queued prefill tokens, then smallest decode batch; ties at random; ignores the cache"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        return lowest(prefills, queued_tokens, rng)
