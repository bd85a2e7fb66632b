"""What-if on the cluster's own traffic: recorded ``requests``, ``heartbeats``, ``dispatch``
and ``request-outcomes`` records turned into a simulator workload, and the cost model
calibrated so that the recorded policy's simulated TTFTs match the observed ones.

Pure: it takes decoded envelopes (``conductor simulate --from-topics`` reads the topics)
and returns what :class:`conductor.harness.sim.session.Bench` runs.

* Requests keep their arrival time (the envelope's ``ts_ms``) and their block keys: a
  request with token ids gets ``schemas.request_chain_keys`` (LoRA, salt and multimodal
  keys included), one with ``block_keys`` keeps them; the simulated caches and view index
  exactly the keys the router looked up. Retries (``retry_of``) are left out: their
  client request is already in.
* The cluster is the nodes that heartbeated in the range, with their recorded roles,
  node ids and KV capacities (largest per role: the simulator sizes instances alike).
* A request's output length is what its outcome observed, else what it expected.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from conductor.costmodel.profiles import ModelProfile, fit_profile
from conductor.errors import ConfigError
from conductor.harness.sim.cluster import ClusterProfile
from conductor.harness.sim.engine import SimResult
from conductor.harness.sim.errors import SimulationError
from conductor.harness.sim.trace import TraceRecord
from conductor.stats import percentile
from schemas import Envelope, Heartbeat, RequestOutcome, RoutingDecision, RoutingRejection, RoutingRequest
from schemas.records import request_chain_keys

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time(text: str, now_ms: int, flag: str = "--since") -> int:
    """A point in time as epoch ms: ``30m`` / ``2h`` / ``1d`` (that long before ``now_ms``), an
    ISO 8601 date-time (local time unless it carries an offset), or an integer of epoch ms."""
    t = text.strip()
    m = _RELATIVE.match(t)
    if m:
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    if t.isdigit():
        return int(t)
    try:
        return int(datetime.fromisoformat(t).timestamp() * 1000)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a duration ago (30m, 2h, 1d), an ISO 8601 time "
                          "(2025-06-01T14:00) or epoch milliseconds") from None


@dataclass
class RecordedTraffic:
    """Recorded traffic in simulator form; ``records[i]`` is request ``request_ids[i]``."""

    records: list[TraceRecord]
    request_ids: list[str]
    cluster: ClusterProfile
    observed: dict[str, RequestOutcome]
    """Outcomes of served requests (status 200, no error, a TTFT), by request id."""
    recorded_policy: str | None
    recorded_params: dict[str, Any]
    roles: dict[str, str]
    """Node id → role, from the heartbeats in the range."""
    first_ms: int
    last_ms: int
    skipped: dict[str, int] = field(default_factory=dict)
    """Requests left out, by reason."""
    time_scale: float = 1.0
    """The recorded engines ran this many times faster than their cost model (emulated engines'
    ``--time-scale``): their part of an observed TTFT is that much longer in model time."""

    def observed_ttft_s(self, request_id: str) -> float | None:
        """TTFT the gateway observed minus its routing time: what the simulator's TTFT
        (arrival at the router → first token) measures. With a ``time_scale``, the engines' part
        (the TTFT less :meth:`path_s`) in model time."""
        o = self.observed.get(request_id)
        if o is None or o.ttft_s is None:
            return None
        if self.time_scale != 1.0:
            path = self.path_s(request_id)
            v = (o.ttft_s - (path or 0.0)) * self.time_scale
        else:
            v = o.ttft_s - (o.routing_ms or 0.0) / 1000.0
        return v if v > 0 else None

    def path_s(self, request_id: str) -> float | None:
        """:func:`path_seconds` of a served request; None when it was not served."""
        o = self.observed.get(request_id)
        return None if o is None else path_seconds(o)


def path_seconds(o: RequestOutcome) -> float | None:
    """Seconds of an observed TTFT spent outside the engines, in real time: the gateway's TTFT less
    its prefill call and its decode call's first token (P/D), else its routing (arrival to decision)."""
    if o.ttft_s is None:
        return None
    if o.prefill_s is not None or o.decode_ttft_s is not None:
        v = o.ttft_s - (o.prefill_s or 0.0) - (o.decode_ttft_s or 0.0)
    else:
        v = o.decided_s if o.decided_s is not None else (o.routing_ms or 0.0) / 1000.0
    return min(max(v, 0.0), o.ttft_s)


HEARTBEAT_SLACK_MS = 60_000
"""The nodes of a recording are those with a heartbeat from this long before its first request
to this long after its last."""


