"""The gateway's overhead on real engines: the same P/D hand-off through ``conductor gateway`` and by hand.

Against one prefill and one decode vLLM engine handing KV off over NIXL: each pair of requests
sends one prompt through the gateway (tokenize, decide, log, prefill, decode, relay) and another
of the same length straight to the engines with the very bodies the gateway sends (the prefill
half with ``do_remote_decode``, then the decode half with the prefill's ``kv_transfer_params``),
the order alternating. The two prompts of a pair differ, so neither side reads the other's
prefix from the engines' caches. A request's overhead is its gateway time to first token minus
its pair's direct one; the result is the distribution of those differences.
"""

from __future__ import annotations

import random
import time
from typing import Any

import httpx
import orjson

from conductor.gateway.handoff.vllm import vllm_decode_body, vllm_prefill_body
from conductor.stats import percentile

WORDS = ("prefill", "decode", "cache", "block", "token", "engine", "router", "gateway", "stream", "event")


def prompts(n: int, words: int, seed: int = 7) -> list[str]:
    """``n`` distinct prompts of ``words`` words each (the first word tells them apart)."""
    rng = random.Random(seed)
    return [" ".join([f"q{i}"] + [rng.choice(WORDS) for _ in range(words - 1)]) for i in range(n)]


async def _first_token(resp: httpx.Response, t0: float) -> float:
    """Seconds from ``t0`` to the first SSE event carrying text; the stream is read to its end."""
    first: float | None = None
    async for line in resp.aiter_lines():
        if first is None and line.startswith("data: {"):
            choices = orjson.loads(line[6:]).get("choices") or []
            if any(c.get("text") for c in choices):
                first = time.perf_counter() - t0
    if resp.status_code != 200 or first is None:
        raise RuntimeError(f"no token (status {resp.status_code})")
    return first


async def through_gateway(http: httpx.AsyncClient, gateway_url: str, api_key: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with http.stream("POST", f"{gateway_url}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {api_key}"}) as resp:
        return await _first_token(resp, t0)


async def by_hand(http: httpx.AsyncClient, prefill_url: str, decode_url: str, body: dict[str, Any]) -> float:
    """The hand-off a client would write itself: the gateway's own two bodies, no decision, no log."""
    t0 = time.perf_counter()
    pre = await http.post(f"{prefill_url}/v1/completions", json=vllm_prefill_body(body, chat=False))
    pre.raise_for_status()
    params = pre.json().get("kv_transfer_params") or {}
    async with http.stream("POST", f"{decode_url}/v1/completions", json=vllm_decode_body(body, params)) as resp:
        return await _first_token(resp, t0)


async def paired_overhead(gateway_url: str, api_key: str, prefill_url: str, decode_url: str, model: str, *,
                          pairs: int = 30, words: int = 200, max_tokens: int = 4) -> dict[str, Any]:
    """``pairs`` pairs, one request at a time; milliseconds."""
    texts = prompts(2 * pairs, words)
    via: list[float] = []
    direct: list[float] = []
    diffs: list[float] = []
    async with httpx.AsyncClient(timeout=120.0) as http:
        for i in range(pairs):
            a, b = ({"model": model, "prompt": t, "max_tokens": max_tokens, "stream": True, "temperature": 0}
                    for t in texts[2 * i : 2 * i + 2])
            if i % 2:
                d = await by_hand(http, prefill_url, decode_url, b)
                g = await through_gateway(http, gateway_url, api_key, a)
            else:
                g = await through_gateway(http, gateway_url, api_key, a)
                d = await by_hand(http, prefill_url, decode_url, b)
            via.append(g * 1000.0)
            direct.append(d * 1000.0)
            diffs.append((g - d) * 1000.0)

    def ms(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else round(v, 2)

    return {
        "pairs": pairs, "prompt_words": words, "max_tokens": max_tokens,
        "gateway_overhead_ms_p50": ms(diffs, 50), "gateway_overhead_ms_p90": ms(diffs, 90),
        "gateway_overhead_ms_p99": ms(diffs, 99),
        "ttft_ms_p50_gateway": ms(via, 50), "ttft_ms_p50_by_hand": ms(direct, 50),
    }


__all__ = ["by_hand", "paired_overhead", "prompts", "through_gateway"]
