"""deploy/kubernetes against the Kubernetes API and against this code.

Each kustomization (base and its overlays) is rendered by a small renderer of the kustomize
subset the manifests use (resources, patches by strategic merge on kind and name, images,
namespace; any other key fails the render), cross-checked with ``kubectl kustomize`` where
kubectl is installed. Then every rendered resource is validated against the schemas of
Kubernetes :data:`KUBERNETES_VERSION` (kubernetes-validate, strict: an unknown field fails) but
the Strimzi custom resources (:data:`CUSTOM_KINDS`: no schema ships; their links are checked
here instead), and the Conductor containers are held to the code: each ``conductor`` command
and option parses with the CLI itself, each port and probe path is one the process serves,
each ``CONDUCTOR_*`` variable is a field of :class:`conductor.settings.Settings` and the
variables of each container load as settings.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer
import yaml

kv = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: pip install -e '.[test]' brings it"
)

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
README = KUBE / "README.md"
KUBERNETES_VERSION = "1.33"
"""The API the manifests target (native sidecars, autoscaling/v2, policy/v1 are all older)."""
RENDERS = ("base", "overlays/dev", "overlays/production")
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CUSTOM_KINDS = {("kafka.strimzi.io/v1beta2", "Kafka"), ("kafka.strimzi.io/v1beta2", "KafkaNodePool")}
"""Custom resources: no schema in kubernetes-validate; test_strimzi_resources checks their links."""
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet"}
PINNED_IMAGES = {"vllm/vllm-openai", "valkey/valkey"}
"""Images the repository does not build: each must carry an exact version tag."""
CONDUCTOR_IMAGE = "conductor"
"""The Dockerfile's image (its ENTRYPOINT is ``conductor``, so ``args`` start with the command)."""
ENV_NAME = re.compile(r"\bCONDUCTOR_[A-Z0-9_]+\b")

# What each command serves over HTTP besides the metrics server that every one of them starts
# on CONDUCTOR_METRICS_PORT (conductor.telemetry.setup_metrics): see served_ports().
SERVERS = {"worker": "faust", "gateway": "gateway", "admin": "admin", "router": None, "balance": None, "bridge": None,
           "epp": "grpc", "planner": None}
VLLM_PATHS = {"/health", "/metrics", "/v1/models"}
"""What the vLLM OpenAI server answers (tests/vllm run it) on its --port."""


