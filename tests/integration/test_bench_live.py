"""``conductor bench live --peer sglang-router``: a tiny trace slice through Conductor's gateway and
through the SGLang router (marker ``peer``: `scripts/test -m peer`), each in front of fresh emulated
engines (2 prefill + 2 decode). Skipped, with the reason, when ``sglang-router`` is not installed
(``pip install '.[peer]'``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conductor.harness.bench.live import LiveOptions, run_live_bench
from conductor.harness.gateway_cluster import sglang_router_missing
from conductor.settings import Settings, child_environment

pytestmark = [pytest.mark.peer, pytest.mark.integration, pytest.mark.timeout(240)]

SIDE_FIELDS = {"requests", "served", "rejected", "errors", "reuse_ratio", "prompt_tokens", "cached_tokens",
               "ttft_p50_s", "ttft_p90_s", "prefills_done", "decodes_done"}


def _trace(path: Path) -> list[dict[str, object]]:
    # Three conversations, each coming back to its prefix (trace blocks: 512 tokens each).
    rows: list[dict[str, object]] = []
    for turn in range(2):
        for conv in range(3):
            blocks = [0, 100 + conv, *range(1000 + 10 * conv, 1000 + 10 * conv + turn + 1)]
            rows.append({"timestamp": 300 * len(rows), "input_length": 512 * len(blocks) - 100,
                         "output_length": 6, "hash_ids": blocks})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return rows


@pytest.fixture
def peer_installed() -> None:
    why = sglang_router_missing()
    if why:
        pytest.skip(why)


def test_the_same_slice_is_served_by_both_routers(peer_installed: None, settings: Settings, tmp_path: Path) -> None:
    rows = _trace(tmp_path / "t.jsonl")
    out = run_live_bench(settings, LiveOptions(duration_s=10.0, speed=10.0, sample=1, trace=tmp_path / "t.jsonl",
                                               drain_s=60.0))
    assert out["requests"] == len(rows) and out["peer_name"] == "sglang-router" and out["peer_mode"] == "pd"
    assert out["peer"] is out["peer_side"]  # the peer's object (peer_side: its older name)
    prompt_tokens = sum(int(r["input_length"]) for r in rows)  # type: ignore[call-overload]
    for side in (out["conductor"], out["peer"]):
        assert SIDE_FIELDS <= set(side), side
        assert {"ttft_p50_s", "ttft_p90_s", "engine_prefix_hit_ratio", "served", "rejected"} <= set(side), side
        # Every request answered with a streamed token, none rejected, none failed.
        assert side["served"] == side["requests"] == len(rows), side
        assert side["rejected"] == 0 and side["errors"] == 0, side
        # Each prompt was prefilled exactly once, by the engines of that side.
        assert side["prefills_done"] == side["decodes_done"] == len(rows), side
        assert side["prompt_tokens"] == prompt_tokens and 0 <= side["cached_tokens"] <= prompt_tokens, side
        assert 0 < side["ttft_p50_s"] <= side["ttft_p90_s"], side
    for key in ("conductor_ttft_p50_s", "conductor_ttft_p90_s", "conductor_reuse_ratio", "conductor_rejected",
                "conductor_errors", "peer_ttft_p50_s", "peer_ttft_p90_s", "peer_reuse_ratio", "peer_rejected",
                "peer_errors"):
        assert key in out
    assert 0 < out["both_served"] <= len(rows) and out["conductor_ttft_p50_s_both_served"] is not None
    # The control plane's CPU over the replay, by process: Conductor's every part but the engines; the peer's router.
    c, p = out["conductor"], out["peer"]
    assert {"gateway", "router", "worker", "broker", "redis"} <= set(c["control_cpu_s_by_process"]), c
    assert sum(1 for n in c["control_cpu_s_by_process"] if n.startswith("bridge-")) == 4, c
    assert not any(n.startswith(("prefill-", "decode-")) for n in c["control_cpu_s_by_process"]), c
    assert set(p["control_cpu_s_by_process"]) == {"sglang-router"}, p
    # /proc counts CPU in clock ticks (10 ms): the peer's Rust router may serve 6 requests within one.
    assert c["control_cpu_s"] > 0 and c["control_cpu_ms_per_request"] > 0, c
    assert p["control_cpu_s"] >= 0 and p["control_cpu_ms_per_request"] >= 0, p
    for side in (c, p):
        assert side["control_cpu_s"] == pytest.approx(sum(side["control_cpu_s_by_process"].values()), abs=0.01)


def test_the_command_names_the_missing_peer_or_the_bad_one(settings: Settings) -> None:
    r = subprocess.run([sys.executable, "-m", "conductor", "bench", "live", "--peer", "nginx", "--json"],
                       env=child_environment(settings), capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert "--peer must be one of sglang-router" in " ".join(r.stderr.split()), r.stderr
