"""Model + hardware profiles: how long prefill, decode steps and KV transfers take.

A profile is the cost model every policy predicts with. Prefill compute follows
FAST'25 (Mooncake) Table 1: a dense transformer costs
``flops(n) = l * (a*n^2*d + b*n*d^2)`` for an ``n``-token prompt, and an
incremental prefill over ``c`` cached tokens costs ``flops(n) - flops(c)``; the
FLOPs are divided by the instance's *effective* throughput (peak x achieved
utilisation). A decode step is memory-bound: it streams the weights once plus the
KV cache of every sequence in the batch from HBM. KV transfers move
``kv_bytes_per_token`` per token at the bandwidth of the tier or link.

Profiles ship as JSON files in ``conductor/costmodel/data/``; ``fit_profile`` refits the
prefill coefficients from measured timings.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conductor.errors import ConfigError
from conductor.stats import percentile
from conductor.topology import Link

DEFAULT_PROFILE = "llama3-70b-a800x8"

# Bounds of every coefficient: loose enough for any real engine (a CPU build fitted against a GPU
# profile moves a and b by 10^3-10^4), tight enough that a fit gone wrong (a window of stalled
# requests, a zero column) or a hand-typed 1e300 or inf is refused where a profile is read: by
# ``load_profile``, by every router's fold of ``set_profile`` and by ``conductor fit`` before it publishes.
MAX_COEFFICIENT = 1e9
"""a and b (FAST'25's dimensionless attention and dense factors; the shipped ones are 4 and 20-28)."""
MAX_FLOPS = 1e21
MAX_BANDWIDTH = 1e16
"""Bytes/s of any tier or link (10 PB/s)."""
MAX_BYTES = 1e15
MAX_SECONDS = 60.0
"""A fixed cost (of a prefill, a decode step, a transfer's set-up, one running request's share)."""
MAX_TTFT_RATIO_P90 = 4.0
"""Early rejection's margin: a profile whose requests take 4x their prediction (p90) is no model; a
larger one (a window of stalled requests) would make early rejection admit nothing. ``fit_outcomes``
holds a fit that measures more at this bound (a margin that saturates); a profile set by hand above it
is refused."""
MAX_TTFT_ERROR_P90 = MAX_TTFT_RATIO_P90 - 1.0
MAX_ERROR = 100.0


class ModelProfile(BaseModel):
    """One model on one instance's hardware. Bandwidths are bytes/s, times seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1)
    description: str = ""
    # --- prefill compute (FAST'25 Table 1) ------------------------------------
    l: int = Field(gt=0, le=4096, description="transformer layers")
    d: int = Field(gt=0, le=1 << 20, description="hidden size")
    a: float = Field(ge=0, le=MAX_COEFFICIENT, description="attention coefficient (quadratic in tokens)")
    b: float = Field(ge=0, le=MAX_COEFFICIENT, description="dense coefficient (linear in tokens)")
    effective_flops: float = Field(gt=0, le=MAX_FLOPS, description="achieved FLOP/s of one instance")
    prefill_overhead_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS, description="fixed cost of one prefill")
    # --- KV cache -------------------------------------------------------------
    kv_bytes_per_token: int = Field(gt=0, le=1 << 30)
    # --- decode (memory-bound roofline) ---------------------------------------
    weight_bytes: float = Field(gt=0, le=MAX_BYTES, description="bytes of weights read per decode step")
    hbm_bandwidth: float = Field(gt=0, le=MAX_BANDWIDTH, description="achieved HBM bytes/s of one instance")
    step_overhead_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS, description="fixed cost of one decode step")
    per_sequence_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS, description="extra cost per sequence per step")
    # --- KV transfer ----------------------------------------------------------
    dram_bandwidth: float = Field(gt=0, le=MAX_BANDWIDTH, description="host DRAM -> HBM")
    ssd_bandwidth: float = Field(gt=0, le=MAX_BANDWIDTH, description="local SSD -> HBM")
    rack_bandwidth: float = Field(gt=0, le=MAX_BANDWIDTH, description="node -> node, same rack (RDMA)")
    cross_rack_bandwidth: float = Field(gt=0, le=MAX_BANDWIDTH, description="node -> node across racks")
    transfer_latency_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS, description="set-up cost of one remote transfer")
    # --- measured (``fit_outcomes``: what the engines did under this profile's predictions) ---
    queue_wait_scale: float = Field(default=1.0, ge=0, le=100.0, description="real queue wait / the wait predicted "
                                    "from a heartbeat's queued tokens (the queue's measured drain rate)")
    running_wait_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS, description="TTFT added by each request already running on "
                                  "the instance (its steps are shared with them: decodes on an aggregated engine, "
                                  "chunked prefills)")
    ttft_error_p50: float | None = Field(default=None, ge=0, le=MAX_ERROR, description="observed |predicted - real| / real TTFT, median")
    ttft_error_p90: float | None = Field(default=None, ge=0, le=MAX_TTFT_ERROR_P90, description="the same, 90th percentile: early "
                                         "rejection's margin for the prediction's own error")
    ttft_ratio_p90: float | None = Field(default=None, ge=0, le=MAX_TTFT_RATIO_P90, description="real / predicted TTFT, 90th percentile: "
                                         "early rejection's margin (nine in ten requests take at most this "
                                         "multiple of their prediction)")
    tbt_error_p50: float | None = Field(default=None, ge=0, le=MAX_ERROR)
    tbt_error_p90: float | None = Field(default=None, ge=0, le=MAX_ERROR)
    fit_rows: int = Field(default=0, ge=0, description="outcomes the measured fields were fitted on (0: hand-set)")

    def flops(self, tokens: float) -> float:
        """FLOPs of prefilling ``tokens`` tokens from scratch."""
        n = float(tokens)
        return self.l * (self.a * n * n * self.d + self.b * n * self.d * self.d)

    def prefill_seconds(self, total_tokens: float, cached_tokens: float = 0) -> float:
        """Compute time of prefilling ``total_tokens`` when the first ``cached_tokens`` are reused."""
        if total_tokens <= 0:
            return 0.0
        cached = min(max(cached_tokens, 0), total_tokens)
        if cached >= total_tokens:
            return 0.0
        return self.prefill_overhead_s + (self.flops(total_tokens) - self.flops(cached)) / self.effective_flops

    def decode_step_seconds(self, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch_size`` sequences holding ``context_tokens`` in total.

        Assumes decode is memory-bound (true for batches far below the compute/bandwidth
        ridge, i.e. every realistic decode batch of a 70B model): each step reads the
        weights once and every sequence's KV cache once, at the achieved HBM bandwidth,
        plus a fixed per-step and a small per-sequence overhead (sampling, scheduling).
        """
        if batch_size <= 0:
            return 0.0
        bytes_read = self.weight_bytes + max(context_tokens, 0) * self.kv_bytes_per_token
        return self.step_overhead_s + batch_size * self.per_sequence_s + bytes_read / self.hbm_bandwidth

    def transfer_seconds(self, tokens: int, tier: str, remote: bool, same_rack: bool = True,
                         link: Link | None = None) -> float:
        """Time to bring ``tokens`` tokens of KV cache held in ``tier`` into this instance's HBM.

        Local HBM costs nothing. A remote read streams from the holder's tier into the
        network, so the slower of the two legs bounds it (plus a set-up latency). ``link``
        (a topology's path) replaces the profile's rack/cross-rack speeds when given.
        """
        if tokens <= 0:
            return 0.0
        nbytes = tokens * self.kv_bytes_per_token
        if tier == "hbm":
            read = 0.0
        elif tier == "dram":
            read = nbytes / self.dram_bandwidth
        elif tier == "ssd":
            read = nbytes / self.ssd_bandwidth
        else:
            raise ValueError(f"unknown tier {tier!r} (hbm, dram or ssd)")
        if not remote:
            return read
        if link is not None:
            return link.seconds(nbytes, read)
        bw = self.rack_bandwidth if same_rack else self.cross_rack_bandwidth
        return self.transfer_latency_s + max(read, nbytes / bw)

    def prefix_load_seconds(
        self, hbm_tokens: int, dram_tokens: int, ssd_tokens: int, remote: bool, same_rack: bool = True,
        link: Link | None = None,
    ) -> float:
        """Time to bring a prefix split over tiers (tokens in each) into this instance's HBM.

        Like :meth:`transfer_seconds` for one tier, but each segment is read at its own
        tier's speed; a remote prefix crosses the link once, pipelined with the reads.
        """
        read = 0.0
        if dram_tokens > 0:
            read += dram_tokens * self.kv_bytes_per_token / self.dram_bandwidth
        if ssd_tokens > 0:
            read += ssd_tokens * self.kv_bytes_per_token / self.ssd_bandwidth
        if not remote:
            return read
        total = max(hbm_tokens, 0) + max(dram_tokens, 0) + max(ssd_tokens, 0)
        if total <= 0:
            return 0.0
        if link is not None:
            return link.seconds(total * self.kv_bytes_per_token, read)
        bw = self.rack_bandwidth if same_rack else self.cross_rack_bandwidth
        return self.transfer_latency_s + max(read, total * self.kv_bytes_per_token / bw)


def _profile_dir() -> resources.abc.Traversable:
    return resources.files("conductor.costmodel").joinpath("data")


CLUSTER_PREFIX = "cluster-"
"""Files ``cluster-*.json`` in the same folder describe simulated clusters, not models."""


def list_profiles() -> list[str]:
    """Names of the shipped model profiles."""
    return sorted(
        p.name[:-5]
        for p in _profile_dir().iterdir()
        if p.name.endswith(".json") and not p.name.startswith(CLUSTER_PREFIX)
    )


def profile_from_dict(data: dict[str, Any], *, source: str = "profile") -> ModelProfile:
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "profile"
        raise ConfigError(f"{source}: {where}: {first.get('msg')}") from None


def load_profile(name: str) -> ModelProfile:
    """The shipped profile ``name``, or a JSON file path; :class:`ConfigError` if unknown."""
    if name.endswith(".json") and Path(name).is_file():
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model profile {name}: cannot read it as JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"model profile {name}: not a JSON object")
        return profile_from_dict(data, source=f"model profile {name}")
    entry = _profile_dir().joinpath(f"{name}.json")
    if name.startswith(CLUSTER_PREFIX) or not entry.is_file():
        raise ConfigError(f"unknown model profile {name!r}; known: {', '.join(list_profiles())}")
    return profile_from_dict(json.loads(entry.read_text()), source=f"profile {name!r}")


# --- fitting -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProfileFit:
    """A refitted profile and how well it explains the measurements."""

    profile: ModelProfile
    rows: int
    rmse_s: float
    max_rel_error: float


def fit_profile(rows: Iterable[Sequence[float]], base: ModelProfile | None = None,
                relative: bool = False) -> ProfileFit:
    """Least-squares fit of ``a``, ``b`` and ``prefill_overhead_s`` to (tokens, cached, seconds) rows.

    ``l``, ``d`` and ``effective_flops`` stay those of ``base`` (the default profile);
    only the coefficients move, so the fitted profile stays comparable to it. With ``relative``
    the residuals are weighted by 1 / seconds: the fit minimises the relative error (what every
    prediction error here reports), so one slow row does not pull the short prompts' predictions
    up to its own scale.
    """

    base = base or load_profile(DEFAULT_PROFILE)
    data = [(float(t), float(c), float(s)) for t, c, s in rows]
    if len(data) < 3:
        raise ConfigError(f"fitting needs at least 3 timing rows, got {len(data)}")
    for i, (tokens, cached, secs) in enumerate(data):
        if not (tokens > 0 and 0 <= cached < tokens and secs > 0) or not all(map(math.isfinite, (tokens, cached, secs))):
            raise ConfigError(f"row {i + 1}: need tokens > cached >= 0 and seconds > 0, got {(tokens, cached, secs)}")
    arr = np.array(data)
    n, c, y = arr[:, 0], arr[:, 1], arr[:, 2]
    scale = base.l / base.effective_flops
    # seconds = overhead + a * [l*d*(n^2-c^2)/F] + b * [l*d^2*(n-c)/F]: linear in (overhead, a, b).
    x_a = scale * base.d * (n * n - c * c)
    x_b = scale * base.d * base.d * (n - c)
    design = np.column_stack([np.ones_like(n), x_a, x_b])
    # Every coefficient is a cost, never negative: least squares over the columns that stay
    # non-negative (an engine whose prefill time hardly grows with the prompt, a small model on
    # a fast machine, fits with a = 0 or b = 0 instead of failing).
    weight = 1.0 / y if relative else np.ones_like(y)
    coef = _nonnegative_lstsq(design * weight[:, None], y * weight)
    overhead, a, b = (float(v) for v in coef)
    if a == 0 and b == 0:
        raise ConfigError("the timings do not grow with the prompt (a = b = 0); need more varied lengths")
    pred = design @ coef
    profile = base.model_copy(
        update={
            "name": f"{base.name}-fit",
            "description": f"{base.name} refitted from {len(data)} timings",
            "a": a,
            "b": b,
            "prefill_overhead_s": overhead,
        }
    )
    return ProfileFit(
        profile=profile,
        rows=len(data),
        rmse_s=float(np.sqrt(np.mean((pred - y) ** 2))),
        max_rel_error=float(np.max(np.abs(pred - y) / y)),
    )


def _nonnegative_lstsq(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best fit over the subsets of columns whose
    unconstrained fit has no negative coefficient (few columns: all subsets are tried)."""
    cols = design.shape[1]
    best, best_sse = np.zeros(cols), float(np.sum(y * y))
    for mask in range(1, 1 << cols):
        keep = [j for j in range(cols) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(design[:, keep], y, rcond=None)
        if np.any(sub < 0):
            continue
        coef = np.zeros(cols)
        coef[keep] = sub
        sse = float(np.sum((design @ coef - y) ** 2))
        if sse < best_sse - 1e-18:
            best, best_sse = coef, sse
    return best


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """A profile whose decode step was refitted, and how well it explains the measured steps."""

    profile: ModelProfile
    rows: int
    rmse_s: float
    max_rel_error: float


MIN_CONTEXT_COST_S = 1e-15
"""Seconds per context token below which a fit calls the context free (the profile's
``kv_bytes_per_token / hbm_bandwidth`` must stay finite)."""


def fit_decode(rows: Iterable[Sequence[float]], base: ModelProfile) -> DecodeFit:
    """Fit the decode step to (batch size, context tokens, step seconds) rows.

    ``decode_step_seconds`` is ``step_overhead + batch * per_sequence + (weights + context *
    kv_bytes_per_token) / hbm_bandwidth``: linear in (1, batch, context), fitted by non-negative
    least squares. ``kv_bytes_per_token`` stays that of ``base`` (transfers use it); the fit sets
    ``hbm_bandwidth`` from the context coefficient, ``weight_bytes`` from the fixed one
    (``step_overhead_s`` 0: the two are one term) and ``per_sequence_s``.
    """
    data = [(float(b), float(c), float(s)) for b, c, s in rows]
    if len(data) < 3:
        raise ConfigError(f"fitting the decode step needs at least 3 rows, got {len(data)}")
    for i, (batch, ctx, secs) in enumerate(data):
        if not (batch >= 1 and ctx >= 0 and secs > 0) or not all(map(math.isfinite, (batch, ctx, secs))):
            raise ConfigError(f"decode row {i + 1}: need batch >= 1, context >= 0 and seconds > 0, "
                              f"got {(batch, ctx, secs)}")
    arr = np.array(data)
    design = np.column_stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]])
    y = arr[:, 2]
    coef = _nonnegative_lstsq(design, y)
    fixed, per_seq, per_ctx = (float(v) for v in coef)
    # A context the fit calls (nearly) free is read at the fastest bandwidth a profile may have,
    # not an infinite one: the fitted profile stays within the schema's bounds.
    per_ctx = max(per_ctx, MIN_CONTEXT_COST_S, base.kv_bytes_per_token / MAX_BANDWIDTH)
    hbm = base.kv_bytes_per_token / per_ctx
    if fixed <= 0:  # weights are read every step: some fixed cost is physical
        fixed = float(np.min(y)) * 1e-3
    profile = base.model_copy(update={
        "hbm_bandwidth": hbm, "weight_bytes": min(fixed * hbm, MAX_BYTES), "step_overhead_s": 0.0,
        "per_sequence_s": per_seq,
    })
    pred = np.array([profile.decode_step_seconds(int(b), int(c)) for b, c, _ in data])
    return DecodeFit(profile=profile, rows=len(data), rmse_s=float(np.sqrt(np.mean((pred - y) ** 2))),
                     max_rel_error=float(np.max(np.abs(pred - y) / y)))