# --- the renderer ---------------------------------------------------------------------------


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge_key(items: list[Any]) -> str | None:
    """The strategic-merge key of a list (containers, env, volumes by name; mounts by path)."""
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in ("name", "mountPath", "containerPort"):
        if all(key in i for i in items):
            return key
    return None


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge for what the patches here use: maps merge, lists of named
    maps merge by name, other lists and scalars are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(base + patch)
        if key is None:
            return copy.deepcopy(patch)
        out = list(base)
        for item in patch:
            at = [i for i, b in enumerate(out) if b[key] == item[key]]
            if at:
                out[at[0]] = strategic_merge(out[at[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def pod_specs(resource: dict[str, Any]) -> list[dict[str, Any]]:
    return [resource["spec"]["template"]["spec"]] if resource["kind"] in WORKLOADS else []


def _split_image(image: str) -> tuple[str, str | None]:
    name, sep, tag = image.rpartition(":")
    return (name, tag) if sep and "/" not in tag else (image, None)


def render(directory: Path) -> list[dict[str, Any]]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: kustomization keys this renderer does not implement: {sorted(unknown)}"
    out: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = directory / entry
        out += render(path) if path.is_dir() else _docs(path)
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only patches by path (strategic merge on kind and name)"
        for doc in _docs(directory / patch["path"]):
            at = [i for i, r in enumerate(out)
                  if (r["kind"], r["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])]
            assert len(at) == 1, f"{directory / patch['path']}: no {doc['kind']} {doc['metadata']['name']} to patch"
            out[at[0]] = strategic_merge(out[at[0]], doc)
    for image in k.get("images", []):
        for spec in (s for r in out for s in pod_specs(r)):
            for c in spec.get("initContainers", []) + spec["containers"]:
                name, tag = _split_image(c["image"])
                if name == image["name"]:
                    new_tag = image.get("newTag", tag)
                    c["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")
    if "namespace" in k:
        for r in out:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = k["namespace"]
    return out


@pytest.fixture(scope="module", params=RENDERS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUBE / request.param)


def _by_name(resources: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {(r["kind"], r["metadata"]["name"]): r for r in resources}
    assert len(out) == len(resources), "two resources of one kind share a name"
    return out


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer is not compared")
@pytest.mark.parametrize("overlay", RENDERS)
def test_renderer_agrees_with_kubectl_kustomize(overlay):
    done = subprocess.run(["kubectl", "kustomize", str(KUBE / overlay)], capture_output=True, text=True, check=False,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert _by_name(render(KUBE / overlay)) == _by_name(theirs)


# --- the Kubernetes API -----------------------------------------------------------------------


def test_every_resource_validates(rendered):
    name, resources = rendered
    custom = []
    for r in resources:
        what = f"{name}: {r['kind']} {r['metadata']['name']}"
        try:
            version = kv.validate(r, KUBERNETES_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            assert (r["apiVersion"], r["kind"]) in CUSTOM_KINDS, f"{what}: no schema and not a known custom resource"
            custom.append(r["kind"])
            continue
        except kv.ValidationError as e:
            pytest.fail(f"{what}: {'.'.join(map(str, e.path))}: {e.message}")
        assert version == KUBERNETES_VERSION
    assert len(resources) - len(custom) >= 15


def test_strimzi_resources():
    """The custom resources no schema checks: the node pool joins the Kafka, and conductor-config
    names that Kafka's bootstrap Service and a plain listener's port."""
    res = _by_name(render(KUBE / "overlays/dev"))
    kafka = [r for (kind, _), r in res.items() if kind == "Kafka"]
    pools = [r for (kind, _), r in res.items() if kind == "KafkaNodePool"]
    assert len(kafka) == 1 and pools
    cluster = kafka[0]["metadata"]["name"]
    assert all(p["metadata"]["labels"]["strimzi.io/cluster"] == cluster for p in pools)
    assert {"controller", "broker"} <= {role for p in pools for role in p["spec"]["roles"]}
    plain = {ln["port"] for ln in kafka[0]["spec"]["kafka"]["listeners"] if not ln["tls"]}
    config = res[("ConfigMap", "conductor-config")]["data"]
    assert config["CONDUCTOR_KAFKA_URL"] in {f"{cluster}-kafka-bootstrap:{p}" for p in plain}
    brokers = sum(p["spec"]["replicas"] for p in pools if "broker" in p["spec"]["roles"])
    assert int(config["CONDUCTOR_REPLICATION_FACTOR"]) <= brokers


def _selects(selector: dict[str, str], resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in resources if r["kind"] in WORKLOADS
            and selector.items() <= r["spec"]["template"]["metadata"]["labels"].items()]


def test_references_resolve(rendered):
    """Selectors select pods; autoscalers scale what exists; every ConfigMap and Secret used is
    rendered or (a Secret) one README.md tells the operator to make."""
    name, resources = rendered
    res = _by_name(resources)
    for r in resources:
        if r["kind"] in WORKLOADS:
            assert r["spec"]["selector"]["matchLabels"].items() <= r["spec"]["template"]["metadata"]["labels"].items()
        if r["kind"] == "Service":
            assert _selects(r["spec"]["selector"], resources), f"{name}: Service {r['metadata']['name']} selects nothing"
        if r["kind"] == "PodDisruptionBudget":
            assert _selects(r["spec"]["selector"]["matchLabels"], resources)
        if r["kind"] == "HorizontalPodAutoscaler":
            ref = r["spec"]["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) in res
    documented = set(re.findall(r"kubectl create secret generic ([a-z0-9-]+)", README.read_text()))
    for spec in (s for r in resources for s in pod_specs(r)):
        containers = pod_containers(spec)
        refs = [("ConfigMap", e["configMapRef"]["name"]) for c in containers for e in c.get("envFrom", [])
                if "configMapRef" in e]
        refs += [("Secret", e["secretRef"]["name"]) for c in containers for e in c.get("envFrom", [])
                 if "secretRef" in e]
        refs += [("Secret", v["valueFrom"]["secretKeyRef"]["name"]) for c in containers
                 for v in c.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})]
        refs += [("Secret", v["secret"]["secretName"]) for v in spec.get("volumes", []) if "secret" in v]
        for kind, ref in refs:
            assert (kind, ref) in res or (kind == "Secret" and ref in documented), (
                f"{name}: {kind} {ref} is neither rendered nor made by a command in {README.relative_to(ROOT)}")


# --- images and commands ----------------------------------------------------------------------


def pod_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers that run for the pod's life: its containers and its native sidecars."""
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert len(sidecars) == len(spec.get("initContainers", [])), "an init container that is not a sidecar"
    return sidecars + spec["containers"]


def _containers(resources: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(resource, pod spec, container) for every container of every workload."""
    return [(r, s, c) for r in resources for s in pod_specs(r) for c in pod_containers(s)]


def _is_conductor(container: dict[str, Any]) -> bool:
    return _split_image(container["image"])[0].rsplit("/", 1)[-1] == CONDUCTOR_IMAGE


def test_images_are_built_here_or_pinned(rendered):
    name, resources = rendered
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert 'ENTRYPOINT ["conductor"]' in (ROOT / "Dockerfile").read_text()
    seen = set()
    for r, _, c in _containers(resources):
        image, tag = _split_image(c["image"])
        where = f"{name}: {r['metadata']['name']}/{c['name']}"
        if _is_conductor(c):
            assert tag == version, f"{where}: the Conductor image should carry the project's version {version}"
            assert "command" not in c, f"{where}: the image's entrypoint is `conductor`; give the command in args"
        else:
            assert image in PINNED_IMAGES, f"{where}: {image} is neither built by the Dockerfile nor a known image"
            assert tag and re.fullmatch(r"v?\d+(\.\d+){1,2}", tag), f"{where}: {c['image']} is not pinned to a version"
        seen.add(_is_conductor(c))
    assert seen == {True, False}


def _command_of(args: list[str]) -> tuple[Any, list[str], list[str]]:
    """The CLI command ``args`` name (typer's own click: a group is what has ``commands``), the
    names that led to it, and the arguments left for it."""
    from conductor.cli import app

    cmd: Any = typer.main.get_command(app)
    path: list[str] = []
    rest = list(args)
    while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
        path.append(rest[0])
        cmd = cmd.commands[rest.pop(0)]
    return cmd, path, rest


def test_every_conductor_command_and_option_exists(rendered):
    """Each container's args parse with the CLI itself: a missing command, an unknown option,
    a value of the wrong type or a missing required option fails here."""
    name, resources = rendered
    commands = set()
    for r, _, c in _containers(resources):
        if not _is_conductor(c):
            continue
        cmd, path, rest = _command_of(c["args"])
        where = f"{name}: {r['metadata']['name']}/{c['name']} args {c['args']}"
        assert len(path) == 1 and not hasattr(cmd, "commands"), f"{where}: not a `conductor` command"
        try:
            cmd.make_context(path[0], rest)
        except typer.TyperException as e:  # the root of typer's click errors: usage, bad value, missing option
            pytest.fail(f"{where}: {getattr(e, 'format_message', e.__str__)()}")
        commands.add(path[0])
    assert commands == set(SERVERS), f"{name}: expected one container of each of {sorted(SERVERS)}"


# --- environment ------------------------------------------------------------------------------


def _settings_field(variable: str) -> bool:
    from conductor.settings import Settings

    field = variable.removeprefix("CONDUCTOR_").lower().split("__", 1)[0]
    return variable.startswith("CONDUCTOR_") and field in Settings.model_fields


def _secret_data(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return data | secret.get("stringData", {})


def operator_secret_keys(secret: str) -> set[str]:
    """The keys README.md's `kubectl create secret generic <secret>` command gives that Secret."""
    text = README.read_text()
    start = text.index(f"kubectl create secret generic {secret}")
    command = text[start:text.index("\n\n", start)]
    return set(re.findall(r"--from-(?:literal|file)=([A-Za-z0-9_.-]+)=", command))


def container_environment(resources: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What the container's process sees of CONDUCTOR_*: envFrom (ConfigMaps, Secrets: rendered
    ones with their values, README's operator-made ones with stand-ins), then env."""
    res = _by_name(resources)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env |= res[("ConfigMap", source["configMapRef"]["name"])]["data"]
        else:
            secret = source["secretRef"]["name"]
            if ("Secret", secret) in res:
                env |= _secret_data(res[("Secret", secret)])
            else:
                env |= {k: f"stand-in-for-{k.lower()}" for k in operator_secret_keys(secret)}
    for v in container.get("env", []):
        if "value" in v:
            env[v["name"]] = v["value"]
        elif "secretKeyRef" in v.get("valueFrom", {}):
            ref = v["valueFrom"]["secretKeyRef"]
            if ("Secret", ref["name"]) in res:
                env[v["name"]] = _secret_data(res[("Secret", ref["name"])])[ref["key"]]
            else:
                assert ref["key"] in operator_secret_keys(ref["name"]), f"README.md's {ref['name']} lacks {ref['key']}"
                env[v["name"]] = f"stand-in-for-{ref['key']}"
    return {k: v for k, v in env.items() if k.startswith("CONDUCTOR_")}


def test_every_conductor_variable_is_a_setting(rendered):
    name, resources = rendered
    named = set()
    for r in resources:
        if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "conductor-config":
            named |= set(r["data"])
            assert all(k.startswith("CONDUCTOR_") for k in r["data"]), "conductor-config holds CONDUCTOR_* only"
        if r["kind"] == "Secret":
            named |= {k for k in _secret_data(r) if k.startswith("CONDUCTOR_")}
    for _, _, c in _containers(resources):
        named |= {v["name"] for v in c.get("env", []) if v["name"].startswith("CONDUCTOR_")}
    named |= operator_secret_keys("conductor-credentials")
    wrong = sorted(v for v in named if not _settings_field(v))
    assert not wrong, f"{name}: not fields of conductor.settings.Settings: {wrong}"
    assert {"CONDUCTOR_KAFKA_URL", "CONDUCTOR_REDIS_URL", "CONDUCTOR_ADMIN_TOKEN"} <= named


def test_every_conductor_variable_written_anywhere_is_a_setting():
    """Comments, README commands and docs too: a name a reader would copy must exist."""
    files = [p for p in KUBE.rglob("*") if p.is_file()] + [ROOT / "docs" / "capacity.md"]
    wrong = sorted({f"{p.relative_to(ROOT)}: {v}" for p in files for v in ENV_NAME.findall(p.read_text())
                    if not _settings_field(v)})
    assert not wrong, f"not fields of conductor.settings.Settings: {wrong}"


def test_each_conductor_container_loads_its_settings(rendered, monkeypatch, tmp_path):
    """The container's CONDUCTOR_* variables load as Settings (types, ranges, URL schemes, token
    lengths, SASL completeness); files they name lie on a mounted volume."""
    from conductor.settings import Settings, load_settings

    name, resources = rendered
    path_fields = {f for f, info in Settings.model_fields.items() if "Path" in str(info.annotation)}
    stand_in = tmp_path / "stand-in.pem"
    stand_in.write_text("")
    for r, _, c in _containers(resources):
        if not _is_conductor(c):
            continue
        env = container_environment(resources, c)
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        for var in list(env):
            if var.removeprefix("CONDUCTOR_").lower() in path_fields:
                assert any(env[var].startswith(m + "/") or env[var] == m for m in mounts), (
                    f"{name}: {r['metadata']['name']}/{c['name']}: {var}={env[var]} is on no mounted volume")
                if var != "CONDUCTOR_DATA_DIR":
                    env[var] = str(stand_in)
        for var in [v for v in os.environ if v.startswith("CONDUCTOR_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        monkeypatch.setenv("CONDUCTOR_DATA_DIR", str(tmp_path))  # no stack.json to find there
        s = load_settings()
        assert s.kafka_url and s.redis_url and s.profile == "production", f"{name}: {r['metadata']['name']}"
        if c["args"][0] == "gateway" and importlib.util.find_spec("conductor.gateway.auth") is not None:
            from conductor.gateway.auth import key_ring  # the gateway refuses to start without a key

            key_ring(s, insecure="--insecure" in c["args"])


# --- ports and probes -------------------------------------------------------------------------


def _paths(server: str) -> set[str] | None:
    """The HTTP paths one server of ours answers (None: every path, as prometheus_client does)."""
    if server == "metrics":
        return None
    if server == "faust":
        from faust.web.apps import production_index

        return {route.uri for route in production_index.blueprint.routes}
    if server == "gateway":
        from conductor.gateway.app import gateway_app

        # The routes are registered when the app is built; what it serves with (the service, its
        # API keys) is only used per request.
        required = [p for p in inspect.signature(gateway_app).parameters.values() if p.default is p.empty]
        return {route.path for route in gateway_app(SimpleNamespace(), *[None] * (len(required) - 1)).routes}
    from conductor.admin.api import create_app
    from conductor.settings import Settings

    settings = Settings(kafka_url="k:9092", redis_url="redis://r:6379/0", admin_token="a-token-of-24-characters")
    app = create_app(settings, feed=SimpleNamespace(), view=object())
    return {route.path for route in app.routes}


def served_ports(command: Any, args: list[str], env: dict[str, str]) -> dict[int, set[str] | None]:
    """Port → paths a `conductor` container serves, from its options and settings as the code reads them."""
    from conductor.settings import Settings

    ctx = command.make_context(command.name or "", list(args))
    s = {k.removeprefix("CONDUCTOR_").lower(): v for k, v in env.items()}
    ports: dict[int, set[str] | None] = {}
    metrics = int(s.get("metrics_port", Settings.model_fields["metrics_port"].default))
    if metrics:
        ports[metrics] = _paths("metrics")
    server = SERVERS[command.name or ""]
    if server == "faust":
        web = ctx.params["web_port"] or s.get("web_port")
        assert web, "a worker's web port must be fixed (CONDUCTOR_WEB_PORT): unset, it takes the next free one"
        ports[int(web)] = _paths("faust")
    elif server == "gateway":
        ports[int(ctx.params["port"])] = _paths("gateway")
    elif server == "admin":
        port = ctx.params["port"] or s.get("admin_port") or Settings.model_fields["admin_port"].default
        ports[int(port)] = _paths("admin")
    elif server == "grpc":  # ext_proc, and gRPC health beside it (as grpc:<service>)
        from conductor.epp.serve import HEALTH_SERVICES

        services = {"liveness", *HEALTH_SERVICES} if ctx.params["health"] else set()
        ports[int(ctx.params["port"])] = {f"grpc:{name}" for name in services}
    return ports


def _vllm_ports(container: dict[str, Any]) -> dict[int, set[str] | None]:
    args = container["args"]
    env = {v["name"]: v.get("value") for v in container.get("env", [])}
    return {int(args[args.index("--port") + 1]): VLLM_PATHS, int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]): set()}


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"{container['name']}: no port named {port}"
    return int(named[0])


def test_every_port_and_probe_is_served(rendered):
    name, resources = rendered
    checked = 0
    for r, spec, c in _containers(resources):
        if not _is_conductor(c) and _split_image(c["image"])[0] != "vllm/vllm-openai":
            continue
        if _is_conductor(c):
            cmd, _, rest = _command_of(c["args"])
            served = served_ports(cmd, rest, container_environment(resources, c))
        else:
            served = _vllm_ports(c)
        where = f"{name}: {r['metadata']['name']}/{c['name']}"
        declared = {int(p["containerPort"]) for p in c.get("ports", [])}
        assert declared == set(served), f"{where}: declares ports {sorted(declared)}, serves {sorted(served)}"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "grpc" in probe:  # a gRPC health service the process serves on that port
                port = int(probe["grpc"]["port"])
                assert f"grpc:{probe['grpc'].get('service', '')}" in (served.get(port) or ()), (
                    f"{where}: {kind} asks gRPC health {probe['grpc']} of a port that serves {served.get(port)}")
                checked += 1
                continue
            assert "httpGet" in probe, f"{where}: {kind} should ask an HTTP path the process serves"
            port = _port_number(c, probe["httpGet"]["port"])
            paths = served.get(port)
            assert port in served and (paths is None or probe["httpGet"]["path"] in paths), (
                f"{where}: {kind} GET :{port}{probe['httpGet']['path']}, but it serves {served}")
            checked += 1
        assert "livenessProbe" in c, f"{where}: no liveness probe"
        annotations = r["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true" and _is_conductor(c):
            assert int(annotations["prometheus.io/port"]) in served
    if name != "base":
        assert checked >= 10
    for r in resources:
        if r["kind"] != "Service":
            continue
        for p in r["spec"]["ports"]:
            pods = _selects(r["spec"]["selector"], resources)
            targets = {pp["name"] for w in pods for s in pod_specs(w) for cc in pod_containers(s)
                       for pp in cc.get("ports", [])}
            assert p["targetPort"] in targets, f"{name}: Service {r['metadata']['name']} targets a port no pod names"


# --- scaling ----------------------------------------------------------------------------------


def test_consumer_groups_scale_up_to_the_partitions(rendered):
    """A partition is read by one member of a consumer group: workers and routers beyond
    CONDUCTOR_PARTITIONS would sit idle."""
    name, resources = rendered
    res = _by_name(resources)
    partitions = int(res[("ConfigMap", "conductor-config")]["data"]["CONDUCTOR_PARTITIONS"])
    assert res[("Deployment", "conductor-worker")]["spec"]["replicas"] <= partitions
    router = res[("HorizontalPodAutoscaler", "conductor-router")]["spec"]
    assert router["minReplicas"] <= router["maxReplicas"] <= partitions, f"{name}: routers beyond the partitions"
    assert res[("Deployment", "conductor-router")]["spec"]["replicas"] <= router["maxReplicas"]
    assert res[("Deployment", "conductor-balance")]["spec"]["replicas"] == 1


def test_autoscalers_read_metrics_the_code_exports():
    """Each custom metric an autoscaler names is one the Prometheus adapter's rules make, from a
    series a Conductor process exports."""
    from conductor.gateway.service import GatewayMetrics
    from conductor.routing.worker import RouterWorker
    from conductor.settings import load_settings
    from conductor.telemetry import scrape, setup_metrics

    setup_metrics("conductor-test")
    GatewayMetrics().requests.add(1, {"status": "200"})
    RouterWorker(load_settings(kafka_url="k:9092", redis_url="redis://r:6379/0"), router=None).lag[0] = 1  # type: ignore[arg-type]
    exported = set(re.findall(r"^(conductor_\w+?)(?:\{| )", scrape(), re.MULTILINE))
    rules = yaml.safe_load((KUBE / "prometheus-adapter" / "rules.yaml").read_text())["rules"]["custom"]
    made = {}
    for rule in rules:
        series = re.match(r"(conductor_\w+)\{", rule["seriesQuery"]).group(1)  # type: ignore[union-attr]
        assert series in exported, f"the adapter reads {series}, which no Conductor process exports"
        made[rule["name"]["as"]] = series
    named = {m["pods"]["metric"]["name"] for r in render(KUBE / "base") if r["kind"] == "HorizontalPodAutoscaler"
             for m in r["spec"]["metrics"] if m["type"] == "Pods"}
    assert named and named <= set(made), f"autoscalers name {sorted(named - set(made))}, which no adapter rule makes"


# --- the Inference Extension ------------------------------------------------------------------

INFERENCE_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
"""Custom resources of ../inference-extension: no schema in kubernetes-validate; their links are checked here."""


def test_the_inference_pool_points_a_gateway_at_conductor_epp():
    """The InferencePool selects the vLLM pods on a port they serve, its endpoint picker is the
    conductor-epp Service on the port it forwards to `conductor epp`'s ext_proc, and the HTTPRoute
    sends to the pool."""
    extension = render(KUBE / "inference-extension")
    assert {(r["apiVersion"], r["kind"]) for r in extension} == INFERENCE_KINDS
    for r in extension:
        with pytest.raises(kv.SchemaNotFoundError):  # not core: checked below instead
            kv.validate(r, KUBERNETES_VERSION, strict=True)
    base = _by_name(render(KUBE / "base"))
    pool = next(r for r in extension if r["kind"] == "InferencePool")
    spec = pool["spec"]
    engines = _selects(spec["selector"]["matchLabels"], list(base.values()))
    assert {e["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for e in engines} == {
        "prefill", "decode"}
    for e in engines:
        vllm = next(c for s in pod_specs(e) for c in s["containers"] if c["image"].startswith("vllm/"))
        served = {int(p["containerPort"]) for p in vllm["ports"]}
        assert {p["number"] for p in spec["targetPorts"]} <= served, f"{e['metadata']['name']} serves {served}"
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    service = base[("Service", ref["name"])]
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    pickers = _selects(service["spec"]["selector"], list(base.values()))
    assert [p["metadata"]["name"] for p in pickers] == ["conductor-epp"]
    container = pickers[0]["spec"]["template"]["spec"]["containers"][0]
    cmd, _, rest = _command_of(container["args"])
    assert cmd.name == "epp"
    grpc_port = int(cmd.make_context("epp", rest).params["port"])
    assert _port_number(container, port["targetPort"]) == grpc_port
    route = next(r for r in extension if r["kind"] == "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]
