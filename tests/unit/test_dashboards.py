"""The Grafana dashboard and the Prometheus alert rules name only metrics Conductor exports,
and compose.yaml provisions both."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from ruamel.yaml import YAML

from conductor.balance.planner import BalanceParams
from conductor.balance.worker import Balancer
from conductor.bridge.scrape import EngineLoad
from conductor.bridge.serve import bridge_instruments
from conductor.bridge.translate import NodeTranslator
from conductor.harness.plan.serve import PlannerMetrics
from conductor.routing.fit_worker import FitMetrics
from conductor.routing.router import RouterMetrics
from conductor.routing.worker import RouterWorker
from conductor.settings import load_settings
from conductor.telemetry import scrape, setup_metrics
from streams.ingest import IngestMetrics
from streams.resume import _counters

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\b(conductor_[a-z_]+)")
SUFFIXES = ("_bucket", "_sum", "_count")


def named_in_dashboard() -> set[str]:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/conductor.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    return {m for e in exprs for m in METRIC.findall(e)}


def named_in_alerts() -> set[str]:
    doc = YAML(typ="safe", pure=True).load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {"alert", "expr"} <= set(rules[0]) and len(rules) >= 6
    return {m for r in rules for m in METRIC.findall(r["expr"])}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every Conductor instrument, given one value, as the Prometheus endpoint names it."""
    setup_metrics("conductor-test")
    r = RouterMetrics()
    r.latency.record(1.0)
    r.reuse.record(0.5)
    r.decisions.add(1, {"prefill": "p", "decode": "d"})
    r.rejections.add(1, {"reason": "ttft_slo"})
    r.predicted_reuse.add(1, {"node": "p"})
    r.routed_prompt.add(1, {"node": "p"})
    bridge = SimpleNamespace(config=SimpleNamespace(node_id="p"), counts=Counter(x=1),
                             translator=NodeTranslator(), scraper=None,
                             last_load=EngineLoad(prefix_hit_tokens=3.0, prefix_query_tokens=5.0))
    bridge_instruments([bridge])  # type: ignore[list-item]
    w = RouterWorker(load_settings(kafka_url="k:9092", redis_url="redis://r:6379/0"), router=None)  # type: ignore[arg-type]
    w.lag[0] = 3
    i = IngestMetrics(lambda: 2)
    for c in (i.applied, i.block_events, i.skipped, i.dead, i.gaps, i.conflicts):
        c.add(1)
    i.staleness.record(5.0)
    for c in _counters():
        c.add(1)
    b = Balancer(load_settings(kafka_url="k:9092"), BalanceParams())
    b._commands.add(1, {"action": "replicate"})
    b._bad.add(1)
    f = FitMetrics()
    f.ttft_error.record(0.1)
    f.tbt_error.record(0.1)
    f.fitted_error.set(0.1, {"quantile": "p90"})
    f.fitted_tbt_error.set(0.1, {"quantile": "p90"})
    f.published.add(1)
    plan = PlannerMetrics()
    for role in ("prefill", "decode"):
        plan.desired.set(1, {"role": role})
        plan.current.set(1, {"role": role})
    plan.attainment.set(0.99, {"cluster": "plan"})
    names = set(re.findall(r"^(conductor_\w+?)(?:\{| )", scrape(), re.MULTILINE))
    return names | {n[: -len(s)] for n in names for s in SUFFIXES if n.endswith(s)}


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_named_is_exported(source, exported):
    named = named_in_dashboard() if source == "dashboard" else named_in_alerts()
    missing = {m for m in named if m not in exported and m.removesuffix("_bucket") not in exported}
    assert not missing, f"{source} names metrics nobody exports: {sorted(missing)} (exported: {sorted(exported)})"


def test_compose_provisions_prometheus_and_grafana():
    doc = YAML(typ="safe", pure=True).load((ROOT / "compose.yaml").read_text())
    svc = doc["services"]
    mounts = " ".join(svc["prometheus"]["volumes"] + svc["grafana"]["volumes"])
    for path in ("deploy/prometheus/prometheus.yml", "deploy/prometheus/alerts.yml", "deploy/grafana/provisioning",
                 "deploy/grafana/dashboards"):
        assert f"./{path}:" in mounts and (ROOT / path).exists()
    prom = YAML(typ="safe", pure=True).load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    scraped = {n for job in prom["scrape_configs"] for sd in job["dns_sd_configs"] for n in sd["names"]}
    assert scraped <= set(svc) and {"worker", "router"} <= scraped
