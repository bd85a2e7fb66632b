"""``local-cache-aware``: the longest prefix in an instance's own cache, load as the tie-break."""

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


class LocalCacheAware(BasePolicy):
    name = "local-cache-aware"
    summary = "longest locally cached prefix (any tier), fewest queued tokens on a tie; decode least loaded"

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        cap = request.chain_len
        top = max(min(i.prefix_blocks[2], cap) for i in prefills)
        longest = [i for i in prefills if min(i.prefix_blocks[2], cap) == top]
        prefill = pick_lowest(longest, [float(i.queued_prefill_tokens) for i in longest], rng)
        decode = pick_lowest(decodes, [float(d.batch_size) for d in decodes], rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)
