"""``conductor admin``: the admin API and the live web console."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
import uvicorn

from conductor.admin.api import create_app
from conductor.admin.auth import tokens_for
from conductor.cli.common import err, exit_on, require_servers, settings_or_exit
from conductor.telemetry import setup_metrics

Port = Annotated[int | None, typer.Option(help="port on CONDUCTOR_BIND_HOST [default: CONDUCTOR_ADMIN_PORT]")]
Insecure = Annotated[bool, typer.Option("--insecure", help="serve with no token configured: open to anyone who "
    "reaches the port (without it the admin API refuses to start unless CONDUCTOR_ADMIN_TOKEN or "
    "CONDUCTOR_READ_TOKEN is set)")]


def admin(port: Port = None, insecure: Insecure = False) -> None:
    """Serve the admin API (OpenAPI at /docs and /openapi.json, behind the read token) and the live console (/).

    Cluster view, recent decisions and rejections, explain, the dead-letter queue
    (list, inspect, re-send), and the policy. Changes (policy, params, cordon, drain)
    are records on the control topic that every router applies in log order.

    Auth: every endpoint but /health needs `Authorization: Bearer <token>` of CONDUCTOR_ADMIN_TOKEN
    (reads and changes) or CONDUCTOR_READ_TOKEN (reads); the console asks for one once and keeps a
    signed session cookie. With neither set it refuses to start, unless --insecure.
    """
    s = settings_or_exit(**({"admin_port": port} if port is not None else {}))
    with exit_on(soft_wrap=True):
        tokens = tokens_for(s, insecure=insecure)
    require_servers(s, kafka=True, redis=True)
    setup_metrics("conductor-admin", s.bind_host, s.metrics_port)
    if tokens.required:
        auth = "bearer tokens required"
    else:
        auth = "--insecure: no token, open to anyone who reaches it"
        err.print("[yellow]warning:[/yellow] the admin API runs --insecure: its changes (policy, cordon, drain) "
                  "are open to anyone who reaches the port", soft_wrap=True)
    err.print(f"admin API and console on http://{s.bind_host}:{s.admin_port}/ ({auth})", soft_wrap=True)
    # Access logs carry paths only (tokens never travel in URLs).
    uvicorn.run(create_app(s, insecure=insecure), host=s.bind_host, port=s.admin_port, log_level="warning",
                access_log=logging.getLogger().isEnabledFor(logging.DEBUG))


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("admin")(admin)
