"""deploy/kubernetes and the image it runs: what kustomize renders passes the Pod Security
Standard "restricted" and strict schema validation, a configuration change re-applies,
the Prometheus Operator objects match their CRDs and the alert rules, and the
Containerfile builds the image the manifests name.

Static tier, no cluster: ``kubectl kustomize`` renders (kubectl is on the machine image),
``kubernetes-validate`` checks built-in kinds against the API's schemas (the [test]
extra), the Operator's CRDs (tests/schemas/) check its kinds, and tests/pod_security.py
holds the Pod Security Standards' rules. deploy/README.md has the commands.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pod_security import violations

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
MONITORING = KUBERNETES / "monitoring"
ALERTS = ROOT / "deploy" / "prometheus" / "wsd-alerts.yml"
CONTAINERFILE = ROOT / "Containerfile"
CHECK_TORCH = ROOT / "deploy" / "image" / "check-torch.py"
CRDS = Path(__file__).parents[1] / "schemas" / "prometheus-operator-v0.93.0"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
# The oldest Kubernetes the manifests are checked against, and the newest kubernetes-validate knows.
OLDEST_KUBERNETES = "1.30"


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIRECTORY` renders (offline: no cluster is asked)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (the machine image has it, with kustomize built in)")
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{"Kind/name": pod template} of every workload."""
    return {f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"] for o in objects if o["kind"] in WORKLOADS}


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


# -- Pod Security Standard "restricted" ------------------------------------------------------------


def test_every_pod_passes_pod_security_restricted():
    """Both pods, as rendered, in a namespace labelled pod-security.kubernetes.io/enforce:
    restricted: the admission controller would refuse the coordinator's Deployment's pods
    and the workers' Job's pods for any line listed here."""
    templates = _templates(_kustomize(KUBERNETES))
    assert set(templates) == {"Deployment/wsd-coordinator", "Job/wsd-workers"}
    for name, template in templates.items():
        assert violations(template) == [], name
        # What the issue found missing, named: every container, the worker's too.
        assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in _containers(template):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]


def _break(template: dict[str, Any], rule: str) -> dict[str, Any]:
    """The pod template with one rule of the profile broken."""
    broken = copy.deepcopy(template)
    spec = broken["spec"]
    worker = spec["containers"][0]
    if rule == "seccomp":
        del spec["securityContext"]["seccompProfile"]
    elif rule == "seccomp-unconfined":
        worker["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    elif rule == "escalation":
        del worker["securityContext"]["allowPrivilegeEscalation"]
    elif rule == "capabilities-drop":
        del spec["initContainers"][0]["securityContext"]["capabilities"]
    elif rule == "capabilities-add":
        worker["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    elif rule == "non-root":
        del spec["securityContext"]["runAsNonRoot"]
    elif rule == "root-user":
        worker["securityContext"]["runAsUser"] = 0
    elif rule == "privileged":
        worker["securityContext"]["privileged"] = True
    elif rule == "host-network":
        spec["hostNetwork"] = True
    elif rule == "host-path":
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    elif rule == "host-port":
        worker["ports"][0]["hostPort"] = 29500
    elif rule == "volume-type":
        spec["volumes"].append({"name": "nfs", "nfs": {"server": "nfs", "path": "/"}})
    else:
        raise ValueError(rule)
    return broken


@pytest.mark.parametrize(("rule", "control"), [
    ("seccomp", "Seccomp"), ("seccomp-unconfined", "Seccomp"), ("escalation", "Privilege Escalation"),
    ("capabilities-drop", "Capabilities"), ("capabilities-add", "Capabilities"), ("non-root", "Running as Non-root"),
    ("root-user", "Running as Non-root user"), ("privileged", "Privileged Containers"),
    ("host-network", "Host Namespaces"), ("host-path", "HostPath Volumes"), ("host-port", "Host Ports"),
    ("volume-type", "Volume Types")])
def test_pod_security_check_finds_each_broken_rule(rule, control):
    """The check above passes only if it can fail: the workers' pod with one rule broken
    is refused, naming the control."""
    (template,) = [t for name, t in _templates(_kustomize(KUBERNETES)).items() if name.startswith("Job/")]
    found = violations(_break(template, rule))
    assert any(line.startswith(f"{control}:") for line in found), found


# -- kustomize and a configuration change -------------------------------------------------------------


def test_kustomize_renders_the_configuration_under_names_the_pods_mount():
    """The ConfigMaps hold wsd.toml and install-keys.sh as they are, under fixed names
    that both pod templates mount."""
    objects = _kustomize(KUBERNETES)
    config_maps = _by_kind(objects, "ConfigMap")
    assert set(config_maps) == {"wsd-config", "wsd-install-keys"}
    assert config_maps["wsd-config"]["data"] == {"wsd.toml": (KUBERNETES / "wsd.toml").read_text()}
    assert config_maps["wsd-install-keys"]["data"] == {"install-keys.sh": (KUBERNETES / "install-keys.sh").read_text()}
    for name, template in _templates(objects).items():
        mounted = {v["configMap"]["name"] for v in template["spec"]["volumes"] if "configMap" in v}
        assert mounted == set(config_maps), name
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "wsd" for o in objects)


def test_a_changed_configuration_changes_only_its_config_map(tmp_path):
    """Edit wsd.toml and re-apply: with kustomize's hash in the ConfigMap's name, the
    Job's pod template changed with it, and the API server refuses any change of a Job's
    template (immutable), so `kubectl apply -k` failed. Now the ConfigMap is the one object
    that differs, and a ConfigMap's data may change: apply accepts everything. (The pods
    read the file when they start: deploy/README.md, "Changing the configuration".)"""
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy_dir)
    toml = copy_dir / "wsd.toml"
    toml.write_text(toml.read_text().replace("num_ubatches = 2", "num_ubatches = 4"))
    assert toml.read_text() != (KUBERNETES / "wsd.toml").read_text()
    before = {(o["kind"], o["metadata"]["name"]): o for o in _kustomize(KUBERNETES)}
    after = {(o["kind"], o["metadata"]["name"]): o for o in _kustomize(copy_dir)}
    assert set(after) == set(before), "a changed file renamed an object"
    changed = sorted(key for key in before if before[key] != after[key])
    assert changed == [("ConfigMap", "wsd-config")], changed
    assert after[("ConfigMap", "wsd-config")]["data"]["wsd.toml"] == toml.read_text()


