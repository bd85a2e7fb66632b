"""``round-robin``: prefill and decode instances in turn, in node-id order.

The policy object keeps the two counters, so one object must serve one stream of
decisions (one router process, one simulator run); it is deterministic.
"""

from __future__ import annotations

import random

from conductor.profiles import ModelProfile
from conductor.routing.policies.base import (
    BasePolicy,
    Decision,
    PolicyParams,
    Rejection,
    local_placement,
    split_roles,
)
from conductor.routing.snapshot import ClusterSnapshot, PolicyRequest


class RoundRobin(BasePolicy):
    name = "round-robin"
    summary = "prefill and decode instances in turn (node-id order); stateful, deterministic"

    def __init__(self, params: PolicyParams, profile: ModelProfile) -> None:
        super().__init__(params, profile)
        self._next_prefill = 0
        self._next_decode = 0

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        roles = split_roles(snapshot)
        if isinstance(roles, Rejection):
            return roles
        prefills = sorted(roles[0], key=lambda i: i.node_id)
        decodes = sorted(roles[1], key=lambda i: i.node_id)
        prefill = prefills[self._next_prefill % len(prefills)]
        decode = decodes[self._next_decode % len(decodes)]
        self._next_prefill += 1
        self._next_decode += 1
        return local_placement(self.costs, request, snapshot, prefill, decode)
