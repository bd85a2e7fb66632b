"""Everything that exists to develop, demonstrate or measure Conductor, kept apart from the
product path: the emulated engine (``engine``), the trace-driven simulator (``sim``), the
embedded stack (``devstack``), the demo, chaos runs, the benchmarks (``bench``) and the
clusters the tests and benchmarks start (emulated, Valkey Cluster, real vLLM).

Nothing on the product path imports this package (an import-linter contract says so)."""
