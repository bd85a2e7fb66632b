"""Model profiles: the cost formulas, the shipped files, and the least-squares fit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conductor.costmodel.profiles import (
    DEFAULT_PROFILE,
    ModelProfile,
    fit_profile,
    list_profiles,
    load_profile,
    read_timings_csv,
)
from conductor.errors import ConfigError


@pytest.fixture(scope="module")
def prof() -> ModelProfile:
    return load_profile(DEFAULT_PROFILE)


def test_default_profile_is_fast25_table1(prof: ModelProfile) -> None:
    assert (prof.l, prof.d, prof.a, prof.b) == (80, 8192, 4, 22)
    assert prof.kv_bytes_per_token == 320 * 1024


def test_every_shipped_profile_loads() -> None:
    names = list_profiles()
    assert DEFAULT_PROFILE in names and len(names) >= 2
    for name in names:
        assert load_profile(name).name == name


def test_unknown_profile_names_itself() -> None:
    with pytest.raises(ConfigError, match="no-such-model"):
        load_profile("no-such-model")


@pytest.mark.parametrize("total,cached", [(1024, 0), (8192, 0), (8192, 4096), (32768, 30000)])
def test_prefill_is_incremental_flops_over_throughput(prof: ModelProfile, total: int, cached: int) -> None:
    def flops(n: int) -> float:
        return 80 * (4 * n * n * 8192 + 22 * n * 8192**2)

    expected = (flops(total) - flops(cached)) / prof.effective_flops
    assert prof.prefill_seconds(total, cached) == pytest.approx(expected, rel=1e-12)


def test_prefill_edges(prof: ModelProfile) -> None:
    assert prof.prefill_seconds(0) == 0.0
    assert prof.prefill_seconds(100, 100) == 0.0
    assert prof.prefill_seconds(100, 500) == 0.0  # more cached than asked is "all cached"
    # quadratic attention: doubling a long prompt more than doubles its cost
    assert prof.prefill_seconds(65536) > 2 * prof.prefill_seconds(32768)


def test_decode_step_is_memory_bound(prof: ModelProfile) -> None:
    one = prof.decode_step_seconds(1, 1000)
    assert one == pytest.approx(
        prof.step_overhead_s + prof.per_sequence_s + (prof.weight_bytes + 1000 * prof.kv_bytes_per_token) / prof.hbm_bandwidth
    )
    assert prof.decode_step_seconds(0, 0) == 0.0
    assert prof.decode_step_seconds(32, 500_000) > prof.decode_step_seconds(32, 100_000) > one


def test_transfer_costs_order_by_tier_and_link(prof: ModelProfile) -> None:
    n = 8192
    assert prof.transfer_seconds(n, "hbm", remote=False) == 0.0
    dram, ssd = prof.transfer_seconds(n, "dram", False), prof.transfer_seconds(n, "ssd", False)
    assert 0 < dram < ssd
    rack, cross = prof.transfer_seconds(n, "hbm", True, True), prof.transfer_seconds(n, "hbm", True, False)
    assert 0 < rack < cross
    assert rack == pytest.approx(prof.transfer_latency_s + n * prof.kv_bytes_per_token / prof.rack_bandwidth)
    # reading 8k tokens over the rack is far cheaper than recomputing them
    assert rack < prof.prefill_seconds(n) / 10
    with pytest.raises(ValueError, match="tier"):
        prof.transfer_seconds(n, "tape", False)


def test_fit_recovers_coefficients_from_noisy_timings(prof: ModelProfile) -> None:
    truth = prof.model_copy(update={"a": 6.0, "b": 18.0, "prefill_overhead_s": 0.01})
    rng = random.Random(7)
    rows = []
    for _ in range(60):
        total = rng.randrange(256, 32768)
        cached = rng.randrange(0, total)
        rows.append((total, cached, truth.prefill_seconds(total, cached) * rng.uniform(0.98, 1.02)))
    fit = fit_profile(rows, base=prof)
    assert fit.profile.a == pytest.approx(6.0, rel=0.1)
    assert fit.profile.b == pytest.approx(18.0, rel=0.1)
    assert fit.max_rel_error < 0.1 and fit.rows == 60


def test_fit_rejects_bad_rows(prof: ModelProfile) -> None:
    with pytest.raises(ConfigError, match="at least 3"):
        fit_profile([(100, 0, 0.1)], base=prof)
    with pytest.raises(ConfigError, match="row 2"):
        fit_profile([(100, 0, 0.1), (100, 200, 0.1), (300, 0, 0.3)], base=prof)


def test_timings_csv(tmp_path: Path, prof: ModelProfile) -> None:
    f = tmp_path / "t.csv"
    f.write_text("tokens,cached,seconds\n1000,0,0.14\n4000,1000,0.5\n8000,0,1.2\n")
    assert read_timings_csv(f) == [(1000, 0, 0.14), (4000, 1000, 0.5), (8000, 0, 1.2)]
    f.write_text("1000,0,abc\n")
    with pytest.raises(ConfigError, match=":1"):
        read_timings_csv(f)