def read_timings_csv(path: Path) -> list[tuple[float, float, float]]:
    """Rows of a CSV with columns tokens, cached, seconds (a header row is optional)."""
    rows: list[tuple[float, float, float]] = []
    try:
        with open(path, newline="") as f:
            for lineno, rec in enumerate(csv.reader(f), 1):
                if not rec or rec[0].strip().startswith("#"):
                    continue
                if lineno == 1 and not rec[0].strip().lstrip("-").replace(".", "", 1).isdigit():
                    continue  # header
                if len(rec) < 3:
                    raise ConfigError(f"{path}:{lineno}: need tokens,cached,seconds")
                try:
                    rows.append((float(rec[0]), float(rec[1]), float(rec[2])))
                except ValueError:
                    raise ConfigError(f"{path}:{lineno}: not numbers: {rec[:3]}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return rows


# --- fitting from served requests ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutcomeSample:
    """One served request as the cost model sees it: what was predicted from, and what happened.

    ``ttft_s`` is the engine-side TTFT (the gateway's, less its routing: what ``predicted_ttft_s``
    predicts); ``queue_s`` the queue wait the decision predicted (:func:`predicted_queue_s`)."""

    prompt_tokens: int
    reused_tokens: int
    queue_s: float
    ttft_s: float
    predicted_ttft_s: float | None = None
    tbt_ms: float | None = None
    predicted_tbt_ms: float | None = None
    running: float = 0.0
    """Requests running on the instance when this one was decided (as the router counts them:
    the heartbeat's and its own in-flight decisions; the fitter counts overlapping requests)."""


def predicted_queue_s(profile: ModelProfile, predicted_ttft_s: float, prompt_tokens: int, reused_tokens: int,
                      running: float = 0.0) -> float:
    """The queue-wait part of a decision's predicted TTFT under ``profile``: the rest is the prefill of
    what the decision did not reuse and the running requests' share (a remote prefix's copy counts as
    wait: its cost is small beside it)."""
    return max(0.0, predicted_ttft_s - profile.running_wait_s * running
               - profile.prefill_seconds(prompt_tokens, min(reused_tokens, prompt_tokens - 1)))


@dataclass(frozen=True, slots=True)
class CostFit:
    """A profile refitted from served requests, with its out-of-sample relative errors."""

    profile: ModelProfile
    rows: int
    ttft_errors: tuple[float, ...]
    """|predicted - real| / real TTFT of each sample, each predicted by a fit that did not see it."""
    tbt_errors: tuple[float, ...]
    form: str = "parametric"


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray, names: Sequence[str], keep: Sequence[str] = ()) -> dict[str, float]:
    """Least squares with every coefficient >= 0: the most negative one is dropped (fixed at 0)
    until none is (a small active-set NNLS; the columns are few). ``keep`` columns are never dropped."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        neg = [(c, i) for c, i in zip(coef, active) if c < 0 and names[i] not in keep]
        if not neg:
            out = dict.fromkeys(names, 0.0)
            out.update({names[i]: max(0.0, float(c)) for c, i in zip(coef, active)})
            return out
        active.remove(min(neg)[1])
        if not active:
            return dict.fromkeys(names, 0.0)


def _prefill_design(base: ModelProfile, samples: Sequence[OutcomeSample]) -> np.ndarray:
    n = np.array([float(s.prompt_tokens) for s in samples])
    c = np.array([float(min(s.reused_tokens, max(s.prompt_tokens - 1, 0))) for s in samples])
    scale = base.l / base.effective_flops
    return np.column_stack([np.ones_like(n), scale * base.d * (n * n - c * c), scale * base.d * base.d * (n - c),
                            np.array([s.running for s in samples]), np.array([s.queue_s for s in samples])])


_TTFT_TERMS = ("prefill_overhead_s", "a", "b", "running_wait_s", "queue_wait_scale")


MIN_QUEUED = 4
"""Samples with a predicted queue wait needed to fit the queue's drain rate (else it stays)."""


