"""``global-cache-aware``: the FAST'25 cache-aware baseline, without cache-load balancing.

Every prefill instance's TTFT is predicted from its queue, its *own* cached prefix
and the compute of the rest; the lowest wins. Prefixes on other nodes are never
copied and nothing is rejected: that is what ``kvcache-centric`` adds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, lowest
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class GlobalCacheAware(PickEachPolicy[PolicyParams]):
    name = "global-cache-aware"
    summary = "lowest predicted TTFT using each instance's own cache only; decode by lowest predicted TBT; no rejection"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        costs, bs = self.costs, snapshot.block_size
        return lowest(prefills, lambda i: costs.queue_wait_s(i) + costs.local_reuse(i, request, bs).cost_s, rng,
                      tol=1e-6)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        return lowest(decodes, lambda d: self.costs.tbt_ms(d, request), rng, tol=1e-6)
