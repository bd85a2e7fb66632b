"""``conductor balance``: replicate hot prefixes, demote cold ones (commands on kv-commands)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from conductor.balance.planner import BalanceParams
from conductor.balance.serve import run_balancer
from conductor.cli.common import err, require_servers, settings_or_exit
from conductor.telemetry import setup_metrics

Interval = Annotated[float, typer.Option(min=0.1, help="seconds between planning rounds")]
Loglevel = Annotated[str, typer.Option(help="Faust worker log level")]


def balance(interval: Interval = 2.0, loglevel: Loglevel = "info") -> None:
    """Run the KVCache balance worker.

    A Faust app: it reads `requests` (its own consumer group) and counts each block's
    accesses in tumbling windows of heat_window_s, in Faust tables with changelogs (a
    restarted worker resumes with the heat it had). Every INTERVAL it reads the view
    for the hot and cold prefixes and the routers' reservations. A hot prefix whose
    every holder is overloaded is replicated to the least-loaded prefill instance; a
    once-hot prefix that cooled is demoted from HBM to DRAM where HBM is under
    pressure. Commands go to `kv-commands`, keyed by the node that must act.
    Parameters: CONDUCTOR_BALANCE_PARAMS (JSON), e.g. '{"hot_threshold": 8}'.
    """
    s = settings_or_exit()
    try:
        params = BalanceParams(**s.balance_params)
    except ValidationError as e:
        first = e.errors()[0]
        err.print(f"[red]error:[/red] balance_params.{'.'.join(map(str, first['loc']))}: {first['msg']}")
        raise typer.Exit(2) from None
    require_servers(s, kafka=True, redis=True)
    setup_metrics("conductor-balance", s.bind_host, s.metrics_port)
    run_balancer(s, params, interval_s=interval, loglevel=loglevel)


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("balance")(balance)
