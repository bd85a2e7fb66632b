"""The gateway's API keys (conductor/gateway/auth.py): who a request is, its limits, its SLO bounds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import SecretStr
from starlette.responses import JSONResponse, Response, StreamingResponse

from conductor.errors import ConfigError
from conductor.frontdoor.protocol import Slo, SloBounds, bound_slo, parse_slo
from conductor.gateway.app import gateway_app
from conductor.gateway.auth import ANONYMOUS, ApiKey, ApiKeyGuard, KeyRing, key_ring
from conductor.settings import load_settings

A, B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
DEFAULTS = SloBounds(max_ttft_s=30.0, max_tbt_ms=100.0, max_priority=0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ring(*keys: ApiKey, clock: Clock | None = None) -> KeyRing:
    return KeyRing(keys, DEFAULTS, clock=clock or Clock())


def test_a_key_is_known_by_its_bearer_header_only() -> None:
    r = ring(ApiKey(name="a", key=SecretStr(A)), ApiKey(name="b", key=SecretStr(B)))
    assert r.identify(f"Bearer {A}").name == "a" and r.identify(f"bearer  {B} ").name == "b"
    for header in (None, "", A, f"Basic {A}", "Bearer", f"Bearer {A}x", f"Bearer {A[:-1]}"):
        assert r.identify(header) is None, header
    assert not r.open and r.names == ["a", "b"]
    anon = ring()
    assert anon.open and anon.identify(None).name == ANONYMOUS and anon.identify(None).bounds == DEFAULTS


def test_in_flight_limit_and_release() -> None:
    r = ring(ApiKey(name="a", key=SecretStr(A), max_in_flight=2))
    c = r.identify(f"Bearer {A}")
    assert r.admit(c) is None and r.admit(c) is None
    no = r.admit(c)
    assert no is not None and no.code == "too_many_requests_in_flight" and no.retry_after_s == 1
    r.release(c)
    assert r.admit(c) is None


def test_rate_limit_is_a_token_bucket_with_a_retry_after() -> None:
    clock = Clock()
    r = ring(ApiKey(name="a", key=SecretStr(A), rate_per_s=0.5, burst=3), clock=clock)
    c = r.identify(f"Bearer {A}")
    for _ in range(3):  # the burst
        assert r.admit(c) is None
        r.release(c)
    no = r.admit(c)
    assert no is not None and no.code == "rate_limit_exceeded" and no.retry_after_s == 2  # one token in 2 s
    clock.t += 2.0
    assert r.admit(c) is None


@pytest.mark.parametrize(("headers", "bounds", "want"), [
    ({"x-conductor-ttft-slo-ms": "3600000"}, DEFAULTS, Slo(30.0, None, 0)),  # a huge SLO: the key's bound
    ({"x-conductor-ttft-slo-ms": "250", "x-conductor-tbt-slo-ms": "40"}, DEFAULTS, Slo(0.25, 40.0, 0)),  # tighter: kept
    ({"x-conductor-tbt-slo-ms": "1e9", "x-conductor-priority": "100"}, DEFAULTS, Slo(None, 100.0, 0)),
    ({"x-conductor-priority": "-40"}, DEFAULTS, Slo(None, None, -40)),  # lowering one's own priority is fine
    ({"x-conductor-priority": "100"}, SloBounds(None, None, 50), Slo(None, None, 50)),
    ({}, DEFAULTS, Slo(None, None, 0)),  # no header: the router's defaults
])
def test_client_slos_are_clamped_to_the_key_s_bounds(headers: dict[str, str], bounds: SloBounds, want: Slo) -> None:
    assert parse_slo(headers, bounds) == want == bound_slo(parse_slo(headers), bounds)


def test_a_key_file_gives_each_key_its_own_bounds(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"keys": [
        {"name": "batch", "key": A, "max_ttft_slo_ms": 120_000, "max_priority": -10, "rate_per_s": 5},
        {"name": "premium", "key": B, "max_tbt_slo_ms": 50, "max_priority": 100, "max_in_flight": 64},
    ]}))
    r = key_ring(load_settings(gateway_api_keys_file=f, ttft_slo_s=10.0, tbt_slo_ms=80.0))
    batch, premium = r.identify(f"Bearer {A}"), r.identify(f"Bearer {B}")
    assert batch.bounds == SloBounds(120.0, 80.0, -10) and batch.rate_per_s == 5 and batch.burst == 5
    assert premium.bounds == SloBounds(10.0, 50.0, 100) and premium.max_in_flight == 64


def entries(*keys: dict[str, Any]) -> str:
    return json.dumps({"keys": list(keys)})


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not a readable JSON file"),
    ('{"keys": []}', "keys: List should have at least 1 item"),
    (entries({"name": "a", "key": "short"}), "keys[0].key: Value error, a key must be 16 to 512 characters"),
    (entries({"name": "a b", "key": A}), "keys[0].name"),
    (entries({"name": "a", "key": A, "burst": 4}), "burst needs rate_per_s"),
    (entries({"name": "a", "key": A, "max_priority": 101}), "keys[0].max_priority"),
    (entries({"name": "a", "key": A}, {"name": "a", "key": B}), "a given twice"),
    (entries({"name": "a", "key": A}, {"name": "b", "key": A}), "the same key"),
])
def test_a_bad_key_file_fails_at_start_naming_the_entry_and_never_the_key(
        tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "keys.json"
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        key_ring(load_settings(gateway_api_keys_file=f))
    assert message in str(e.value) and "gateway_api_keys_file" in str(e.value) and A not in str(e.value)


def test_no_key_is_refused_unless_insecure() -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        key_ring(load_settings())
    assert key_ring(load_settings(), insecure=True).open
    assert key_ring(load_settings(gateway_api_key=A), insecure=True).names == ["default"]  # a key still counts
    with pytest.raises(ConfigError) as e:
        load_settings(gateway_api_key="short")
    assert "gateway_api_key" in str(e.value) and "short" not in str(e.value)


# --- the guard in front of an app ---------------------------------------------------------

def guarded(keys: KeyRing, seen: list[Any]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(ApiKeyGuard, keys=keys)

    async def completions(request: Request) -> Response:
        seen.append((request.state.caller.name, request.state.caller.in_flight))
        return JSONResponse({"ok": True})

    async def stream(request: Request) -> Response:
        caller = request.state.caller

        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(3):
                seen.append(caller.in_flight)  # still in flight while the stream runs
                await asyncio.sleep(0)
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/stream", stream, methods=["POST"])
    app.add_api_route("/health", lambda: Response(status_code=200), methods=["GET"])
    return app


def test_the_guard_answers_401_and_429_in_openai_s_shape() -> None:
    keys = ring(ApiKey(name="a", key=SecretStr(A), rate_per_s=1, burst=1))
    seen: list[Any] = []
    with TestClient(guarded(keys, seen)) as c:
        assert c.get("/health").status_code == 200  # probes need no key
        r = c.post("/v1/completions")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"message": "invalid or missing API key: send Authorization: Bearer <key>",
                                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        assert c.post("/v1/completions", headers={"Authorization": f"Bearer {B}"}).status_code == 401
        ok = c.post("/v1/completions", headers={"Authorization": f"Bearer {A}"})
        assert ok.status_code == 200 and seen == [("a", 1)]
        over = c.post("/v1/completions", headers={"Authorization": f"Bearer {A}"})
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "rate_limit_exceeded" and A not in over.text
    assert keys.identify(f"Bearer {A}").in_flight == 0


def test_a_stream_counts_in_flight_until_it_ends() -> None:
    keys = ring(ApiKey(name="a", key=SecretStr(A), max_in_flight=1))
    seen: list[Any] = []
    with TestClient(guarded(keys, seen)) as c:
        r = c.post("/v1/stream", headers={"Authorization": f"Bearer {A}"})
        assert r.status_code == 200 and r.text.count("data:") == 3
        assert seen == [1, 1, 1]
        assert c.post("/v1/stream", headers={"Authorization": f"Bearer {A}"}).status_code == 200  # released
    assert keys.identify(f"Bearer {A}").in_flight == 0


class FakeGateway:
    """What the routes hand to the gateway: the body, and the SLOs as the key's bounds clamp them."""

    def __init__(self) -> None:
        self.slos: list[Slo] = []

    async def handle(self, body: Any, hdrs: Any, *, chat: bool, bounds: SloBounds | None = None) -> Response:
        self.slos.append(parse_slo(hdrs, bounds))
        return JSONResponse({"chat": chat})


def test_the_gateway_s_routes_pass_the_key_s_bounds_to_the_request() -> None:
    gw = FakeGateway()
    keys = ring(ApiKey(name="a", key=SecretStr(A), max_ttft_slo_ms=5000, max_priority=20))
    with TestClient(gateway_app(gw, keys)) as c:  # type: ignore[arg-type]
        h = {"Authorization": f"Bearer {A}", "x-conductor-ttft-slo-ms": "1e12", "x-conductor-priority": "90"}
        assert c.post("/v1/completions", json={}, headers=h).json() == {"chat": False}
        assert c.post("/v1/chat/completions", json={}, headers=h).json() == {"chat": True}
        assert c.post("/v1/completions", json={}).status_code == 401
        assert c.get("/v1/models").status_code == 401
    assert gw.slos == [Slo(5.0, None, 20)] * 2
