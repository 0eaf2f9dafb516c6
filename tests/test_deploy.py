"""deploy/: the recipes parse, their configurations load, their metric names exist, and
the local script runs and stops a real cluster.

Static tier: every shell script passes ``bash -n`` (and shellcheck where
installed), every YAML file parses, every example TOML loads with
``load_config`` and agrees with the manifests it sits beside, and every metric
name (and label) the dashboard, the alert rules and the scrape configuration
use is one the coordinator exports. Process tier: ``deploy/local/run.sh``
starts a coordinator and torchrun workers, shows only the chosen ranks, and
stops everything it started on Ctrl-C, on SIGTERM, and when its coordinator dies.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import wait_until
from procs import spawn, wait_gone, worker_env, write_config  # noqa: F401  (spawn is a fixture)

from wsd.config import load_config
from wsd_client.client import Client

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RUN_SH = DEPLOY / "local" / "run.sh"
SHELL_SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
TOML_FILES = sorted(DEPLOY.rglob("*.toml"))
DASHBOARD = DEPLOY / "grafana" / "wsd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "wsd-alerts.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
KUBERNETES = DEPLOY / "kubernetes"


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(DEPLOY)) for p in paths]


def test_every_recipe_is_there():
    """The parametrized checks below run over what they find: pin what must be found, so
    that a renamed or deleted recipe fails here instead of silently dropping out."""
    assert {"local/run.sh", "slurm/wsd.sbatch"} <= set(_ids(SHELL_SCRIPTS))
    assert {"local/wsd.toml", "slurm/wsd.toml", "kubernetes/wsd.toml"} <= set(_ids(TOML_FILES))
    assert {"kubernetes/kustomization.yaml", "kubernetes/coordinator.yaml", "kubernetes/workers.yaml",
            "prometheus/prometheus.yml", "prometheus/wsd-alerts.yml"} <= set(_ids(YAML_FILES))
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
        for container in spec["containers"]:
            assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)


def test_kubernetes_keys_are_a_read_only_secret_mounted_alike_everywhere():
    mounts = []
    for _, template in _pod_specs():
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "wsd-curve-keys"
        assert volume["secret"]["defaultMode"] == 0o400
        # Optional until the security issue lands: the pods must start without it.
        assert volume["secret"]["optional"] is True
        for container in spec["containers"]:
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
            assert mount["readOnly"] is True
            mounts.append(mount["mountPath"])
    assert len(mounts) == 2 and set(mounts) == {"/etc/wsd/keys"}


def test_kubernetes_workers_rendezvous_and_world_agree_with_the_configuration():
    """The Job's node count, torchrun's arguments, the headless Service and wsd.toml's world
    size must agree, or the rendezvous waits forever for nodes that never come."""
    config = load_config(KUBERNETES / "wsd.toml", env={})
    (job,) = [w for w, _ in _pod_specs() if w["kind"] == "Job"]
    container = _container("Job")
    env = {e["name"]: e["value"] for e in container["env"]}
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


def test_kustomize_renders_the_manifests_with_the_configuration():
    """`kubectl kustomize` (no cluster needed) renders the ConfigMap from wsd.toml and
    rewrites every reference to its hashed name."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(["kubectl", "kustomize", str(KUBERNETES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert config_map["data"]["wsd.toml"] == (KUBERNETES / "wsd.toml").read_text()
    name = config_map["metadata"]["name"]
    assert name.startswith("wsd-config-")
    for doc in documents:
        if doc["kind"] in ("Deployment", "Job"):
            names = [v["configMap"]["name"] for v in doc["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
            assert names == [name]


# -- metric names --------------------------------------------------------------------------------

_SLOT = ("rank", "tp_group", "ubatch", "lane")
_RANK = ("rank", "tp_group", "host")
_GROUP = ("tp_group",)

# The families the coordinator exports, {name: (kind, labels)}, mirroring the
# contract of issue 6. The exporter (wsd/metrics.py) does not exist yet: when
# it lands it must export this as wsd.metrics.FAMILIES in the same shape, and
# _families() below then reads it from the code; delete this mirror then.
FAMILIES_MIRROR: dict[str, tuple[str, tuple[str, ...]]] = {
    "wsd_slot_capacity_bytes": ("gauge", _SLOT),
    "wsd_slot_peak_requested_bytes": ("gauge", _SLOT),
    "wsd_slot_requests_total": ("counter", _SLOT),
    "wsd_slot_resizes_total": ("counter", _SLOT),
    "wsd_slot_lock_violations_total": ("counter", _SLOT),
    "wsd_rank_up": ("gauge", _RANK),
    "wsd_rank_locked": ("gauge", _RANK),
    "wsd_rank_ubatches": ("gauge", _RANK),
    "wsd_rank_last_step": ("gauge", _RANK),
    "wsd_rank_workspace_bytes": ("gauge", _RANK),
    "wsd_group_workspace_bytes": ("gauge", _GROUP),
    "wsd_group_skew_bytes": ("gauge", _GROUP),
    "wsd_group_consistent": ("gauge", _GROUP),
    "wsd_command_duration_seconds": ("histogram", ("action",)),
    "wsd_commands_total": ("counter", ("action", "result")),
    "wsd_ranks": ("gauge", ("state",)),
    "wsd_heartbeats_total": ("counter", ()),
    "wsd_command_seq": ("gauge", ()),
    "wsd_stats_age_seconds": ("gauge", ()),
}

# Labels Prometheus adds to every series of a target (the scrape configs' relabelling adds namespace).
_TARGET_LABELS = {"job", "instance", "namespace"}


def _families() -> Mapping[str, tuple[str, tuple[str, ...]]]:
    try:
        from wsd import metrics  # type: ignore[attr-defined]
    except ImportError:
        return FAMILIES_MIRROR
    return getattr(metrics, "FAMILIES", FAMILIES_MIRROR)


def _series() -> dict[str, frozenset[str]]:
    """Every series name the exporter emits, with the labels it carries."""
    series = {}
    for name, (kind, labels) in _families().items():
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
    """Labels named in Grafana legends ({{rank}}) and alert templates ({{ $labels.rank }})."""
    return set(re.findall(r"\{\{\s*(?:\$labels\.)?(\w+)\s*\}\}", text)) - {"value"}


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
    text = SCRAPE.read_text()
    return [(name, "") for name in re.findall(r"\bwsd_\w+", text)]


@pytest.mark.parametrize("source", ["dashboard", "alerts", "scrape"])
def test_every_metric_and_label_used_is_exported(source):
    """A misspelt series or label gives an empty panel or an alert that never fires, with no
    error anywhere: each name must be one the coordinator exports (deploy/grafana, deploy/prometheus)."""
    queries = {"dashboard": _dashboard_queries, "alerts": _alert_queries, "scrape": _scrape_queries}[source]()
    series = _series()
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
    metrics port (7602; the [coordinator] key that sets it arrives with the exporter)."""
    (document,) = _documents(SCRAPE)
    jobs = {job["job_name"]: job for job in document["scrape_configs"]}
    assert document["rule_files"] == [ALERTS.name]
    static = jobs["wsd-coordinator"]["static_configs"][0]["targets"]
    assert [t.rsplit(":", 1)[1] for t in static] == ["7602"]
    keep = jobs["wsd-coordinator-kubernetes"]["relabel_configs"][0]
    service, port_name = keep["regex"].split(";")
    (svc,) = [d for d in _manifests() if d["kind"] == "Service" and d["metadata"]["name"] == service]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}[port_name] == 7602
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"


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
            "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state"),
            "WSD_COORDINATOR_HEARTBEAT_INTERVAL": "0.2", "WSD_COORDINATOR_HEARTBEAT_TIMEOUT": "1.0",
            **_SMALL_WORKLOAD, **knobs}


def _start_cluster(spawn, tmp_path: Path, nproc: int, **knobs: str):  # noqa: F811
    proc = spawn(["bash", str(RUN_SH)], env=_local_env(tmp_path, NPROC=str(nproc), **knobs), name="run.sh")
    endpoint = proc.wait_for(r"wsd-local: clients on (\S+)", 60).group(1)
    proc.wait_for(rf"wsd-local: try +WSD_ENDPOINT={re.escape(endpoint)} wsctl status", 5)
    client = Client(endpoint, timeout=5)
    wait_until(lambda: client.status()["ranks"]["live"] == nproc, 60, f"{nproc} ranks to register")
    return proc, client


def _leftovers(tmp_path: Path) -> list[str]:
    return [p.name for p in tmp_path.glob("wsd-local.*")]


def test_local_script_runs_a_cluster_shows_chosen_ranks_and_stops_on_ctrl_c(tmp_path, spawn):  # noqa: F811
    """Ctrl-C (SIGINT to the terminal's process group) stops the workers at one step, then
    torchrun, then the coordinator: every process gone, exit 0. Only local rank 0 prints
    (SHOW_RANKS, torchrun's --local-ranks-filter); rank 1's output is in LOG_DIR."""
    logs = tmp_path / "logs"
    proc, client = _start_cluster(spawn, tmp_path, 2, SHOW_RANKS="0", LOG_DIR=str(logs))
    with client:
        status = client.status()
        assert status["world_size"] == 2 and status["tp_size"] == 2  # told up front; one group per node
    proc.wait_for(r"rank 0/2 wsd.workload INFO warm-up done", 30)
    pids = proc.tree()
    assert len(pids) >= 5, pids  # run.sh, the coordinator, torchrun, two workers
    proc.send(signal.SIGINT, group=True)
    assert proc.wait(60) == 0, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("wsd-local: stopped by SIGINT") == 1, proc.output()
    assert proc.count(r"rank 0/2 wsd.worker INFO stopped cleanly after") == 1, proc.output()
    assert proc.count(r"rank 1/2") == 0, "rank 1 printed despite SHOW_RANKS=0"
    assert proc.count("coordinator stopped") == 1 and proc.count("Traceback") == 0, proc.output()
    rank1 = [p for p in logs.rglob("*.log") if p.parent.name == "1" and "stopped cleanly after" in p.read_text()]
    assert len(rank1) == 1, sorted(str(p) for p in logs.rglob("*"))
    assert _leftovers(tmp_path) == []


def test_local_script_stops_everything_on_sigterm(tmp_path, spawn):  # noqa: F811
    """SIGTERM to the script alone (as a service manager sends it): the TERM trap stops what
    it started. Idle workers, empty SHOW_RANKS: every rank prints."""
    proc, client = _start_cluster(spawn, tmp_path, 2, SHOW_RANKS="", WORKER_ARGS="--idle")
    client.close()
    pids = proc.tree()
    assert len(pids) >= 5, pids
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("wsd-local: stopped by SIGTERM") == 1, proc.output()
    assert proc.count(r"rank [01]/2 wsd.worker INFO stopped cleanly \(idle\)") == 2, proc.output()
    assert _leftovers(tmp_path) == []


def test_local_script_stops_the_workers_when_its_coordinator_dies(tmp_path, spawn):  # noqa: F811
    """A coordinator that dies (here SIGKILL) leaves no workers running on their own: the
    script stops them and exits 1."""
    proc, client = _start_cluster(spawn, tmp_path, 1, WORKER_ARGS="--idle")
    client.close()
    pids = proc.tree()
    coordinators = [p for p in pids if "wsd.cli coordinator" in _cmdline(p)]
    assert len(coordinators) == 1, [_cmdline(p) for p in pids]
    os.kill(coordinators[0], signal.SIGKILL)
    assert proc.wait(60) == 1, proc.output()
    wait_gone(pids, 10, "processes started by run.sh")
    assert proc.count("the coordinator ended unexpectedly; stopping the workers") == 1
    assert proc.count(r"stopped cleanly \(idle\)") == 1, proc.output()
    assert _leftovers(tmp_path) == []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_local_script_refuses_a_bad_configuration_before_starting_workers(tmp_path, spawn):  # noqa: F811
    config = write_config(tmp_path / "bad.toml", {"workspace": {"num_ubatches": 0}})
    proc = spawn(["bash", str(RUN_SH)], env=_local_env(tmp_path, CONFIG=config), name="run.sh")
    assert proc.wait(60) == 2, proc.output()
    assert "bad.toml" in proc.output() and "num_ubatches must be between 1 and" in proc.output()
    assert proc.count("wsd-local: the coordinator exited with code 2 before it was ready") == 1
    assert "torch" not in proc.output() and _leftovers(tmp_path) == []


@pytest.mark.parametrize(("knob", "value"), [("NPROC", "0"), ("NPROC", "two"), ("SHOW_RANKS", "rank0"),
                                             ("STOP_GRACE", "-1")])
def test_local_script_names_a_bad_knob(tmp_path, knob, value):
    result = subprocess.run(["bash", str(RUN_SH)], env=_local_env(tmp_path, **{knob: value}),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"wsd-local: {knob} must be"), result.stderr
    assert _leftovers(tmp_path) == []
