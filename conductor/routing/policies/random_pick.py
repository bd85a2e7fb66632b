"""``random``: a uniformly random prefill and decode instance (the floor any policy must beat)."""

from __future__ import annotations

import random

from conductor.routing.policies.base import (
    BasePolicy,
    Decision,
    Rejection,
    local_placement,
    split_roles,
)
from conductor.routing.snapshot import ClusterSnapshot, PolicyRequest


class RandomPick(BasePolicy):
    name = "random"
    summary = "uniformly random prefill and decode instance; never rejects by prediction"

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        # Sorted so the pick depends on the seed and the set of instances, not their order.
        prefills = sorted(roles[0], key=lambda i: i.node_id)
        decodes = sorted(roles[1], key=lambda i: i.node_id)
        prefill = prefills[rng.randrange(len(prefills))]
        decode = decodes[rng.randrange(len(decodes))]
        return local_placement(self.costs, request, snapshot, prefill, decode)
