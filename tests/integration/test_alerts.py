"""deploy/prometheus and deploy/grafana, checked with the real tools: promtool and Prometheus.

Static tier. With promtool (Debian's ``prometheus`` package, which .ci/run
installs; each test skips, saying so, where it is missing): the alert rules
pass ``promtool check rules``; their unit tests (deploy/prometheus/
wsd-alerts.test.yml: group skew in one of two clusters, one coordinator of two
down, a discovered coordinator gone, Slurm jobs that end (no alert), a job
whose ranks never register, a burst of lock violations across ranks and
slots) pass ``promtool test rules``, and fail on rules that fall back into the faults they were written for; both
scrape configurations pass ``promtool check config``. Without a tool: every
metric the rules, their unit tests and the dashboard name is a family that
docs/metrics.md documents and the coordinator exports; every dashboard query
is confined to one cluster; no panel puts two units on one axis.

Process tier: a real Prometheus, loading the shipped rules with a scrape
configuration made from the shipped one, scrapes three running coordinators
(``wsd coordinator``; two with two simulated ranks of four registered, one
with none): every alert rule evaluates without error, with two clusters' TP
group 0 side by side; every dashboard query parses and returns one cluster's
figures; the ranks that never registered raise WsdRankDown once per TP group
and cluster; stopping one coordinator raises WsdCoordinatorDown for that one
alone.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import wait_until
from procs import Proc, processes, python, write_config

from wsd.coordinator.metrics import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "wsd-alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "wsd-alerts.test.yml"
SCRAPE = PROMETHEUS_DIR / "prometheus.yml"
SCRAPE_KUBERNETES = PROMETHEUS_DIR / "prometheus-kubernetes.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "wsd-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
_MISSING = "is not installed (Debian's package `prometheus` has it; .ci/run installs it)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {_MISSING}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus {_MISSING}")

# The labels a scrape gives every series of a coordinator: one cluster is one
# (namespace, job, instance); static targets have no namespace.
_TARGET = ("namespace", "job", "instance")


def _yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _yaml(ALERTS)["groups"] for rule in group["rules"]]


def _promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


# -- promtool ------------------------------------------------------------------------------------


@needs_promtool
def test_alert_rules_pass_promtool_check():
    result = _promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


@needs_promtool
def test_alert_unit_tests_pass():
    """The scenarios of deploy/prometheus/wsd-alerts.test.yml, evaluated by promtool against
    the shipped rules: alerts fire for the right cluster and group, with their annotations."""
    result = _promtool("test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# Each fault the rules once had, put back into a copy of them: the unit tests must
# catch it. (what the rules say, what the fault says, a pattern of what promtool must report.)
_FAULTS = {
    "matching on tp_group alone": (
        "/ on (job, instance, namespace, engine, tp_group)", "/ on (tp_group)",
        r"rule: WsdGroupSkew, .* err: .*matching"),
    "counting on tp_group alone": (
        "count by (job, instance, namespace, engine, tp_group) (wsd_rank_workspace_bytes)",
        "count by (tp_group) (wsd_rank_workspace_bytes)", "alertname: WsdGroupSkew"),
    "a coordinator down as absent(wsd_ranks)": (
        'up{job=~"wsd-coordinator.*"} == 0', "absent(wsd_ranks)", "alertname: WsdCoordinatorDown"),
    "a Slurm job that ended as a coordinator gone": (
        'up{job=~"wsd-coordinator.*", job!="wsd-coordinator-slurm"}[1h]', 'up{job=~"wsd-coordinator.*"}[1h]',
        "alertname: WsdCoordinatorGone"),
    "a rank alert per rank": (
        "count by (job, instance, namespace, engine, tp_group) (wsd_rank_up == 0)", "wsd_rank_up == 0",
        "alertname: WsdRankDown"),
    "the engines of one coordinator counted together": (
        "count by (job, instance, namespace, engine, tp_group) (wsd_rank_up == 0)",
        "count by (job, instance, namespace, tp_group) (wsd_rank_up == 0)", "alertname: WsdRankDown"),
    "a stalled rank alerted without the peer it waits for": (
        "max by (job, instance, namespace, engine, tp_group, rank, peer) (wsd_rank_waits_for == 1)",
        "max by (job, instance, namespace, engine, tp_group, rank) (wsd_rank_waits_for == 1)",
        "alertname: WsdRankStalled"),
    "a violation alert per rank": (
        "sum by (job, instance, namespace, engine, tp_group) (increase(wsd_rank_lock_violations_total[5m])) > 0",
        "increase(wsd_rank_lock_violations_total[5m]) > 0", "alertname: WsdLockViolations"),
}


@needs_promtool
@pytest.mark.parametrize("fault", sorted(_FAULTS))
def test_alert_unit_tests_catch_the_faults_they_were_written_for(fault, tmp_path):
    """A unit test that passes whatever the rules say proves nothing: each fault the rules
    once had, put back into a copy of the rules makes ``promtool test rules`` fail, and say why."""
    good, bad, reported = _FAULTS[fault]
    text = ALERTS.read_text()
    assert good in text, f"the rules no longer contain {good!r}: update this test"
    (tmp_path / ALERTS.name).write_text(text.replace(good, bad))
    shutil.copy(ALERT_TESTS, tmp_path)
    result = _promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0, f"the unit tests pass with {fault}"
    assert re.search(reported, result.stdout + result.stderr), result.stdout + result.stderr


def _target(series: str) -> tuple[str, ...]:
    """(namespace, job, instance) of an input series written as ``name{label="value", ...}``."""
    labels = dict(re.findall(r'(\w+)="([^"]*)"', series))
    return tuple(labels.get(label, "") for label in _TARGET)


def test_alert_unit_tests_fire_every_alert_among_several_clusters():
    """Every alert is shown firing in some scenario, and every scenario holds two clusters or
    more (what one Prometheus sees when it scrapes several coordinators), or two engines of one
    coordinator (each numbering its ranks from 0)."""
    document = _yaml(ALERT_TESTS)
    assert document["rule_files"] == [ALERTS.name]
    fired = {case["alertname"] for test in document["tests"] for case in test.get("alert_rule_test", [])
             if case["exp_alerts"]}
    assert fired == {rule["alert"] for rule in _rules()}
    for test in document["tests"]:
        clusters = {_target(s["series"]) for s in test["input_series"]}
        engines = {(_target(s["series"]), m.group(1)) for s in test["input_series"]
                   if (m := re.search(r'engine="([^"]*)"', s["series"]))}
        assert len(clusters) >= 2 or len(engines) >= 2, f"{test['name']}: one cluster and one engine only"


@needs_promtool
@pytest.mark.parametrize("path", [SCRAPE, SCRAPE_KUBERNETES], ids=lambda p: p.name)
def test_scrape_configuration_passes_promtool_check(path, tmp_path):
    """prometheus.yml must load in any build, Debian's included. prometheus-kubernetes.yml
    needs Kubernetes discovery, which a distribution build may lack: there, everything but
    the discovery is checked (a static target in its place)."""
    result = _promtool("check", "config", path.name)
    if result.returncode != 0 and "field kubernetes_sd_configs not found" in result.stderr + result.stdout:
        assert path != SCRAPE, "prometheus.yml must load without Kubernetes discovery"
        document = _yaml(path)
        for job in document["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs"), job["job_name"]
            job["static_configs"] = [{"targets": ["127.0.0.1:7602"]}]
        (tmp_path / path.name).write_text(yaml.safe_dump(document))
        shutil.copy(ALERTS, tmp_path)
        result = _promtool("check", "config", path.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _yaml(path)["rule_files"] == [ALERTS.name]


# -- names, filters and units ------------------------------------------------------------------


def _documented() -> dict[str, str]:
    """{family: type} from the table of docs/metrics.md."""
    rows = re.findall(r"^\| `(wsd_\w+)` \| (\w+) \|", METRICS_DOC.read_text(), re.M)
    assert rows, "no family found in docs/metrics.md"
    return dict(rows)


def _series_of(families: dict[str, str]) -> dict[str, str]:
    """{series name: family} of families given as {name: type}."""
    series = {}
    for name, kind in families.items():
        if kind == "counter":
            series[name if name.endswith("_total") else name + "_total"] = name
        elif kind == "histogram":
            series.update({name + suffix: name for suffix in ("_bucket", "_sum", "_count")})
        else:
            series[name] = name
    return series


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in _dashboard()["templating"]["list"]}


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return query["query"] if isinstance(query, dict) else query


def _dashboard_queries() -> list[tuple[str, str]]:
    """(where, expression) of every panel target and every query variable."""
    queries = [(f"panel {p['title']!r}", t["expr"]) for p in _panels() for t in p["targets"]]
    queries += [(f"variable {name}", _variable_query(v)) for name, v in _variables().items() if v["type"] == "query"]
    return queries


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every expression that names metrics: the rules, their unit tests
    (input series and expressions) and the dashboard."""
    texts = [(f"rule {r['alert']}", r["expr"]) for r in _rules()]
    for test in _yaml(ALERT_TESTS)["tests"]:
        texts += [(f"unit test {test['name']!r}", s["series"]) for s in test["input_series"]]
        texts += [(f"unit test {test['name']!r}", e["expr"]) for e in test.get("promql_expr_test", [])]
    return texts + _dashboard_queries()


