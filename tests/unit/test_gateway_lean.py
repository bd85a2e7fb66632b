"""The gateway's per-request shortcuts: one connection pool per engine, and no framework telemetry."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conductor.gateway.app import gateway_app
from conductor.gateway.auth import key_ring
from conductor.gateway.upstream import EnginePools
from conductor.settings import Settings

pytestmark = pytest.mark.unit


async def test_each_engine_gets_a_pool_of_its_own_and_keeps_it() -> None:
    made: list[list[str]] = []

    def make() -> httpx.AsyncBaseTransport:
        seen: list[str] = []
        made.append(seen)

        def answer(r: httpx.Request) -> httpx.Response:
            seen.append(str(r.url))
            return httpx.Response(200, text="ok")

        return httpx.MockTransport(answer)

    pools = EnginePools(make=make)
    async with httpx.AsyncClient(transport=pools) as c:
        for url in ("http://p0:8000/v1/completions", "http://d0:8000/v1/completions",
                    "http://p0:8000/tokenize", "http://p0:8001/v1/completions", "http://d0:8000/v1/completions"):
            assert (await c.post(url)).text == "ok"
        assert made == [["http://p0:8000/v1/completions", "http://p0:8000/tokenize"],
                        ["http://d0:8000/v1/completions", "http://d0:8000/v1/completions"],
                        ["http://p0:8001/v1/completions"]]
        assert len(pools.pools) == 3
    assert pools.pools == {}  # closed with the client



async def test_pools_of_engines_gone_are_closed_once_nothing_runs_on_them() -> None:
    # A rollout gives every pod a new address: a long-lived gateway must not keep a pool per
    # engine it ever met. Past `keep` pools, a new one closes those idle long enough, never one
    # whose stream is still open.
    closed: list[int] = []
    now = [0.0]

    class Transport(httpx.MockTransport):
        def __init__(self, n: int) -> None:
            # A body read as it comes (as from a socket), not one the response already holds.
            super().__init__(lambda r: httpx.Response(200, stream=httpx.ByteStream(b"ok")))
            self.n = n

        async def aclose(self) -> None:
            closed.append(self.n)

    made = iter(range(100))
    pools = EnginePools(make=lambda: Transport(next(made)), keep=2, idle_s=60.0, clock=lambda: now[0])
    async with httpx.AsyncClient(transport=pools) as c:
        async with c.stream("POST", "http://e0:8000/v1/completions") as streaming:  # pool 0: a call open
            assert (await c.post("http://e1:8000/v1/completions")).text == "ok"   # pool 1: done
            now[0] = 30.0
            assert (await c.post("http://e2:8000/v1/completions")).text == "ok"   # pool 2: nothing idle 60 s yet
            assert closed == [] and len(pools.pools) == 3
            now[0] = 100.0
            assert (await c.post("http://e3:8000/v1/completions")).text == "ok"
            assert closed == [1, 2]  # idle 70 and 100 s; pool 0's stream is still open
            assert [p.open_calls for p in pools.pools.values()] == [1, 0]
            assert streaming.status_code == 200
        now[0] = 1000.0
        assert (await c.post("http://e4:8000/v1/completions")).text == "ok"
        assert closed == [1, 2, 0, 3]  # its stream closed: pool 0 goes too


def test_the_gateway_app_records_no_framework_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    # FastAPI measures every request itself once a meter provider is installed (conductor.telemetry
    # installs one): a histogram, a counter and a wrapper around each send that nothing reads.
    reader = InMemoryMetricReader()
    monkeypatch.setattr(metrics, "get_meter_provider", lambda: MeterProvider(metric_readers=[reader]))

    async def readiness() -> None:
        return None

    from fastapi.testclient import TestClient

    app = gateway_app(SimpleNamespace(readiness=readiness), key_ring(Settings.model_construct(), insecure=True))  # type: ignore[arg-type]
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
    data = reader.get_metrics_data()
    names = [m.name for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics for m in sm.metrics]
    assert "http.server.request.duration" not in names
