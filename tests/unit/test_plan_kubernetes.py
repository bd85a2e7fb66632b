"""The planner's autoscalers read what the planner exports: deploy/kubernetes/base/planner.yaml against
:class:`conductor.harness.plan.serve.PlannerMetrics` and the Prometheus adapter's external rules."""

from __future__ import annotations

import re

import pytest
import yaml

pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed: pip install -e '.[test]'")

from tests.unit.test_kubernetes_manifests import KUBE, render


def test_engine_autoscalers_read_the_planners_gauge_per_role():
    from conductor.harness.plan.serve import PlannerMetrics
    from conductor.telemetry import scrape, setup_metrics

    setup_metrics("conductor-test")
    PlannerMetrics().desired.set(3, {"role": "prefill"})
    exported = set(re.findall(r"^(conductor_\w+?)(?:\{| )", scrape(), re.MULTILINE))
    rules = yaml.safe_load((KUBE / "prometheus-adapter" / "rules.yaml").read_text())["rules"]["external"]
    made = {}
    for rule in rules:
        series = re.match(r"(conductor_\w+)\{", rule["seriesQuery"]).group(1)  # type: ignore[union-attr]
        assert series in exported, f"the adapter reads {series}, which no Conductor process exports"
        made[rule["name"]["as"]] = series
    base = render(KUBE / "base")
    scaled = {}
    for r in base:
        if r["kind"] != "HorizontalPodAutoscaler":
            continue
        for m in r["spec"]["metrics"]:
            if m["type"] == "External":
                assert m["external"]["metric"]["name"] in made
                assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = value
                scaled[m["external"]["metric"]["selector"]["matchLabels"]["role"]] = r["spec"]["scaleTargetRef"]["name"]
    assert scaled == {"prefill": "vllm-prefill", "decode": "vllm-decode"}
    planner = next(r for r in base if r["metadata"]["name"] == "conductor-planner")
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["template"]["spec"]["containers"][0]["args"][0] == "planner"
