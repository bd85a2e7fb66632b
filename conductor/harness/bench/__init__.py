"""Benchmarks that print their numbers (``conductor bench ...``), all in one place.

- :mod:`.ingest`: engines → Kafka → stream worker → Redis, end to end (``bench ingest``).
- :mod:`.view_read`: the routing read's layouts on a dedicated Valkey (``bench view-read``).
- :mod:`.route`: full routing decisions on a synthetic view (``bench route``).
- :mod:`.bridge`: one bridge, engine batches → Conductor records (``bench bridge``).
- :mod:`.scrape`: following one engine's load, per ``/metrics`` scrape (``bench scrape``).
- :mod:`.gateway`: the gateway's overhead over calling the engines directly (``bench gateway``).
- :mod:`.live`, :mod:`.live_vllm`: one trace slice through Conductor and a peer router, on
  emulated or real vLLM engines (``bench live``).
- :mod:`.pool`: put/get latency of the shared KV pool, Mooncake Store (``bench pool``).
- :mod:`.stack`: the servers a benchmark runs against: the configured Redis, else an embedded
  stack started for the run.
"""

from __future__ import annotations
