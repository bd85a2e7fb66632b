"""``conductor chaos --scenario NAME --json``: fault scenarios, each run N times, checked pair by pair."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from conductor.cli.common import err, print_json, settings_or_exit
from conductor.harness.chaos import SCENARIOS, run_scenario
from conductor.harness.devstack import EmbeddedStack

Scenario = Annotated[list[str] | None, typer.Option("--scenario", help="scenario to run (repeatable); default: "
    "all. redis-flushall, redis-flushall-quiet, redis-restart-empty, worker-sigkill, bad-records, duplicates, "
    "silent-node, skewed-clock, two-workers-one-killed, failover (a primary killed, its lagging replica promoted), "
    "failover-quiet (the same with no traffic after it)")]
Runs = Annotated[int, typer.Option("--runs", "-n", min=1, help="runs per scenario")]
Records = Annotated[int, typer.Option(help="KV-event records published per run")]
Seed = Annotated[int, typer.Option(help="seed of the first run's truth (run i uses seed + i)")]
TimeoutS = Annotated[float, typer.Option(help="give a run up after this long without converging")]
JsonObject = Annotated[bool, typer.Option("--json", help="print one JSON object")]


def chaos(
    scenario: Scenario = None,
    runs: Runs = 3,
    records: Records = 3000,
    seed: Seed = 1,
    timeout_s: TimeoutS = 120.0,
    json_out: JsonObject = False,
) -> None:
    """Inject faults under a busy stream worker and check the view against an independent truth.

    Each run starts a Valkey of its own (it is flushed, or killed and restarted empty on the
    same port; for failover a primary and a replica behind a switchable address), a `conductor worker` subprocess, and synthetic engines that know which
    (node, block) pairs the view must hold. The broker is CONDUCTOR_KAFKA_URL, else an
    embedded stack started for the command. Prints, per scenario, pairs_lost, pairs_extra
    and recovery_s (seconds from the fault to the view equal to the truth and healthy) of
    every run, and their worst/median.
    """
    names = scenario or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown}; known: {', '.join(SCENARIOS)}", param_hint="--scenario")
    s = settings_or_exit()
    out = asyncio.run(_run_all(s, names, runs, records, seed, timeout_s))
    if json_out:
        print_json(out)
        return
    for name, r in out["scenarios"].items():
        err.print(f"{name}: pairs_lost {r['pairs_lost']} pairs_extra {r['pairs_extra']} "
                  f"recovery_s median {r['recovery_s_median']} max {r['recovery_s_max']} ({r['runs']} runs)")


async def _run_all(s: Any, names: list[str], runs: int, records: int, seed: int, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conductor-chaos-") as tmp:
        stack = None
        kafka_url = s.kafka_url
        if not kafka_url:
            stack = EmbeddedStack(Path(tmp) / "stack", host=s.bind_host)
            kafka_url = (await asyncio.to_thread(stack.up)).kafka_url
        try:
            result: dict[str, Any] = {}
            for name in names:
                rs = []
                for i in range(runs):
                    r = await run_scenario(name, kafka_url, Path(tmp) / f"{name}-{i}", records=records, seed=seed + i,
                                           timeout_s=timeout_s)
                    err.print(f"{name} run {i + 1}/{runs}: lost {r.pairs_lost} extra {r.pairs_extra} recovery {r.recovery_s}s")
                    rs.append(r)
                rec = [r.recovery_s for r in rs if r.recovery_s is not None]
                result[name] = {
                    "runs": runs,
                    "pairs_lost": sum(r.pairs_lost for r in rs),
                    "pairs_extra": sum(r.pairs_extra for r in rs),
                    "converged": sum(r.converged for r in rs),
                    "recovery_s": [r.recovery_s for r in rs],
                    "recovery_s_median": round(statistics.median(rec), 2) if rec else None,
                    "recovery_s_max": max(rec) if rec else None,
                    "per_run": [asdict(r) for r in rs],
                }
        finally:
            if stack is not None:
                stack.down()
    return {"records": records, "scenarios": result}


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("chaos")(chaos)
