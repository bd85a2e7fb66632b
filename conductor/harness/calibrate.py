"""``conductor profile calibrate``: measure a live OpenAI-compatible engine and fit a profile to it.

The sweep (:class:`SweepPlan`) has two parts, each point run ``repeats`` times:

* **prefill**: for every prompt length and cached fraction, a prompt of fresh random token ids;
  with a fraction above 0 its first ``fraction x length`` tokens are sent first as a prompt of
  their own (the engine's prefix cache then holds them), then the whole prompt. One request
  at a time, streamed with one output token: the time to its first token is the engine's
  TTFT with an empty queue. The cached tokens are those the engine reports
  (``usage.prompt_tokens_details.cached_tokens``: vLLM with ``--enable-prompt-tokens-details``),
  else the warmed prefix rounded down to whole blocks.
* **decode**: for every batch size and context length, that many streams at once, each a fresh
  prompt of that length generating ``decode_tokens`` tokens (``ignore_eos``); the gaps between
  a stream's tokens while every stream is decoding are the decode step time of that batch
  and context.

Then :func:`conductor.costmodel.profiles.fit_profile` fits the prefill coefficients to (tokens, cached,
TTFT) by relative error (the error every prediction here is judged by) and :func:`conductor.costmodel.profiles.fit_decode` the decode step to (batch, context, step); the
result is a :class:`~conductor.costmodel.profiles.ModelProfile` file a cluster starts from
(``CONDUCTOR_MODEL_PROFILE=<file>``). Token ids, not text, make every length exact on any
tokenizer.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conductor.costmodel.profiles import ModelProfile, fit_decode, fit_profile
from conductor.errors import ConfigError
from conductor.stats import percentile

Progress = Callable[[str, int, int], None]
"""(what is being measured, units done, units in all)."""


@dataclass(frozen=True)
class SweepPlan:
    """What the calibration sends. Checked on construction: a bad value raises :class:`ConfigError`
    naming the option."""

    prompt_lengths: tuple[int, ...] = (64, 256, 512, 1024, 1536)
    cached_fractions: tuple[float, ...] = (0.0, 0.5, 0.9)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    decode_contexts: tuple[int, ...] = (64, 512)
    """Prompt tokens of each stream in the decode sweep."""
    decode_tokens: int = 24
    repeats: int = 2
    warmup: int = 5
    """Unmeasured requests first, cycling over the prompt lengths (an engine's first prefill of a
    length is slow: kernels chosen, memory mapped)."""
    block_size: int = 16
    """The engine's KV block: a warmed prefix counts as cached to whole blocks when the engine
    does not report its cached tokens."""

    def __post_init__(self) -> None:
        for name, values, lo in (("--lengths", self.prompt_lengths, 2), ("--batches", self.batch_sizes, 1),
                                 ("--contexts", self.decode_contexts, 1)):
            if not values:
                raise ConfigError(f"{name}: give at least one value")
            if any(v < lo for v in values):
                raise ConfigError(f"{name}: every value must be at least {lo}, got {list(values)}")
        if not self.cached_fractions or any(not 0.0 <= f < 1.0 for f in self.cached_fractions):
            raise ConfigError(f"--cached: fractions in [0, 1), got {list(self.cached_fractions)}")
        if len(set(self.prompt_lengths)) < 2 and len(set(self.cached_fractions)) < 2:
            raise ConfigError("--lengths/--cached: the prefill fit needs at least two lengths or two fractions")
        if self.repeats < 1:
            raise ConfigError(f"--repeats: at least 1, got {self.repeats}")
        if self.decode_tokens < 3:
            raise ConfigError(f"--decode-tokens: at least 3 (two gaps), got {self.decode_tokens}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup: not negative, got {self.warmup}")
        if self.block_size < 1:
            raise ConfigError(f"--block-size: at least 1, got {self.block_size}")

    def prefill_points(self) -> list[tuple[int, int]]:
        """(prompt tokens, warmed prefix tokens) of every measured prefill, in the order sent:
        the grid ``repeats`` times over (a repeat is a pass over the whole grid, so a slow
        moment of the engine spreads over the points)."""
        grid = [(n, int(f * n)) for n in self.prompt_lengths for f in self.cached_fractions]
        return [p for _ in range(self.repeats) for p in dict.fromkeys(grid)]

    def decode_points(self) -> list[tuple[int, int]]:
        """(batch size, prompt tokens per stream) of every measured decode batch, in the order sent."""
        grid = [(b, c) for c in self.decode_contexts for b in self.batch_sizes]
        return [p for _ in range(self.repeats) for p in dict.fromkeys(grid)]

    def requests(self) -> int:
        """Requests the sweep sends (the progress bar's total)."""
        prefill = sum(2 if cached else 1 for _, cached in self.prefill_points())
        return self.warmup + prefill + sum(b for b, _ in self.decode_points())

    def cached_estimate(self, warmed: int) -> int:
        """Cached tokens assumed for a warmed prefix when the engine reports none: whole blocks."""
        return warmed // self.block_size * self.block_size


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int
    warmed_tokens: int
    cached_tokens: int
    reported: bool
    """Whether ``cached_tokens`` is the engine's own count."""
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    batch_size: int
    context_tokens: int
    """Tokens held by the whole batch, on average over the measured steps."""
    step_s: float
    gaps: int


@dataclass
class Calibration:
    """What a calibration measured, the profile fitted to it and how well each profile predicts."""

    engine: str
    model: str
    base: str
    profile: ModelProfile
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    prefill_rmse_s: float
    decode_rmse_s: float | None
    ttft_error: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"base": {...}, "calibrated": {...}}``: relative TTFT error p50/p90 on the sweep's prefills."""
    tbt_error: dict[str, dict[str, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The JSON line ``--json`` prints."""
        return {
            "engine": self.engine, "model": self.model, "base": self.base, "profile": self.profile.name,
            "prefill_samples": len(self.prefill), "decode_samples": len(self.decode),
            "cached_reported": all(s.reported for s in self.prefill if s.warmed_tokens) if self.prefill else None,
            "prefill_rmse_s": round(self.prefill_rmse_s, 6),
            "decode_rmse_s": None if self.decode_rmse_s is None else round(self.decode_rmse_s, 6),
            "ttft_error": self.ttft_error, "tbt_error": self.tbt_error,
            "a": self.profile.a, "b": self.profile.b, "prefill_overhead_s": self.profile.prefill_overhead_s,
            "per_sequence_s": self.profile.per_sequence_s, "hbm_bandwidth": self.profile.hbm_bandwidth,
            "weight_bytes": self.profile.weight_bytes,
            "wall_s": round(self.wall_s, 2), "notes": self.notes,
        }

    def write_timings(self, path: Path) -> None:
        """The prefill samples as ``tokens,cached,seconds`` (what ``conductor profile fit --csv`` reads)."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["tokens", "cached", "seconds"])
            for s in self.prefill:
                w.writerow([s.prompt_tokens, s.cached_tokens, f"{s.ttft_s:.6f}"])


def relative_errors(pred: Sequence[float], observed: Sequence[float]) -> dict[str, float]:
    """p50 and p90 of |predicted - observed| / observed."""
    errs = [abs(p - o) / o for p, o in zip(pred, observed, strict=True) if o > 0]
    if not errs:
        return {}
    return {"p50": round(percentile(errs, 50, empty=0.0), 4), "p90": round(percentile(errs, 90, empty=0.0), 4)}


def prefill_medians(samples: Sequence[PrefillSample]) -> list[tuple[int, int, float]]:
    """(tokens, cached, median TTFT) per point of the grid: repeats of a point agree on its
    tokens and warmed prefix; the median keeps one slow moment of the engine out of the fit."""
    groups: dict[tuple[int, int], list[PrefillSample]] = {}
    for s in samples:
        groups.setdefault((s.prompt_tokens, s.warmed_tokens), []).append(s)
    return [(n, int(statistics.median(s.cached_tokens for s in g)), statistics.median(s.ttft_s for s in g))
            for (n, _), g in groups.items()]


def decode_medians(samples: Sequence[DecodeSample]) -> list[tuple[int, int, float]]:
    """(batch, context, median step) per (batch, context) of the grid."""
    groups: dict[int, list[DecodeSample]] = {}
    for s in samples:
        groups.setdefault(s.batch_size * 1_000_003 + s.context_tokens // max(1, s.batch_size), []).append(s)
    return [(g[0].batch_size, int(statistics.median(s.context_tokens for s in g)),
             statistics.median(s.step_s for s in g)) for g in groups.values()]


def fit_calibration(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], base: ModelProfile,
                    name: str) -> tuple[ModelProfile, float, float | None, list[str]]:
    """(profile, prefill RMSE, decode RMSE or None, notes): ``base`` refitted to the medians of
    the samples' grid points (pure)."""
    pre = fit_profile(prefill_medians(prefill), base=base, relative=True)
    prof, notes = pre.profile, []
    dec_rmse: float | None = None
    rows = decode_medians(decode)
    if len(rows) >= 3:
        dec = fit_decode(rows, base=prof)
        prof, dec_rmse = dec.profile, dec.rmse_s
    else:
        notes.append("decode step not fitted (needs 3 points of batch size x context): the base's kept")
    prof = prof.model_copy(update={"name": name, "description": (
        f"{base.name} calibrated on {len(prefill)} prefills and {len(decode)} decode batches")})
    return prof, pre.rmse_s, dec_rmse, notes


# --- talking to the engine -------------------------------------------------------------------


class EngineCallError(ConfigError):
    """The engine refused or broke a calibration request (its status and answer in the message)."""


@dataclass
class _Engine:
    client: httpx.AsyncClient
    url: str
    model: str
    ignore_eos: bool

    async def complete(self, prompt: list[int], max_tokens: int) -> tuple[list[float], dict[str, Any]]:
        """Stream one completion; (monotonic time of each chunk holding a choice, from the send; usage)."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                "temperature": 0.0, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        times: list[float] = []
        usage: dict[str, Any] = {}
        try:
            async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")[:300]
                    raise EngineCallError(f"{self.url}/v1/completions answered {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        times.append(time.perf_counter() - t0)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except httpx.HTTPError as e:
            raise EngineCallError(f"{self.url}: {type(e).__name__}: {e}") from None
        if not times:
            raise EngineCallError(f"{self.url}/v1/completions streamed no token")
        return times, usage


async def _served_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
        raise ConfigError(f"--engine {url}: cannot list its models at /v1/models ({e}); name one with --model") from None


def _cached_of(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])


@dataclass(frozen=True)
class CalibrateConfig:
    """What ``conductor profile calibrate`` is told."""

    engine: str
    plan: SweepPlan
    base: ModelProfile
    model: str | None = None
    name: str | None = None
    seed: int = 0
    vocab: int = 1000
    """Token ids are drawn from [vocab / 10, vocab): any model with this many tokens takes them."""
    ignore_eos: bool = True
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.engine.startswith(("http://", "https://")):
            raise ConfigError(f"--engine: an http(s) URL, got {self.engine!r}")
        if self.vocab < 100:
            raise ConfigError(f"--vocab: at least 100, got {self.vocab}")


async def calibrate_engine(config: CalibrateConfig, progress: Progress | None = None) -> Calibration:
    """Run the sweep of ``config`` against its engine and fit a profile to what it measured."""
    plan, rng = config.plan, random.Random(config.seed)
    url = config.engine.rstrip("/")
    done, total = 0, plan.requests()
    say = progress or (lambda _label, _done, _total: None)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(config.vocab // 10, config.vocab) for _ in range(n)]

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=config.timeout_s) as client:
        model = config.model or await _served_model(client, url)
        engine = _Engine(client, url, model, config.ignore_eos)
        for i in range(plan.warmup):
            await engine.complete(prompt(plan.prompt_lengths[i % len(plan.prompt_lengths)]), 2)
            done += 1
            say("warm-up", done, total)
        prefill: list[PrefillSample] = []
        for n, warmed in plan.prefill_points():
            ids = prompt(n)
            if warmed:
                await engine.complete(ids[:warmed], 1)
                done += 1
            times, usage = await engine.complete(ids, 1)
            done += 1
            reported = _cached_of(usage)
            cached = reported if reported is not None else plan.cached_estimate(warmed)
            prefill.append(PrefillSample(n, warmed, min(cached, n - 1), reported is not None, times[0]))
            say(f"prefill {n} tokens, {warmed} warmed", done, total)
        decode: list[DecodeSample] = []
        for batch, context in plan.decode_points():
            runs = await asyncio.gather(*(engine.complete(prompt(context), plan.decode_tokens) for _ in range(batch)))
            done += batch
            sample = decode_sample(batch, context, [t for t, _ in runs])
            if sample is not None:
                decode.append(sample)
            say(f"decode batch {batch} x {context} tokens", done, total)
    name = config.name or f"{config.base.name}-calibrated"
    profile, pre_rmse, dec_rmse, notes = fit_calibration(prefill, decode, config.base, name)
    if not all(s.reported for s in prefill if s.warmed_tokens):
        notes.append("the engine reports no cached tokens (vLLM: --enable-prompt-tokens-details): "
                     f"warmed prefixes counted as cached to whole blocks of {plan.block_size}")
    cal = Calibration(engine=url, model=model, base=config.base.name, profile=profile, prefill=prefill,
                      decode=decode, prefill_rmse_s=pre_rmse, decode_rmse_s=dec_rmse, notes=notes)
    cal.ttft_error, cal.tbt_error = prediction_errors(prefill, decode, {"base": config.base, "calibrated": profile})
    cal.wall_s = time.perf_counter() - started
    return cal


def merged(calibrations: Sequence[Calibration], base: ModelProfile, name: str) -> Calibration:
    """One calibration of alike engines swept at the same time (each its own sweep): the profile
    fitted to all their samples; wall time the longest sweep's."""
    if not calibrations:
        raise ConfigError("no calibration to merge")
    prefill = [s for c in calibrations for s in c.prefill]
    decode = [s for c in calibrations for s in c.decode]
    profile, pre_rmse, dec_rmse, notes = fit_calibration(prefill, decode, base, name)
    first = calibrations[0]
    cal = Calibration(engine=", ".join(c.engine for c in calibrations), model=first.model, base=base.name,
                      profile=profile, prefill=prefill, decode=decode, prefill_rmse_s=pre_rmse,
                      decode_rmse_s=dec_rmse, notes=sorted({n for c in calibrations for n in c.notes} | set(notes)),
                      wall_s=max(c.wall_s for c in calibrations))
    cal.ttft_error, cal.tbt_error = prediction_errors(prefill, decode, {"base": base, "calibrated": profile})
    return cal


def prediction_errors(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample],
                      profiles: dict[str, ModelProfile]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """TTFT and decode-step relative error p50/p90 of each profile against the grid points' medians."""
    pre, dec = prefill_medians(prefill), decode_medians(decode)
    ttft = {label: relative_errors([p.prefill_seconds(n, c) for n, c, _ in pre], [y for _, _, y in pre])
            for label, p in profiles.items()}
    tbt = {label: relative_errors([p.decode_step_seconds(b, c) for b, c, _ in dec], [y for _, _, y in dec])
           for label, p in profiles.items()} if dec else {}
    return ttft, tbt


def decode_sample(batch: int, context: int, streams: Sequence[Sequence[float]]) -> DecodeSample | None:
    """The decode step of ``batch`` streams of ``context`` prompt tokens each, from the times of
    their chunks: the median gap between consecutive chunks of a stream inside the window where
    every stream is decoding (after the last first token, before the first last token). None
    when the window holds no gap."""
    lo = max(t[0] for t in streams)
    hi = min(t[-1] for t in streams)
    gaps = [b - a for t in streams for a, b in itertools.pairwise(t) if a >= lo and b <= hi]
    if not gaps:
        return None
    produced = statistics.mean(len(t) for t in streams)
    return DecodeSample(batch, int(batch * (context + produced / 2)), statistics.median(gaps), len(gaps))


def write_profile(profile: ModelProfile, path: Path) -> None:
    """The profile as the JSON ``load_profile`` reads back."""
    path.write_text(json.dumps(profile.model_dump(), indent=2) + "\n")


__all__ = ["CalibrateConfig", "Calibration", "DecodeSample", "EngineCallError", "PrefillSample", "SweepPlan",
           "calibrate_engine", "decode_medians", "decode_sample", "fit_calibration", "merged", "prediction_errors",
           "prefill_medians", "relative_errors", "write_profile"]
