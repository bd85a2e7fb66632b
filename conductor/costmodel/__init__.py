"""The cost model: what a prefill, a prefix copy, a queue wait and a decode step take, in seconds.

- :mod:`.profiles`: ``ModelProfile`` (a model on its hardware: FLOPs, bandwidths, fitted terms),
  loading the shipped profiles (JSON files in ``data/``) and fitting them to measured timings.
- :mod:`.costs`: ``Costs``, the estimates the policies and the cluster index share, bound to one
  profile and one topology.
- :mod:`.fitting`: ``CostFitter``, the profile refitted from served requests (``conductor fit``).

Pure: no I/O driver, no clock; it imports no routing, balance or harness module, so every one of
them reads the same numbers.
"""
