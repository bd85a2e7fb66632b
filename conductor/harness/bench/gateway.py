"""``conductor bench gateway``: what the gateway adds over calling the chosen engines directly.

Starts a stream worker, a router, 2 prefill + 2 decode emulated engines with no compute
time (``time_scale`` 1e9: every model step is ~0 s), and a gateway. For each concurrency
level, that many streaming clients send requests back to back, first straight to a
prefill/decode pair (the vLLM hand-off done by the client itself), then through the
gateway. Overhead = the gateway's time to first token minus the direct one, at p50 and
p99 (tokenize + the routing request's round trip through Kafka and the router + the
relay). Routing time per request is read from the gateway's ``request_outcome`` records.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from conductor.gateway.protocol import percentile, vllm_decode_body, vllm_prefill_body
from conductor.harness.devstack import EmbeddedStack
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings
from schemas import RequestOutcome, decode
from streams.kafka import consumer
from streams.topics import topics

ZERO_COMPUTE = 1e9


def _body(i: int, max_tokens: int) -> dict[str, Any]:
    # Shared system prefix + a per-request tail: realistic block sharing for the router.
    return {"model": "default", "prompt": "you are a helpful assistant " * 16 + f"question {i} " * 8,
            "max_tokens": max_tokens, "stream": True}


async def _stream_ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        async for chunk in r.aiter_raw():
            if ttft is None and (b'"text": "' in chunk or b'"text":"' in chunk):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token")
    return ttft


async def _direct(client: httpx.AsyncClient, p_url: str, d_url: str, body: dict[str, Any]) -> float:
    """The same hand-off a client would do itself against a known pair (no tokenize, no routing)."""
    t0 = time.perf_counter()
    r = await client.post(p_url + "/v1/completions", json=vllm_prefill_body(body, chat=False))
    r.raise_for_status()
    dbody = vllm_decode_body(body, r.json()["kv_transfer_params"])
    return (time.perf_counter() - t0) + await _stream_ttft(client, d_url + "/v1/completions", dbody)


async def _load(concurrency: int, requests: int, one: Any) -> tuple[list[float], int, float]:
    ttfts: list[float] = []
    errors = 0
    next_i = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for i in next_i:
            try:
                ttfts.append(await one(i))
            except Exception:  # noqa: BLE001 - counted, the bench goes on
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, errors, time.perf_counter() - t0


def _rounded(v: float | None, scale: float = 1.0) -> float | None:
    return None if v is None else round(scale * v, 2)


def _ms_or_none(xs: list[float], q: float) -> float | None:
    """The ``q`` percentile of ``xs`` (seconds) in milliseconds, to 0.01 ms; None for no samples."""
    return _rounded(percentile(xs, q), 1000)


def _overhead_ms(via: list[float], direct: list[float], q: float) -> float | None:
    v, d = _ms_or_none(via, q), _ms_or_none(direct, q)
    return None if v is None or d is None else round(v - d, 2)


async def _routing_ms(settings: Settings, since_ms: int) -> list[float]:
    cons = consumer(settings.kafka(), topics(settings.topic_config()).request_outcomes.name, group_id=None, fetch_max_wait_ms=50)
    await cons.start()
    out: list[float] = []
    try:
        idle = 0
        while idle < 3:
            got = await cons.getmany(timeout_ms=300)
            idle = 0 if got else idle + 1
            for recs in got.values():
                for r in recs:
                    env = decode(r.value)
                    if env.ts_ms >= since_ms and isinstance(env.body, RequestOutcome) and env.body.routing_ms:
                        out.append(env.body.routing_ms)
    finally:
        await cons.stop()
    return out


def run_gateway_bench(settings: Settings, *, levels: tuple[int, ...], requests_per_client: int,
                      max_tokens: int) -> dict[str, Any]:
    """Run the bench (starting the embedded broker and Redis when no URLs are set); one result dict."""
    stack = None
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-gw-"))
    if not (settings.kafka_url and settings.redis_url):
        stack = EmbeddedStack(tmp / "stack", host=settings.bind_host)
        st = stack.up(die_with_parent=True)
        settings = settings.model_copy(update={"kafka_url": st.kafka_url, "redis_url": st.redis_url,
                                               "profile": "embedded"})
    try:
        return asyncio.run(_bench(settings, tmp, levels, requests_per_client, max_tokens))
    finally:
        if stack is not None:
            stack.down()


async def _bench(settings: Settings, tmp: Path, levels: tuple[int, ...], requests_per_client: int,
                 max_tokens: int) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex[:8]
    s = settings.model_copy(update={"topic_prefix": f"bench-gw-{tag}.", "view_namespace": f"bgw{tag}",
                                    "metrics_port": 0, "data_dir": tmp / "data"})
    out: dict[str, Any] = {"prefill": 2, "decode": 2, "max_tokens": max_tokens, "levels": {}}
    async with GatewayCluster(s, tmp / "logs", time_scale=ZERO_COMPUTE) as c:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        # The key goes to the engines too on the direct path: they ignore it.
        async with httpx.AsyncClient(timeout=60, limits=limits, headers=c.auth_headers) as client:
            gw = c.gateway_url + "/v1/completions"
            p_url, d_url = c.engine_urls["prefill-0"], c.engine_urls["decode-0"]
            for _ in range(20):  # warm up connections, caches and the router
                await _stream_ttft(client, gw, _body(0, max_tokens))
            for conc in levels:
                n = conc * requests_per_client
                direct, derr, _ = await _load(conc, n, lambda i: _direct(client, p_url, d_url, _body(i, max_tokens)))
                since = time.time_ns() // 1_000_000
                via, gerr, wall = await _load(conc, n, lambda i: _stream_ttft(client, gw, _body(i, max_tokens)))
                routing = await _routing_ms(s, since)
                out["levels"][str(conc)] = {
                    "clients": conc, "requests": n,
                    "gateway_overhead_ms_p50": _overhead_ms(via, direct, 50),
                    "gateway_overhead_ms_p99": _overhead_ms(via, direct, 99),
                    "requests_per_s": round(len(via) / wall, 1), "errors": gerr + derr,
                    "ttft_ms_p50_gateway": _ms_or_none(via, 50), "ttft_ms_p99_gateway": _ms_or_none(via, 99),
                    "ttft_ms_p50_direct": _ms_or_none(direct, 50), "ttft_ms_p99_direct": _ms_or_none(direct, 99),
                    "routing_ms_p50": _rounded(percentile(routing, 50)),
                    "routing_ms_p99": _rounded(percentile(routing, 99)),
                }
    first = out["levels"][str(levels[0])]
    for k in ("gateway_overhead_ms_p50", "gateway_overhead_ms_p99", "requests_per_s", "errors"):
        out[k] = first[k]  # the headline fields: the first (lowest) concurrency level
    out["errors"] = sum(v["errors"] for v in out["levels"].values())
    return out
