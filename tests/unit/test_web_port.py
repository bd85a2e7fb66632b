"""The Faust web port: a second worker on one host takes a free one; a taken explicit one is one line."""

from __future__ import annotations

import asyncio
import socket

import pytest

from conductor.errors import ConfigError
from conductor.settings import load_settings
from streams.app import WEB_PORT, WEB_PORT_TRIES, bind_web_port, make_app


def _port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def test_unset_port_takes_the_first_free_one_from_the_default_up():
    first = bind_web_port("127.0.0.1", None)
    second = bind_web_port("127.0.0.1", None)  # while the first still holds its port
    try:
        a, b = _port(first), _port(second)
        assert a != b
        if b < WEB_PORT + WEB_PORT_TRIES:  # (past that range only when another program holds all of it)
            assert WEB_PORT <= a < b
    finally:
        first.close()
        second.close()


def test_a_taken_explicit_port_is_one_line_naming_the_variable():
    holder = bind_web_port("127.0.0.1", None)
    taken = _port(holder)
    try:
        with pytest.raises(ConfigError) as exc:
            bind_web_port("127.0.0.1", taken)
    finally:
        holder.close()
    msg = str(exc.value)
    assert "CONDUCTOR_WEB_PORT" in msg and f"127.0.0.1:{taken}" in msg and "\n" not in msg


def test_a_free_explicit_port_is_that_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = _port(s)
    sock = bind_web_port("127.0.0.1", free)
    try:
        assert _port(sock) == free
    finally:
        sock.close()


async def _http_status(port: int) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    line = await asyncio.wait_for(r.readline(), 5)
    w.close()
    return line


@pytest.mark.parametrize("profile", ["embedded", "production"])
async def test_two_apps_serve_their_web_servers_on_one_host(tmp_path, profile):
    s = load_settings(kafka_url="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0", profile=profile, data_dir=tmp_path)
    apps = [make_app(s.worker(), app_id=f"a{i}", web_socket=bind_web_port(s.bind_host, None)) for i in range(2)]
    ports = [app.conf.web_port for app in apps]
    assert ports[0] != ports[1] and ports == [_port(app.web_socket) for app in apps]
    try:
        for app in apps:
            await app.web.start_server()
        for port in ports:  # both answer HTTP (no route: 404, but served)
            assert (await _http_status(port)).startswith(b"HTTP/1.")
    finally:
        for app in apps:
            await app.web.stop_server()
            app.web_socket.close()


def test_the_balance_worker_opens_no_web_server(tmp_path):
    # `conductor balance` is a Faust app too: with its web server off, any number run on one host.
    from conductor.balance.planner import BalanceParams
    from conductor.balance.worker import Balancer

    b = Balancer(load_settings(kafka_url="127.0.0.1:1", data_dir=tmp_path), BalanceParams())
    assert b.app.conf.web_enabled is False
    assert list(b.app.boot_strategy.web_server()) == []
