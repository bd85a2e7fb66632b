"""A prefill's KV that no decode took, freed by the gateway's one-token pull, on real vLLM engines.

vLLM's P/D prefill (``do_remote_decode``) keeps the prompt's blocks for the decode that will pull
them over NIXL, and frees them only when a decode has pulled them or after its abort timeout
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default). The gateway's hand-off
(``conductor/gateway/handoff/vllm.py``) sends a one-token decode that pulls held blocks when the
client left, when a retry went to another prefill instance, or (``Orphans``) at the next decode
that opens after a decode-side outage. Here the prefill engine's own gauge
(``vllm:kv_cache_usage_perc``: blocks held by requests, not blocks merely cached) shows the blocks
held, still held seconds later, and released once the gateway's pull ran.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from conductor.gateway.config import UpstreamTimeouts
from conductor.gateway.handoff import Call
from conductor.gateway.handoff import vllm as handoff
from conductor.gateway.outcome import Trace
from conductor.gateway.upstream import Upstream
from conductor.harness.vllm_kit import BLOCK_SIZE, VllmEngine
from schemas import RoutingDecision
from tests.vllm.test_engines import metric, metrics_text, tokenize, until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PRE, DEC = "vllm-p", "vllm-d"
HELD_S = 3.0
"""How long the test watches held blocks stay held before the pull (the engine frees them itself only
after its abort timeout, minutes)."""


def decision(rid: str) -> RoutingDecision:
    return RoutingDecision(request_id=rid, prefill_instance=PRE, decode_instance=DEC, reused_tokens=0,
                           predicted_ttft_s=0.0, predicted_tbt_ms=20.0, policy="test")


def call(p: VllmEngine, d: VllmEngine, prompt: list[int]) -> Call:
    rid = f"free-{uuid.uuid4().hex[:10]}"
    body = {"model": p.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True}
    return Call(body, False, decision(rid), rid, {}, p.url, d.url)


async def usage(http: httpx.AsyncClient, e: VllmEngine) -> float:
    return metric(await metrics_text(http, e), "vllm:kv_cache_usage_perc")


async def held_prefill(up: Upstream, c: Call) -> handoff.Held:
    """The prefill half as the hand-off sends it; its blocks stay held for a decode."""
    tr = Trace(request_id=c.request_id, t0=time.monotonic(), stream=True)
    pj = await up.prefill(c.prefill_url + c.path, handoff.vllm_prefill_body(c.body, c.chat),
                          c.headers(PRE), PRE, tr)
    params = pj.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("remote_block_ids"), pj
    return PRE, params, pj


async def settled() -> None:
    """Every background pull the hand-off started has ended."""
    while handoff._freeing:
        await asyncio.gather(*list(handoff._freeing), return_exceptions=True)


async def test_a_held_prefill_is_freed_by_the_gateways_pull_and_an_orphan_by_the_next_decode(
    vllm_pd: tuple[VllmEngine, VllmEngine], http: httpx.AsyncClient, unique_text: str
) -> None:
    p, d = vllm_pd
    tokens = await tokenize(http, p, unique_text * 40)
    blocks = min(len(tokens) // BLOCK_SIZE, 12)
    assert blocks >= 8, f"prompt too short: {len(tokens)} tokens"
    async with httpx.AsyncClient() as client:
        up = Upstream(client, UpstreamTimeouts(), time.monotonic)
        base = await usage(http, p)
        xfers0 = metric(await metrics_text(http, d), "vllm:nixl_xfer_time_seconds_count")

        # 1. The client's decode never came (it left): the prefill's blocks stay held on P.
        first = call(p, d, tokens[: blocks * BLOCK_SIZE])
        held = await held_prefill(up, first)
        after_prefill = await usage(http, p)
        assert after_prefill > base, (base, after_prefill)
        await asyncio.sleep(HELD_S)
        assert await usage(http, p) > base, "P freed the blocks by itself: nothing for the pull to prove"

        # The gateway's pull (what it sends when the client leaves mid-decode) frees them now.
        handoff.free_held(up, first, held)
        await settled()
        await until("P's held blocks released after the pull", lambda: _back_to(http, p, base), timeout=30)
        assert metric(await metrics_text(http, d), "vllm:nixl_xfer_time_seconds_count") - xfers0 == 1

        # 2. Every decode failed (an outage): the held KV waits as an orphan, and the next request's
        #    decode that opens, through the hand-off as the gateway runs it, pulls it too.
        off = handoff.VllmHandOff()
        lost = call(p, d, list(reversed(tokens))[: blocks * BLOCK_SIZE])
        off.orphans.add(lost, await held_prefill(up, lost))
        assert await usage(http, p) > base
        await asyncio.sleep(HELD_S)
        assert await usage(http, p) > base, "the orphan's blocks were freed without a pull"

        nxt = call(p, d, tokens[: BLOCK_SIZE])
        tr = Trace(request_id=nxt.request_id, t0=time.monotonic(), stream=True)
        resp, _ = await off(up, nxt, tr)
        try:
            assert resp.status_code == 200
            assert [chunk async for chunk in resp.aiter_bytes()]
        finally:
            await resp.aclose()
        await settled()
        assert len(off.orphans) == 0
        await until("the orphan's blocks released by the next decode's pull", lambda: _back_to(http, p, base),
                    timeout=30)


async def _back_to(http: httpx.AsyncClient, p: VllmEngine, base: float) -> bool:
    return await usage(http, p) <= base + 1e-9
