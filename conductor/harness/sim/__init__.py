"""A trace-driven, discrete-event simulator of a prefill/decode-disaggregated cluster.

It calls the same policy functions as the routing worker, and cache contents reach
the policy only through the production path (KV events → fold → in-memory view),
so what it measures is what the live system would decide.
"""

from conductor.harness.sim.errors import SimulationError, TraceError

__all__ = ["SimulationError", "TraceError"]
