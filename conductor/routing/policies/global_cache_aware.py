"""``global-cache-aware``: the FAST'25 cache-aware baseline, without cache-load balancing.

Every prefill instance's TTFT is predicted from its queue, its *own* cached prefix
and the compute of the rest; the lowest wins. Prefixes on other nodes are never
copied and nothing is rejected: that is what ``kvcache-centric`` adds.
"""

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


class GlobalCacheAware(BasePolicy):
    name = "global-cache-aware"
    summary = "lowest predicted TTFT using each instance's own cache only; decode by lowest predicted TBT; no rejection"

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        costs, bs = self.costs, snapshot.block_size
        ttfts = [costs.queue_wait_s(i) + costs.local_reuse(i, request, bs).cost_s for i in prefills]
        prefill = pick_lowest(prefills, ttfts, rng, tol=1e-6)
        decode = pick_lowest(decodes, [costs.tbt_ms(d, request) for d in decodes], rng, tol=1e-6)
        return local_placement(costs, request, snapshot, prefill, decode)
