"""deploy/: the recipes parse, their configurations load, their metric names exist, and
the local script runs and stops a real cluster.

Static tier: every shell script passes ``bash -n`` (and shellcheck where
installed), every YAML file parses, every example TOML loads with
``load_config`` and agrees with the manifests it sits beside, and every metric
name (and label) the dashboard, the alert rules and the scrape configuration
use is one the coordinator exports. Agent token: ``slurm/wsd.sbatch``, run with
test doubles of srun and scontrol, gives both job steps one token made for the
job; the Kubernetes coordinator and workers take it from one Secret, which the
documented steps make. Process tier: ``deploy/local/run.sh`` starts a
coordinator and torchrun workers (agents authenticated by a token it made),
shows only the chosen ranks, and stops everything it started on Ctrl-C, on
SIGTERM, and when its coordinator dies; each example configuration starts a
coordinator as its recipe starts it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import one_engine, wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    COORDINATOR_READY,
    RUN_SH,
    cmdline,
    leftovers,
    python,
    spawn,
    wait_gone,
    worker_env,
    write_config,
)
from prometheus_client.parser import text_string_to_metric_families

from wsd import WorkspaceManager
from wsd.agent.thread import Agent
from wsd.config import load_config
from wsd.coordinator.metrics import FAMILIES
from wsd.security import load_agent_token
from wsd.wire.curve import agent_keys
from wsd.wire.protocol import ErrorCode
from wsd_client import wsctl
from wsd_client.client import Client, ClientError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHELL_SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
TOML_FILES = sorted(DEPLOY.rglob("*.toml"))
DASHBOARD = DEPLOY / "grafana" / "wsd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "wsd-alerts.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
SCRAPE_KUBERNETES = DEPLOY / "prometheus" / "prometheus-kubernetes.yml"
KUBERNETES = DEPLOY / "kubernetes"
SBATCH = DEPLOY / "slurm" / "wsd.sbatch"
INSTALL_KEYS = KUBERNETES / "install-keys.sh"
README = DEPLOY / "README.md"


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(DEPLOY)) for p in paths]


def test_every_recipe_is_there():
    """The parametrized checks below run over what they find: pin what must be found, so
    that a renamed or deleted recipe fails here instead of silently dropping out."""
    assert {"local/run.sh", "slurm/wsd.sbatch"} <= set(_ids(SHELL_SCRIPTS))
    assert {"local/wsd.toml", "slurm/wsd.toml", "slurm/wsd-curve.toml", "kubernetes/wsd.toml"} <= set(_ids(TOML_FILES))
    assert "kubernetes/install-keys.sh" in _ids(SHELL_SCRIPTS)
    assert {"kubernetes/kustomization.yaml", "kubernetes/coordinator.yaml", "kubernetes/workers.yaml",
            "prometheus/prometheus.yml", "prometheus/prometheus-kubernetes.yml", "prometheus/wsd-alerts.yml",
            "prometheus/wsd-alerts.test.yml"} <= set(_ids(YAML_FILES))
    assert DASHBOARD.is_file() and (DEPLOY / "README.md").is_file()


# -- shell scripts ---------------------------------------------------------------------------


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_ids(SHELL_SCRIPTS))
def test_shell_script_parses_and_is_executable(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable (chmod +x)"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_ids(SHELL_SCRIPTS))
def test_shell_script_passes_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- YAML and TOML -----------------------------------------------------------------------------


def _documents(path: Path) -> list[Any]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@pytest.mark.parametrize("path", YAML_FILES, ids=_ids(YAML_FILES))
def test_yaml_file_parses(path):
    documents = _documents(path)
    assert documents and all(isinstance(d, dict) for d in documents), path


@pytest.mark.parametrize("path", TOML_FILES, ids=_ids(TOML_FILES))
def test_example_configuration_loads_and_is_consistent(path):
    """Loaded as a worker and the coordinator would (env={}: the test runner's WSD_* must not
    help), plus what only a running job would find out: TP sizes that disagree."""
    config = load_config(path, env={})
    coordinator, worker = config.coordinator, config.worker
    if coordinator.tp_size is not None and worker.tp_size is not None:
        assert coordinator.tp_size == worker.tp_size, "[coordinator] tp_size differs from [worker] tp_size"
    if worker.tp_size is not None:
        assert config.workload.ffn_size % worker.tp_size == 0, "[workload] ffn_size must split across tp_size"
        if coordinator.world_size is not None:
            assert coordinator.world_size % worker.tp_size == 0


# -- Kubernetes ----------------------------------------------------------------------------------


def _manifests() -> list[dict[str, Any]]:
    return [d for name in ("coordinator.yaml", "workers.yaml") for d in _documents(KUBERNETES / name)]


def _pod_specs() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, StatefulSet and Job."""
    for doc in _manifests():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc, doc["spec"]["template"]


