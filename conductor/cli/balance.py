"""``conductor balance``: replicate hot prefixes, demote cold ones (commands on kv-commands)."""

from __future__ import annotations

import asyncio

import typer
from pydantic import ValidationError

from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from conductor.cli.common import err, settings_or_exit
from conductor.telemetry import setup_metrics


def register(groups: dict[str, typer.Typer]) -> None:
    app = groups["app"]

    @app.command("balance")
    def balance(
        interval: float = typer.Option(2.0, min=0.1, help="seconds between planning rounds"),
    ) -> None:
        """Run the KVCache balance worker.

        It reads `requests` (its own consumer group) to keep a decayed heat per prefix,
        and every INTERVAL reads the view for hot and cold prefixes. A hot prefix whose
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
        setup_metrics("conductor-balance", s.bind_host, s.metrics_port)
        try:
            asyncio.run(Balancer(s, params).run(interval_s=interval))
        except KeyboardInterrupt:
            pass
