"""``round-robin``: prefill and decode instances in turn, in node-id order.

The turn is the request's position in the log (``PolicyRequest.ordinal``: its offset on
``requests``, the trace index in the simulator), not a counter in the policy object, so
any decision can be re-derived from the log alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from conductor.routing.policies.base import PolicyParams
from conductor.routing.policies.parts import PickEachPolicy, pick_in_turn
from conductor.routing.snapshot import ClusterSnapshot, Instance, PolicyRequest


class RoundRobin(PickEachPolicy[PolicyParams]):
    name = "round-robin"
    summary = "prefill and decode instances in turn (node-id order, by the request's log position); deterministic"

    def prefill(self, request: PolicyRequest, snapshot: ClusterSnapshot, prefills: Sequence[Instance],
                rng: random.Random) -> Instance:
        return pick_in_turn(prefills, request.ordinal)

    def decode(self, request: PolicyRequest, snapshot: ClusterSnapshot, decodes: Sequence[Instance],
               rng: random.Random) -> Instance:
        return pick_in_turn(decodes, request.ordinal)
