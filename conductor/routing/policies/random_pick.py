"""``random``: a uniformly random prefill and decode instance (the floor any policy must beat)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, pick_uniform
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class RandomPick(PickEachPolicy[PolicyParams]):
    name = "random"
    summary = "uniformly random prefill and decode instance; never rejects by prediction"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        return pick_uniform(prefills, rng)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        return pick_uniform(decodes, rng)
