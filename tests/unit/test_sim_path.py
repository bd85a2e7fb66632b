"""Recorded time outside the engines (gateway, log, hand-off): split from the gateway's outcome, carried
into the replay and counted toward the TTFT SLO; with a time scale, the engines' part is model time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.harness.sim.recorded import path_seconds, recorded_traffic
from conductor.harness.sim.session import Bench
from schemas import RequestOutcome, envelope
from tests.unit.test_sim_recorded import BS, T0, _base, _traffic_envelopes


def _outcome(**kw) -> RequestOutcome:
    return RequestOutcome(**{"request_id": "r", "gateway": "gw", "status": 200, **kw})


@pytest.mark.parametrize(
    "fields,path",
    [
        ({"ttft_s": 5.0, "prefill_s": 3.0, "decode_ttft_s": 0.5, "decided_s": 1.0}, 1.5),  # P/D: all but the calls
        ({"ttft_s": 5.0, "decided_s": 0.8, "routing_ms": 500.0}, 0.8),  # aggregated: its routing
        ({"ttft_s": 5.0, "routing_ms": 500.0}, 0.5),  # an older gateway: routing_ms only
        ({"ttft_s": 1.0, "prefill_s": 0.9, "decode_ttft_s": 0.3}, 0.0),  # clocks that overlap: never negative
        ({"ttft_s": None}, None),
    ],
)
def test_path_is_the_ttft_outside_the_engines(fields, path):
    got = path_seconds(_outcome(**fields))
    assert got == (None if path is None else pytest.approx(path))


def _with_paths(time_scale: float = 1.0):
    reqs, hbs, _ = _traffic_envelopes(n=30)
    outs = [
        envelope(
            _outcome(
                request_id=f"r{i}",
                ttft_s=2.0 + i / 10,
                prefill_s=1.0,
                decode_ttft_s=0.5,
                decided_s=0.1,
                routing_ms=100.0,
                output_tokens=8,
            ),
            producer_id="gw",
            producer_seq=i,
            ts_ms=T0 + 250 * i + 900,
        )
        for i in range(0, 30, 2)
    ]
    return recorded_traffic(reqs, hbs, outs, base=_base(), block_size=BS, path=True, time_scale=time_scale)


def test_each_request_carries_its_path_and_an_unserved_one_the_median():
    t = _with_paths()
    by_id = dict(zip(t.request_ids, t.records, strict=True))
    assert by_id["r4"].path_s == pytest.approx(2.4 - 1.5)
    served = sorted(2.0 + i / 10 - 1.5 for i in range(0, 30, 2))
    assert by_id["r5"].path_s == pytest.approx(served[len(served) // 2])  # r5 has no outcome
    assert recorded_traffic(*_traffic_envelopes(n=30)[:2], base=_base(), block_size=BS).records[0].path_s == 0.0


def test_observed_engine_ttft_is_model_time_under_a_time_scale():
    one, ten = _with_paths(), _with_paths(time_scale=10.0)
    assert one.observed_ttft_s("r4") == pytest.approx(2.4 - 0.1)  # unchanged: the TTFT less its routing
    assert ten.observed_ttft_s("r4") == pytest.approx((1.0 + 0.5) * 10.0)  # the engines' calls, scaled


def test_the_path_counts_toward_the_ttft_slo():
    t = _with_paths()
    bench = Bench(t.records, t.cluster, bucket_ms=1.0)
    engines_only = Bench([replace(r, path_s=0.0) for r in t.records], t.cluster, bucket_ms=1.0)
    base, _ = engines_only.run("least-loaded", 1.0)
    assert base["ttft_slo_attainment"] == 1.0
    # a tight SLO: the paths (0.5 to 1.9 s) push some over it, the engines' TTFT alone met it
    tight = t.cluster.model_copy(update={"ttft_slo_s": base["ttft_p90_s"] + 1.0})
    bench.cluster = engines_only.cluster = tight
    with_path, res = bench.run("least-loaded", 1.0)
    without, _ = engines_only.run("least-loaded", 1.0)
    late = sum(o.ttft_s <= tight.ttft_slo_s < o.ttft_s + o.path_s for o in res.outcomes)
    assert late > 0 and with_path["ttft_slo_attainment"] == pytest.approx(without["ttft_slo_attainment"] - late / 30)
