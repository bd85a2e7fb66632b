"""Runtime control: the ``control`` topic folded into the state every router decides under.

Operators change the policy, its parameters, or take nodes out of rotation by
publishing :class:`~schemas.ControlCommand` records; nothing is changed by writing
to Redis. Every router folds the one-partition ``control`` topic in offset order
with :func:`apply_control` (pure: no I/O, no clock), so all replicas, the
simulator and ``conductor explain`` reach the same :class:`ControlState` for the
same offset. A decision records that offset.

``set_profile`` swaps the cost model the policy predicts with for one fitted from the engines'
measurements (``conductor fit``); a decision's control offset then names the profile it
was made under as well, so ``explain`` re-derives it with that profile.

A command that names an unknown policy, bad parameters or a profile that does not validate is skipped (the state
keeps its previous policy and notes why in ``last_error``) but its offset still
counts: every reader skips it the same way.

The topic is compacted (after the audit retention: ``explain`` folds from offset 0 to a decision's
offset, and a decision is kept that long), so a new router folds a few records, not every change
since the cluster began. Compaction keeps the last record of each key, offsets unchanged: with
:func:`control_key` the fold of what survives is the fold of everything, but for the history and
the counts the admin API shows, and a node both cordoned and drained shown as draining only.
A refused command replaces its key's last good one, so :func:`~conductor.routing.control_log.publish_control`
refuses what the fold would skip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from conductor.costmodel.profiles import ModelProfile, profile_from_dict
from conductor.errors import ConfigError
from schemas import ControlCommand

PolicyCheck = Callable[[str | None, dict[str, Any]], None]
"""Raises (any exception) when a policy name (``None``: the configured one) and parameters
would not build a policy."""


@dataclass(frozen=True, slots=True)
class ControlState:
    offset: int = -1
    """Offset of the last control record folded in; -1 before any."""
    policy: str | None = None
    """The policy set at run time; ``None``: the one configured at start-up."""
    params: Mapping[str, Any] | None = None
    """Its parameters; ``None``: the configured ones."""
    cordoned: frozenset[str] = frozenset()
    draining: frozenset[str] = frozenset()
    last_error: str = ""
    changes: int = 0
    """Control records applied (skipped ones not counted)."""
    history: tuple[dict[str, Any], ...] = field(default=())
    """The last few applied or skipped commands, newest last (for the admin API)."""
    profile: ModelProfile | None = None
    """The cost model set at run time (``set_profile``); ``None``: the one configured at start-up."""

    @property
    def excluded(self) -> frozenset[str]:
        """Nodes that take no new requests."""
        return self.cordoned | self.draining

    def node_status(self, node_id: str) -> str:
        if node_id in self.draining:
            return "draining"
        if node_id in self.cordoned:
            return "cordoned"
        return "active"

    def as_dict(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "policy": self.policy,
            "params": None if self.params is None else dict(self.params),
            "cordoned": sorted(self.cordoned),
            "draining": sorted(self.draining),
            "last_error": self.last_error,
            "changes": self.changes,
            "history": list(self.history),
            "profile": None if self.profile is None else self.profile.name,
        }


HISTORY = 20


def control_key(cmd: ControlCommand) -> str:
    """The record key of ``cmd`` on the compacted ``control`` topic: one key per part of the state
    that a later record replaces whole (the policy, its parameters, the profile, each node's status)."""
    if cmd.action in ("cordon", "drain", "uncordon"):
        return f"node:{cmd.node_id}"
    if cmd.action == "set_profile":
        return "profile"
    # A set_params that names a policy sets it, as set_policy does; one that does not keeps the policy.
    return "policy" if cmd.action == "set_policy" or cmd.policy else "params"


def apply_control(
    state: ControlState, cmd: ControlCommand, offset: int, check: PolicyCheck | None = None
) -> ControlState:
    """The state after ``cmd`` at ``offset``. ``check`` validates a policy change; without it
    every change is taken as valid. A record at or below the state's offset is a replay: ignored."""
    if offset <= state.offset:
        return state
    entry = {"offset": offset, "action": cmd.action, "policy": cmd.policy, "params": dict(cmd.params),
             "node_id": cmd.node_id, "reason": cmd.reason, "operator": cmd.operator}
    new: ControlState
    error = ""
    if cmd.action == "set_profile":
        entry["profile"] = str((cmd.profile or {}).get("name"))
        try:
            prof = profile_from_dict(dict(cmd.profile or {}), source=f"offset {offset}: set_profile")
        except ConfigError as e:
            error = f"{e} (skipped)"
            new = replace(state, offset=offset, last_error=error)
        else:
            new = replace(state, offset=offset, profile=prof, last_error="", changes=state.changes + 1)
    elif cmd.action in ("set_policy", "set_params"):
        name = cmd.policy if cmd.action == "set_policy" else (cmd.policy or state.policy)
        params = dict(cmd.params)
        try:
            if check is not None:
                check(name, params)
        except Exception as e:  # noqa: BLE001 - any refusal of the policy factory
            error = f"offset {offset}: {cmd.action} refused: {e}"
        if error:
            new = replace(state, offset=offset, last_error=error)
        else:
            new = replace(state, offset=offset, policy=name, params=MappingProxyType(params), last_error="",
                          changes=state.changes + 1)
    else:
        node = cmd.node_id or ""
        cordoned, draining = set(state.cordoned), set(state.draining)
        if cmd.action == "cordon":
            cordoned.add(node)
        elif cmd.action == "drain":
            draining.add(node)
        else:  # uncordon
            cordoned.discard(node)
            draining.discard(node)
        new = replace(state, offset=offset, cordoned=frozenset(cordoned), draining=frozenset(draining),
                      last_error="", changes=state.changes + 1)
    entry["applied"] = not error
    if error:
        entry["error"] = error
    return replace(new, history=(*state.history, entry)[-HISTORY:])


def fold_control(
    records: Iterable[tuple[int, ControlCommand]], state: ControlState | None = None, check: PolicyCheck | None = None
) -> ControlState:
    """Fold ``(offset, command)`` pairs, in offset order, into a state."""
    st = state or ControlState()
    for offset, cmd in records:
        st = apply_control(st, cmd, offset, check)
    return st


__all__ = ["ControlState", "PolicyCheck", "apply_control", "control_key", "fold_control"]
