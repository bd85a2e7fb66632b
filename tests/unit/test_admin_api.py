"""The admin API's auth and reads on fakes (an in-memory view, a log feed fed by hand)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from conductor.admin.api import COOKIE, create_app
from conductor.admin.auth import SESSION_TTL_S, Tokens
from conductor.admin.feed import LogFeed
from conductor.errors import ConfigError
from conductor.routing.control import apply_control
from conductor.settings import load_settings
from schemas import BlocksStored, ControlCommand, Heartbeat, RoutingDecision, RoutingRejection, envelope
from state.memory import InMemoryViewStore

ADMIN, READ = "admin-token-0123456789", "read-token-0123456789"


class View(InMemoryViewStore):
    async def close(self) -> None:  # the app closes its view on shutdown
        pass


def app_with(insecure: bool = False, base_url: str = "http://testserver", **kw):
    s = load_settings(kafka_url=None, redis_url=None, **kw)
    feed = LogFeed(s)
    view = View()
    now = int(time.time() * 1000)
    for i, (node, role) in enumerate((("p0", "prefill"), ("d0", "decode"))):
        view.apply_sync(envelope(Heartbeat(role=role, total_kv_blocks=100, free_kv_blocks=40), producer_id=node,
                                 producer_seq=0, ts_ms=now))
    view.apply_sync(envelope(BlocksStored(block_keys=[1, 2, 3]), producer_id="p0", producer_seq=1, ts_ms=now))
    feed.prompt_tokens["r1"] = 100
    feed.on_dispatch(RoutingDecision(request_id="r1", prefill_instance="p0", decode_instance="d0", reused_tokens=48,
                                     predicted_ttft_s=0.5, predicted_tbt_ms=20, policy="kvcache-centric"), now)
    feed.on_dispatch(RoutingRejection(request_id="r2", reason="ttft_slo", policy="kvcache-centric"), now)
    feed.control = apply_control(feed.control, ControlCommand(action="cordon", node_id="d0"), 0)
    return TestClient(create_app(s, insecure=insecure, feed=feed, view=view), base_url=base_url)


def test_open_without_tokens_only_when_insecure_and_reads_are_stable():
    with pytest.raises(ConfigError, match="CONDUCTOR_ADMIN_TOKEN"):
        app_with()
    with app_with(insecure=True) as c:
        cl = c.get("/api/cluster").json()
        rows = {n["node_id"]: n for n in cl["nodes"]}
        assert rows["p0"]["blocks"] == {"hbm": 3} and rows["p0"]["kv_use"] == 0.6 and rows["p0"]["hit_rate"] == 1.0
        assert rows["d0"]["status"] == "cordoned" and rows["p0"]["status"] == "active"
        st = c.get("/api/stats").json()
        assert st["reuse_ratio"] == 0.48 and st["rejections_by_reason"] == {"ttft_slo": 1}
        ds = c.get("/api/decisions", params={"kind": "rejected"}).json()["decisions"]
        assert [d["request_id"] for d in ds] == ["r2"]
        pol = c.get("/api/policy").json()
        assert pol["policy"] == "kvcache-centric" and pol["control"]["cordoned"] == ["d0"]
        assert "/api/cluster" in c.get("/openapi.json").json()["paths"]
        assert "Conductor console" in c.get("/").text


def test_tokens_guard_every_endpoint_but_health():
    with app_with(admin_token=ADMIN, read_token=READ) as c:
        assert c.get("/health").status_code == 200
        for path in ("/api/cluster", "/api/stats", "/api/policy", "/api/decisions", "/api/dead-letters"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer wrong-token-000000000"}).status_code == 401
            assert c.get(path, headers={"Authorization": f"Bearer {READ}"}).status_code == 200
            assert c.get(path, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        assert c.get("/").status_code == 401 and "Sign in" in c.get("/").text
        # a read token cannot change anything (refused before any broker is touched)
        r = c.put("/api/policy", json={"policy": "least-loaded"}, headers={"Authorization": f"Bearer {READ}"})
        assert r.status_code == 403
        assert c.post("/api/nodes/p0/cordon", headers={"Authorization": f"Bearer {READ}"}).status_code == 403
        # the console's session cookie
        assert c.post("/login", json={"token": "nope"}).status_code == 401
        assert c.post("/login", json={"token": READ}).json() == {"scope": "read"}
        assert c.get("/api/cluster").status_code == 200 and "Conductor console" in c.get("/").text


def test_token_compare_and_settings_never_echo_a_token():
    t = Tokens(load_settings(admin_token=ADMIN))
    assert t.scope_of(f"Bearer {ADMIN}") == "admin" and t.scope_of(f"bearer {ADMIN}") == "admin"
    assert t.scope_of(f"Basic {ADMIN}") is None and t.scope_of(None) is None
    s = load_settings(admin_token=ADMIN)
    assert ADMIN not in repr(s) and ADMIN not in str(s.model_dump())
    with pytest.raises(ConfigError) as e:
        load_settings(read_token="short-secret")
    assert "short-secret" not in str(e.value) and "read_token" in str(e.value)


def test_the_session_cookie_holds_no_token_and_is_signed():
    with app_with(admin_token=ADMIN, read_token=READ, base_url="https://testserver") as c:
        r = c.post("/login", json={"token": READ})
        header = r.headers["set-cookie"]
        cookie = c.cookies[COOKIE]
        assert READ not in header and ADMIN not in header and cookie.startswith("read.")
        attrs = {a.strip().split("=")[0].lower() for a in header.split(";")}
        assert {"httponly", "secure", "max-age", "path"} <= attrs and "samesite=strict" in header.lower()
        assert c.get("/api/cluster").status_code == 200
        c.cookies.clear()
        # A cookie edited to the admin scope no longer matches its signature.
        for forged in ("admin." + cookie.split(".", 1)[1], READ):  # READ: the raw token, as the old cookie held it
            assert c.get("/api/cluster", headers={"Cookie": f"{COOKIE}={forged}"}).status_code == 401
        assert c.get("/api/cluster", headers={"Cookie": f"{COOKIE}={cookie}"}).status_code == 200
    with app_with(admin_token=ADMIN) as c:  # over http: no Secure (the browser would not send it back)
        assert "secure" not in c.post("/login", json={"token": ADMIN}).headers["set-cookie"].lower()


def test_a_session_ends_at_its_expiry_and_when_its_token_changes():
    tokens = Tokens(load_settings(admin_token=ADMIN, read_token=READ))
    now = 1_000_000.0
    cookie = tokens.session("admin", now)
    assert tokens.session_scope(cookie, now + SESSION_TTL_S - 1) == "admin"
    assert tokens.session_scope(cookie, now + SESSION_TTL_S + 1) is None
    rotated = Tokens(load_settings(admin_token="admin-token-rotated-0000", read_token=READ))
    assert rotated.session_scope(cookie, now) is None
    assert rotated.session_scope(tokens.session("read", now), now) == "read"  # the read token did not change
    for forged in ("", "admin", "admin.9999999999.x.", "read.x.y.z", "other.9999999999.n." + "0" * 64):
        assert tokens.session_scope(forged, now) is None


def test_conductor_admin_refuses_to_start_without_a_token() -> None:
    from typer.testing import CliRunner

    from conductor.cli import app

    env = {"CONDUCTOR_KAFKA_URL": "127.0.0.1:1", "CONDUCTOR_REDIS_URL": "redis://127.0.0.1:1/0"}
    res = CliRunner().invoke(app, ["admin"], env=env)
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and "CONDUCTOR_ADMIN_TOKEN" in res.output
    assert "--insecure" in res.output