def _container(kind: str) -> dict[str, Any]:
    (workload,) = [w for w, _ in _pod_specs() if w["kind"] == kind]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_kubernetes_manifests_reference_what_exists():
    """A Service selecting no pod, a volume naming a ConfigMap that is not generated, or a
    port name no container declares is accepted by kubectl and fails only in the cluster."""
    manifests = _manifests()
    assert all({"apiVersion", "kind", "metadata"} <= set(d) and d["metadata"].get("name") for d in manifests)
    kustomization = _documents(KUBERNETES / "kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == ["coordinator.yaml", "workers.yaml"]
    generated = {g["name"] for g in kustomization["configMapGenerator"]}
    for generator in kustomization["configMapGenerator"]:
        assert all((KUBERNETES / f).is_file() for f in generator["files"]), generator
    claims = {d["metadata"]["name"] for d in manifests if d["kind"] == "PersistentVolumeClaim"}
    templates = [t for _, t in _pod_specs()]
    for service in (d for d in manifests if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matching = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert matching, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            declared = {(p.get("name"), p["containerPort"]) for t in matching
                        for c in t["spec"]["containers"] for p in c.get("ports", [])}
            assert any(target in pair for pair in declared), (service["metadata"]["name"], target)
    for template in templates:
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in generated
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
        mounted = {m["name"] for c in spec["containers"] + spec.get("initContainers", []) for m in c["volumeMounts"]}
        assert set(volumes) <= mounted, f"volumes no container mounts: {set(volumes) - mounted}"


_SECURITY_FILES = ("server_secret_key", "server_public_key", "agent_secret_key")
_SECURITY_FOLDERS = ("viewer_keys", "admin_keys", "agent_keys")


def _spec(kind: str) -> dict[str, Any]:
    (template,) = [t for w, t in _pod_specs() if w["kind"] == kind]
    return template["spec"]


def _install_keys(spec: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """The install-keys initContainer, and its SECRETS and KEYS folders."""
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == "install-keys"]
    env = {e["name"]: e["value"] for e in init["env"]}
    return init, env["SECRETS"], env["KEYS"]


def _secret_sources(volume: dict[str, Any]) -> list[tuple[str, list[dict[str, str]] | None, bool]]:
    """(Secret, items or None for every entry, optional) of a secret or projected volume."""
    if "secret" in volume:
        s = volume["secret"]
        return [(s["secretName"], s.get("items"), s.get("optional", False))]
    if "projected" in volume:
        sources = volume["projected"]["sources"]
        assert all(set(s) == {"secret"} for s in sources), volume["name"]
        return [(s["secret"]["name"], s["secret"].get("items"), s["secret"].get("optional", False))
                for s in sources]
    return []


def _installed(spec: dict[str, Any]) -> tuple[dict[str, tuple[str, str]], dict[str, list[str]]]:
    """What install-keys makes under KEYS in this pod, read from the manifest: files
    {relative path: (Secret, entry)} picked by items, and folders {relative path: [Secrets
    every entry of which lands there]} (each mount is a folder, empty or not)."""
    init, secrets, _ = _install_keys(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    files: dict[str, tuple[str, str]] = {}
    folders: dict[str, list[str]] = {}
    for mount in init["volumeMounts"]:
        sources = _secret_sources(volumes[mount["name"]])
        if not sources:
            continue
        assert mount["mountPath"].startswith(secrets + "/"), mount
        base = mount["mountPath"][len(secrets) + 1:]
        folders.setdefault(base, [])
        for name, items, _ in sources:
            if items is None:
                folders[base].append(name)
                continue
            for item in items:
                path = f"{base}/{item['path']}"
                assert path not in files, f"two items install {path}"
                files[path] = (name, item["key"])
    return files, folders


def _under(path: str, keys: str) -> str:
    """``path`` relative to the keys folder ``keys``."""
    assert path.startswith(keys + "/"), f"{path} is not under {keys}"
    return path[len(keys) + 1:]


def _public_half(entry: str) -> str:
    assert entry.endswith(".key_secret"), entry
    return entry[: -len("_secret")]


def test_kubernetes_security_paths_are_the_keys_each_pod_installs():
    """Every [security] path of kubernetes/wsd.toml must be a file or folder that the pod
    reading it gets from its Secrets (a wrong path is a pod that never starts); a file's
    name must say what its entry is (install-keys picks the mode by the name, and a secret
    key installed as NAME.key would be world-readable); and no pod holds the other's secret
    key. Read from the manifests: items, mounts, the initContainer's folders."""
    security = load_config(KUBERNETES / "wsd.toml", env={}).security
    assert security.curve_clients and security.curve_agents
    layouts = {}
    for kind, files_read, folders_read, not_held in (
            ("Deployment", ("server_secret_key",), _SECURITY_FOLDERS, ("agent_secret_key",)),
            ("Job", ("agent_secret_key", "server_public_key"), (), ("server_secret_key",))):
        spec = _spec(kind)
        _, _, keys = _install_keys(spec)
        files, folders = _installed(spec)
        layouts[kind] = files, folders

        def relative(key: str) -> str:
            return _under(getattr(security, key), keys)  # noqa: B023  (keys: this pod's, used now)

        for key in files_read:
            assert relative(key) in files, f"{kind}: [security] {key} is installed by no item"
        for key in folders_read:
            assert relative(key) in folders, f"{kind}: [security] {key} is not a mounted folder"
        for key in not_held:
            assert relative(key) not in files, f"{kind} holds {key}, which only the other pod needs"
        for path, (secret, entry) in files.items():
            assert Path(path).suffix == Path(entry).suffix, f"{kind}: {secret}/{entry} installed as {path}"
    (coordinator_files, _), (worker_files, _) = layouts["Deployment"], layouts["Job"]
    keys = _install_keys(_spec("Deployment"))[2]
    assert _install_keys(_spec("Job"))[2] == keys  # one wsd.toml for both pods
    # The pairs match: the agents pin the public half of the coordinator's secret key, and
    # the coordinator admits the public half of the agents' one.
    secret, entry = coordinator_files[_under(security.server_secret_key, keys)]
    assert worker_files[_under(security.server_public_key, keys)] == (secret, _public_half(entry))
    secret, entry = worker_files[_under(security.agent_secret_key, keys)]
    agents_folder = _under(security.agent_keys, keys)
    assert (secret, _public_half(entry)) in [e for p, e in coordinator_files.items()
                                             if os.path.dirname(p) == agents_folder and p.endswith(".key")]


def test_kubernetes_liveness_probe_is_a_listed_viewer():
    """With CURVE on the client endpoint a plain `wsctl ping` gets nothing: the probe would
    fail and the kubelet restart the coordinator forever. Its keys must be installed, and its
    public key be in the viewer folder."""
    security = load_config(KUBERNETES / "wsd.toml", env={}).security
    command = _container("Deployment")["livenessProbe"]["exec"]["command"]
    options = dict(zip(command[1:-1:2], command[2:-1:2]))
    assert command[0] == "wsctl" and command[-1] == "ping", command
    assert options["--curve-server-key"] == security.server_public_key
    spec = _spec("Deployment")
    keys = _install_keys(spec)[2]
    files, _ = _installed(spec)
    client = _under(options["--curve-client-key"], keys)
    secret, entry = files[client]
    viewers = _under(security.viewer_keys, keys)
    # wsd lists *.key directly in the folder, not below it.
    assert (secret, _public_half(entry)) in [e for p, e in files.items() if os.path.dirname(p) == viewers]
    assert files[_under(security.server_public_key, keys)][1].endswith(".key")


def test_kubernetes_secret_keys_reach_wsd_only_through_the_mode_fixing_init_container():
    """With fsGroup the kubelet makes Secret-volume files group-readable (mode | 0440), and
    wsd refuses such a secret key: no main container may mount a Secret; each pod's
    install-keys initContainer, same image and user, runs install-keys.sh (the generated
    ConfigMap) into an in-memory emptyDir that the main container mounts read-only."""
    kustomization = _documents(KUBERNETES / "kustomization.yaml")[0]
    generators = {g["name"]: g["files"] for g in kustomization["configMapGenerator"]}
    assert generators["wsd-install-keys"] == [INSTALL_KEYS.name]
    for workload, template in _pod_specs():
        spec = template["spec"]
        assert spec["securityContext"]["fsGroup"] and spec["securityContext"]["runAsNonRoot"] is True
        init, _, keys = _install_keys(spec)
        (main,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert init["image"] == main["image"]
        for container in (init, main):
            assert "runAsUser" not in container.get("securityContext", {}), "one user for the pod"
        script_dir = os.path.dirname(init["command"][-1])
        (script_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == script_dir]
        assert volumes[script_mount["name"]]["configMap"]["name"] == "wsd-install-keys"
        assert init["command"] == ["bash", f"{script_dir}/{INSTALL_KEYS.name}"]
        assert not [m for m in main["volumeMounts"] if _secret_sources(volumes[m["name"]])], \
            f"{workload['kind']}: the main container mounts a Secret"
        (written,) = [m for m in init["volumeMounts"] if m["mountPath"] == keys]
        (read,) = [m for m in main["volumeMounts"] if m["mountPath"] == keys]
        assert written["name"] == read["name"] and read["readOnly"] is True and not written.get("readOnly")
        assert volumes[read["name"]]["emptyDir"]["medium"] == "Memory"
        secret_volumes = [v for v in volumes.values() if _secret_sources(v)]
        assert secret_volumes
        for volume in secret_volumes:
            mode = (volume.get("secret") or volume.get("projected"))["defaultMode"]
            assert mode | 0o440 == 0o440, f"{volume['name']}: mode {mode:o} gives others access"

_AGENT_TOKEN_ENV = "WSD_AGENT_TOKEN"


def _token_ref(kind: str) -> dict[str, Any]:
    """Where the container of ``kind`` takes the agent token from (its secretKeyRef)."""
    container = _container(kind)
    (variable,) = [e for e in container.get("env", []) if e["name"] == _AGENT_TOKEN_ENV]
    return variable["valueFrom"]["secretKeyRef"]


def test_kubernetes_coordinator_and_workers_take_the_agent_token_from_one_secret():
    """Without the token in the coordinator, any pod reaching the agent port may register as
    any rank not live; without it in the workers, every worker is refused. Both must read
    the same entry of the same required Secret, which the documented steps make, and
    wsd.toml must not point either at a token file instead."""
    coordinator, worker = _token_ref("Deployment"), _token_ref("Job")
    assert coordinator == worker, (coordinator, worker)
    assert not coordinator.get("optional", False), "a pod without the token must not start"
    assert load_config(KUBERNETES / "wsd.toml", env={}).security.agent_token_file is None
    steps = _readme_block("### Keys on Kubernetes")
    made = re.findall(r"kubectl create secret generic (\S+) --from-file=(\w+)=", steps)
    assert (coordinator["name"], coordinator["key"]) in made, made


def test_kubernetes_workers_rendezvous_and_world_agree_with_the_configuration():
    """The Job's node count, torchrun's arguments, the headless Service and wsd.toml's world
    size must agree, or the rendezvous waits forever for nodes that never come."""
    config = load_config(KUBERNETES / "wsd.toml", env={})
    (job,) = [w for w, _ in _pod_specs() if w["kind"] == "Job"]
    container = _container("Job")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}  # not the token's secretKeyRef
    nnodes, nproc = int(env["NNODES"]), int(env["NPROC_PER_NODE"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    assert nnodes * nproc == config.coordinator.world_size
    assert container["resources"]["limits"]["nvidia.com/gpu"] == nproc
    script = " ".join(container["args"])
    assert "--rdzv-backend c10d" in script and '--nnodes "$NNODES"' in script
    endpoint = re.search(r'--rdzv-endpoint "([^":]+):(\d+)"', script)
    assert endpoint, script
    subdomain = job["spec"]["template"]["spec"]["subdomain"]
    assert endpoint.group(1) == f"{job['metadata']['name']}-0.{subdomain}"  # pod 0 of the indexed Job
    (headless,) = [d for d in _manifests() if d["kind"] == "Service" and d["metadata"]["name"] == subdomain]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert int(endpoint.group(2)) in {p["port"] for p in headless["spec"]["ports"]}
    assert "--config /etc/wsd/wsd.toml" in script
    # The agents reach the coordinator through its Service.
    service = re.fullmatch(r"tcp://([\w-]+):(\d+)", config.coordinator.connect_endpoint)
    assert service, config.coordinator.connect_endpoint
    (coordinator_service,) = [d for d in _manifests()
                              if d["kind"] == "Service" and d["metadata"]["name"] == service.group(1)]
    assert int(service.group(2)) in {p["port"] for p in coordinator_service["spec"]["ports"]}
    assert _container("Deployment")["command"][-1] == "/etc/wsd/wsd.toml"


# The rendered manifests (kustomize, Pod Security, schemas, the image): tests/integration/test_kubernetes.py.


# -- metric names --------------------------------------------------------------------------------

# Labels Prometheus adds to every series of a target (the scrape configs' relabelling adds namespace).
_TARGET_LABELS = {"job", "instance", "namespace"}


def _series() -> dict[str, frozenset[str]]:
    """Every series name the exporter emits (wsd.coordinator.metrics.FAMILIES), with the labels it carries."""
    series = {}
    for name, (kind, labels) in FAMILIES.items():
        if kind == "counter":
            series[name if name.endswith("_total") else name + "_total"] = frozenset(labels)
        elif kind == "histogram":
            series[name + "_bucket"] = frozenset(labels) | {"le"}
            series[name + "_sum"] = series[name + "_count"] = frozenset(labels)
        else:
            series[name] = frozenset(labels)
    return series


_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression (or a Grafana label_values query) uses.

    What is left once strings, label matchers, ranges, grouping clauses, Grafana
    variables and numbers are removed, and that is neither a keyword nor a
    function (a name followed by "("), is a metric name.
    """
    labels: set[str] = set()
    query = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", expr, re.S)
    if query:
        expr = query.group(1)
        labels.add(query.group(2))
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    for body in re.findall(_GROUPING, text):
        labels |= set(re.findall(r"[A-Za-z_]\w*", body))
    text = re.sub(_GROUPING, " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"(?<![\w:.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[smhdwy]?\b", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        if match.group(0).lower() in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.add(match.group(0))
    return names, labels


def test_promql_names_finds_metrics_and_labels_and_nothing_else():
    """The extractor the checks below rely on: a name it missed would pass unchecked."""
    expr = ('histogram_quantile(0.95, sum by (le, action) (rate(wsd_command_duration_seconds_bucket'
            '{job="x"}[$__rate_interval]))) / on (tp_group) up > 1e6 and bool count(foo2_bar offset 5m)')
    assert promql_names(expr) == ({"wsd_command_duration_seconds_bucket", "up", "foo2_bar"},
                                  {"le", "action", "job", "tp_group"})
    assert promql_names('label_values(wsd_rank_up{tp_group=~"$tp_group"}, rank)') == (
        {"wsd_rank_up"}, {"tp_group", "rank"})
    assert promql_names("absent(wsd_ranks)") == ({"wsd_ranks"}, set())


def _templated_labels(text: str) -> set[str]:
    """Labels named in Grafana legends ({{rank}}) and alert templates ({{ $labels.rank }}, also
    within an action: {{ with $labels.namespace }}...{{ end }})."""
    legends = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text)) - {"value", "end", "else"}
    return legends | set(re.findall(r"\$labels\.(\w+)", text))


def _dashboard_queries() -> list[tuple[str, str]]:
    """(expr, legend) of every panel target and every templating query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append((query["query"] if isinstance(query, dict) else query, ""))
    return queries


def _alert_queries() -> list[tuple[str, str]]:
    (document,) = _documents(ALERTS)
    return [(rule["expr"], " ".join(rule.get("annotations", {}).values()))
            for group in document["groups"] for rule in group["rules"]]


def _scrape_queries() -> list[tuple[str, str]]:
    # Relabelling rules may name series (metric_relabel_configs); the rest of the file names
    # none. Any wsd_ name anywhere in it must exist.
    text = SCRAPE.read_text() + SCRAPE_KUBERNETES.read_text()
    return [(name, "") for name in re.findall(r"\bwsd_\w+", text)]


_OTHER_EXPORTERS = {
    # vLLM's own /metrics (vllm/v1/metrics/loggers.py: labelnames = ["model_name", "engine"]).
    "vllm:kv_cache_usage_perc": frozenset({"model_name", "engine"}),
}


@pytest.mark.parametrize("source", ["dashboard", "alerts", "scrape"])
def test_every_metric_and_label_used_is_exported(source):
    """A misspelt series or label gives an empty panel or an alert that never fires, with no
    error anywhere: each name must be one the coordinator exports (deploy/grafana, deploy/prometheus)."""
    queries = {"dashboard": _dashboard_queries, "alerts": _alert_queries, "scrape": _scrape_queries}[source]()
    # Besides the coordinator's, Prometheus's own `up` of each target (WsdCoordinatorDown), and
    # the series of other exporters the dashboard joins wsd's with, with their labels.
    series = {**_series(), "up": frozenset(), **_OTHER_EXPORTERS}
    used = set()
    for expr, template in queries:
        names, labels = promql_names(expr)
        unknown = names - set(series)
        assert not unknown, f"{source}: {expr!r} uses {sorted(unknown)}, not exported"
        available = set().union(*(series[n] for n in names)) | _TARGET_LABELS if names else set()
        labels |= _templated_labels(template)
        assert labels <= available, f"{source}: {expr!r} uses labels {sorted(labels - available)}"
        used |= names
    if source != "scrape":
        assert used, f"no metric found in {source}"  # the extractor found something to check
    if source == "dashboard":
        # What the dashboard is for: capacity and peak per slot, skew per group, violations, ranks up.
        assert {"wsd_slot_capacity_bytes", "wsd_slot_peak_requested_bytes", "wsd_group_skew_bytes",
                "wsd_slot_lock_violations_total", "wsd_rank_up"} <= used


def test_dashboard_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard["panels"]))) - {"__rate_interval"}
    assert used <= variables, used - variables


def test_scrape_config_targets_the_coordinators_metrics_port():
    """The static target and the Kubernetes discovery must point where the recipes put the
    metrics port: 7602, the [coordinator] metrics_port of every example configuration."""
    documents = [_documents(path)[0] for path in (SCRAPE, SCRAPE_KUBERNETES)]
    jobs = {job["job_name"]: job for document in documents for job in document["scrape_configs"]}
    assert all(document["rule_files"] == [ALERTS.name] for document in documents)
    static = jobs["wsd-coordinator"]["static_configs"][0]["targets"]
    assert [t.rsplit(":", 1)[1] for t in static] == ["7602"]
    keep = jobs["wsd-coordinator-kubernetes"]["relabel_configs"][0]
    service, port_name = keep["regex"].split(";")
    (svc,) = [d for d in _manifests() if d["kind"] == "Service" and d["metadata"]["name"] == service]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}[port_name] == 7602
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
    for path in TOML_FILES:
        assert load_config(path, env={}).coordinator.metrics_port == 7602, path
    (port,) = [p for p in _container("Deployment")["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == 7602
    # Inside the pod, Prometheus comes from another pod: loopback would be unreachable.
    assert load_config(KUBERNETES / "wsd.toml", env={}).coordinator.metrics_host == "0.0.0.0"


# -- slurm/wsd.sbatch: the steps it starts, with test doubles of srun and scontrol -------------------

# `scontrol show hostnames` lists the nodes. srun records each step (its options, its
# command, its WSD_* environment) instead of running it; the coordinator step prints a
# ready line and waits to be stopped, the workers' step ends at once, as a job whose
# workers finished: the script then stops the coordinator and exits 0.
_FAKE_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
tr ',' '\\n' <<<"$3"
"""
# The ready line names the metrics URL given in FAKE_METRICS_URL (none if empty). Each step
# also records the Prometheus target files (*.json) in the submit directory as it starts.
_FAKE_SRUN = """#!{python}
import json, os, pathlib, sys, time
args, options = sys.argv[1:], []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
env = {{k: v for k, v in os.environ.items() if k.startswith("WSD_")}}
targets = {{str(p): p.read_text() for p in pathlib.Path(os.environ["SLURM_SUBMIT_DIR"]).rglob("*.json")}}
with open({log!r}, "a") as f:
    f.write(json.dumps({{"options": options, "argv": args, "env": env, "targets": targets}}) + "\\n")
if "coordinator" in args:
    metrics = os.environ.get("FAKE_METRICS_URL", "http://0.0.0.0:7602/metrics")
    print("wsd coordinator ready: agents tcp://127.0.0.1:1 clients tcp://127.0.0.1:2"
          + (" metrics " + metrics if metrics else ""), flush=True)
    time.sleep(60)  # until the script's SIGTERM
elif "wsd.worker" in args:
    time.sleep(float(os.environ.get("FAKE_WORKERS_SECONDS", "0")))
"""


def _sbatch_env(tmp_path: Path, config: Path, job_id: str, **env: str) -> tuple[dict[str, str], Path]:
    """The environment Slurm would run wsd.sbatch in on two nodes from ``tmp_path``, with
    the test doubles first on PATH, and the file srun records the steps in."""
    bin_dir, log = tmp_path / f"bin-{job_id}", tmp_path / f"steps-{job_id}.jsonl"
    bin_dir.mkdir()
    for name, text in (("scontrol", _FAKE_SCONTROL),
                       ("srun", _FAKE_SRUN.format(python=sys.executable, log=str(log)))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("WSD_", "SLURM_"))}
    return {**base, "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}", "PYTHON": sys.executable,
            "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "node1,node2", "SLURM_SUBMIT_DIR": str(tmp_path),
            "CONFIG": str(config), **env}, log


def _run_sbatch(tmp_path: Path, config: Path, job_id: str = "4242", **env: str) -> tuple[int, str, list[dict]]:
    """wsd.sbatch as Slurm would run it on two nodes from ``tmp_path``: (exit code, its
    output, the job steps it started)."""
    full_env, log = _sbatch_env(tmp_path, config, job_id, **env)
    result = subprocess.run(["bash", str(SBATCH)], check=False, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env=full_env)
    steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result.returncode, result.stdout + result.stderr, steps


def _steps(steps: list[dict]) -> tuple[dict, dict]:
    """The coordinator's step and the workers' step."""
    (coordinator,) = [s for s in steps if "coordinator" in s["argv"]]
    (workers,) = [s for s in steps if "wsd.worker" in s["argv"]]
    return coordinator, workers


def test_slurm_script_gives_both_steps_a_token_made_for_the_job_and_the_world_size(tmp_path):
    """Without a token the coordinator admits any registration that reaches its agent port
    (every interface of the first node); without the world size it would refuse to start.
    Each job gets a token of its own, the same in the coordinator's step and the workers'
    (exported to both, --export=ALL so that `sbatch --export=NONE` does not drop it),
    printed nowhere; one given in WSD_AGENT_TOKEN is kept; a short one is refused before
    any step starts."""
    tokens = []
    for job in ("101", "102"):
        code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", job)
        assert code == 0, output
        coordinator, workers = _steps(steps)
        token = coordinator["env"].get(_AGENT_TOKEN_ENV)
        assert token and re.fullmatch(r"[0-9a-f]{64}", token), coordinator["env"]
        assert workers["env"].get(_AGENT_TOKEN_ENV) == token
        assert coordinator["env"]["WSD_COORDINATOR_WORLD_SIZE"] == str(2 * 8)  # 2 nodes x NPROC_PER_NODE
        assert all("--export=ALL" in s["options"] for s in (coordinator, workers))
        run_dir = tmp_path / f"wsd-{job}"
        assert token not in output
        assert not [f for f in run_dir.rglob("*") if f.is_file() and token in f.read_text()]
        tokens.append(token)
    assert tokens[0] != tokens[1], "two jobs got the same token"
    given = secrets.token_hex(16)
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "103", WSD_AGENT_TOKEN=given)
    assert code == 0, output
    assert {s["env"][_AGENT_TOKEN_ENV] for s in steps} == {given}
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "104", WSD_AGENT_TOKEN="short")
    assert code == 2 and steps == [], output
    assert "at least 16 characters" in output


def test_slurm_script_passes_cpus_per_task_on_to_the_workers_step(tmp_path):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the allocation: without it
    passed on, a node's torchrun and all its workers run on one CPU. The coordinator's step
    keeps the default (one task, one CPU: it computes nothing)."""
    config = DEPLOY / "slurm" / "wsd.toml"
    code, output, steps = _run_sbatch(tmp_path, config, "201", SLURM_CPUS_PER_TASK="32")
    assert code == 0, output
    coordinator, workers = _steps(steps)
    assert "--cpus-per-task=32" in workers["options"]
    assert not [o for o in coordinator["options"] if o.startswith("--cpus-per-task")]
    # An allocation without it (sbatch --cpus-per-task not given): srun's own default.
    code, output, steps = _run_sbatch(tmp_path, config, "202")
    assert code == 0, output
    assert not [o for s in steps for o in s["options"] if o.startswith("--cpus-per-task")]
    assert [o for o in _steps(steps)[1]["options"] if not o] == [], "an empty word reached srun"


def test_slurm_script_expands_its_possibly_empty_arrays_as_old_bash_allows():
    """Under ``set -u``, bash before 4.4 (CentOS 7 has 4.2) calls an empty ``"${a[@]}"`` an
    unbound variable: the job would die at the workers' step whenever the allocation has no
    --cpus-per-task. No old bash is at hand here (and bash 5's BASH_COMPAT does not bring the
    old behaviour back), so this checks the text: every array the script may leave empty is
    expanded as ``${a[@]+"${a[@]}"}``, which every bash expands to nothing."""
    text = "\n".join(line for line in SBATCH.read_text().splitlines() if not line.lstrip().startswith("#"))
    maybe_empty = set(re.findall(r"^\s*(\w+)=\(\)", text, re.M))
    assert "cpus" in maybe_empty
    for name in maybe_empty:
        guarded = "${" + name + '[@]+"${' + name + '[@]}"}'
        bare = text.replace(guarded, "")
        assert not re.search(r"\$\{" + name + r"\[[@*]\]", bare), f"{name} expanded without a guard"
        assert guarded in text, f"{name} is never expanded"


def _targets_while_running(steps: list[dict]) -> dict[str, Any]:
    """{path: JSON} of the target files there were when the workers' step started."""
    _, workers = _steps(steps)
    return {path: json.loads(text) for path, text in workers["targets"].items()}


@pytest.mark.parametrize(("metrics_url", "target", "scheme"), [
    ("http://0.0.0.0:7602/metrics", "node1:7602", "http"),    # the recipe's port, every interface
    ("https://0.0.0.0:43117/metrics", "node1:43117", "https"),  # a port the OS picked; TLS
])
def test_slurm_script_writes_the_coordinators_metrics_endpoint_for_prometheus(tmp_path, metrics_url, target,
                                                                               scheme):
    """Prometheus finds the job's coordinator through file_sd: a JSON target file naming the
    first node and the metrics port the coordinator bound (from its ready line), instead of
    a hand-edited HEAD:7602; by default in wsd-targets/JOB_ID.json of the submit directory.
    It goes when the job ends."""
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "4242", SLURM_CLUSTER_NAME="gpu-a",
                                      FAKE_METRICS_URL=metrics_url)
    assert code == 0, output
    path = tmp_path / "wsd-targets" / "4242.json"
    assert _targets_while_running(steps) == {str(path): [{"targets": [target], "labels": {
        "__scheme__": scheme, "__metrics_path__": "/metrics", "slurm_job_id": "4242", "slurm_cluster": "gpu-a"}}]}
    assert f"wsd-slurm: Prometheus target {target} ({scheme}) in {path}" in output
    assert not path.exists() and not list(path.parent.iterdir()), "the target outlived the job"


def test_slurm_script_writes_the_target_file_where_targets_file_says(tmp_path):
    """TARGETS_FILE names the file (a folder Prometheus watches); empty, or a coordinator
    without a metrics port, writes none."""
    chosen = tmp_path / "prometheus" / "sd" / "wsd-gpu.json"
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "301", TARGETS_FILE=str(chosen))
    assert code == 0, output
    assert list(_targets_while_running(steps)) == [str(chosen)]
    for job, env in (("302", {"TARGETS_FILE": ""}), ("303", {"FAKE_METRICS_URL": ""})):
        code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", job, **env)
        assert code == 0, output
        assert _targets_while_running(steps) == {} and "Prometheus target" not in output


def _documented_target_cleanup() -> tuple[str, str]:
    """deploy/README.md's two ways of removing a dead job's target file: (the epilog's
    command, the sweep's command)."""
    text = README.read_text()
    section = text[text.index("The file goes with the job only when the script's trap runs"):]
    epilog, sweep = re.findall(r"```sh\n(.*?)```", section, re.S)[:2]
    return epilog.strip(), sweep.strip()


def test_a_job_killed_without_its_trap_leaves_its_target_which_the_documented_cleanup_removes(tmp_path):
    """A node failure kills the batch script with no trap run: its file_sd target stays and
    WsdCoordinatorDown fires for a job that is gone. deploy/README.md says so and gives an
    epilog line and an age-based sweep; both, run as documented (the folder swapped for this
    test's), remove the dead job's file, and the sweep leaves a running job's file alone."""
    targets = tmp_path / "wsd-targets"
    env, _ = _sbatch_env(tmp_path, DEPLOY / "slurm" / "wsd.toml", "501", FAKE_WORKERS_SECONDS="60")
    script = subprocess.Popen(["bash", str(SBATCH)], cwd=tmp_path, env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (targets / "501.json").exists(), timeout=30, what="the job's target file")
    finally:
        os.killpg(script.pid, signal.SIGKILL)  # the whole node goes: no trap runs
        script.wait(timeout=10)
    assert (targets / "501.json").exists(), "the test did not kill the job before its trap ran"
    epilog, sweep = _documented_target_cleanup()
    documented = "/shared/wsd/wsd-targets"
    assert documented in epilog and documented in sweep
    subprocess.run(["sh", "-c", epilog.replace(documented, str(targets))], check=True, timeout=10,
                   env={**os.environ, "SLURM_JOB_ID": "501"})
    assert not (targets / "501.json").exists(), "the epilog left the target"
    dead, running = targets / "502.json", targets / "503.json"
    dead.write_text("[]")
    running.write_text("[]")
    eight_days_ago = time.time() - 8 * 24 * 3600
    os.utime(dead, (eight_days_ago, eight_days_ago))
    subprocess.run(["sh", "-c", sweep.replace(documented, str(targets))], check=True, timeout=10)
    assert not dead.exists() and running.exists()


PROMETHEUS = shutil.which("prometheus")


def test_prometheus_discovers_the_coordinator_from_the_slurm_target_file(tmp_path, spawn):  # noqa: F811
    """A real Prometheus, with a file_sd_configs job reading the folder the script writes
    to, turns the file into the scrape URL of the first node's coordinator, labels kept."""
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian's package `prometheus`; .ci/run installs it)")
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "4243",
                                      FAKE_METRICS_URL="http://0.0.0.0:7602/metrics")
    assert code == 0, output
    ((path, text),) = _steps(steps)[1]["targets"].items()
    sd = tmp_path / "sd"
    sd.mkdir()
    (sd / Path(path).name).write_text(text)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [{
        "job_name": "wsd-coordinator-slurm", "scrape_interval": "1h",
        "file_sd_configs": [{"files": [str(sd / "*.json")]}]}]}))
    url = _start_prometheus(spawn, config, tmp_path / "data")

    def active() -> list[dict[str, Any]]:
        with urllib.request.urlopen(url + "/api/v1/targets", timeout=5) as response:
            return json.load(response)["data"]["activeTargets"]

    wait_until(active, 30, "Prometheus to discover the target", interval=0.1)
    (found,) = active()
    assert found["scrapeUrl"] == "http://node1:7602/metrics"
    assert found["labels"] == {"instance": "node1:7602", "job": "wsd-coordinator-slurm", "slurm_job_id": "4243"}