def _picked(requests: Iterable[Envelope], lo: float, hi: float, skipped: Counter[str],
            ) -> list[tuple[int, int, RoutingRequest]]:
    """The requests of ``[lo, hi]`` the simulator replays (first copy of an id, no retries, a
    prompt), as (ts_ms, position, request) in time order; the others counted in ``skipped``."""
    seen: set[str] = set()
    picked: list[tuple[int, int, RoutingRequest]] = []
    for n, env in enumerate(requests):
        req = env.body
        if not isinstance(req, RoutingRequest) or not lo <= env.ts_ms <= hi:
            continue
        if req.retry_of is not None:
            skipped["retry"] += 1
            continue
        if req.request_id in seen:
            skipped["duplicate id"] += 1
            continue
        seen.add(req.request_id)
        if req.prompt_tokens < 1:
            skipped["empty prompt"] += 1
            continue
        picked.append((env.ts_ms, n, req))
    picked.sort(key=lambda p: (p[0], p[1]))
    return picked


def request_span(requests: Iterable[Envelope], *, since_ms: int | None = None,
                 until_ms: int | None = None) -> tuple[int, int, set[str]] | None:
    """(first ms, last ms, request ids) of the requests :func:`recorded_traffic` would replay
    from ``[since_ms, until_ms]`` (None: none): what a reader needs to know which heartbeats and
    outcomes to read."""
    picked = _picked(requests, since_ms if since_ms is not None else -1,
                     until_ms if until_ms is not None else math.inf, Counter())
    if not picked:
        return None
    return picked[0][0], picked[-1][0], {req.request_id for _, _, req in picked}


def latest_heartbeats(heartbeats: Iterable[Envelope], first_ms: int, last_ms: int) -> list[Envelope]:
    """Each node's last heartbeat from ``HEARTBEAT_SLACK_MS`` before ``first_ms`` to as long after
    ``last_ms``, in the order given: all that :func:`recorded_traffic` reads of the heartbeats
    for requests spanning ``[first_ms, last_ms]``."""
    latest: dict[str, Envelope] = {}
    for env in heartbeats:
        if isinstance(env.body, Heartbeat) and first_ms - HEARTBEAT_SLACK_MS <= env.ts_ms <= last_ms + HEARTBEAT_SLACK_MS:
            latest[env.producer_id] = env
    return list(latest.values())


