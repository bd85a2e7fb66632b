"""Operator and developer tools around the flow: the embedded stack (``devstack``), the demo,
and the benchmarks (``bench``)."""
