"""``sglang-style``: the SGLang router's cache-aware policy, modelled on our snapshot.

When the prefill instances are imbalanced (max load - min load above an absolute
threshold *and* max load above a relative threshold x min load) the shortest queue
wins. Otherwise the instance with the highest prefix match rate wins if that rate
exceeds ``cache_threshold``, else the one with the smallest cache (most room).
Load is queued + running requests. Decode: the smallest batch. Never rejects.
"""

from __future__ import annotations

import random

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


class SglangStyleParams(PolicyParams):
    cache_threshold: float = Field(default=0.3, ge=0, le=1, description="match rate above which the best match wins")
    balance_abs_threshold: int = Field(default=64, ge=0, description="load spread (requests) that counts as imbalanced")
    balance_rel_threshold: float = Field(default=1.5, ge=1, description="max/min load ratio that counts as imbalanced")


def _load(i: Instance) -> int:
    return i.queued_requests + i.running_requests


class SglangStyle(BasePolicy):
    name = "sglang-style"
    summary = "cache-aware when balanced, shortest queue when imbalanced (abs and rel thresholds); decode smallest batch"
    Params = SglangStyleParams

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills, decodes = roles
        p: SglangStyleParams = self.p  # type: ignore[assignment]
        loads = [_load(i) for i in prefills]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            prefill = pick_lowest(prefills, [float(x) for x in loads], rng)
        else:
            cap = max(request.chain_len, 1)
            rates = [min(i.prefix_blocks[2], cap) / cap for i in prefills]
            best = max(rates)
            if request.chain_len > 0 and best > p.cache_threshold:
                prefill = pick_lowest(prefills, [-r for r in rates], rng)
            else:
                used = [float(i.total_kv_blocks - i.free_kv_blocks) for i in prefills]
                prefill = pick_lowest(prefills, used, rng)
        decode = pick_lowest(decodes, [float(d.batch_size) for d in decodes], rng)
        return local_placement(self.costs, request, snapshot, prefill, decode)
