"""``conductor bench idle``: what a started stack burns with no traffic, per process.

Starts what ``conductor bench gateway`` starts (the embedded broker and Redis unless URLs are
set, a stream worker, a router, 2 prefill + 2 decode emulated engines with a ``conductor bridge``
each, and ``conductor gateway``), waits ``settle_s`` for start-up work to end, then reads every
process's CPU time (:mod:`conductor.harness.cpu`) over ``seconds`` with no request sent.
``control_core_percent``: the control plane's CPU as a share of one core (100 = one core busy);
the engines' own is reported apart (``engines_core_percent_by_process``): they are not Conductor's.
The engines heartbeat every ``heartbeat_s`` (default 1 s, as a ``conductor bridge`` does for a
real engine; the tests' clusters use 0.3 s): heartbeats are the one traffic an idle cluster has.
The emulated engines do not follow ``dispatch`` (``GatewayCluster`` starts them with
``--no-dispatch``: every request reaches them by HTTP, as a real engine behind a gateway).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from conductor.harness.bench.stack import with_servers
from conductor.harness.cpu import CpuMeter, cpu_report
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings


def core_percent(used: dict[str, float | None], seconds: float) -> dict[str, float]:
    """Each process's CPU over ``seconds`` as a percentage of one core (unreadable ones left out)."""
    return {k: round(100 * v / seconds, 2) for k, v in sorted(used.items()) if v is not None and seconds > 0}


HEARTBEAT_S = 1.0
"""The engines' heartbeat interval: a ``conductor bridge``'s default (``--heartbeat-s``)."""


def run_idle_bench(settings: Settings, *, seconds: float = 30.0, settle_s: float = 5.0, prefill: int = 2,
                   decode: int = 2, heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
    """Run the bench (starting the embedded broker and Redis when no URLs are set); one result dict."""
    if heartbeat_s <= 0:
        raise ValueError("heartbeat_s must be > 0")
    with with_servers(settings) as s, TemporaryDirectory(prefix="conductor-bench-idle-") as tmp:
        return asyncio.run(_bench(s, Path(tmp), seconds, settle_s, prefill, decode, heartbeat_s))


async def _bench(settings: Settings, tmp: Path, seconds: float, settle_s: float, prefill: int,
                 decode: int, heartbeat_s: float) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tag = uuid.uuid4().hex[:8]
    s = settings.model_copy(update={"topic_prefix": f"bench-idle-{tag}.", "view_namespace": f"bidle{tag}",
                                    "metrics_port": 0, "data_dir": tmp / "data"})
    async with GatewayCluster(s, tmp / "logs", prefill, decode, bridges=True, engine_heartbeat_s=heartbeat_s) as c:
        await asyncio.sleep(settle_s)
        control = CpuMeter(c.control_pids()).start()
        engines = CpuMeter({n: p.pid for n, p in c.engine_procs.items()}).start()
        await asyncio.sleep(seconds)
        used, engine_used = control.used(), engines.used()
        wall = control.wall_s
    cpu = cpu_report(used, 0)
    by_process = core_percent(used, wall)
    return {
        "bench": "idle",
        "seconds": round(wall, 2),
        "settle_s": settle_s,
        "prefill": prefill,
        "decode": decode,
        "heartbeat_s": heartbeat_s,
        "control_core_percent": round(sum(by_process.values()), 2),
        "control_core_percent_by_process": by_process,
        "control_cpu_s": cpu["control_cpu_s"],
        "control_cpu_s_by_process": cpu["control_cpu_s_by_process"],
        "control_cpu_unreadable": cpu["control_cpu_unreadable"],
        "engines_core_percent_by_process": core_percent(engine_used, wall),
    }


__all__ = ["HEARTBEAT_S", "core_percent", "run_idle_bench"]
