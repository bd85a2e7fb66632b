"""`conductor demo` runs both policies on the real pipeline, prints its JSON line and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.harness.devstack import StackState
from conductor.settings import Settings

pytestmark = [pytest.mark.integration]


@pytest.mark.slow  # both runs of the demo, ~1 min: `scripts/test -m slow`
def test_demo_completes_and_compares_with_the_baseline(stack: StackState, settings: Settings, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    # The session's servers: the demo then starts no embedded stack of its own.
    env.update({"CONDUCTOR_KAFKA_URL": stack.kafka_url, "CONDUCTOR_REDIS_URL": stack.redis_url,
                "CONDUCTOR_PROFILE": "embedded", "CONDUCTOR_DATA_DIR": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-c", "from conductor.cli import main; main()", "demo", "--duration", "24", "--json"],
        env=env, capture_output=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1  # stdout is the JSON line only; the dashboard is on stderr
    r = json.loads(lines[0])
    for k in ("requests", "decisions", "rejected", "reuse_ratio", "ttft_p50_s", "ttft_p90_s", "baseline_policy",
              "baseline_reuse_ratio", "baseline_ttft_p90_s"):
        assert k in r, k
    assert r["ok"] and r["requests"] > 0
    assert r["decisions"] + r["rejected"] == r["requests"]  # every request answered
    assert r["baseline_requests"] == r["requests"]  # the same slice
    assert r["decisions"] == 0 or r["ttft_p50_s"] is not None, {k: v for k, v in r.items() if k != "pids"}
    assert 0.0 <= r["reuse_ratio"] <= 1.0
    assert "Summary" in proc.stderr.decode()
    # worker, router, admin console, gateway, 2 prefill, 2 decode, per run
    assert len(r["pids"]) == 2 * (1 + 1 + 1 + 1 + 2 + 2)
    # The traffic went through the gateway: the client saw the first tokens, the gateway routed them.
    assert r["gateway_url"].startswith("http://") and "gateway (OpenAI API" in proc.stderr.decode()
    # Closed by default: the demo made up a key and a console token, and said them.
    assert "API key sk-demo-" in proc.stderr.decode() and "sign in with demo-admin-" in proc.stderr.decode()
    assert r["decisions"] == 0 or (r["client_ttft_wall_p50_s"] is not None and r["gateway_routing_ms_p50"] > 0)
    for pid in r["pids"]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
    # The stack outlives the demo, so the `conductor explain` lines it printed work as printed.
    run = next((run for run in r["runs"] if run["example_request_ids"]), None)
    if run is not None:
        rid = run["example_request_ids"][0]
        assert f"CONDUCTOR_TOPIC_PREFIX={run['topic_prefix']} conductor explain {rid}" in proc.stdout.decode() + \
            proc.stderr.decode()
        ex = subprocess.run(
            [sys.executable, "-c", "from conductor.cli import main; main()", "explain", rid, "--json"],
            env=env | {"CONDUCTOR_TOPIC_PREFIX": run["topic_prefix"]}, capture_output=True, timeout=60, check=False,
        )
        assert ex.returncode == 0, (ex.stdout + ex.stderr).decode(errors="replace")[-3000:]
        assert json.loads(ex.stdout)["request_id"] == rid


def test_settings_travel_to_child_processes_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.settings import load_settings, settings_env

    s = load_settings(policy_params={"slo_margin": 0.9, "remote_reuse": False}, kafka_url="k:9092",
                      redis_url="redis://r:6379/0", partitions=3, data_dir=Path("/tmp/x"))
    for k, v in settings_env(s).items():
        monkeypatch.setenv(k, v)
    assert load_settings() == s


def test_trace_blocks_become_the_same_tokens_for_every_request_that_shares_them() -> None:
    from conductor.harness.demo import TRACE_BLOCK_TOKENS, block_tokens, request_tokens
    from schemas import chain_keys

    a = request_tokens((0, 1, 2), 1300, index=0)
    b = request_tokens((0, 1, 7), 1500, index=1)
    assert len(a) == 1300 and len(b) == 1500
    assert a[:1024] == b[:1024] == block_tokens(0) + block_tokens(1)
    assert a[1024:1100] != b[1024:1100]
    assert block_tokens(5) == block_tokens(5) and len(block_tokens(5)) == TRACE_BLOCK_TOKENS
    ka, kb = chain_keys(a, 64), chain_keys(b, 64)
    assert ka[:16] == kb[:16] and ka[16] != kb[16]  # Conductor sees exactly the shared 1,024 tokens
    # Past the trace's blocks, the prompt is unique to its request.
    assert request_tokens((3,), 600, index=1)[512:] != request_tokens((3,), 600, index=2)[512:]


def test_the_slice_keeps_whole_conversations_and_arrives_within_the_horizon(tmp_path: Path) -> None:
    from conductor.harness.demo import load_slice

    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 6, 7]},
        {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 5]},
        {"timestamp": 2000, "input_length": 900, "output_length": 5, "hash_ids": [0, 6, 7, 8]},
        {"timestamp": 90_000, "input_length": 600, "output_length": 5, "hash_ids": [0, 12]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    got = load_slice(trace, speed=10.0, sample=3, horizon_s=5.0)
    assert [r.hash_ids for r in got] == [(0, 6, 7), (0, 6, 7, 8)]  # conversation "6" kept whole, "5" not sampled
    assert [round(r.arrival_s, 3) for r in got] == [0.0, 0.2]  # 10x faster; the 90 s request is past the horizon