def test_every_metric_named_is_documented_and_exported():
    """A misspelt family is an empty panel, an alert that never fires, or a unit test that
    proves nothing, with no error anywhere: every wsd_ series named must belong to a family
    docs/metrics.md documents and the coordinator exports."""
    documented = _series_of(_documented())
    exported = FAMILIES
    used = set()
    for where, text in _texts():
        names = set(re.findall(r"\bwsd_\w+", text))
        unknown = names - set(documented)
        assert not unknown, f"{where} names {sorted(unknown)}, not in docs/metrics.md"
        used |= {documented[n] for n in names}
    assert not used - set(exported), f"documented but not exported: {sorted(used - set(exported))}"
    # Each alert and the dashboard's main panels are there to be checked.
    assert {"wsd_rank_up", "wsd_slot_lock_violations_total", "wsd_group_skew_bytes",
            "wsd_slot_capacity_bytes", "wsd_slot_peak_requested_bytes"} <= used


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: operator and value}) of every wsd_ selector of ``expr``."""
    found = []
    for name, body in re.findall(r"\b(wsd_\w+)\s*(?:\{([^}]*)\})?", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")', body)
        found.append((name, {label: op + value for label, op, value in matchers}))
    return found


_CLUSTER = {"namespace": '=~"$namespace"', "job": '="$job"', "instance": '="$instance"'}
"""The matchers that confine a query to the cluster chosen at the top of the dashboard."""
_CHOOSERS = {f"variable {name}" for name in _TARGET}
"""The variables that choose the cluster: their queries span every cluster."""


def test_every_dashboard_query_is_confined_to_one_cluster():
    """Two clusters in one Prometheus number their ranks and groups alike: a query without
    the cluster's matchers sums or mixes them. Every selector of every panel, and the
    tp_group and rank variables, must carry them; one cluster is chosen at a time; "Ranks up"
    honours the TP group and rank filters as the panels beside it do."""
    variables = _variables()
    for name in _TARGET:
        assert name in variables, f"no {name} variable"
    assert not variables["instance"]["multi"] and not variables["instance"].get("includeAll")
    assert not variables["job"]["multi"] and not variables["job"].get("includeAll")
    for where, expr in _dashboard_queries():
        if where in _CHOOSERS:
            continue
        selectors = _selectors(expr)
        assert selectors, f"{where}: no wsd_ selector in {expr!r}"
        for metric, matchers in selectors:
            missing = {k: v for k, v in _CLUSTER.items() if matchers.get(k) != v}
            assert not missing, f"{where}: {metric} lacks {missing}"
    (ranks_up,) = [p for p in _panels() if p["title"] == "Ranks up"]
    for target in ranks_up["targets"]:
        for _, matchers in _selectors(target["expr"]):
            assert matchers.get("tp_group") == '=~"$tp_group"' and matchers.get("rank") == '=~"$rank"'


def _unit(series: str) -> str:
    """What a series measures: bytes, seconds, or (any other) itself."""
    base = re.sub(r"_(total|bucket|sum|count)$", "", series)
    for unit in ("bytes", "seconds"):
        if base.endswith("_" + unit):
            return unit
    return base


_GRAFANA_UNITS = {"bytes": "bytes", "seconds": "s"}


def test_no_panel_puts_two_units_on_one_axis():
    """Steps, heartbeats, sequence numbers and seconds on one axis read as nothing: each
    panel graphs one kind of figure, in the unit Grafana is told."""
    for panel in _panels():
        # wsd_rank_info is 1 for every rank: a join's label source (model_name, UUID), no unit.
        units = {_unit(name) for t in panel["targets"] for name, _ in _selectors(t["expr"])
                 if not name.endswith("_info")}
        if not units:  # another exporter's figure, confined to the cluster by a join (vLLM's)
            continue
        assert len(units) == 1, f"panel {panel['title']!r} mixes {sorted(units)}"
        (unit,) = units
        if unit in _GRAFANA_UNITS:
            assert panel["fieldConfig"]["defaults"].get("unit") == _GRAFANA_UNITS[unit], panel["title"]


# -- a real Prometheus scraping running coordinators -------------------------------------------

WORLD_SIZE, TP_SIZE, REGISTERED = 4, 2, 2
"""Each cluster expects 4 ranks in TP groups of 2; ranks 0 and 1 (group 0) register, group 1 never does."""

_READY = re.compile(r"wsd coordinator ready: agents (\S+) clients (\S+) metrics http://(\S+)/metrics")


@dataclass
class Cluster:
    coordinator: Proc
    agents: str
    clients: str
    target: str
    """HOST:PORT of its metrics, the ``instance`` Prometheus gives its series."""


@dataclass
class Prometheus:
    url: str
    clusters: dict[str, Cluster]
    """"a" and "b", with simulated ranks; "victim", a coordinator alone, for the test that stops it."""


def _start_cluster(start: Any, folder: Path, *, ranks: int) -> Cluster:
    folder.mkdir()
    config = write_config(folder / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(folder / "state"), "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0,
        "metrics_port": 0, "metrics_refresh": 0.5, "world_size": WORLD_SIZE, "tp_size": TP_SIZE}})
    coordinator = start(python("-m", "wsd.programs.cli", "coordinator", "--config", config),
                        name=f"coordinator-{folder.name}")
    agents, clients, target = coordinator.wait_for(_READY.pattern, 30).groups()
    if ranks:
        simulated = start(python("-m", "wsd.agent.simulated", "--endpoint", agents, "--ranks", str(ranks),
                                 "--world-size", str(WORLD_SIZE), "--tp-size", str(TP_SIZE), "--ubatches", "2",
                                 "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.0",
                                 "--model", f"model-{folder.name}"),
                          name=f"ranks-{folder.name}")
        simulated.wait_for("simulated ranks connecting", 30)
    return Cluster(coordinator, agents, clients, target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, Any]:
    """(HTTP status, decoded JSON) of a GET; an error status's body too (Prometheus explains there)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.load(e)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _start_prometheus(start: Any, folder: Path, targets: list[str]) -> str:
    """A Prometheus on a free loopback port, with the shipped rules and the shipped static
    scrape job pointed at ``targets`` every second; its base URL once it answers ready."""
    config = _yaml(SCRAPE)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(ALERTS)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "wsd-coordinator"]
    config["scrape_configs"] = [job]
    job.update(scrape_interval="1s", scrape_timeout="1s", static_configs=[{"targets": targets}])
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    for attempt in range(3):  # the port is free when picked; another process may take it first
        port = _free_port()
        proc = start([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                      f"--storage.tsdb.path={folder / f'data{attempt}'}",
                      f"--web.listen-address=127.0.0.1:{port}"], name="prometheus")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.popen.poll() is None and time.monotonic() < deadline and not _ready(url):
            time.sleep(0.1)
        if proc.popen.poll() is None and _ready(url):
            return url
        if "address already in use" not in proc.output():
            break
    pytest.fail(f"prometheus did not become ready; its output ends:\n{proc.output()[-3000:]}")


