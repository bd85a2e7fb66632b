"""Errors of the simulator (under Conductor's one error root)."""

from __future__ import annotations

from conductor.errors import ConductorError


class SimulationError(ConductorError):
    """The simulation was configured wrongly or reached an impossible state."""


class TraceError(SimulationError):
    """A trace file is missing or a line of it is malformed; the message names the line."""
