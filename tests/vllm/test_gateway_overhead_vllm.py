"""The gateway against a hand-made P/D hand-off to the same real vLLM engines (NIXL), paired.

A measurement, not a timed test: it prints the paired overhead's distribution (the numbers in
README and docs/benchmarks.md come from
`OVERHEAD_PAIRS=24 scripts/test -m vllm tests/vllm/test_gateway_overhead_vllm.py -s`)
and checks only what must hold whatever the machine's load: every request of both sides got its
tokens, and every gateway decision was the P/D pair, made in the gateway's own process and logged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conductor.harness.bench.gateway_vllm import paired_overhead
from conductor.harness.vllm_cluster import VllmGatewayCluster, VllmNode
from conductor.settings import Settings
from schemas import RoutingDecision, decode
from streams.kafka import consumer
from streams.topics import topics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PRE, DEC = "vllm-p", "vllm-d"
PAIRS = int(os.environ.get("OVERHEAD_PAIRS", "8"))
"""Pairs sent one at a time (each pair is 2-20 s on two CPU engines): 8 keeps the suite short; the
figures in docs/benchmarks.md were taken with OVERHEAD_PAIRS=24."""


@pytest.fixture
async def cluster(vllm_settings: Settings, vllm_engines, tmp_path: Path) -> AsyncIterator[VllmGatewayCluster]:  # type: ignore[no-untyped-def]
    for e in (vllm_engines.prefill, vllm_engines.decode):
        if not e.running:
            await e.start()
    nodes = [VllmNode(PRE, "prefill", vllm_engines.prefill), VllmNode(DEC, "decode", vllm_engines.decode)]
    async with VllmGatewayCluster(vllm_settings.model_copy(update={"heartbeat_ttl_s": 30.0}), tmp_path / "logs",
                                  nodes=nodes, model=vllm_engines.prefill.model) as c:
        yield c


async def test_gateway_against_a_hand_made_pd_hand_off(  # type: ignore[no-untyped-def]
        cluster: VllmGatewayCluster, vllm_settings: Settings, vllm_engines) -> None:
    out = await paired_overhead(cluster.gateway_url, cluster.api_key, vllm_engines.prefill.url,
                                vllm_engines.decode.url, cluster.model, pairs=PAIRS, words=120)
    print("\ngateway vs hand-made P/D on real vLLM:", json.dumps(out))
    assert out["pairs"] == PAIRS and out["gateway_overhead_ms_p50"] is not None

    cons = consumer(vllm_settings.kafka(), topics(vllm_settings.topic_config()).dispatch.name, group_id=None,
                    fetch_max_wait_ms=50)
    await cons.start()
    decisions: list[RoutingDecision] = []
    try:
        deadline = time.monotonic() + 20
        while len(decisions) < PAIRS and time.monotonic() < deadline:
            for recs in (await cons.getmany(timeout_ms=500)).values():
                decisions += [b for r in recs if isinstance(b := decode(r.value).body, RoutingDecision)]
    finally:
        await cons.stop()
    assert len(decisions) >= PAIRS
    assert {(d.prefill_instance, d.decode_instance, d.mode) for d in decisions} == {(PRE, DEC, "disaggregated")}
    assert {d.decided_by for d in decisions} == {cluster.gateway_id}
