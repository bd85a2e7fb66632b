"""``conductor admin``: the admin API and the live web console."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
import uvicorn

from conductor.admin.api import create_app
from conductor.cli.common import err, require_servers, settings_or_exit
from conductor.telemetry import setup_metrics

Port = Annotated[int | None, typer.Option(help="port on CONDUCTOR_BIND_HOST [default: CONDUCTOR_ADMIN_PORT]")]


def admin(port: Port = None) -> None:
    """Serve the admin API (OpenAPI at /docs and /openapi.json) and the live console (/).

    Cluster view, recent decisions and rejections, explain, the dead-letter queue
    (list, inspect, re-send), and the policy. Changes (policy, params, cordon, drain)
    are records on the control topic that every router applies in log order.

    Auth: with CONDUCTOR_ADMIN_TOKEN and/or CONDUCTOR_READ_TOKEN set, every endpoint
    but /health needs `Authorization: Bearer <token>` (the console asks for it once).
    """
    s = settings_or_exit(**({"admin_port": port} if port is not None else {}))
    require_servers(s, kafka=True, redis=True)
    setup_metrics("conductor-admin", s.bind_host, s.metrics_port)
    auth = "bearer tokens required" if (s.admin_token or s.read_token) else "no tokens configured: open"
    err.print(f"admin API and console on http://{s.bind_host}:{s.admin_port}/ ({auth})", soft_wrap=True)
    # Access logs carry paths only (tokens never travel in URLs).
    uvicorn.run(create_app(s), host=s.bind_host, port=s.admin_port, log_level="warning",
                access_log=logging.getLogger().isEnabledFor(logging.DEBUG))


def register(groups: dict[str, typer.Typer]) -> None:
    groups["app"].command("admin")(admin)