def _query(prometheus: Prometheus, expr: str) -> list[dict[str, Any]]:
    """The result of an instant query; fails on any error Prometheus reports (a parse error)."""
    status, body = _get(f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert status == 200 and body["status"] == "success", f"{expr!r}: {body.get('error', body)}"
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.skip(f"prometheus {_MISSING}")
    folder = tmp_path_factory.mktemp("alerts")
    with processes() as start:
        clusters = {name: _start_cluster(start, folder / name, ranks=ranks)
                    for name, ranks in (("a", REGISTERED), ("b", REGISTERED), ("victim", 0))}
        prometheus = Prometheus(_start_prometheus(start, folder, [c.target for c in clusters.values()]), clusters)
        # A command, so that the command families have samples whatever the exporter's start.
        # Exit code 3: incomplete, as ranks 2 and 3 never registered.
        lock = subprocess.run(python("-m", "wsd_client.wsctl", "--endpoint", clusters["a"].clients, "lock"),
                              capture_output=True, text=True, timeout=30)
        assert lock.returncode in (0, 3), lock.stdout + lock.stderr
        # Every cluster scraped, and both clusters' TP group 0 answered a stats round: the
        # rules' vector matches then meet two clusters' group 0 side by side.
        wait_until(lambda: len(_query(prometheus, 'up{job="wsd-coordinator"} == 1')) == 3, 30,
                   "Prometheus to scrape the three coordinators")
        wait_until(lambda: len(_query(prometheus, 'wsd_group_skew_bytes{tp_group="0"}')) == 2, 30,
                   "both clusters' group 0 to report a stats round")
        yield prometheus


def _rule_states(prometheus: Prometheus) -> dict[str, dict[str, Any]]:
    status, body = _get(prometheus.url + "/api/v1/rules")
    assert status == 200, body
    return {r["name"]: r for g in body["data"]["groups"] for r in g["rules"]}


def _evaluated_since(rule: dict[str, Any], since: float) -> bool:
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", rule["lastEvaluation"]).replace("Z", "+00:00")
    return rule["health"] != "unknown" and datetime.fromisoformat(stamp).timestamp() > since


@needs_prometheus
def test_every_alert_rule_evaluates_in_prometheus(prometheus):
    """Loaded by a real Prometheus that scrapes two clusters numbered alike, every rule
    evaluates without error (the old group-skew rule failed every evaluation here)."""
    since = time.time()
    names = {rule["alert"] for rule in _rules()}
    wait_until(lambda: {n for n, r in _rule_states(prometheus).items() if _evaluated_since(r, since)} >= names,
               30, "every rule to be evaluated again")
    states = _rule_states(prometheus)
    assert set(states) == names
    for name, rule in states.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), f"{name}: {rule.get('lastError')}"