# -- strict schema validation ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the [test] extra")


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_manifests_pass_strict_schema_validation(kubernetes_validate, version):
    """Every rendered object against the API's own schema for that Kubernetes version,
    strictly: a misspelt or misplaced field (which kubectl's default validation only
    warns about, or the API server drops) fails here."""
    if version == "latest":
        version = kubernetes_validate.latest_version()
    objects = _kustomize(KUBERNETES)
    assert {o["kind"] for o in objects} >= {"Deployment", "Job", "Service", "ConfigMap", "NetworkPolicy"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    (job,) = _by_kind(objects, "Job").values()
    misplaced = copy.deepcopy(job)
    misplaced["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccomp"] = "RuntimeDefault"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misplaced, version, strict=True)


def _strict(schema: Any) -> Any:
    """A CRD's structural schema made strict: an object that lists its properties takes no
    other (what the API server reports as unknown fields with strict field validation)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


def _crd_validator(kind: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema comes with kubernetes-validate ([test] extra)")
    for path in CRDS.glob("*.yaml"):
        (crd,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
            schema = _strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schema["properties"]["apiVersion"] = {"const": api_version}
            return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


def test_operator_objects_pass_their_crds_strictly():
    """The ServiceMonitor and the PrometheusRule against the Operator's own CRDs (v0.93.0),
    strictly; a field the CRD does not know fails."""
    objects = _kustomize(MONITORING)
    assert sorted(o["kind"] for o in objects) == ["PrometheusRule", "ServiceMonitor"]
    for obj in objects:
        validator = _crd_validator(obj["kind"])
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert errors == [], (obj["kind"], errors)
    (monitor,) = _by_kind(objects, "ServiceMonitor").values()
    misspelt = copy.deepcopy(monitor)
    misspelt["spec"]["endpoints"][0]["scrape_timeout"] = "5s"
    assert list(_crd_validator("ServiceMonitor").iter_errors(misspelt))


# -- Prometheus Operator ---------------------------------------------------------------------------


def test_prometheus_rule_carries_exactly_the_alert_rules():
    """The PrometheusRule is make-prometheusrule.sh's output for the current
    wsd-alerts.yml: rules changed there and not regenerated here fail, with the command."""
    regenerate = "deploy/kubernetes/monitoring/make-prometheusrule.sh >deploy/kubernetes/monitoring/prometheusrule.yaml"
    result = subprocess.run(["bash", str(MONITORING / "make-prometheusrule.sh")], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert (MONITORING / "prometheusrule.yaml").read_text() == result.stdout, f"out of date: run {regenerate}"
    (rule,) = _by_kind(_kustomize(MONITORING), "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    assert [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]


def test_service_monitor_scrapes_the_coordinators_metrics_port_under_the_alerts_job_name():
    """The ServiceMonitor must select the coordinator's Service and its metrics port, and
    the job label the Operator gives the series (the Service's name) must be one the
    alert rules' job selectors match, or WsdCoordinatorDown never fires."""
    (monitor,) = _by_kind(_kustomize(MONITORING), "ServiceMonitor").values()
    services = _by_kind(_kustomize(KUBERNETES), "Service")
    selected = [s for s in services.values()
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["wsd-coordinator"]
    (endpoint,) = monitor["spec"]["endpoints"]
    ports = {p["name"]: p["port"] for p in selected[0]["spec"]["ports"]}
    assert ports[endpoint["port"]] == 7602 and endpoint["path"] == "/metrics"
    job = selected[0]["metadata"]["name"]
    selectors = set(re.findall(r'job=~"([^"]+)"', ALERTS.read_text()))
    assert selectors and all(re.fullmatch(s, job) for s in selectors), (job, selectors)


# -- the image: Containerfile ------------------------------------------------------------------------


def _containerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", CONTAINERFILE.read_text(), re.M))


def test_manifests_run_the_image_the_containerfile_builds_at_the_package_version():
    """wsd:VERSION in every container (initContainers too), the Containerfile's
    WSD_VERSION, and pyproject.toml's version are one: a release that bumps one and not
    the others deploys an image nothing builds, or the wrong wsd."""
    args = _containerfile_args()
    assert args["WSD_VERSION"] == VERSION
    images = {c["image"] for t in _templates(_kustomize(KUBERNETES)).values() for c in _containers(t)}
    assert images == {f"wsd:{VERSION}"}
    assert f"-t wsd:{VERSION} ." in CONTAINERFILE.read_text()


def test_containerfile_runs_as_the_manifests_non_root_user_with_a_deliberate_torch():
    """USER must be numeric (runAsNonRoot can verify only a numeric user) and the one the
    pods run as; the default torch is the CUDA build, pinned to the torch CI tests; a CPU
    build needs its index named; wsd goes in without the [worker] extra, after torch, so
    nothing pulls another torch; and the build checks what it got."""
    text = CONTAINERFILE.read_text()
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0
    for name, template in _templates(_kustomize(KUBERNETES)).items():
        context = template["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), name
    args = _containerfile_args()
    assert args["TORCH"] == "cuda"
    ci_torch = re.search(r"pip install --quiet torch==(\S+)", (ROOT / ".ci" / "run").read_text())
    assert ci_torch and args["TORCH_VERSION"] == ci_torch.group(1)
    assert re.search(r'cpu\)\s*\[ -n "\$TORCH_INDEX_URL" \] \|\|', text), "TORCH=cpu must require an index"
    commands = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "[worker]" not in commands and "pip install ." not in commands
    torch_step, wsd_step = text.index('"torch==$TORCH_VERSION"'), text.index("/wheels/wsd-${WSD_VERSION}")
    assert torch_step < wsd_step
    assert 'check-torch.py "$TORCH"' in text[wsd_step:]


def test_containerfile_copies_what_building_the_wheel_needs(tmp_path):
    """The wheel stage copies pyproject.toml, README.md, wsd/ and clients/: from exactly
    those (and through .dockerignore), `pip wheel` builds the file the final stage
    installs, wsd-WSD_VERSION-py3-none-any.whl."""
    text = CONTAINERFILE.read_text()
    stage = text.split(" AS wheel", 1)[1].split("\nFROM ", 1)[0]
    sources = [word for line in re.findall(r"^COPY (.+)$", stage, re.M) for word in line.split()[:-1]]
    assert sources == ["pyproject.toml", "README.md", "wsd", "clients"]
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for source in [*sources, "deploy/image/check-torch.py"]:
        assert ("!" + source + ("/" if (ROOT / source).is_dir() else "")) in ignore or \
            f"!{Path(source).parent}/" in ignore, f".dockerignore leaves {source} out of the context"
    context = tmp_path / "src"
    context.mkdir()
    for source in sources:
        (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, context / source)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(tmp_path / "wheels"), str(context)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == [f"wsd-{_containerfile_args()['WSD_VERSION']}"
                                                                  "-py3-none-any.whl"]


def test_containerfile_installs_numpy_with_torch_in_the_worker_extras_range():
    """torch no longer depends on numpy but imports it at start-up, warning "Failed to
    initialize NumPy" in every worker without it; the [worker] extra lists it, which the
    image does not install. So numpy goes in beside torch, in the same pip command (one
    resolution, from the same index) and the extra's range, in both branches that install
    torch; TORCH=none has neither."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    (numpy,) = [requirement for requirement in extra if requirement.startswith("numpy")]
    text = CONTAINERFILE.read_text()
    branches = dict(re.findall(r"^\s*(cuda|cpu|none)\)(.*?);;", text, re.M | re.S))
    assert set(branches) == {"cuda", "cpu", "none"}
    for build in ("cuda", "cpu"):
        (command,) = [c for c in branches[build].split(";") if "pip install" in c]
        assert '"torch==$TORCH_VERSION"' in command and f'"{numpy}"' in command, (build, command)
    assert "numpy" not in branches["none"]


def _torch_without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import numpy`` fails, as in an image that has no numpy."""
    shadow = tmp_path / "shadow" / "numpy"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    return {**os.environ, "PYTHONPATH": str(shadow.parent)}


def test_check_torch_refuses_a_torch_without_numpy(tmp_path):
    """An image whose torch cannot use numpy warns "Failed to initialize NumPy" in every
    worker: the build's last check fails it, saying why."""
    torch = pytest.importorskip("torch")
    build = "cuda" if torch.version.cuda else "cpu"
    result = subprocess.run([sys.executable, str(CHECK_TORCH), build], capture_output=True, text=True, timeout=120,
                            env=_torch_without_numpy(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"TORCH={build}: torch cannot use numpy" in result.stderr


@pytest.mark.parametrize(("asked", "code"), [("cpu", 0), ("cuda", 1), ("none", 1), ("rocm", 2)])
def test_check_torch_refuses_a_torch_other_than_the_one_asked_for(asked, code):
    """The Containerfile's last check, run here where torch is the CPU build: only "cpu"
    passes; an unknown build is a usage error."""
    torch = pytest.importorskip("torch")
    if torch.version.cuda:
        pytest.skip("this machine's torch is a CUDA build")
    result = subprocess.run([sys.executable, str(CHECK_TORCH), asked], capture_output=True, text=True, timeout=120)
    assert result.returncode == code, result.stdout + result.stderr
    if code == 1:
        assert result.stderr.strip() == f"TORCH={asked} was asked for, but the torch installed is cpu"


def test_no_pod_gets_service_link_variables_and_wsd_ignores_them_anyway():
    """Kubelet gives every pod <SERVICE>_PORT=tcp://... for each Service of its namespace;
    the project's own wsd-coordinator yields WSD_COORDINATOR_* variables, which once made
    every wsd (and vLLM) pod in that namespace fail at start. The pods opt out, and the
    loader ignores them where a pod does not (a vLLM Deployment of the operator's own)."""
    from kubelet import service_links, services

    from wsd.config import load_config

    for name, template in _templates(_kustomize(KUBERNETES)).items():
        assert template["spec"].get("enableServiceLinks") is False, f"{name} gets service links"
    for name, template in _templates(_kustomize(VLLM)).items():
        assert template["spec"].get("enableServiceLinks") is False, f"{name} gets service links"
    env = service_links(services(KUBERNETES))
    assert "WSD_COORDINATOR_PORT" in env  # the Service that caused it is still there
    # None of ours gives a vLLM of the namespace (with service links on) a VLLM_* setting:
    # VLLM_PORT=tcp://... stops vLLM at start.
    assert not [k for k in env if k.startswith("VLLM_")], sorted(env)
    assert load_config(None, env=env).coordinator.agent_endpoint  # loads


# -- vLLM with wsd's plugin (deploy/kubernetes/vllm) ------------------------------------------------

VLLM = KUBERNETES / "vllm"
VLLM_CONTAINERFILE = ROOT / "deploy" / "image" / "vllm.Containerfile"


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_vllm_pods_pass_pod_security_restricted_with_a_read_only_root():
    templates = _templates(_kustomize(VLLM))
    assert set(templates) == {"StatefulSet/vllm"}
    (template,) = templates.values()
    assert violations(template) == []
    for container in _containers(template):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
    assert template["spec"]["enableServiceLinks"] is False  # a Service named vllm would set VLLM_PORT


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_vllm_manifests_pass_strict_schema_validation(kubernetes_validate, version):
    if version == "latest":
        version = kubernetes_validate.latest_version()
    objects = _kustomize(VLLM)
    assert {o["kind"] for o in objects} == {"StatefulSet", "Service"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_vllm_pods_join_the_coordinator_as_the_workers_do():
    """What the vLLM pods take from deploy/kubernetes is there and the workers' own: the
    ConfigMaps, the Secrets, the coordinator's NetworkPolicy admitting them to the agent
    port; the plugin turns on from WSD_CONFIG; each replica is an engine named after its
    pod (stable: a StatefulSet's), within max_engines; TP is the pod's GPU count."""
    from wsd.config import load_config
    from wsd.integrations.vllm import plugin
    from wsd.names import engine_name_problem

    base = _kustomize(KUBERNETES)
    (vllm,) = _by_kind(_kustomize(VLLM), "StatefulSet").values()
    (job,) = _by_kind(base, "Job").values()
    template, workers = vllm["spec"]["template"], job["spec"]["template"]
    config_maps = set(_by_kind(base, "ConfigMap"))

    def secrets(t: dict[str, Any]) -> set[tuple[str, str]]:
        found = {(v["secret"]["secretName"], i["key"]) for v in t["spec"]["volumes"] if "secret" in v
                 for i in v["secret"]["items"]}
        return found | {(e["secretKeyRef"]["name"], e["secretKeyRef"]["key"]) for c in _containers(t)
                        for e in _env(c).values() if isinstance(e, dict) and "secretKeyRef" in e}

    assert {v["configMap"]["name"] for v in template["spec"]["volumes"] if "configMap" in v} == config_maps
    assert secrets(template) == secrets(workers)
    (policy,) = _by_kind(base, "NetworkPolicy").values()
    (agents,) = [rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"port": 7600}]]
    (selector,) = [peer["podSelector"]["matchLabels"] for peer in agents["from"]]
    for t in (template, workers):
        assert selector.items() <= t["metadata"]["labels"].items()

    (container,) = template["spec"]["containers"]
    env = _env(container)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert env["WSD_CONFIG"] == mount["mountPath"]
    assert env["WSD_ENGINE"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert plugin.enabled({"WSD_CONFIG": str(KUBERNETES / "wsd.toml")})
    config = load_config(str(KUBERNETES / "wsd.toml"), env={})
    pods = [f"{vllm['metadata']['name']}-{i}" for i in range(vllm["spec"]["replicas"])]
    assert all(engine_name_problem(pod) is None for pod in pods)
    assert len(pods) + 1 <= config.coordinator.max_engines  # and the workers' own engine
    tp = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--tensor-parallel-size=")]
    assert tp == [str(container["resources"]["limits"]["nvidia.com/gpu"])]
    assert "--shutdown-timeout=10" in container["args"]  # a drain: the ranks say goodbye


def test_vllm_image_is_vllms_own_at_a_verified_release_with_wsd_at_the_package_version():
    from wsd.integrations.vllm.patches import CHECKED_VERSIONS

    text = VLLM_CONTAINERFILE.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.M))
    assert args["WSD_VERSION"] == VERSION
    release = re.fullmatch(r"vllm/vllm-openai:v(\S+)", args["VLLM_IMAGE"])
    assert release and release.group(1) in CHECKED_VERSIONS
    images = {c["image"] for t in _templates(_kustomize(VLLM)).values() for c in _containers(t)}
    assert images == {f"wsd-vllm:{VERSION}"}
    assert f"-t wsd-vllm:{VERSION} ." in text
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    context = _templates(_kustomize(VLLM))["StatefulSet/vllm"]["spec"]["securityContext"]
    assert user == f"{context['runAsUser']}:{context['runAsGroup']}"
    assert 'pip install --no-deps "/wheels/wsd-${WSD_VERSION}-py3-none-any.whl"' in text  # vLLM's pins stay
    # The same wheel as the main image's: built from the same sources.
    stage = text.split(" AS wheel", 1)[1].split("\nFROM ", 1)[0]
    main = CONTAINERFILE.read_text().split(" AS wheel", 1)[1].split("\nFROM ", 1)[0]
    assert re.findall(r"^(?:COPY|RUN) .+$", stage, re.M) == re.findall(r"^(?:COPY|RUN) .+$", main, re.M)


def test_the_vllm_images_build_check_finds_the_plugin_beside_this_vllm():
    pytest.importorskip("vllm")
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "image" / "check-vllm.py")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wsd's plugin loads" in result.stdout and "(verified with wsd" in result.stdout
