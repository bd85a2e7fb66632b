"""``conductor simulate`` end to end on a tiny synthetic trace."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from conductor.cli import app
from conductor.costmodel.profiles import load_profile

REQUIRED = ("policy", "requests", "ttft_mean_s", "ttft_p90_s", "tbt_p90_ms", "slo_attainment", "goodput_rps",
            "reuse_ratio", "reuse_upper_bound", "rejected", "sim_wall_s")


def tiny_trace(path, n: int = 120) -> None:
    rng = random.Random(3)
    lines = []
    for i in range(n):
        conv = rng.randrange(8)
        blocks = rng.randrange(2, 12)
        ids = [0] + [1000 * conv + j for j in range(1, blocks)]
        lines.append(json.dumps({"timestamp": 1000 * (i // 3), "input_length": 512 * blocks - 100,
                                 "output_length": rng.randrange(2, 60), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def test_json_lines_capacity_and_report(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    tiny_trace(trace)
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--policy", "kvcache-centric,random",
                                   "--cluster", "2P1D", "--capacity", "--json", "--report", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["policy"] for r in rows] == ["kvcache-centric", "random"]
    for r in rows:
        assert all(k in r for k in REQUIRED) and r["requests"] == 120 and r["cluster"] == "2P1D"
        assert r["capacity_speed"] > 0 and 0 <= r["reuse_ratio"] <= r["reuse_upper_bound"] <= 1
    md = (out / "README.md").read_text()
    assert "| kvcache-centric |" in md and "--capacity" in md
    for png in ("ttft_cdf.png", "slo_vs_speed.png", "reuse.png", "load_per_instance.png"):
        assert (out / png).stat().st_size > 1000


def test_bad_trace_line_exits_2_naming_the_line(tmp_path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 0}\n')
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--policy", "random"])
    assert res.exit_code != 0
    assert "bad.jsonl:2" in str(res.exception) or "bad.jsonl:2" in res.output


def test_a_profile_file_drives_the_simulated_engines(tmp_path) -> None:
    """``--profile FILE`` (what ``conductor profile calibrate`` writes): prefill 4x slower than the
    cluster profile's model gives a slower simulated TTFT; the report names the file."""
    trace = tmp_path / "t.jsonl"
    tiny_trace(trace, n=60)
    base = load_profile("llama3-70b-a800x8")
    slow = base.model_copy(update={"name": "slow", "effective_flops": base.effective_flops / 4})
    path = tmp_path / "slow.json"
    path.write_text(slow.model_dump_json())
    args = ["simulate", "--trace", str(trace), "--policy", "round-robin", "--cluster", "2P1D", "--json"]
    rows = []
    for extra in ([], ["--profile", str(path)]):
        res = CliRunner().invoke(app, args + extra + ["--report", str(tmp_path / f"r{len(extra)}")])
        assert res.exit_code == 0, res.output
        rows.append(json.loads(next(line for line in res.stdout.splitlines() if line.startswith("{"))))
    assert rows[1]["ttft_p50_s"] > 2 * rows[0]["ttft_p50_s"]
    assert f"--profile {path}" in (tmp_path / "r2" / "README.md").read_text()
    bad = CliRunner().invoke(app, args + ["--profile", "control"])
    assert bad.exit_code != 0 and "--from-topics" in (bad.output + str(bad.exception))