def _substituted(expr: str, cluster: Cluster) -> str:
    """A dashboard query as Grafana sends it with cluster ``cluster`` chosen and All groups and ranks."""
    values = {"namespace": ".*", "job": "wsd-coordinator", "instance": cluster.target, "engine": ".*", "tp_group": ".*",
              "rank": ".*", "__rate_interval": "1m"}
    label_values = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr, re.S)
    if label_values:  # Grafana's, not PromQL: Grafana asks for the series of its selector
        expr = label_values.group(1)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


_OTHERS = re.compile(r"avg by \(model_name\) \(vllm:kv_cache_usage_perc\) and on \(model_name\) ")
"""The dashboard's figures of other exporters, joined to one cluster's ranks by model_name."""


@needs_prometheus
def test_every_dashboard_query_parses_and_shows_one_cluster(prometheus):
    """Each panel's and variable's query, with the variables as Grafana fills them in, parses
    in Prometheus and returns figures; those are one cluster's, not the sum of two alike."""
    cluster = prometheus.clusters["a"]
    for where, expr in _dashboard_queries():
        query = _substituted(expr, cluster)
        _query(prometheus, query)  # parses: fails at once otherwise
        if _OTHERS.match(query):  # another exporter's figures (vLLM's): none runs here, so
            query = _OTHERS.sub("", query)  # the wsd part they are joined to must return data
        wait_until(lambda q=query: _query(prometheus, q), 30, f"{where} to return data ({query})")
        if where in _CHOOSERS:
            continue  # they list every cluster, to choose one
        for sample in _query(prometheus, query):
            assert sample["metric"].get("instance", cluster.target) == cluster.target, (where, sample)
    (ranks_up,) = [p for p in _panels() if p["title"] == "Ranks up"]
    up, expected = ([float(s["value"][1]) for s in _query(prometheus, _substituted(t["expr"], cluster))]
                    for t in ranks_up["targets"])
    assert (up, expected) == ([REGISTERED], [WORLD_SIZE])


