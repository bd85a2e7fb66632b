"""`conductor demo` runs both policies on the real pipeline, prints its JSON line and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.devstack import StackState
from conductor.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_completes_and_compares_with_the_baseline(stack: StackState, settings: Settings, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    # The session's servers: the demo then starts no embedded stack of its own.
    env.update({"CONDUCTOR_KAFKA_URL": stack.kafka_url, "CONDUCTOR_REDIS_URL": stack.redis_url,
                "CONDUCTOR_PROFILE": "embedded", "CONDUCTOR_DATA_DIR": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-c", "from conductor.cli import main; main()", "demo", "--duration", "24", "--json"],
        env=env, capture_output=True, timeout=120,
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
    assert r["decisions"] == 0 or r["ttft_p50_s"] is not None
    assert 0.0 <= r["reuse_ratio"] <= 1.0
    assert "Summary" in proc.stderr.decode()
    assert len(r["pids"]) == 2 * (1 + 1 + 2 + 2)  # worker, router, 2 prefill, 2 decode, per run
    for pid in r["pids"]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]


def test_settings_travel_to_child_processes_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.demo import settings_env
    from conductor.settings import load_settings

    s = load_settings(policy_params={"slo_margin": 0.9, "remote_reuse": False}, kafka_url="k:9092",
                      redis_url="redis://r:6379/0", partitions=3, data_dir=Path("/tmp/x"))
    for k, v in settings_env(s).items():
        monkeypatch.setenv(k, v)
    assert load_settings() == s
