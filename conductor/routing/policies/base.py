"""What every policy returns, what it is built from, and the base its classes share.

Pure: no I/O, no clock, randomness only from the ``random.Random`` passed to
``decide``. The estimates come from :mod:`conductor.costmodel.costs`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar, get_args, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from conductor.costmodel.costs import Costs
from conductor.costmodel.profiles import ModelProfile
from conductor.routing.policies.stages import DECIDE, Mark
from conductor.routing.snapshot import ClusterSnapshot, PolicyRequest
from conductor.topology import Topology
from schemas import Tier
from schemas.records import PolicyRejectReason

RejectCode = PolicyRejectReason
REJECT_CODES: frozenset[str] = frozenset(get_args(PolicyRejectReason))
"""The reasons a policy may give: the policy part of ``schemas.RejectReason``."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Run the prefill on ``prefill`` and the decode on ``decode``.

    ``reused_blocks`` blocks of the prompt's prefix are read from ``reuse_source``
    (the prefill instance itself when local) out of ``reuse_tier`` instead of being
    recomputed; ``reuse_tier`` is the slowest tier the prefix is read from.
    """

    prefill: str
    decode: str
    reused_blocks: int
    reuse_source: str | None
    reuse_tier: Tier | None
    predicted_ttft_s: float
    predicted_tbt_ms: float
    prefill_group: tuple[str, ...] = ()
    """Chunked pipeline parallelism: the prefill instances in pipeline order (``prefill``
    first); empty when one instance prefills the whole prompt."""
    chunk_boundaries: tuple[int, ...] = ()
    """The end token of each group member's chunk (the last is the prompt length); the
    first chunk starts after the reused prefix."""
    left_holder: str | None = None
    """Why the instance holding the longest prefix of the chain was not chosen, when it was not
    (``kvcache-centric``'s stay rule: ``prefill_plan.stay_on_holder``)."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """Do not run the request; ``reason`` is a machine-readable code."""

    reason: RejectCode
    message: str

    def __post_init__(self) -> None:
        if self.reason not in REJECT_CODES:
            raise ValueError(f"unknown rejection reason {self.reason!r}; one of {sorted(REJECT_CODES)}")


Decision = Placement | Rejection


@runtime_checkable
class Policy(Protocol):
    """A routing policy: one placement (or rejection) per request, from a snapshot."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> dict[str, Any]:
        """The parameters by name, as recorded in each decision."""

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision: ...


class PolicyParams(BaseModel):
    """Base of each policy's parameter model: unknown names are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aggregate_below_tokens: int = Field(
        default=512, ge=0,
        description="conditional disaggregation: a request whose prefill instance is an aggregated-capable "
        "(role both) instance stays there, prefill and decode in one call, when it would compute at most "
        "this many prompt tokens (policies/mode.py)",
    )


def slo_budgets(request: PolicyRequest, slo_margin: float = 1.0, priority_shift: float = 0.0) -> tuple[float, float]:
    """(TTFT budget in s, TBT budget in ms) the early rejection holds ``request`` to: its SLOs
    times ``slo_margin``, scaled by its priority: ``1 + priority_shift * priority / 100``, so a
    request of priority -100 is shed while the cluster could still take it at
    ``1 - priority_shift`` of its SLO (leaving that headroom to the others), one of +100 is kept
    up to ``1 + priority_shift`` of it, and priority 0 (the default) is held to its SLO."""
    scale = slo_margin * (1.0 + priority_shift * request.priority / 100.0)
    return request.ttft_slo_s * scale, request.tbt_slo_ms * scale


P = TypeVar("P", bound=PolicyParams)
"""A policy's parameter model."""


@runtime_checkable
class StagedPolicy(Protocol):
    """A policy that reports its stages as it decides (the same decision as ``decide``;
    :mod:`.stages` names the stages)."""

    def decide_staged(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random,
                      mark: Mark) -> Decision: ...


class BasePolicy(Generic[P]):
    """Holds the profile and the validated parameters (``p``, of the parameter model the class
    is typed over: ``class KvCacheCentric(RoleSplitPolicy[KvCacheCentricParams])``); subclasses
    implement ``decide``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    """The parameter model that :func:`~conductor.routing.policies.make_policy` validates with:
    the one named in the class's base (``PolicyParams`` when none is)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], PolicyParams):
                cls.Params = args[0]

    def __init__(self, params: P, profile: ModelProfile, topology: Topology | None = None) -> None:
        self.p: P = params
        self.params: dict[str, Any] = params.model_dump()
        self.profile = profile
        self.costs = Costs(profile, topology)

    def decide(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random) -> Decision:
        raise NotImplementedError

    def decide_staged(self, request: PolicyRequest, snapshot: ClusterSnapshot, rng: random.Random,
                      mark: Mark) -> Decision:
        """:meth:`decide`, its stages reported to ``mark`` as they end (:mod:`.stages`); a policy
        not split into stages is one, ``decide``."""
        out = self.decide(request, snapshot, rng)
        mark(DECIDE)
        return out

    def __repr__(self) -> str:
        return f"<policy {self.name} {self.params}>"
