"""``conductor bench epp``: the endpoint picker's decision latency over gRPC against the gateway's own.

Starts a stream worker, a router, 2 prefill + 2 decode emulated engines with no compute time,
``conductor gateway`` and ``conductor epp`` in front of them (both deciding the same way:
``colocated``, each in its own process, or through the log, on the same routers), and sends the same completions to each, their prompts as token ids (no
tokenizer round trip on either path: what is timed is the decision):

- EPP: one ext_proc stream per request over real gRPC (:class:`~conductor.harness.epp_cluster.EnvoySide`,
  full duplex, headers and body in one message each), from the first message sent to the
  answer that names the destination, measured by the client (gRPC, parse, the decision and its
  acknowledgement on the log, the answer): ``epp_ms``; and the picker's own time from the body's
  end to its answer (its ``x-conductor-routing-ms`` header): ``epp_inside_ms``;
- gateway: the ``routing_ms`` of each ``request_outcome`` (the decision and its acknowledgement on
  the log, measured inside the gateway), for the same requests.

CPU (:mod:`conductor.harness.cpu`): ``control_cpu_*`` over the picker's phase and
``gateway_control_cpu_*`` over the gateway's, every control-plane process (picker, gateway,
router, worker, broker, Redis; not the engines, not this client) per process and per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

from conductor.harness.bench.gateway import routing_ms_since
from conductor.harness.bench.stack import with_servers
from conductor.harness.cpu import CpuMeter
from conductor.harness.epp_cluster import EppCluster
from conductor.settings import Settings
from conductor.stats import percentile

ZERO_COMPUTE = 1e9
"""The engines' time scale: every model step takes ~0 s, so only the request path is timed."""

SYSTEM = list(range(1000, 1256))
"""A shared 256-token system prefix (token ids): realistic block sharing for the router."""


def _body(i: int) -> dict[str, Any]:
    return {"model": "default", "prompt": SYSTEM + [5000 + i % 1000] * 32, "max_tokens": 1}


async def _load(concurrency: int, requests: int, one: Callable[[int], Awaitable[float]]) -> tuple[list[float], int, float]:
    """``requests`` calls of ``one``, ``concurrency`` at a time: (seconds of each success, errors, wall seconds)."""
    took: list[float] = []
    errors = 0
    turns = iter(range(requests))

    async def worker() -> None:
        nonlocal errors
        for i in turns:
            try:
                took.append(await one(i))
            except Exception:  # noqa: BLE001 - counted, the bench goes on
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return took, errors, time.perf_counter() - t0


def _ms(xs: list[float], q: float) -> float | None:
    v = percentile(xs, q)
    return None if v is None else round(v, 2)


def run_epp_bench(settings: Settings, *, requests: int = 200, concurrency: int = 1,
                  routing: str = "colocated", workers: int = 1) -> dict[str, Any]:
    """Run the bench (starting the embedded broker and Redis when no URLs are set); one result dict.
    ``routing``: how both the picker and the gateway decide (``colocated`` or ``log``); ``workers``:
    the picker's ``--workers``. Each concurrent client has a gRPC connection of its own, as each of
    Envoy's worker threads does (the kernel spreads connections over the workers)."""
    with with_servers(settings) as s, TemporaryDirectory(prefix="conductor-bench-epp-") as tmp:
        return asyncio.run(_bench(s, Path(tmp), requests, concurrency, routing, workers))


async def _bench(settings: Settings, tmp: Path, requests: int, concurrency: int, routing: str,
                 workers: int = 1) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex[:8]
    s = settings.model_copy(update={"topic_prefix": f"bench-epp-{tag}.", "view_namespace": f"bepp{tag}",
                                    "metrics_port": 0, "data_dir": tmp / "data"})
    async with EppCluster(s, tmp / "logs", time_scale=ZERO_COMPUTE, with_gateway=True,
                          epp_args=["--routing", routing, "--workers", str(workers)],
                          gateway_args=["--routing", routing]) as c, \
            httpx.AsyncClient(timeout=60, headers=c.auth_headers) as client:
        gw = c.gateway_url + "/v1/completions"
        # A connection per concurrent client, as each of Envoy's worker threads has its own (and what
        # spreads them over --workers); one client: one connection.
        envoys = [c.envoy(own_connection=concurrency > 1) for _ in range(concurrency)]

        inside: list[float] = []

        async def via_epp(i: int) -> float:
            t0 = time.perf_counter()
            a = await envoys[i % len(envoys)].request(json.dumps(_body(i)).encode())
            if a.status != 200:
                raise RuntimeError(f"{a.status}: {a.error}")
            took = time.perf_counter() - t0
            inside.append(float(a.headers["x-conductor-routing-ms"]))
            return took

        async def via_gateway(i: int) -> float:
            t0 = time.perf_counter()
            r = await client.post(gw, json=_body(i))
            r.raise_for_status()
            return time.perf_counter() - t0

        for i in range(20 * len(envoys)):  # warm up connections (each), caches and the router
            await via_epp(i)
            await via_gateway(i)
        inside.clear()
        # The picker's phase: its own process, the routers, worker, broker and Redis (the gateway idles).
        meter = CpuMeter(c.control_pids()).start()
        epp, epp_errors, epp_wall = await _load(concurrency, requests, via_epp)
        epp_cpu = meter.report(len(epp))
        since = time.time_ns() // 1_000_000
        meter.start()
        gw_ok, gw_errors, _ = await _load(concurrency, requests, via_gateway)
        gw_cpu = meter.report(len(gw_ok), prefix="gateway_control_")
        routing_ms = await routing_ms_since(s, since)
        for e in envoys:
            await e.close()
    return {
        "requests": requests, "concurrency": concurrency, "prefill": 2, "decode": 2, "routing": routing,
        "epp_workers": workers,
        "epp_ms_p50": _ms([x * 1000 for x in epp], 50), "epp_ms_p99": _ms([x * 1000 for x in epp], 99),
        "epp_inside_ms_p50": _ms(inside, 50), "epp_inside_ms_p99": _ms(inside, 99),
        "epp_decisions_per_s": round(len(epp) / epp_wall, 1) if epp_wall else None,
        "gateway_routing_ms_p50": _ms(routing_ms, 50), "gateway_routing_ms_p99": _ms(routing_ms, 99),
        "errors": epp_errors + gw_errors,
        **epp_cpu,
        **gw_cpu,
    }