def recorded_traffic(
    requests: Iterable[Envelope],
    heartbeats: Iterable[Envelope],
    outcomes: Iterable[Envelope] = (),
    dispatch: Iterable[Envelope] = (),
    *,
    base: ClusterProfile,
    block_size: int,
    since_ms: int | None = None,
    until_ms: int | None = None,
    time_scale: float = 1.0,
    path: bool = False,
) -> RecordedTraffic:
    """The traffic recorded in ``[since_ms, until_ms]`` on a cluster shaped like its heartbeats.

    ``base`` gives what the log does not say (SLOs, decode batch limit, view delay, model
    profile); ``block_size`` is the router's. ``time_scale``: see :attr:`RecordedTraffic.time_scale`.
    ``path``: each request carries its observed time outside the engines (:meth:`RecordedTraffic.path_s`;
    the median of the served ones for a request not served) into the replay, to count toward the
    TTFT SLO as it did. :class:`SimulationError` when the range holds no request or no prefill/decode node.
    """
    lo = since_ms if since_ms is not None else -1
    hi = until_ms if until_ms is not None else math.inf
    skipped: Counter[str] = Counter()
    picked: list[tuple[int, int, RoutingRequest, list[int]]] = []
    for ts, n, req in _picked(requests, lo, hi, skipped):
        if req.block_keys is not None:
            if req.block_size is not None and req.block_size != block_size:
                skipped[f"block size {req.block_size} != {block_size}"] += 1
                continue
            chain = list(req.block_keys[: req.prompt_tokens // block_size])
        else:
            chain = request_chain_keys(req, block_size)
        picked.append((ts, n, req, chain))
    if not picked:
        raise SimulationError("no routing requests recorded in the time range"
                              + (f" ({dict(skipped)} left out)" if skipped else ""))

    served: dict[str, RequestOutcome] = {}
    output: dict[str, int] = {}
    for env in outcomes:
        o = env.body
        if not isinstance(o, RequestOutcome):
            continue
        if o.output_tokens > 0:
            output[o.request_id] = o.output_tokens
        if o.status == 200 and o.error is None and o.ttft_s is not None:
            served[o.request_id] = o

    paths: dict[str, float] = {}
    if path:
        paths = {rid: v for rid, o in served.items() if (v := path_seconds(o)) is not None}
    typical = statistics.median(paths.values()) if paths else 0.0
    records, ids = [], []
    for i, (ts, _, req, chain) in enumerate(picked):
        out_len = max(1, output.get(req.request_id, req.expected_output_tokens))
        records.append(TraceRecord(i, float(ts), req.prompt_tokens, out_len, tuple(chain), keyed=True,
                                   path_s=paths.get(req.request_id, typical)))
        ids.append(req.request_id)
    first, last = picked[0][0], picked[-1][0]

    # Nodes alive around the traffic: heartbeats from one interval before the range on.
    latest: dict[str, Heartbeat] = {}
    for env in latest_heartbeats(heartbeats, first, last):
        assert isinstance(env.body, Heartbeat)
        latest[env.producer_id] = env.body
    prefill = sorted(n for n, hb in latest.items() if hb.role in ("prefill", "both"))
    decode = sorted(n for n, hb in latest.items() if hb.role in ("decode", "both"))
    if not prefill or not decode:
        raise SimulationError(f"the heartbeats around the range name {len(prefill)} prefill and {len(decode)} "
                              "decode nodes; the simulator needs at least one of each")
    # A "both" node would be two simulated instances under one name; number those apart.
    names_ok = not set(prefill) & set(decode)
    update: dict[str, Any] = {
        "name": "recorded",
        "description": f"{len(prefill)} prefill + {len(decode)} decode nodes from the heartbeats",
        "prefill_instances": len(prefill),
        "decode_instances": len(decode),
        "prefill_names": tuple(prefill) if names_ok else (),
        "decode_names": tuple(decode) if names_ok else (),
        "block_size": block_size,
        "store_dram_blocks": 0,
        "store_ssd_blocks": 0,
    }
    hbm = max((latest[n].tier_capacity.get("hbm", latest[n].total_kv_blocks) for n in prefill), default=0)
    dram = max((latest[n].tier_capacity.get("dram", 0) for n in prefill), default=0)
    if hbm + dram > 0:
        # The simulated cache is one LRU tier: a node with host DRAM keeps its prefixes there.
        update["prefill_cache_blocks"] = hbm + dram
        update["prefill_cache_tier"] = "dram" if dram > 0 else "hbm"
    dec = max((latest[n].total_kv_blocks for n in decode), default=0)
    if dec > 0:
        update["decode_kv_tokens"] = dec * block_size

    votes: Counter[str] = Counter()
    params: dict[str, dict[str, Any]] = {}
    model_profiles: Counter[str] = Counter()
    for env in dispatch:
        d = env.body
        if isinstance(d, (RoutingDecision, RoutingRejection)) and d.policy and lo <= env.ts_ms <= hi:
            votes[d.policy] += 1
            params[d.policy] = dict(d.params)
            if d.model_profile:
                model_profiles[d.model_profile] += 1
    if model_profiles:
        update["model_profile"] = model_profiles.most_common(1)[0][0]
    policy = votes.most_common(1)[0][0] if votes else None
    return RecordedTraffic(
        records=records, request_ids=ids, cluster=base.model_copy(update=update), observed=served,
        recorded_policy=policy, recorded_params=params.get(policy, {}) if policy else {},
        roles={n: hb.role for n, hb in sorted(latest.items())}, first_ms=first, last_ms=last,
        skipped=dict(skipped), time_scale=time_scale,
    )


# --- calibration -------------------------------------------------------------------


@dataclass
class Calibration:
    """How the cost model was fitted to what the cluster observed."""

    method: str
    """``scale`` (prefill compute times ``compute_scale``), ``fit`` (profile fit_profile'd to the
    observed (prompt, cached, TTFT)) or ``off``."""
    policy: str
    """The policy simulated to compare with the observations (the recorded one)."""
    requests: int
    """Requests with an observed TTFT that the simulation served too."""
    observed_ttft_p50_s: float | None
    simulated_ttft_p50_s: float | None
    """The recorded policy's simulated TTFT p50 with the uncalibrated profile."""
    calibrated_ttft_p50_s: float | None
    error_p50: float | None
    """Median of |simulated - observed| / observed per request, after calibration."""
    compute_scale: float = 1.0
    iterations: int = 0
    fit_rmse_s: float | None = None
    note: str = ""
    observed_ttft_p90_s: float | None = None
    calibrated_ttft_p90_s: float | None = None
    """The recorded policy's simulated TTFT p90 with the profile the runs use (as ``calibrated_ttft_p50_s``)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.requests == 0:
            return f"none ({self.note or 'off'})"
        if self.method == "off":
            return (f"none, the profile as given: `{self.policy}` simulated TTFT p50 {_s(self.calibrated_ttft_p50_s)}, "
                    f"p90 {_s(self.calibrated_ttft_p90_s)} against {_s(self.observed_ttft_p50_s)}, "
                    f"{_s(self.observed_ttft_p90_s)} observed over {self.requests} requests; per-request error p50 "
                    f"{_pct(self.error_p50)}")
        what = (f"prefill compute x{self.compute_scale:.3g} after {self.iterations} runs" if self.method == "scale"
                else f"prefill coefficients fitted to {self.requests} observed (prompt, cached, TTFT), "
                     f"RMSE {self.fit_rmse_s:.3g} s")
        return (f"{what}: `{self.policy}` simulated TTFT p50 {_s(self.simulated_ttft_p50_s)} → "
                f"{_s(self.calibrated_ttft_p50_s)} against {_s(self.observed_ttft_p50_s)} observed over "
                f"{self.requests} requests; per-request error p50 {_pct(self.error_p50)}"
                + (f" ({self.note})" if self.note else ""))


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g} s"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def scale_compute(profile: ModelProfile, k: float) -> ModelProfile:
    """``profile`` with every prefill taking ``k`` times as long."""
    return profile.model_copy(update={"effective_flops": profile.effective_flops / k,
                                      "prefill_overhead_s": profile.prefill_overhead_s * k,
                                      "name": f"{profile.name}-x{k:.3g}"})


def _pairs(traffic: RecordedTraffic, result: SimResult) -> list[tuple[float, float]]:
    """(simulated, observed) TTFT of every request both served."""
    out = []
    for o in result.outcomes:
        obs = traffic.observed_ttft_s(traffic.request_ids[o.index])
        if obs is not None and o.rejected is None and math.isfinite(o.ttft_s):
            out.append((o.ttft_s, obs))
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def calibrate(
    traffic: RecordedTraffic,
    profile: ModelProfile,
    simulate: Callable[[ModelProfile], SimResult],
    *,
    policy: str,
    method: str = "scale",
    tolerance: float = 0.05,
    max_runs: int = 6,
) -> tuple[ModelProfile, Calibration]:
    """The profile that makes ``simulate`` (the recorded policy on the recorded traffic) match
    the observed TTFTs, and how well it does.

    ``scale`` multiplies prefill compute by ``k`` and moves ``k`` by observed/simulated TTFT
    p50 until they agree within ``tolerance`` (queueing makes the relation non-linear, so it
    iterates); ``fit`` refits the prefill coefficients to the observed TTFTs as if they
    were compute only (queueing and transfers fold into the coefficients); ``off`` keeps the
    profile (one given with ``--profile``, measured already) and says how well it matches.
    """
    if method not in ("scale", "fit", "off"):
        raise ConfigError(f"--calibrate: expected scale, fit or off, not {method!r}")
    observed = [v for rid in traffic.request_ids if (v := traffic.observed_ttft_s(rid)) is not None]
    if not observed:
        note = "off" if method == "off" else "no served request-outcomes in the range: the profile as it is"
        return profile, Calibration("off", policy, 0, _median(observed), None, None, None, note=note)
    first = simulate(profile)
    pairs = _pairs(traffic, first)
    if not pairs:
        return profile, Calibration(method, policy, 0, _median(observed), None, None, None,
                                    note="the simulation served none of the observed requests")
    sim0 = _median([s for s, _ in pairs])
    obs = _median([o for _, o in pairs])
    assert sim0 is not None and obs is not None
    cal = Calibration(method, policy, len(pairs), obs, sim0, sim0, None, iterations=1,
                      observed_ttft_p90_s=percentile([o for _, o in pairs], 90))
    if method == "off":
        result = first
    elif method == "fit":
        rows = []
        for rid in traffic.request_ids:
            o, v = traffic.observed.get(rid), traffic.observed_ttft_s(rid)
            if o is not None and v is not None and o.prompt_tokens > o.cached_tokens:
                rows.append((o.prompt_tokens, o.cached_tokens, v))
        try:
            fit = fit_profile(rows, base=profile)
        except ConfigError as e:
            cal.note = f"fit failed ({e}); the profile as it is"
            cal.error_p50 = _median([abs(s - o) / o for s, o in pairs])
            return profile, cal
        profile, cal.fit_rmse_s = fit.profile, fit.rmse_s
        result = simulate(profile)
        cal.iterations = 2
    else:
        k, result, sim = 1.0, first, sim0
        while abs(sim / obs - 1.0) > tolerance and cal.iterations < max_runs and sim > 0:
            k = min(1e3, max(1e-3, k * obs / sim))
            result = simulate(scale_compute(profile, k))
            cal.iterations += 1
            p = _pairs(traffic, result)
            sim = _median([s for s, _ in p]) or 0.0
        if k != 1.0:
            profile = scale_compute(profile, k)
        cal.compute_scale = k
    pairs = _pairs(traffic, result)
    cal.requests = len(pairs)
    cal.calibrated_ttft_p50_s = _median([s for s, _ in pairs])
    cal.calibrated_ttft_p90_s = percentile([s for s, _ in pairs], 90)
    cal.error_p50 = _median([abs(s - o) / o for s, o in pairs])
    return profile, cal