def _fit_ttft(base: ModelProfile, samples: Sequence[OutcomeSample]) -> dict[str, float]:
    y = np.array([s.ttft_s for s in samples])
    # Weighted by 1/y: the relative error is what the policy's SLO test and early rejection feel.
    w = 1.0 / np.maximum(y, 1e-6)
    x = _prefill_design(base, samples)
    if int(np.sum(x[:, 4] > 1e-9)) < MIN_QUEUED:
        # Too few requests met a queue to measure it: its drain rate stays the base's (scale 1).
        coef = _nonneg_lstsq(x[:, :4] * w[:, None], (y - x[:, 4]) * w, _TTFT_TERMS[:4])
        return {**coef, "queue_wait_scale": 1.0}
    return _nonneg_lstsq(x * w[:, None], y * w, _TTFT_TERMS)


def _ttft_with(base: ModelProfile, coef: Mapping[str, float], samples: Sequence[OutcomeSample]) -> np.ndarray:
    return np.asarray(_prefill_design(base, samples) @ np.array([coef[k] for k in _TTFT_TERMS]))


def _fit_tbt(base: ModelProfile, samples: Sequence[OutcomeSample]) -> tuple[float, float] | None:
    """(step_overhead_s, scale) with which ``decode_step_seconds`` maps the base's predicted TBT
    onto the observed one: ``tbt = 1000 * step_overhead_s + scale * (pred - 1000 * base.step_overhead_s)``."""
    rows = [(s.predicted_tbt_ms, s.tbt_ms) for s in samples if _step_time(s)]
    if len(rows) < 3:
        return None
    pred, obs = (np.array(v) for v in zip(*rows))
    w = 1.0 / np.maximum(obs, 1e-6)
    var = pred - 1000.0 * base.step_overhead_s
    coef = _nonneg_lstsq(np.column_stack([np.ones_like(var), var]) * w[:, None], obs * w, ("c", "scale"))
    scale = max(coef["scale"], 1e-9)
    return coef["c"] / 1000.0, scale


