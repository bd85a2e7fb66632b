"""The CLI parses its options into the typed config of the package that runs the thing, and nothing
else: each command's config is checked here as the entry point receives it (no broker, no Redis)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conductor.bridge import serve as bridge_serve
from conductor.bridge.serve import BridgeServeConfig
from conductor.cli import app
from conductor.errors import ConfigError
from conductor.gateway import serve as gateway_serve
from conductor.gateway.config import GatewayConfig
from conductor.harness.engine import serve as engine_serve
from conductor.harness.engine.pool import POOL_NODE
from conductor.harness.engine.serve import EngineServeConfig, PoolOptions
from conductor.harness.sim.run import SimulateConfig

ENV = {"CONDUCTOR_KAFKA_URL": "127.0.0.1:1", "CONDUCTOR_REDIS_URL": "redis://127.0.0.1:1/0"}


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What each entry point was called with, instead of running it."""
    calls: dict[str, Any] = {}

    async def serve_engine(config: EngineServeConfig, settings: Any, **_: Any) -> None:
        calls["engine"] = config

    async def serve_bridge(config: BridgeServeConfig, settings: Any, **_: Any) -> dict[str, int]:
        calls["bridge"] = config
        return {}

    async def serve_gateway(config: GatewayConfig, settings: Any, **kw: Any) -> None:
        calls["gateway"] = (config, kw["port"], kw["tokenizer_path"])
        calls["gateway_keys"] = kw["keys"]

    def run_simulation(settings: Any, config: SimulateConfig, **_: Any) -> list[Any]:
        calls["simulate"] = config
        return []

    monkeypatch.setattr(engine_serve, "serve", serve_engine)
    monkeypatch.setattr(bridge_serve, "serve", serve_bridge)
    monkeypatch.setattr(gateway_serve, "serve", serve_gateway)
    monkeypatch.setattr("conductor.cli.simulate.run_simulation", run_simulation)
    return calls


def invoke(*argv: str, **env: str) -> Any:
    return CliRunner().invoke(app, list(argv), env=ENV | env)


def test_engine_options_become_its_config(handed: dict[str, Any]) -> None:
    res = invoke("engine", "--role", "prefill", "--node-id", "p0", "--http-port", "0", "--kv-blocks", "64",
                 "--no-self-heartbeat", "--rack", "r1", "--mooncake-master", "h:5", "--pool-segment-mb", "8")
    assert res.exit_code == 0, res.output
    assert handed["engine"] == EngineServeConfig(
        node_id="p0", role="prefill", kv_blocks=64, http_port=0, self_heartbeat=False, rack="r1",
        pool=PoolOptions("h:5", POOL_NODE, 8, None))


def test_bridge_options_become_its_config(handed: dict[str, Any]) -> None:
    res = invoke("bridge", "--zmq", "tcp://e:5557", "--replay", "tcp://e:5558", "--node-id", "n", "--role", "decode",
                 "--engine-url", "http://e:8000/", "--dp-size", "2", "--no-kv-transfer")
    assert res.exit_code == 0, res.output
    config = handed["bridge"]
    assert config == BridgeServeConfig(zmq_endpoint="tcp://e:5557", node_id="n", role="decode",
                                       replay_endpoint="tcp://e:5558", engine_url="http://e:8000/", dp_size=2,
                                       kv_transfer=False)
    ranks = config.rank_configs(block_size=16)
    assert [(r.node_id, r.zmq_endpoint, r.endpoint) for r in ranks] == [
        ("n-dp0", "tcp://e:5557", "http://e:8000"), ("n-dp1", "tcp://e:5558", "http://e:8000")]


def test_gateway_options_become_its_config(handed: dict[str, Any]) -> None:
    res = invoke("gateway", "--port", "0", "--engine", "p0=http://h:1", "--engine-protocol", "sglang",
                 "--gateway-id", "gw-a", "--max-attempts", "2", "--tokenizer", "tok.json",
                 CONDUCTOR_GATEWAY_API_KEY="k" * 20)
    assert res.exit_code == 0, res.output
    config, port, tokenizer = handed["gateway"]
    assert config == GatewayConfig(gateway_id="gw-a", engines={"p0": "http://h:1"}, protocol="sglang", max_attempts=2)
    assert (port, tokenizer) == (0, "tok.json")
    assert handed["gateway_keys"].names == ["default"] and "k" * 20 not in res.output


