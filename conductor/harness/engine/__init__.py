"""An emulated prefill/decode engine that speaks what vLLM speaks to Conductor (its KV events
over ZMQ with replay), timed by a model profile: for the demo, the tests and benchmarks."""