MIN_TBT_MS = 1.0
"""Token gaps shorter than this are tokens that reached the gateway in one chunk, not a decode step."""


def _step_time(s: OutcomeSample) -> bool:
    return s.tbt_ms is not None and s.tbt_ms >= MIN_TBT_MS and s.predicted_tbt_ms is not None


def _tbt_profile(base: ModelProfile, fit: tuple[float, float]) -> dict[str, float]:
    overhead, scale = fit
    # A step the fit calls (nearly) free of the model's cost is read at the fastest bandwidth a
    # profile may have, not a faster one: the profile stays within the schema's bounds.
    scale = max(scale, base.hbm_bandwidth / MAX_BANDWIDTH)
    return {"step_overhead_s": max(0.0, overhead), "per_sequence_s": base.per_sequence_s * scale,
            "hbm_bandwidth": base.hbm_bandwidth / scale}


def _rel(pred: np.ndarray, obs: np.ndarray) -> list[float]:
    return [float(v) for v in np.abs(pred - obs) / np.maximum(obs, 1e-9)]


def _folds(n: int, k: int) -> list[np.ndarray]:
    idx = np.arange(n)
    return [idx[i::k] for i in range(k)]


def fit_outcomes(samples: Sequence[OutcomeSample], base: ModelProfile, *, folds: int = 5,
                 name: str | None = None) -> CostFit:
    """Refit ``base`` to served requests: prefill (a fixed cost, linear and quadratic in the tokens
    not reused, FAST'25's form), the queue's drain rate (``queue_wait_scale``) and the decode step
    (its fixed cost and its scale against batch and context).

    ``l``, ``d``, the FLOP/s, the KV bytes and the bandwidths of transfers stay ``base``'s. The
    errors set on the profile (``ttft_error_p50``...) are out of sample: each sample predicted by
    a fit on the other folds, so early rejection's margin is what a new request meets."""
    if len(samples) < 4:
        raise ConfigError(f"fitting needs at least 4 served requests, got {len(samples)}")
    bad = next((s for s in samples if not (s.ttft_s > 0 and s.prompt_tokens > 0 and math.isfinite(s.ttft_s))), None)
    if bad is not None:
        raise ConfigError(f"a sample needs ttft_s > 0 and prompt_tokens > 0, got {bad}")
    coef = _fit_ttft(base, samples)
    obs = np.array([s.ttft_s for s in samples])
    pred = np.empty_like(obs)
    k = min(folds, len(samples))
    tbt_fit = _fit_tbt(base, samples)
    tbt_errs: list[float] = []
    for test in _folds(len(samples), k):
        train = [samples[i] for i in range(len(samples)) if i not in set(test.tolist())]
        part = [samples[i] for i in test]
        pred[test] = _ttft_with(base, _fit_ttft(base, train) if len(train) >= 4 else coef, part)
        f = _fit_tbt(base, train) if tbt_fit is not None else None
        if f is not None:
            sb = base.model_copy(update=_tbt_profile(base, f))
            tbt_errs += _tbt_errors(base, sb, part)
    ttft_errs = _rel(pred, obs)
    ratios = [float(v) for v in obs / np.maximum(pred, 1e-9)]
    update: dict[str, Any] = {"prefill_overhead_s": coef["prefill_overhead_s"], "a": coef["a"], "b": coef["b"],
                              "queue_wait_scale": coef["queue_wait_scale"] * base.queue_wait_scale,
                              "running_wait_s": coef["running_wait_s"]}
    if tbt_fit is not None:
        update.update(_tbt_profile(base, tbt_fit))
    # Early rejection's margins saturate at their bounds: a window whose tail took more than 4x its
    # out-of-sample prediction (a CPU engine sharing its cores) still gives its coefficients, and its
    # margin is held where the schema says a margin stops being a model (it then admits more, never
    # less). The measured value stays in the description.
    ratio90, err90 = _percentile(ratios, 90), _percentile(ttft_errs, 90)
    held = []
    if ratio90 is not None and ratio90 > MAX_TTFT_RATIO_P90:
        held.append(f"TTFT ratio p90 {ratio90:.3g}")
        ratio90 = MAX_TTFT_RATIO_P90
    if err90 is not None and err90 > MAX_TTFT_ERROR_P90:
        held.append(f"TTFT error p90 {err90:.3g}")
        err90 = MAX_TTFT_ERROR_P90
    description = f"{base.name.removesuffix('-fit')} refitted from {len(samples)} served requests"
    if held:
        description += f" ({', '.join(held)} measured, held at the bound)"
    update.update(
        name=name or (base.name if base.name.endswith("-fit") else f"{base.name}-fit"),
        description=description[:256],
        ttft_error_p50=_percentile(ttft_errs, 50), ttft_error_p90=err90, ttft_ratio_p90=ratio90,
        tbt_error_p50=_percentile(tbt_errs, 50), tbt_error_p90=_percentile(tbt_errs, 90), fit_rows=len(samples))
    # Validated here, so a fit out of any other bound is refused where it is made, naming the field,
    # and never reaches a ``set_profile`` that every reader would refuse.
    profile = profile_from_dict({**base.model_dump(), **update}, source="the fit")
    return CostFit(profile, len(samples), tuple(ttft_errs), tuple(tbt_errs))


