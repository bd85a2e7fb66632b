"""``dynamo-style``: NVIDIA Dynamo's KV router cost, modelled on our snapshot.

cost = overlap_score_weight x prefill blocks (the request's blocks not already
cached there, plus the blocks queued for prefill) + decode blocks (KV blocks in
use, plus the request's). The lowest cost wins; with ``temperature`` > 0 the
instance is instead sampled from a softmax over the min-max normalised costs.
Decode instances are costed by their decode blocks alone. Never rejects.
"""

from __future__ import annotations

import math
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


class DynamoStyleParams(PolicyParams):
    overlap_score_weight: float = Field(default=1.0, ge=0, description="weight of the prefill blocks in the cost")
    temperature: float = Field(default=0.0, ge=0, description="0 = lowest cost; > 0 = softmax sampling")


def _used_blocks(i: Instance, block_size: int) -> float:
    if i.total_kv_blocks > 0:
        return float(i.total_kv_blocks - i.free_kv_blocks)
    return i.decode_context_tokens / block_size


class DynamoStyle(BasePolicy):
    name = "dynamo-style"
    summary = "cost = weight x prefill blocks after overlap + decode blocks; optional softmax temperature"
    Params = DynamoStyleParams

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        p: DynamoStyleParams = self.p  # type: ignore[assignment]
        bs = snapshot.block_size
        req_blocks = -(-request.prompt_tokens // bs)
        pcost = []
        for i in prefills:
            overlap = min(i.prefix_blocks[0], request.chain_len)  # Dynamo indexes device (HBM) blocks
            prefill_blocks = max(req_blocks - overlap, 0) + i.queued_prefill_tokens / bs
            pcost.append(p.overlap_score_weight * prefill_blocks + _used_blocks(i, bs) + req_blocks)
        dcost = [_used_blocks(d, bs) + req_blocks for d in decodes]
        prefill = self._pick(prefills, pcost, rng)
        decode = self._pick(decodes, dcost, rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)

    def _pick(self, items: Sequence[Instance], costs: Sequence[float], rng: random.Random) -> Instance:
        t = self.p.temperature  # type: ignore[attr-defined]
        if t <= 0 or len(items) == 1:
            return pick_lowest(items, costs, rng)
        order = sorted(range(len(items)), key=lambda k: items[k].node_id)
        lo, hi = min(costs), max(costs)
        span = hi - lo or 1.0
        weights = [math.exp(-((costs[k] - lo) / span) / t) for k in order]
        x = rng.random() * sum(weights)
        for k, w in zip(order, weights):
            x -= w
            if x < 0:
                return items[k]
        return items[order[-1]]
