"""Routing: ``requests`` → view snapshot + reservations → policy → ``dispatch``.

- :mod:`.snapshot`: what a policy sees (``ClusterSnapshot``, ``Instance``, ``PolicyRequest``, ``IndexView``).
- :mod:`.index`: the cluster picture kept from read to read (``ClusterIndex``).
- :mod:`.policies`: the policies, pure functions of (request, snapshot, params, seeded rng).
- :mod:`.router`: the routing worker (one decision at a time) and its Kafka loop.
- :mod:`.dispatch`: the dispatcher client that engines and gateways read decisions with.
- :mod:`.explain`: re-derive and explain a past decision from the log.
"""