def _tbt_errors(base: ModelProfile, fitted: ModelProfile, samples: Sequence[OutcomeSample]) -> list[float]:
    """Relative TBT errors of ``fitted`` on samples predicted under ``base`` (mapped by the affine
    relation between the two decode models, which is exact for ``_tbt_profile``'s fit)."""
    out = []
    for s in samples:
        if _step_time(s) and s.tbt_ms is not None and s.predicted_tbt_ms is not None:
            scale = base.hbm_bandwidth / fitted.hbm_bandwidth
            p = 1000.0 * fitted.step_overhead_s + scale * (s.predicted_tbt_ms - 1000.0 * base.step_overhead_s)
            out.append(abs(p - s.tbt_ms) / s.tbt_ms)
    return out


def prediction_errors(samples: Sequence[OutcomeSample]) -> tuple[list[float], list[float]]:
    """(TTFT, TBT) relative errors of the predictions the samples carry (as decided)."""
    ttft = [abs(s.predicted_ttft_s - s.ttft_s) / s.ttft_s for s in samples
            if s.predicted_ttft_s is not None and s.ttft_s > 0]
    tbt = [abs(s.predicted_tbt_ms - s.tbt_ms) / s.tbt_ms for s in samples
           if s.predicted_tbt_ms is not None and s.tbt_ms]
    return ttft, tbt


