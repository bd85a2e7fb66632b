"""``conductor simulate --from-topics``: traffic recorded on the real broker, replayed under two policies."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conductor.costmodel.profiles import load_profile
from conductor.routing.control_log import publish_control
from conductor.settings import Settings, settings_env
from schemas import ControlCommand, Heartbeat, RequestOutcome, RoutingDecision, RoutingRequest, encode, envelope
from streams import kafka
from streams.topics import topics

pytestmark = pytest.mark.integration


async def _record(settings: Settings, now: int, n: int = 60) -> None:
    """What a small cluster leaves on its topics: heartbeats, requests (token ids with shared
    system prompts), the router's decisions and the gateway's outcomes."""
    t = topics(settings.topic_config())
    await kafka.ensure_topics(settings.kafka(), t.all())
    rng = random.Random(5)
    bs = settings.block_size
    systems = [[rng.randrange(1, 30000) for _ in range(bs * 40)] for _ in range(3)]
    prod = kafka.producer(settings.kafka())
    await prod.start()
    try:
        start = now - 120_000
        nodes = [("p-0", "prefill"), ("p-1", "prefill"), ("d-0", "decode"), ("d-1", "decode")]
        for seq, ts in enumerate(range(start - 2000, now, 5000)):
            for node, role in nodes:
                hb = Heartbeat(role=role, total_kv_blocks=2000, free_kv_blocks=2000)
                await prod.send(t.heartbeats.name, encode(envelope(hb, producer_id=node, producer_seq=seq, ts_ms=ts)),
                                key=node.encode())
        for i in range(n):
            ts = start + i * 1500
            tokens = systems[i % 3] + [rng.randrange(1, 30000) for _ in range(bs * rng.randrange(4, 80))]
            req = RoutingRequest(request_id=f"q{i}", token_ids=tokens, prompt_tokens=len(tokens))
            await prod.send(t.requests.name, encode(envelope(req, producer_id="gw-0", producer_seq=i, ts_ms=ts)),
                            key=req.request_id.encode())
            dec = RoutingDecision(request_id=req.request_id, prefill_instance=f"p-{i % 2}",
                                  decode_instance=f"d-{i % 2}", reused_tokens=0, predicted_ttft_s=0.2,
                                  predicted_tbt_ms=20.0, policy="round-robin", block_size=bs)
            await prod.send(t.dispatch.name, encode(envelope(dec, producer_id="router-0", producer_seq=i,
                                                             ts_ms=ts + 5)), key=b"p-0")
            # Observed: slower than the profile predicts (what calibration has to absorb).
            out = RequestOutcome(request_id=req.request_id, gateway="gw-0", status=200, prompt_tokens=len(tokens),
                                 cached_tokens=0, output_tokens=20 + i % 7, ttft_s=0.03 + len(tokens) * 4e-5,
                                 routing_ms=10.0, prefill_instance=dec.prefill_instance,
                                 decode_instance=dec.decode_instance)
            await prod.send(t.request_outcomes.name, encode(envelope(out, producer_id="gw-0", producer_seq=i,
                                                                     ts_ms=ts + 2000)), key=req.request_id.encode())
        await prod.flush()
    finally:
        await prod.stop()


async def test_recorded_traffic_replayed_under_two_policies(settings: Settings, tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    await _record(settings, now)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    env.update(settings_env(settings))
    report = tmp_path / "whatif"
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "from conductor.cli import main; main()", "simulate", "--from-topics",
         "--since", "10m", "--policy", "recorded,kvcache-centric", "--json", "--report", str(report)],
        env=env, capture_output=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    runs = [json.loads(line) for line in out.stdout.decode().splitlines() if line.startswith("{")]
    assert [r["policy"] for r in runs] == ["round-robin", "kvcache-centric"]
    for r in runs:
        assert r["source"] == "topics" and r["requests"] == 60
        for key in ("ttft_mean_s", "ttft_p90_s", "slo_attainment", "reuse_ratio", "rejected"):
            assert key in r  # the trace report's fields stay
    cal = runs[0]["calibration"]
    assert cal["policy"] == "round-robin" and cal["requests"] == 60 and cal["method"] == "scale"
    assert cal["compute_scale"] != 1.0
    assert abs(cal["calibrated_ttft_p50_s"] / cal["observed_ttft_p50_s"] - 1) <= 0.05
    # Shared system prompts: the cache-aware policy reuses more than round-robin does.
    assert runs[1]["reuse_ratio"] > runs[0]["reuse_ratio"], runs
    md = (report / "README.md").read_text()
    assert "What-if on recorded traffic" in md and "calibration" in md and "--from-topics" in md
    assert "| round-robin |" in md and "| kvcache-centric |" in md and "Against the paper" not in md
    assert list(report.glob("*.png"))


async def test_an_empty_range_says_so(settings: Settings) -> None:
    await _record(settings, int(time.time() * 1000), n=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    env.update(settings_env(settings))
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "from conductor.cli import main; main()", "simulate", "--from-topics", "--until", "1d"],
        env=env, capture_output=True, timeout=120, check=False,
    )
    assert out.returncode != 0
    assert "no routing requests recorded in the time range" in out.stderr.decode()


async def test_the_fitted_profile_on_control_drives_the_simulated_engines(settings: Settings) -> None:
    """``--profile control``: the last ``set_profile`` on the control topic (what ``conductor fit``
    publishes) times the simulated engines, with no calibration to the outcomes; none there: a
    clear error."""
    now = int(time.time() * 1000)
    await _record(settings, now)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_")}
    env.update(settings_env(settings))
    args = [sys.executable, "-c", "from conductor.cli import main; main()", "simulate", "--from-topics",
            "--since", "10m", "--policy", "recorded", "--profile", "control", "--json"]

    none = await asyncio.to_thread(subprocess.run, args, env=env, capture_output=True, timeout=300, check=False)
    assert none.returncode != 0 and b"no set_profile record" in none.stderr + none.stdout

    base = load_profile(settings.model_profile)
    runs = {}
    for name, slower in (("fit-slow", 8.0), ("fit-fast", 1.0)):
        fitted = base.model_copy(update={"name": name, "description": "a test fit",
                                         "effective_flops": base.effective_flops / slower})
        await publish_control(settings, ControlCommand(action="set_profile", profile=fitted.model_dump()))
        out = await asyncio.to_thread(subprocess.run, args, env=env, capture_output=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        assert f"profile: {name}" in out.stderr.decode()  # the last set_profile, read back
        runs[name] = next(json.loads(line) for line in out.stdout.decode().splitlines() if line.startswith("{"))
    for r in runs.values():
        cal = r["calibration"]
        assert cal["method"] == "off" and cal["compute_scale"] == 1.0 and cal["requests"] == 60
        assert cal["calibrated_ttft_p50_s"] == pytest.approx(r["ttft_p50_s"], rel=0.05)
        assert cal["observed_ttft_p90_s"] is not None and cal["calibrated_ttft_p90_s"] is not None
    assert runs["fit-slow"]["ttft_p50_s"] > 3 * runs["fit-fast"]["ttft_p50_s"]
