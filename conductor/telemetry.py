"""Metrics through opentelemetry-sdk, exposed for Prometheus to scrape.

``setup_metrics(settings)`` installs a MeterProvider whose reader is the
Prometheus exporter and, when ``metrics_port`` is set, serves ``/metrics`` on
``bind_host:metrics_port``. Only a process's entry point calls it (once). Every
other module takes its meter from the OpenTelemetry *API*
(``opentelemetry.metrics.get_meter(__name__)``), which is a no-op until the SDK
provider is installed, so libraries, pure code and tests never need a server and
no lower layer imports this one.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import REGISTRY, generate_latest, start_http_server

log = logging.getLogger(__name__)
_lock = threading.Lock()
_provider: MeterProvider | None = None
_server_port: int | None = None


def setup_metrics(service: str, bind_host: str = "127.0.0.1", port: int = 0) -> MeterProvider:
    """Install the Prometheus-backed provider (once) and serve it on ``port`` if non-zero."""
    global _provider, _server_port
    with _lock:
        if _provider is None:

            reader: MetricReader = PrometheusMetricReader()
            _provider = MeterProvider(
                metric_readers=[reader], resource=Resource.create({"service.name": service})
            )
            metrics.set_meter_provider(_provider)
        if port and _server_port is None:

            start_http_server(port, addr=bind_host)
            _server_port = port
            log.info("metrics on http://%s:%d/metrics", bind_host, port)
        return _provider


def scrape() -> str:
    """The Prometheus text exposition of everything recorded so far (for tests and `--json` dumps)."""

    return generate_latest(REGISTRY).decode()