def _start_prometheus(spawn, config: Path, data: Path) -> str:  # noqa: F811
    """Prometheus with ``config`` on a free loopback port; its URL once it answers ready."""
    for attempt in range(3):  # the port is free when picked; another process may take it first
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = spawn([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}{attempt}",
                      f"--web.listen-address=127.0.0.1:{port}"], name="prometheus")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: proc.popen.poll() is not None or _answers(url + "/-/ready"), 60,  # noqa: B023
                   "Prometheus to start or exit", interval=0.1)
        if proc.popen.poll() is None:
            return url
        if "address already in use" not in proc.output():
            break
    pytest.fail(f"prometheus did not become ready; its output ends:\n{proc.output()[-3000:]}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_security_doc_cites_tests_that_exist_and_the_recipes_it_names():
    """docs/security.md answers each attack with the test that tries it: a renamed or
    deleted test would leave the threat model pointing at nothing."""
    doc = (DEPLOY.parent / "docs" / "security.md").read_text()
    tests = DEPLOY.parent / "tests"
    cited_files = set(re.findall(r"`(tests/\w+/test_\w+\.py)`", doc))
    assert cited_files and all((DEPLOY.parent / f).is_file() for f in cited_files), cited_files
    source = "".join(p.read_text() for p in tests.rglob("test_*.py"))
    cited = set(re.findall(r"`(test_\w+)`", doc))
    assert len(cited) >= 15
    assert not [name for name in cited if not re.search(rf"^def {name}\(", source, re.M)]
    assert all((DEPLOY.parent / path).exists() for path in re.findall(r"`(deploy/[\w./-]+)`", doc))


# -- deploy/local/run.sh, for real -------------------------------------------------------------------

_SMALL_WORKLOAD = {"WSD_WORKLOAD_HIDDEN_SIZE": "32", "WSD_WORKLOAD_FFN_SIZE": "64",
                   "WSD_WORKLOAD_MAX_TOKENS": "32", "WSD_WORKLOAD_WARMUP_STEPS": "4",
                   "WSD_WORKLOAD_PACE": "0.05"}


def _local_env(tmp_path: Path, **knobs: str) -> dict[str, str]:
    """run.sh's environment: the example configuration, on ports the OS picks, short heartbeats."""
    env = {k: v for k, v in worker_env().items() if not k.startswith("WSD_")}
    return {**env, "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
            "WSD_COORDINATOR_AGENT_ENDPOINT": "tcp://127.0.0.1:0",
            "WSD_COORDINATOR_CLIENT_ENDPOINT": "tcp://127.0.0.1:0",
            "WSD_COORDINATOR_METRICS_PORT": "0",
            "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state"),
            "WSD_COORDINATOR_HEARTBEAT_INTERVAL": "0.2", "WSD_COORDINATOR_HEARTBEAT_TIMEOUT": "1.0",
            **_SMALL_WORKLOAD, **knobs}


