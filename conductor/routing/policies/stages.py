"""A decision as named stages, each timed (llm-d's scheduler profile: filter → scorers → picker).

``kvcache-centric`` runs :data:`CANDIDATES` (which prefill instances can win), :data:`PREFILL_PLAN`
(each one's reuse plan and predicted TTFT, the lowest picked), :data:`ADMISSION` (early rejection
and its explanation, CPP when no single instance meets the SLO) and :data:`DECODE_PICK`; around any
policy, :func:`~conductor.routing.policies.mode.decide_mode` adds :data:`MODE` (aggregated or
disaggregated). Deciding from the router's index, the candidates are found by walking the queues
in order of wait, each costed with a plan built first, so :data:`PREFILL_PLAN` (the plan) comes
before :data:`CANDIDATES` (the walk, its costing included) there. A policy without stages is one
stage, :data:`DECIDE`.

The policies stay pure: a stage only calls the :data:`Mark` it is given when it ends, and the
clock is the caller's (:class:`StageTimes`), so no time enters a decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

VIEW_READ: Final = "view_read"
"""The router's: the view read and the reservations pending against it."""
CLUSTER: Final = "cluster"
"""The router's: the policy's picture of the read (the cluster index brought up to it)."""
CANDIDATES: Final = "candidates"
PREFILL_PLAN: Final = "prefill_plan"
ADMISSION: Final = "admission"
DECODE_PICK: Final = "decode_pick"
MODE: Final = "mode"
DECIDE: Final = "decide"
STAGE_NAMES: Final = (VIEW_READ, CLUSTER, CANDIDATES, PREFILL_PLAN, ADMISSION, DECODE_PICK, MODE, DECIDE)
"""Every stage a decision may report, in the order :class:`StageTimes` lists them."""

Mark = Callable[[str], None]
"""Called with a stage's name when it ends."""


def no_mark(stage: str) -> None:
    """The :data:`Mark` of an untimed decision."""


class StageTimes:
    """Seconds per stage of one decision, by the ``clock`` passed in (``time.perf_counter``):
    :meth:`mark` charges the time since the previous mark (or :meth:`start`) to a stage."""

    __slots__ = ("_clock", "_last", "seconds")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        """Time from now on (what happened since the last mark is charged to no stage)."""
        self._last = self._clock()

    def mark(self, stage: str) -> None:
        now = self._clock()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - self._last)
        self._last = now

    def ms(self) -> dict[str, float]:
        """Milliseconds per stage that ran, in :data:`STAGE_NAMES` order (others after, by name)."""
        order = {name: i for i, name in enumerate(STAGE_NAMES)}
        names = sorted(self.seconds, key=lambda n: (order.get(n, len(order)), n))
        return {n: self.seconds[n] * 1000.0 for n in names}


__all__ = ["ADMISSION", "CANDIDATES", "CLUSTER", "DECIDE", "DECODE_PICK", "MODE", "PREFILL_PLAN", "STAGE_NAMES",
           "VIEW_READ", "Mark", "StageTimes", "no_mark"]
