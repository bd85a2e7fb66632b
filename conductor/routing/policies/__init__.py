"""Routing policies: pure functions of (request, cluster snapshot, params, rng) → decision.

Build one by name with :func:`make_policy`; every name and its parameters are in
:data:`POLICIES` (``conductor policies`` prints them).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from conductor.costmodel.costs import Costs, Reuse
from conductor.costmodel.profiles import ModelProfile
from conductor.errors import ConfigError
from conductor.routing.policies.base import (
    REJECT_CODES,
    BasePolicy,
    Decision,
    Placement,
    Policy,
    PolicyParams,
    RejectCode,
    Rejection,
)
from conductor.routing.policies.dynamo_style import DynamoStyle
from conductor.routing.policies.global_cache_aware import GlobalCacheAware
from conductor.routing.policies.kvcache_centric import KvCacheCentric
from conductor.routing.policies.least_loaded import LeastLoaded
from conductor.routing.policies.llm_d_style import LlmDStyle
from conductor.routing.policies.local_cache_aware import LocalCacheAware
from conductor.routing.policies.parts import PickEachPolicy, RoleSplitPolicy, pick_lowest, split_roles
from conductor.routing.policies.random_pick import RandomPick
from conductor.routing.policies.round_robin import RoundRobin
from conductor.routing.policies.sglang_style import SglangStyle
from conductor.topology import Topology

POLICIES: dict[str, type[BasePolicy[Any]]] = {
    cls.name: cls
    for cls in (
        KvCacheCentric,
        RandomPick,
        RoundRobin,
        LeastLoaded,
        LocalCacheAware,
        GlobalCacheAware,
        SglangStyle,
        DynamoStyle,
        LlmDStyle,
    )
}
"""Every registered policy by name; ``kvcache-centric`` is Conductor's own, the rest are baselines."""


def make_policy(name: str, params: dict[str, Any] | None, profile: ModelProfile,
                topology: Topology | None = None) -> Policy:
    """A fresh policy object costing transfers on ``topology`` (default: the profile's two
    link speeds); :class:`ConfigError` naming the policy or the bad parameter."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    try:
        validated = cls.Params.model_validate(params or {})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err.get("loc", ())) or "params"
            if err.get("type") == "extra_forbidden":
                known = ", ".join(cls.Params.model_fields) or "none"
                lines.append(f"policy {name!r}: unknown parameter {field!r} (known: {known})")
            else:
                lines.append(f"policy {name!r}: parameter {field!r}: {err.get('msg')} (got {err.get('input')!r})")
        raise ConfigError("\n".join(lines)) from None
    return cls(validated, profile, topology)


def list_policies() -> list[dict[str, Any]]:
    """Name, summary and parameters (type, default, meaning) of every policy."""
    out = []
    for name, cls in POLICIES.items():
        params = {}
        for field, info in cls.Params.model_fields.items():
            ann = info.annotation
            params[field] = {
                "type": getattr(ann, "__name__", str(ann)),
                "default": info.default,
                "description": info.description or "",
            }
        out.append({"name": name, "summary": cls.summary, "params": params})
    return out


__all__ = [
    "POLICIES", "REJECT_CODES", "BasePolicy", "Costs", "Decision", "PickEachPolicy", "Placement", "Policy",
    "PolicyParams", "RejectCode", "Rejection", "Reuse", "RoleSplitPolicy", "list_policies", "make_policy",
    "pick_lowest", "split_roles",
]