def test_the_gateway_is_closed_unless_told_insecure(handed: dict[str, Any]) -> None:
    res = invoke("gateway", "--port", "0")
    assert res.exit_code == 2 and not handed
    assert "CONDUCTOR_GATEWAY_API_KEY" in res.output and "--insecure" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    res = invoke("gateway", "--port", "0", "--insecure")
    assert res.exit_code == 0, res.output
    assert handed["gateway_keys"].open and "--insecure" in res.output  # said loudly


def test_a_bad_keys_file_is_one_line_naming_the_entry(handed: dict[str, Any], tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text('{"keys": [{"name": "a", "key": "a-secret-of-20-chars", "max_in_flight": 0}]}')
    res = invoke("gateway", CONDUCTOR_GATEWAY_API_KEYS_FILE=str(f))
    assert res.exit_code == 2 and not handed
    text = " ".join(res.output.split())
    assert "gateway_api_keys_file" in text and "keys[0].max_in_flight" in text and "a-secret" not in text


@pytest.mark.parametrize(("argv", "message"), [
    (["engine", "--role", "store", "--node-id", "s"], "--role must be one of prefill, decode, both, not 'store'"),
    (["bridge", "--zmq", "tcp://e:1", "--node-id", "n", "--role", "x"], "--role must be one of"),
    (["bridge", "--zmq", "tcp://e:1", "--node-id", "n", "--role", "both", "--metrics-url", "http://e/metrics",
      "--heartbeat-s", "0"], "--metrics-url needs --heartbeat-s > 0"),
    (["bridge", "--zmq", "tcp://e:1", "--node-id", "n", "--role", "both", "--engine-url", "e:8000"],
     "--engine-url must be http(s)://HOST:PORT"),
    (["bridge", "--zmq", "tcp://e:1", "--node-id", "n", "--role", "both", "--execute-commands"],
     "--execute-commands needs the engine's URL"),
    (["gateway", "--engine-protocol", "grpc"], "--engine-protocol must be one of vllm, sglang"),
    (["gateway", "--engine", "no-url"], "no-url"),
    (["gateway", "--gateway-id", "bad id!"], "--gateway-id:"),
])
def test_a_bad_option_exits_2_naming_it_before_anything_runs(
    handed: dict[str, Any], argv: list[str], message: str
) -> None:
    res = invoke(*argv)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert not handed


def test_the_reports_command_line_reproduces_the_run(handed: dict[str, Any], tmp_path: Path) -> None:
    argv = ["simulate", "--trace", str(tmp_path / "t.jsonl"), "--policy", "kvcache-centric,random", "--cluster",
            "4P2D", "--speed", "2.5", "--capacity", "--target", "0.8", "--balance", "both", "--cpp", "on",
            "--params", '{"random": {}}', "--json", "--report", str(tmp_path / "r")]
    assert invoke(*argv).exit_code == 0
    config = handed.pop("simulate")
    again = shlex.split(config.command_line())
    assert again[:2] == ["conductor", "simulate"]
    assert invoke(*again[1:]).exit_code == 0
    assert handed["simulate"] == config


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "give either --trace FILE or --from-topics"),
    ({"trace": Path("t"), "since": "1h"}, "--since/--until select a range of the topics"),
    ({"trace": Path("t"), "policy": "nope"}, "--policy: unknown nope"),
    ({"trace": Path("t"), "balance": "sometimes"}, "--balance: expected on, off or both"),
    ({"from_topics": True, "policy": "recorded,random"}, None),
])
def test_simulate_config_checks_its_options(fields: dict[str, Any], message: str | None) -> None:
    if message is None:
        assert SimulateConfig(**fields).policies() == ["recorded", "random"]
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SimulateConfig(**fields)

