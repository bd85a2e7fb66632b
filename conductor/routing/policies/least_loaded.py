"""``least-loaded``: the shortest prefill queue and the smallest decode batch, cache-blind."""

from __future__ import annotations

import random

from conductor.routing.policies.base import (
    BasePolicy,
    Decision,
    Rejection,
    local_placement,
    pick_lowest,
    split_roles,
)
from conductor.routing.snapshot import ClusterSnapshot, PolicyRequest


class LeastLoaded(BasePolicy):
    name = "least-loaded"
    summary = "fewest queued prefill tokens, then smallest decode batch; ties at random; ignores the cache"

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        prefill = pick_lowest(prefills, [float(i.queued_prefill_tokens) for i in prefills], rng)
        decode = pick_lowest(decodes, [float(d.batch_size) for d in decodes], rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)