def _alerts(prometheus: Prometheus, name: str) -> list[dict[str, Any]]:
    status, body = _get(prometheus.url + "/api/v1/alerts")
    assert status == 200, body
    return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]


@needs_prometheus
def test_ranks_that_never_registered_raise_rank_down_per_group(prometheus):
    """Group 1 of each cluster never registered: WsdRankDown goes pending once for each
    cluster's group 1, with the count of its ranks down, and not for group 0."""
    clusters = prometheus.clusters
    wanted = {(clusters[c].target, "1") for c in ("a", "b")}

    def pending() -> dict[tuple[str, str], str]:
        return {(a["labels"]["instance"], a["labels"]["tp_group"]): a["value"]
                for a in _alerts(prometheus, "WsdRankDown") if a["labels"]["instance"] in {t for t, _ in wanted}}

    wait_until(lambda: set(pending()) == wanted, 30, f"WsdRankDown for {sorted(wanted)}")
    assert {float(v) for v in pending().values()} == {WORLD_SIZE - REGISTERED}
    for alert in _alerts(prometheus, "WsdRankDown"):
        assert alert["labels"]["job"] == "wsd-coordinator" and alert["state"] in ("pending", "firing")


@needs_prometheus
def test_one_coordinator_stopping_raises_coordinator_down_for_it_alone(prometheus):
    """Three coordinators scraped, one stops: WsdCoordinatorDown goes pending for that one,
    named by its instance, while the others stay up (absent(wsd_ranks) saw nothing here)."""
    victim = prometheus.clusters["victim"]
    victim.coordinator.send(signal.SIGTERM)
    victim.coordinator.wait(30)
    wait_until(lambda: [a["labels"]["instance"] for a in _alerts(prometheus, "WsdCoordinatorDown")] == [victim.target],
               30, f"WsdCoordinatorDown for {victim.target} alone")
    up = {s["metric"]["instance"]: s["value"][1] for s in _query(prometheus, 'up{job="wsd-coordinator"}')}
    assert up == {c.target: ("0" if c is victim else "1") for c in prometheus.clusters.values()}


