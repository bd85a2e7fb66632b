"""`conductor epp`'s server without a cluster: TLS, gRPC health, the ready line, and bad options
failing at start-up naming the option (a fake decider; the protocol itself: test_epp_picker.py)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_epp_picker import ENGINES, FakeDecider
from typer.testing import CliRunner

from conductor.cli import app
from conductor.epp.serve import epp_config, serve, tls_config
from conductor.errors import ConfigError
from conductor.harness.epp_cluster import EnvoySide
from conductor.settings import load_settings

BODY = b'{"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 4}'
"""Token ids: no tokenizer call (the engines here are made-up addresses)."""


@pytest.fixture
def settings() -> Any:
    return load_settings(kafka_url="k:9092")


def self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the TLS test makes its certificate with it")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], cwd=tmp, check=True, capture_output=True)
    return tmp / "cert.pem", tmp / "key.pem"


async def test_tls_health_and_a_pick_through_the_real_server(settings: Any, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    config = epp_config(settings, epp_id="epp-tls", engines=dict(ENGINES))
    stop = asyncio.Event()
    ready: list[dict[str, Any]] = []
    decider = FakeDecider()
    task = asyncio.create_task(serve(config, settings, port=0, stop=stop, tls=tls_config(cert, key),
                                     on_ready=ready.append, decider=decider))
    try:
        for _ in range(100):
            if ready or task.done():
                break
            await asyncio.sleep(0.05)
        assert ready and ready[0]["tls"] and ready[0]["routing"] == "colocated", (ready, task)
        port = ready[0]["port"]
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with EnvoySide(f"localhost:{port}", creds) as envoy:
            a = await envoy.request(BODY, chunks=3)
        assert a.status == 200 and a.headers["x-gateway-destination-endpoint"] == "10.0.0.2:8001"
        assert decider.asked[0].request_id.startswith("epp-tls-") and decider.asked[0].token_ids == [1, 2, 3, 4]
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                got = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert got.status == health_pb2.HealthCheckResponse.SERVING, service
        # Plaintext against the TLS port gets no answer.
        async with EnvoySide(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await plain.request(BODY, timeout_s=2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_readiness_follows_the_decider(settings: Any) -> None:
    decider = FakeDecider()
    down = {"why": "the colocated router is starting"}
    decider.problem = lambda: down["why"]  # type: ignore[method-assign]
    stop = asyncio.Event()
    ready: list[dict[str, Any]] = []
    task = asyncio.create_task(serve(epp_config(settings, epp_id="epp-h", engines=dict(ENGINES)), settings, port=0,
                                     stop=stop, on_ready=ready.append, decider=decider))
    try:
        while not ready:
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ready[0]['port']}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                return int((await stub.Check(health_pb2.HealthCheckRequest(service=service))).status)

            await asyncio.sleep(0.2)
            assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
            down["why"] = None  # type: ignore[assignment]
            for _ in range(40):
                if await status("readiness") == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            assert await status("readiness") == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("kwargs,option", [
    ({"routing": "router"}, "--routing"), ({"body_mode": "streamed"}, "--body-mode"), ({"epp_id": "a b"}, "--epp-id"),
])
def test_bad_options_name_themselves(settings: Any, kwargs: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        epp_config(settings, **{"epp_id": None, "engines": {}, **kwargs})


def test_tls_files_are_read_at_start_up(tmp_path: Path) -> None:
    assert tls_config(None, None) is None
    with pytest.raises(ConfigError, match="go together"):
        tls_config(tmp_path / "cert.pem", None)
    with pytest.raises(ConfigError, match="--tls-cert .*missing.pem"):
        tls_config(tmp_path / "missing.pem", tmp_path / "key.pem")
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(ConfigError, match="--tls-cert .*not PEM"):
        tls_config(tmp_path / "cert.pem", tmp_path / "key.pem")


def test_the_command_says_what_is_wrong_and_exits_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["epp", "--tls-cert", str(tmp_path / "c.pem")], env={"CONDUCTOR_KAFKA_URL": "k:9092"})
    assert r.exit_code == 2 and "--tls-key go together" in r.output.replace("\n", " ")
    r = CliRunner().invoke(app, ["epp", "--engine", "d0=10.0.0.2:8001"], env={"CONDUCTOR_KAFKA_URL": "k:9092"})
    assert r.exit_code == 2 and "NODE_ID=http://HOST:PORT" in r.output.replace("\n", " ")
