"""`conductor profile calibrate`: the sweep plan, the decode samples and the fit on synthetic timings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conductor.cli import app
from conductor.costmodel.profiles import DEFAULT_PROFILE, ModelProfile, fit_decode, fit_profile, load_profile
from conductor.errors import ConfigError
from conductor.harness.calibrate import (
    Calibration,
    DecodeSample,
    PrefillSample,
    SweepPlan,
    decode_medians,
    decode_sample,
    fit_calibration,
    merged,
    prediction_errors,
    prefill_medians,
    relative_errors,
    write_profile,
)
from conductor.settings import load_settings


@pytest.fixture(scope="module")
def base() -> ModelProfile:
    return load_profile(DEFAULT_PROFILE)


def test_plan_repeats_the_grid_in_passes() -> None:
    plan = SweepPlan(prompt_lengths=(100, 400), cached_fractions=(0.0, 0.5), batch_sizes=(1, 4),
                     decode_contexts=(64,), repeats=3, warmup=1)
    assert plan.prefill_points() == [(100, 0), (100, 50), (400, 0), (400, 200)] * 3
    assert plan.decode_points() == [(1, 64), (4, 64)] * 3
    # warm-up + one request per uncached point, two per cached one + every stream of every batch
    assert plan.requests() == 1 + 3 * (1 + 2 + 1 + 2) + 3 * (1 + 4)


def test_plan_counts_a_fraction_rounding_to_no_token_as_uncached() -> None:
    plan = SweepPlan(prompt_lengths=(3, 64), cached_fractions=(0.0, 0.25), repeats=1, warmup=0,
                     batch_sizes=(1,), decode_contexts=(8,))
    assert plan.prefill_points() == [(3, 0), (64, 0), (64, 16)]  # 0.25 x 3 = 0 tokens: the same point as 0.0
    assert plan.requests() == 1 + 1 + 2 + 1


def test_plan_cached_estimate_is_whole_blocks() -> None:
    plan = SweepPlan(block_size=32)
    assert [plan.cached_estimate(w) for w in (0, 31, 32, 95, 96)] == [0, 0, 32, 64, 96]


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"prompt_lengths": ()}, "--lengths"),
    ({"prompt_lengths": (1, 64)}, "--lengths"),
    ({"cached_fractions": (0.0, 1.0)}, "--cached"),
    ({"cached_fractions": (-0.1,)}, "--cached"),
    ({"prompt_lengths": (64,), "cached_fractions": (0.5,)}, "--lengths/--cached"),
    ({"batch_sizes": (0, 2)}, "--batches"),
    ({"decode_contexts": ()}, "--contexts"),
    ({"repeats": 0}, "--repeats"),
    ({"decode_tokens": 2}, "--decode-tokens"),
    ({"block_size": 0}, "--block-size"),
])
def test_plan_rejects_a_bad_grid_naming_the_option(kwargs: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        SweepPlan(**kwargs)  # type: ignore[arg-type]


def test_decode_sample_takes_the_gaps_while_every_stream_decodes() -> None:
    # Stream a starts at 0.0 with 10 ms steps; stream b joins at 0.05 (its prefill) and ends at 0.30.
    a = [round(0.01 * i, 6) for i in range(40)]
    b = [round(0.05 + 0.02 * i, 6) for i in range(13)]
    s = decode_sample(2, 100, [a, b])
    assert s is not None
    # Window [0.05, 0.29]: a's 10 ms gaps (24) and b's 20 ms gaps (12): the median is a's step.
    assert s.gaps == 24 + 12 and s.step_s == pytest.approx(0.01)
    assert s.context_tokens == int(2 * (100 + (40 + 13) / 2 / 2))
    assert decode_sample(2, 100, [[0.0, 0.1], [0.2, 0.3]]) is None  # never both decoding


def test_fit_profile_keeps_coefficients_non_negative(base: ModelProfile) -> None:
    # A small model on a CPU: prefill time grows linearly, no quadratic term (noise would make it negative).
    rng = random.Random(3)
    rows = [(n, c, 0.02 + 1e-4 * (n - c) * rng.uniform(0.95, 1.05))
            for n in (64, 256, 512, 1024, 1536, 2000) for c in (0, n // 2)]
    fit = fit_profile(rows, base=base)
    assert fit.profile.a >= 0 and fit.profile.b > 0
    assert fit.profile.prefill_overhead_s == pytest.approx(0.02, rel=0.2)
    assert fit.profile.prefill_seconds(1000, 0) == pytest.approx(0.02 + 0.1, rel=0.05)
    with pytest.raises(ConfigError, match="do not grow"):
        fit_profile([(64, 0, 0.05), (512, 0, 0.05), (1024, 0, 0.05)], base=base)


def test_fit_decode_recovers_batch_and_context_costs(base: ModelProfile) -> None:
    rng = random.Random(7)
    rows = [(b, b * c, (0.004 + 0.0005 * b + 2e-7 * b * c) * rng.uniform(0.97, 1.03))
            for b in (1, 2, 4, 8, 16) for c in (64, 512, 2048)]
    fit = fit_decode(rows, base=base)
    p = fit.profile
    assert p.per_sequence_s == pytest.approx(0.0005, rel=0.1)
    assert p.kv_bytes_per_token / p.hbm_bandwidth == pytest.approx(2e-7, rel=0.1)
    assert p.decode_step_seconds(1, 0) == pytest.approx(0.0045, rel=0.1)
    assert fit.max_rel_error < 0.08 and fit.rows == 15
    assert p.kv_bytes_per_token == base.kv_bytes_per_token  # transfers keep their bytes
    with pytest.raises(ConfigError, match="decode row 2"):
        fit_decode([(1, 10, 0.01), (0, 10, 0.01), (2, 10, 0.02)], base=base)


def test_fit_decode_with_free_context_stays_finite(base: ModelProfile) -> None:
    fit = fit_decode([(b, b * 100, 0.01 + 0.001 * b) for b in (1, 2, 4, 8)], base=base)
    assert fit.profile.decode_step_seconds(4, 10**6) == pytest.approx(0.014, rel=0.01)


def test_calibration_fit_on_synthetic_engine_beats_the_base(base: ModelProfile) -> None:
    """An engine whose TTFT is 15 ms + 40 us per new token and whose steps cost 3 ms + 1 ms per sequence."""
    plan = SweepPlan(prompt_lengths=(64, 512, 1536), cached_fractions=(0.0, 0.5, 0.9), repeats=3,
                     batch_sizes=(1, 2, 4, 8), decode_contexts=(64, 512))
    prefill = []
    for i, (n, warmed) in enumerate(plan.prefill_points()):
        cached = plan.cached_estimate(warmed)
        slow = 3.0 if i % 7 == 3 else 1.0  # now and then the machine is busy (once a point): medians keep it out
        prefill.append(PrefillSample(n, warmed, cached, False, slow * (0.015 + 4e-5 * (n - cached))))
    decode = [DecodeSample(b, b * c, 0.003 + 0.001 * b, 20) for b, c in plan.decode_points()]
    prof, pre_rmse, dec_rmse, notes = fit_calibration(prefill, decode, base, "tiny-cpu")
    assert prof.name == "tiny-cpu" and not notes
    assert pre_rmse < 0.005 and dec_rmse is not None and dec_rmse < 0.001
    assert len(prefill_medians(prefill)) == 9 and len(decode_medians(decode)) == 8
    ttft, tbt = prediction_errors(prefill, decode, {"base": base, "calibrated": prof})
    assert ttft["calibrated"]["p90"] < 0.1 < ttft["base"]["p50"]
    assert tbt["calibrated"]["p90"] < 0.05 < tbt["base"]["p50"]
    # Round trip through the file a cluster starts from.
    assert ModelProfile.model_validate_json(prof.model_dump_json()) == prof


def test_relative_errors_quantiles() -> None:
    assert relative_errors([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == {"p50": 1.0, "p90": 1.8}
    assert relative_errors([], []) == {}


def test_calibrate_help_documents_the_sweep() -> None:
    out = CliRunner().invoke(app, ["profile", "calibrate", "--help"], terminal_width=200).output
    for option in ("--engine", "--lengths", "--cached", "--batches", "--contexts", "--decode-tokens", "--repeats",
                   "--out", "--json", "cached_tokens"):
        assert option in out, option


def test_calibrate_refuses_a_bad_grid_before_calling_the_engine() -> None:
    r = CliRunner().invoke(app, ["profile", "calibrate", "--engine", "http://127.0.0.1:9", "--cached", "0,1.5"])
    assert r.exit_code == 2 and "--cached" in r.output
    r = CliRunner().invoke(app, ["profile", "calibrate", "--engine", "ftp://x", "--lengths", "64,128"])
    assert r.exit_code == 2 and "--engine" in r.output


def test_a_profile_file_is_a_setting_checked_at_start_up(tmp_path: Path, base: ModelProfile) -> None:
    """CONDUCTOR_MODEL_PROFILE=<the file calibrate wrote>: a cluster starts from it; a missing or
    broken file fails the settings naming the field, a wrong field fails the load naming both."""
    good = tmp_path / "cal.json"
    write_profile(base.model_copy(update={"name": "cal", "prefill_overhead_s": 0.02}), good)
    s = load_settings(kafka_url=None, redis_url=None, model_profile=str(good))
    assert load_profile(s.model_profile).prefill_overhead_s == 0.02
    (tmp_path / "cut.json").write_text('{"name": ')
    (tmp_path / "list.json").write_text("[]")
    for path, why in (("missing.json", "cannot read"), ("cut.json", "not JSON"), ("list.json", "no JSON object")):
        with pytest.raises(ConfigError, match=f"model_profile.*{why}"):
            load_settings(kafka_url=None, redis_url=None, model_profile=str(tmp_path / path))
    (tmp_path / "bad.json").write_text(base.model_copy(update={"l": 1}).model_dump_json().replace('"l":1', '"l":0'))
    with pytest.raises(ConfigError, match=r"model profile .*bad.json: l: "):
        load_profile(str(tmp_path / "bad.json"))


def test_merged_fits_the_samples_of_every_engine(base: ModelProfile) -> None:
    def one(engine: str, lengths: tuple[int, ...]) -> Calibration:
        pre = [PrefillSample(n, 0, 0, True, 0.01 + 1e-4 * n) for n in lengths]
        dec = [DecodeSample(b, 100 * b, 0.002 * b, 10) for b in (1, 2, 4)]
        prof, rmse, drmse, _ = fit_calibration(pre, dec, base, "x")
        return Calibration(engine, "m", base.name, prof, pre, dec, rmse, drmse, wall_s=len(lengths))

    cal = merged([one("a", (64, 256, 512)), one("b", (1024, 1536, 2048))], base, "both")
    assert cal.engine == "a, b" and len(cal.prefill) == 6 and len(cal.decode) == 6 and cal.wall_s == 3
    assert cal.profile.name == "both" and cal.profile.prefill_seconds(1024) == pytest.approx(0.01 + 0.1024, rel=0.02)
    assert cal.ttft_error["calibrated"]["p90"] < 0.02
