"""``sglang-style``: the SGLang router's cache-aware policy, modelled on our snapshot.

When the prefill instances are imbalanced (max load - min load above an absolute
threshold *and* max load above a relative threshold x min load) the shortest queue
wins. Otherwise the instance with the highest prefix match rate wins if that rate
exceeds ``cache_threshold``, else the one with the smallest cache (most room).
Load is queued + running requests. Decode: the smallest batch. Never rejects.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, lowest, pick_lowest, prefix_share
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class SglangStyleParams(PolicyParams):
    cache_threshold: float = Field(default=0.3, ge=0, le=1, description="match rate above which the best match wins")
    balance_abs_threshold: int = Field(default=64, ge=0, description="load spread (requests) that counts as imbalanced")
    balance_rel_threshold: float = Field(default=1.5, ge=1, description="max/min load ratio that counts as imbalanced")


def _load(i: Instance) -> int:
    return i.queued_requests + i.running_requests


class SglangStyle(PickEachPolicy[SglangStyleParams]):
    name = "sglang-style"
    summary = "cache-aware when balanced, shortest queue when imbalanced (abs and rel thresholds); decode smallest batch"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        p = self.p
        loads = [_load(i) for i in prefills]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            return pick_lowest(prefills, [float(x) for x in loads], rng)
        rates = [prefix_share(i, request) for i in prefills]
        if max(rates) > p.cache_threshold:
            return pick_lowest(prefills, [-r for r in rates], rng)
        return lowest(prefills, lambda i: float(i.total_kv_blocks - i.free_kv_blocks), rng)  # most room
