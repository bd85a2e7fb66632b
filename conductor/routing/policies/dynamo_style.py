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

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, by_node, kv_used_blocks, pick_lowest
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class DynamoStyleParams(PolicyParams):
    overlap_score_weight: float = Field(default=1.0, ge=0, description="weight of the prefill blocks in the cost")
    temperature: float = Field(default=0.0, ge=0, description="0 = lowest cost; > 0 = softmax sampling")


class DynamoStyle(PickEachPolicy[DynamoStyleParams]):
    name = "dynamo-style"
    summary = "cost = weight x prefill blocks after overlap + decode blocks; optional softmax temperature"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        w = self.p.overlap_score_weight
        bs = snapshot.block_size
        req_blocks = -(-request.prompt_tokens // bs)
        costs = []
        for i in prefills:
            overlap = min(i.prefix_blocks[0], request.chain_len)  # Dynamo indexes device (HBM) blocks
            prefill_blocks = max(req_blocks - overlap, 0) + i.queued_prefill_tokens / bs
            costs.append(w * prefill_blocks + kv_used_blocks(i, bs) + req_blocks)
        return self._pick(prefills, costs, rng)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        bs = snapshot.block_size
        req_blocks = -(-request.prompt_tokens // bs)
        return self._pick(decodes, [kv_used_blocks(d, bs) + req_blocks for d in decodes], rng)

    def _pick(self, items: Sequence[Instance], costs: Sequence[float], rng: random.Random) -> Instance:
        t = self.p.temperature
        if t <= 0 or len(items) == 1:
            return pick_lowest(items, costs, rng)
        # A softmax over the min-max normalised costs, drawn in node-id order.
        cost_of = {i.node_id: c for i, c in zip(items, costs)}
        ordered = by_node(items)
        lo, hi = min(costs), max(costs)
        span = hi - lo or 1.0
        weights = [math.exp(-((cost_of[i.node_id] - lo) / span) / t) for i in ordered]
        x = rng.random() * sum(weights)
        for i, w in zip(ordered, weights):
            x -= w
            if x < 0:
                return i
        return ordered[-1]