def predict_ttft(profile: ModelProfile, s: OutcomeSample, base: ModelProfile) -> float:
    """What ``profile`` predicts for a sample whose queue wait ``s.queue_s`` was predicted under ``base``."""
    scale = profile.queue_wait_scale / base.queue_wait_scale if base.queue_wait_scale > 0 else 0.0
    return (scale * s.queue_s + profile.running_wait_s * s.running
            + profile.prefill_seconds(s.prompt_tokens, min(s.reused_tokens, s.prompt_tokens - 1)))


def _percentile(values: Sequence[float], p: float) -> float | None:
    v = percentile(values, p)
    return None if v is None else round(v, 6)


def fit_moved(old: ModelProfile, new: ModelProfile, threshold: float) -> bool:
    """Whether ``new`` predicts differently enough from ``old`` to be published: the TTFT of a
    short, a middle and a long prompt, or the decode step, moves by more than ``threshold``
    (relative), or ``old`` was never fitted."""
    if old.fit_rows == 0:
        return True
    for n in (32, 512, 4096):
        a, b = old.prefill_seconds(n), new.prefill_seconds(n)
        if abs(a - b) > threshold * max(a, 1e-9):
            return True
    a, b = old.decode_step_seconds(8, 8 * 1024), new.decode_step_seconds(8, 8 * 1024)
    ra, rb = old.running_wait_s * 8, new.running_wait_s * 8  # eight requests running
    return (abs(a - b) > threshold * max(a, 1e-9) or abs(old.queue_wait_scale - new.queue_wait_scale) > threshold
            or abs(ra - rb) > threshold * max(ra, old.prefill_seconds(512), 1e-9))