def _start_cluster(spawn, tmp_path: Path, nproc: int, **knobs: str):  # noqa: F811
    proc = spawn(["bash", str(RUN_SH)], env=_local_env(tmp_path, NPROC=str(nproc), **knobs), name="run.sh")
    endpoint = proc.wait_for(r"wsd-local: clients on (\S+)", 60).group(1)
    proc.wait_for(rf"wsd-local: try +WSD_ENDPOINT={re.escape(endpoint)} wsctl status", 5)
    metrics_url = proc.wait_for(r"wsd-local: Prometheus metrics on (http://\S+)", 5).group(1)
    client = Client(endpoint, timeout=5)
    wait_until(lambda: client.status()["ranks"]["live"] == nproc, 60, f"{nproc} ranks to register")
    return proc, client, metrics_url


def _ranks_up(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {s.labels["rank"]: s.value for f in text_string_to_metric_families(text) if f.name == "wsd_rank_up"
            for s in f.samples}


def test_local_script_runs_a_cluster_shows_chosen_ranks_and_stops_on_ctrl_c(tmp_path, spawn):  # noqa: F811
    """Ctrl-C (SIGINT to the terminal's process group) stops the workers at one step, then
    torchrun, then the coordinator: every process gone, exit 0. Only local rank 0 prints
    (SHOW_RANKS, torchrun's --local-ranks-filter); rank 1's output is in LOG_DIR."""
    logs = tmp_path / "logs"
    proc, client, metrics_url = _start_cluster(spawn, tmp_path, 2, SHOW_RANKS="0", LOG_DIR=str(logs))
    with client:
        status = client.status()
        assert status["world_size"] == 2 and status["tp_size"] == 2  # told up front; one group per node
        # run.sh made up a token, as `wsd up` does: the workers registered with it.
        assert status["agents_authenticated"] is True and status["agents_refused"] == {}
    # The metrics URL the script printed (from the coordinator's ready line) answers.
    wait_until(lambda: _ranks_up(metrics_url) == {"0": 1.0, "1": 1.0}, 10, "both ranks up in /metrics")
    proc.wait_for(r"rank 0/2 wsd.worker.workload INFO warm-up done", 30)
    pids = proc.tree()
    assert len(pids) >= 5, pids  # run.sh, the coordinator, torchrun, two workers
    proc.send(signal.SIGINT, group=True)
    assert proc.wait(60) == 0, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("wsd-local: stopped by SIGINT") == 1, proc.output()
    assert proc.count(r"rank 0/2 wsd.programs.worker INFO stopped cleanly after") == 1, proc.output()
    assert proc.count(r"rank 1/2") == 0, "rank 1 printed despite SHOW_RANKS=0"
    assert proc.count("coordinator stopped") == 1 and proc.count("Traceback") == 0, proc.output()
    rank1 = [p for p in logs.rglob("*.log") if p.parent.name == "1" and "stopped cleanly after" in p.read_text()]
    assert len(rank1) == 1, sorted(str(p) for p in logs.rglob("*"))
    assert leftovers(tmp_path) == []


def test_local_script_stops_everything_on_sigterm(tmp_path, spawn):  # noqa: F811
    """SIGTERM to the script alone (as a service manager sends it): the TERM trap stops what
    it started. Idle workers, empty SHOW_RANKS: every rank prints."""
    proc, client, _ = _start_cluster(spawn, tmp_path, 2, SHOW_RANKS="", WORKER_ARGS="--idle")
    client.close()
    pids = proc.tree()
    assert len(pids) >= 5, pids
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("wsd-local: stopped by SIGTERM") == 1, proc.output()
    assert proc.count(r"rank [01]/2 wsd.programs.worker INFO stopped cleanly \(idle\)") == 2, proc.output()
    assert leftovers(tmp_path) == []


def test_local_script_stops_the_workers_when_its_coordinator_dies(tmp_path, spawn):  # noqa: F811
    """A coordinator that dies (here SIGKILL) leaves no workers running on their own: the
    script stops them and exits 1."""
    proc, client, _ = _start_cluster(spawn, tmp_path, 1, WORKER_ARGS="--idle")
    client.close()
    pids = proc.tree()
    coordinators = [p for p in pids if "wsd.programs.cli coordinator" in cmdline(p)]
    assert len(coordinators) == 1, [cmdline(p) for p in pids]
    os.kill(coordinators[0], signal.SIGKILL)
    assert proc.wait(60) == 1, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("the coordinator ended unexpectedly; stopping the workers") == 1
    assert proc.count(r"stopped cleanly \(idle\)") == 1, proc.output()
    assert leftovers(tmp_path) == []


def test_local_script_refuses_a_bad_configuration_before_starting_workers(tmp_path, spawn):  # noqa: F811
    config = write_config(tmp_path / "bad.toml", {"workspace": {"num_ubatches": 0}})
    proc = spawn(["bash", str(RUN_SH)], env=_local_env(tmp_path, CONFIG=config), name="run.sh")
    assert proc.wait(60) == 2, proc.output()
    assert "bad.toml" in proc.output() and "num_ubatches must be between 1 and" in proc.output()
    assert proc.count("wsd-local: the coordinator exited with code 2 before it was ready") == 1
    assert "torch" not in proc.output() and leftovers(tmp_path) == []


@pytest.mark.parametrize(("knob", "value"), [("NPROC", "0"), ("NPROC", "two"), ("SHOW_RANKS", "rank0"),
                                             ("STOP_GRACE", "-1"), ("ENGINE", "trt"), ("API_PORT", "http")])
def test_local_script_names_a_bad_knob(tmp_path, knob, value):
    result = subprocess.run(["bash", str(RUN_SH)], env=_local_env(tmp_path, **{knob: value}),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"wsd-local: {knob} must be"), result.stderr
    assert leftovers(tmp_path) == []


def test_local_script_with_vllm_needs_its_model(tmp_path):
    result = subprocess.run(["bash", str(RUN_SH)], env=_local_env(tmp_path, ENGINE="vllm"),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr == "wsd-local: ENGINE=vllm needs VLLM_MODEL, the model vLLM serves\n"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("plugins", ["", "lora_resolver", "wsd-extra,other"])
def test_local_script_with_vllm_refuses_an_allow_list_without_wsd(tmp_path, plugins):
    """Set, VLLM_PLUGINS names every plugin vLLM loads: one without wsd would start vLLM
    without wsd and say nothing, so the recipe says so and starts nothing."""
    result = subprocess.run(["bash", str(RUN_SH)], env=_local_env(tmp_path, ENGINE="vllm", VLLM_MODEL="m",
                                                                  VLLM_PLUGINS=plugins),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"wsd-local: VLLM_PLUGINS='{plugins}' leaves wsd out: vLLM loads only the plugins "
                             f"it names; add wsd (VLLM_PLUGINS={plugins + ',' if plugins else ''}wsd) or unset it\n")
    assert leftovers(tmp_path) == []


# -- CURVE keys, for real: the documented steps, the mounts, a coordinator --------------------------


def _readme_block(heading: str) -> str:
    """The first ```sh block of deploy/README.md after ``heading``."""
    text = README.read_text()
    block = re.search(r"```sh\n(.*?)```", text[text.index(heading):], re.S)
    assert block, heading
    return block.group(1)


def _run_readme_block(heading: str, cwd: Path) -> list[list[str]]:
    """Run the block as written in ``cwd`` (HOME there too), with a ``kubectl`` that only
    records its arguments; the calls it recorded."""
    shim, log = cwd / "shim", cwd / "kubectl.log"
    shim.mkdir()
    (shim / "kubectl").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                  f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (shim / "kubectl").chmod(0o755)
    (cwd / "home").mkdir()
    env = {**os.environ, "HOME": str(cwd / "home"),
           "PATH": os.pathsep.join([str(shim), os.path.dirname(sys.executable), os.environ["PATH"]])}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", _readme_block(heading)], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _secrets(calls: list[list[str]], cwd: Path) -> dict[str, dict[str, bytes]]:
    """{Secret: {entry: content}} that `kubectl create secret generic` would have made."""
    secrets = {}
    for call in calls:
        if call[:3] != ["create", "secret", "generic"]:
            continue
        data = {}
        for arg in call[4:]:
            assert arg.startswith("--from-file="), arg
            key, _, path = arg[len("--from-file="):].rpartition("=")
            source = cwd / path
            for file in sorted(source.iterdir()) if source.is_dir() else [source]:
                data[key or file.name] = file.read_bytes()
        secrets[call[3]] = data
    return secrets


def _mount_as_kubelet(target: Path, volume: dict[str, Any], secrets: dict[str, dict[str, bytes]]) -> None:
    """The volume as the kubelet mounts it with fsGroup: files in a timestamped folder behind
    ..data, visible names linked to it, modes defaultMode | 0440."""
    entries: dict[str, bytes] = {}
    for name, items, optional in _secret_sources(volume):
        if name not in secrets:
            assert optional, f"Secret {name} is required and the documented steps make none"
            continue
        if items is None:
            entries.update(secrets[name])
        for item in items or []:
            assert item["key"] in secrets[name], f"Secret {name} has no entry {item['key']}"
            entries[item["path"]] = secrets[name][item["key"]]
    source = volume.get("secret") or volume.get("projected")
    assert source is not None, f"volume {volume.get('name')} is neither a Secret nor a projected one"
    mode = source["defaultMode"] | 0o440
    data = target / "..2025_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    (target / "..data").symlink_to(data.name)
    for path, content in entries.items():
        (data / path).parent.mkdir(parents=True, exist_ok=True)
        (data / path).write_bytes(content)
        (data / path).chmod(mode)
        top = path.split("/")[0]
        if not (target / top).is_symlink():
            (target / top).symlink_to(f"..data/{top}")


def _install_pod_keys(kind: str, root: Path, secrets: dict[str, dict[str, bytes]]) -> Path:
    """Mount the pod's Secret volumes under ``root`` as the kubelet would and run the pod's
    install-keys initContainer over them, with its own environment; the keys folder."""
    spec = _spec(kind)
    init, _secrets_dir, keys = _install_keys(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in init["volumeMounts"]:
        if _secret_sources(volumes[mount["name"]]):
            _mount_as_kubelet(root / mount["mountPath"].lstrip("/"), volumes[mount["name"]], secrets)
    env = {**os.environ, **{e["name"]: str(root / e["value"].lstrip("/")) for e in init["env"]}}
    result = subprocess.run(["bash", str(INSTALL_KEYS)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return root / keys.lstrip("/")


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}


def test_kubernetes_install_keys_gives_each_pod_its_keys_with_modes_wsd_accepts(tmp_path):
    """The documented kubectl steps, the manifests' Secret volumes as the kubelet mounts them
    with fsGroup (group-readable) and install-keys.sh: secret keys end 0600, public ones
    0644, each pod holds only its own secret, and the ..data entries are not copied."""
    secrets = _secrets(_run_readme_block("### Keys on Kubernetes", tmp_path), tmp_path)
    coordinator = _install_pod_keys("Deployment", tmp_path / "coordinator", secrets)
    worker = _install_pod_keys("Job", tmp_path / "worker", secrets)
    assert _modes(coordinator) == {
        "coordinator/coordinator.key_secret": 0o600, "coordinator/coordinator.key": 0o644,
        "coordinator/probe.key_secret": 0o600, "agents/agents.key": 0o644, "admin/alice.key": 0o644,
        "viewer/grafana.key": 0o644, "viewer/probe.key": 0o644}
    assert _modes(worker) == {"coordinator/coordinator.key": 0o644, "agents/agents.key_secret": 0o600}


def _start_secured(spawn, config: Path, tmp_path: Path, cwd: Path, env: Mapping[str, str]):  # noqa: F811
    """`wsd coordinator` with ``config`` and ``env`` (what the recipe gives it), moved to
    OS-chosen loopback ports and a state file of the test's; its two endpoints."""
    base = {k: v for k, v in worker_env().items() if not k.startswith("WSD_")}
    proc = spawn(python("-m", "wsd.programs.cli", "coordinator", "--config", str(config)), cwd=cwd,
                 name="wsd coordinator",
                 env={**base, **env, "WSD_COORDINATOR_AGENT_ENDPOINT": "tcp://127.0.0.1:0",
                      "WSD_COORDINATOR_CLIENT_ENDPOINT": "tcp://127.0.0.1:0",
                      "WSD_COORDINATOR_METRICS_PORT": "0", "WSD_COORDINATOR_METRICS_HOST": "127.0.0.1",
                      "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state")})
    return proc.wait_for(COORDINATOR_READY, 30).groups()


def _agent_registers(agent_endpoint: str, client_endpoint: str, security: Any, *, world_size: int,
                     tp_size: int, token: str, server_key: Path, admin_key: Path) -> None:
    """A worker's agent with ``security``'s keys and the token in its environment (read as
    a worker reads it) registers as rank 0, and the coordinator says it authenticates agents."""
    agent = Agent(WorkspaceManager("cpu", 1), endpoint=agent_endpoint, rank=0, world_size=world_size,
                  tp_size=tp_size, idle=True, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                  curve=agent_keys(security), token=load_agent_token(security, {_AGENT_TOKEN_ENV: token})).start()
    try:
        with Client(client_endpoint, timeout=5, curve_server_key=str(server_key),
                    curve_client_key=str(admin_key)) as admin:
            wait_until(lambda: admin.status()["ranks"]["live"] == 1, 30, "the agent to register")
            status = admin.status()
            assert status["agents_authenticated"] is True and status["world_size"] == world_size
    finally:
        agent.stop(timeout=10)


def _check_roles(client_endpoint: str, server_key: Path, admin_key: Path, viewer_key: Path) -> None:
    with Client(client_endpoint, timeout=5, retries=0, curve_server_key=str(server_key),
                curve_client_key=str(admin_key)) as admin:
        assert one_engine(admin.lock(wait=False)).seq == 1
    with Client(client_endpoint, timeout=5, retries=0, curve_server_key=str(server_key),
                curve_client_key=str(viewer_key)) as viewer:
        assert viewer.status()["desired"]["locked"] is True
        with pytest.raises(ClientError) as refused:
            viewer.unlock(wait=False)
        assert refused.value.code is ErrorCode.FORBIDDEN


def test_kubernetes_example_config_starts_a_coordinator_on_the_installed_keys(tmp_path, spawn):  # noqa: F811
    """kubernetes/wsd.toml, its [security] paths moved (WSD_SECURITY_*) under a root holding
    what each pod's install-keys produced from the documented Secrets: `wsd coordinator`
    starts with the agent token the pod gets from its Secret; the admin key locks, the
    viewer key is forbidden; the liveness probe's command answers; a worker's agent
    registers with the worker pod's keys and token."""
    secrets = _secrets(_run_readme_block("### Keys on Kubernetes", tmp_path), tmp_path)
    ref = _token_ref("Deployment")
    token = secrets[ref["name"]][ref["key"]].decode()
    config = load_config(KUBERNETES / "wsd.toml", env={})
    roots = {kind: tmp_path / kind for kind in ("Deployment", "Job")}
    for kind, root in roots.items():
        _install_pod_keys(kind, root, secrets)

    def moved(kind: str) -> dict[str, str]:
        return {f"WSD_SECURITY_{key.upper()}": str(roots[kind] / getattr(config.security, key).lstrip("/"))
                for key in _SECURITY_FILES + _SECURITY_FOLDERS}

    agent_endpoint, client_endpoint = _start_secured(spawn, KUBERNETES / "wsd.toml", tmp_path, tmp_path,
                                                     {**moved("Deployment"), _AGENT_TOKEN_ENV: token})
    home = tmp_path / "home" / ".wsd"
    keys = roots["Deployment"] / "etc/wsd/keys"
    _check_roles(client_endpoint, keys / "coordinator/coordinator.key", home / "alice.key_secret",
                 home / "grafana.key_secret")
    probe = _container("Deployment")["livenessProbe"]["exec"]["command"]
    probe = [str(roots["Deployment"] / a.lstrip("/")) if a.startswith("/etc/wsd/") else a for a in probe]
    probe[probe.index("--endpoint") + 1] = client_endpoint
    assert wsctl.main(probe[1:]) == 0
    worker = load_config(KUBERNETES / "wsd.toml", env=moved("Job")).security
    _agent_registers(agent_endpoint, client_endpoint, worker, world_size=config.coordinator.world_size,
                     tp_size=config.worker.tp_size, token=token, server_key=keys / "coordinator/coordinator.key",
                     admin_key=home / "alice.key_secret")


def _local_with_security(path: Path) -> Path:
    """local/wsd.toml with its commented [security] section uncommented."""
    text = (DEPLOY / "local" / "wsd.toml").read_text()
    head, marker, tail = text.partition("# [security]\n")
    assert marker, "local/wsd.toml has no commented [security] section"
    lines = tail.splitlines()
    assert all(line.startswith("# ") for line in lines), "the commented section must end the file"
    path.write_text(head + "[security]\n" + "\n".join(line[2:] for line in lines) + "\n")
    return path


def test_slurm_curve_example_is_the_plain_one_plus_security():
    """slurm/wsd-curve.toml is wsd.toml with CURVE: any other difference is drift."""
    plain = load_config(DEPLOY / "slurm" / "wsd.toml", env={})
    curve = load_config(DEPLOY / "slurm" / "wsd-curve.toml", env={})
    assert plain.security.curve_clients is False and curve.security.curve_clients is True
    assert curve.security.curve_agents is True
    assert dataclasses.replace(curve, security=plain.security, source=plain.source) == plain


@pytest.mark.parametrize("example", ["slurm/wsd-curve.toml", "local/wsd.toml"])
def test_security_example_starts_a_coordinator_on_the_documented_keys(example, tmp_path, spawn):  # noqa: F811
    """The documented keygen steps for Slurm and one machine, run as written, then `wsd
    coordinator` with the example (local: its [security] section uncommented) from that
    directory, with the environment its recipe gives it (Slurm: what wsd.sbatch hands its
    coordinator step, world size and token included): the relative key paths resolve, the
    admin key locks, the viewer key is forbidden, and an agent with the workers' keys and
    token registers."""
    _run_readme_block("### Keys for Slurm and one machine", tmp_path)
    if example.startswith("slurm"):
        config = DEPLOY / example
        code, output, steps = _run_sbatch(tmp_path, config)
        assert code == 0, output
        coordinator, workers = _steps(steps)
        assert coordinator["argv"] == python("-m", "wsd.programs.cli", "coordinator", "--config", str(config))
        env, token = coordinator["env"], workers["env"][_AGENT_TOKEN_ENV]
    else:
        # What run.sh gives its coordinator (its real runs above check that it does).
        config = _local_with_security(tmp_path / "local.toml")
        token = secrets.token_hex(32)
        env = {"WSD_COORDINATOR_WORLD_SIZE": "2", _AGENT_TOKEN_ENV: token}
    security = load_config(config, env={}).security
    assert security.curve_clients and security.curve_agents
    agent_endpoint, client_endpoint = _start_secured(spawn, config, tmp_path, tmp_path, env)
    home = tmp_path / "home" / ".wsd"
    _check_roles(client_endpoint, tmp_path / security.server_public_key, home / "alice.key_secret",
                 home / "grafana.key_secret")
    # The workers run from the same directory: their keys, relative paths made absolute here.
    worker = dataclasses.replace(security, **{key: str(tmp_path / getattr(security, key))
                                              for key in _SECURITY_FILES + _SECURITY_FOLDERS})
    assert agent_keys(worker).server == agent_keys(dataclasses.replace(worker, server_public_key=None)).server
    config_file = load_config(config, env={})
    _agent_registers(agent_endpoint, client_endpoint, worker, world_size=int(env["WSD_COORDINATOR_WORLD_SIZE"]),
                     tp_size=config_file.worker.tp_size or int(env["WSD_COORDINATOR_WORLD_SIZE"]), token=token,
                     server_key=tmp_path / security.server_public_key, admin_key=home / "alice.key_secret")


def test_slurm_script_runs_one_vllm_engine_over_every_node_with_the_plugin(tmp_path):
    """ENGINE=vllm: the coordinator's default engine is vLLM's (its world the job's, one TP
    group per node); one `vllm serve` step over the nodes, the plugin on by WSD_CONFIG, the
    agents pointed at the first node, the job's token; on each node, run as srun would,
    the first is the API server and the others headless followers of vLLM's rendezvous."""
    config = DEPLOY / "slurm" / "wsd.toml"
    code, output, steps = _run_sbatch(tmp_path, config, "301", ENGINE="vllm", VLLM_MODEL="meta-llama/Llama-3.1-70B",
                                      VLLM_ARGS="--max-model-len 8192")
    assert code == 0, output
    (coordinator,) = [s for s in steps if "coordinator" in s["argv"]]
    (vllm,) = [s for s in steps if "serve" in " ".join(s["argv"])]
    assert coordinator["env"]["WSD_COORDINATOR_ENGINE"] == "vllm"
    assert coordinator["env"]["WSD_COORDINATOR_WORLD_SIZE"] == "16"
    assert coordinator["env"]["WSD_COORDINATOR_TP_SIZE"] == "8"
    assert vllm["env"]["WSD_CONFIG"] == str(config) and vllm["env"]["WSD_ENGINE"] == "vllm"
    assert vllm["env"]["WSD_COORDINATOR_CONNECT_ENDPOINT"] == "tcp://node1:7600"
    assert vllm["env"][_AGENT_TOKEN_ENV] == coordinator["env"][_AGENT_TOKEN_ENV]
    assert {"--nodes=2", "--ntasks-per-node=1", "--export=ALL"} <= set(vllm["options"])
    # Each node's task, as srun starts it there: its command line, with vllm a double.
    fake = tmp_path / "vllm"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    argv = [*vllm["argv"][:3], str(fake), *vllm["argv"][4:]]
    serve = ["serve", "meta-llama/Llama-3.1-70B", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
             "--port", "8000", "--shutdown-timeout", "10", "--nnodes", "2", "--master-addr", "node1",
             "--master-port", "29501", "--max-model-len", "8192"]
    for node, role in ((0, []), (1, ["--headless"])):
        ran = subprocess.run(argv, env={**os.environ, "SLURM_NODEID": str(node), "SLURM_NNODES": "2"},
                             capture_output=True, text=True, timeout=10)
        assert ran.stdout.splitlines() == [*serve, "--node-rank", str(node), *role], ran.stderr
    # One node: one process, no rendezvous.
    code, output, steps = _run_sbatch(tmp_path, config, "302", ENGINE="vllm", VLLM_MODEL="m",
                                      SLURM_JOB_NODELIST="node1")
    assert code == 0, output
    (vllm,) = [s for s in steps if "serve" in " ".join(s["argv"])]
    argv = [*vllm["argv"][:3], str(fake), *vllm["argv"][4:]]
    ran = subprocess.run(argv, env={**os.environ, "SLURM_NODEID": "0", "SLURM_NNODES": "1"},
                         capture_output=True, text=True, timeout=10)
    assert ran.stdout.splitlines() == ["serve", "m", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
                                       "--port", "8000", "--shutdown-timeout", "10"], ran.stderr


def test_slurm_script_with_vllm_needs_its_model(tmp_path):
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "303", ENGINE="vllm")
    assert code == 2 and steps == [] and "ENGINE=vllm needs VLLM_MODEL" in output


def test_slurm_script_with_vllm_refuses_an_allow_list_without_wsd(tmp_path):
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "304", ENGINE="vllm",
                                      VLLM_MODEL="m", VLLM_PLUGINS="lora_resolver")
    assert code == 2 and steps == [] and "VLLM_PLUGINS='lora_resolver' leaves wsd out" in output, output
    code, output, steps = _run_sbatch(tmp_path, DEPLOY / "slurm" / "wsd.toml", "305", ENGINE="vllm",
                                      VLLM_MODEL="m", VLLM_PLUGINS="lora_resolver,wsd", SLURM_JOB_NODELIST="node1")
    assert code == 0, output
