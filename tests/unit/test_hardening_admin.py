"""The admin API's front door (issue 36, low items): its OpenAPI map behind the read scope, and a
limit on failed sign-ins per address."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from conductor.admin.api import create_app
from conductor.admin.auth import LoginAttempts
from conductor.admin.feed import LogFeed
from conductor.settings import load_settings
from state.memory import InMemoryViewStore

ADMIN, READ = "admin-token-0123456789", "read-token-0123456789"


class View(InMemoryViewStore):
    async def close(self) -> None:
        pass


def client(**kw: object) -> TestClient:
    s = load_settings(kafka_url=None, redis_url=None, admin_token=ADMIN, read_token=READ, **kw)
    return TestClient(create_app(s, feed=LogFeed(s), view=View()))


def test_the_openapi_map_needs_a_token() -> None:
    with client() as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert c.get(path).status_code in (401, 404), path
        assert c.get("/openapi.json").status_code == 401 and c.get("/docs").status_code == 401
        auth = {"Authorization": f"Bearer {READ}"}
        assert "/api/cluster" in c.get("/openapi.json", headers=auth).json()["paths"]
        assert "/openapi.json" not in c.get("/openapi.json", headers=auth).json()["paths"]
        assert "swagger" in c.get("/docs", headers=auth).text.lower()


def test_sign_ins_are_limited_per_address(caplog: pytest.LogCaptureFixture) -> None:
    with client(admin_login_max_failures=3, admin_login_window_s=60) as c, \
            caplog.at_level(logging.WARNING, logger="conductor.admin.api"):
        assert [c.post("/login", json={"token": f"guess-{i}"}).status_code for i in range(3)] == [401] * 3
        r = c.post("/login", json={"token": READ})  # even the right token: the address is locked out
        assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
        assert caplog.text.count("failures from") == 1  # one line per lock-out, not one per attempt
    with client(admin_login_max_failures=3) as c:
        assert c.post("/login", json={"token": "guess"}).status_code == 401
        assert c.post("/login", json={"token": READ}).json() == {"scope": "read"}  # a success clears the count


def test_login_attempts_window_and_bounds() -> None:
    a = LoginAttempts(max_failures=2, window_s=10, max_clients=2)
    assert not a.failed("x", 0.0) and a.failed("x", 1.0)
    assert a.retry_after("x", 5.0) == pytest.approx(5.0) and a.retry_after("y", 5.0) is None
    assert a.retry_after("x", 10.5) is None  # the first failure left the window
    a.failed("y", 11.0)
    a.failed("z", 11.0)
    a.failed("w", 11.0)
    assert len(a._failures) == 2  # the least recently failed address forgotten
    off = LoginAttempts(max_failures=0)
    assert not any(off.failed("x", float(i)) for i in range(50)) and off.retry_after("x", 50.0) is None