@needs_prometheus
def test_a_real_prometheus_keeps_scraping_while_16_clients_never_read_their_answer(tmp_path):
    """16 connections that sent `GET /metrics` and never read held every slot of the endpoint
    once a scrape outgrew the socket buffers: 0 of 40 real scrapes got in. A real Prometheus
    scrapes an 8 MB view every second while 16 such clients are kept connected (each one the
    endpoint drops is opened again at once); every scrape of it succeeds."""
    import threading

    from test_metrics_server import _big_view

    from wsd.coordinator.metrics_server import MetricsServer

    published = _big_view(2048, 8)
    server = MetricsServer(lambda: published, "127.0.0.1", 0)
    stop = threading.Event()
    opened = [0]

    def hold() -> None:
        socks: list[socket.socket] = []
        while not stop.is_set():
            kept = []
            for sock in socks:
                try:
                    gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False  # nothing to read, still open: it is not reading anyway
                except OSError:
                    gone = True
                if gone:
                    sock.close()
                else:
                    kept.append(sock)
            while len(kept) < 16:
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                kept.append(sock)
                opened[0] += 1
            socks = kept
            stop.wait(0.1)
        for sock in socks:
            sock.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    target = f"127.0.0.1:{server.port}"
    try:
        with processes() as start:
            prometheus = Prometheus(_start_prometheus(start, tmp_path, [target]), {})
            wait_until(lambda: _query(prometheus, f'up{{instance="{target}"}} == 1'), 30, "a first scrape")
            window = f'[8s] @ {time.time() + 8:.3f}'
            wait_until(lambda: time.time() > float(window.split("@ ")[1]) + 1, 15, "eight seconds of scrapes",
                       interval=0.5)
            samples = _query(prometheus, f'count_over_time(up{{instance="{target}"}}{window})')
            lowest = _query(prometheus, f'min_over_time(up{{instance="{target}"}}{window})')
            assert samples and int(samples[0]["value"][1]) >= 6, samples
            assert lowest and float(lowest[0]["value"][1]) == 1, lowest  # no scrape of the eight failed
            assert opened[0] > 16  # the non-readers were dropped, and came back, all along
    finally:
        stop.set()
        holder.join(10)
        server.stop()
