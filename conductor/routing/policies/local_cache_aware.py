"""``local-cache-aware``: the longest prefix in an instance's own cache, load as the tie-break."""

from __future__ import annotations

import random
from collections.abc import Sequence

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, lowest, queued_tokens
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class LocalCacheAware(PickEachPolicy[PolicyParams]):
    name = "local-cache-aware"
    summary = "longest locally cached prefix (any tier), fewest queued tokens on a tie; decode least loaded"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        cap = request.chain_len
        top = max(min(i.prefix_blocks[2], cap) for i in prefills)
        return lowest([i for i in prefills if min(i.prefix_blocks[2], cap) == top], queued_tokens, rng)
