"""wsd's figures in vLLM's own /metrics, without an engine: a real manager's figures written
by a worker's ``Publisher``, read by the API server's ``WorkerCollector`` through a real
prometheus_client registry, under vLLM's labels; and lock violations in the process's log.

The real engine (its API server scraped over HTTP) is tests/vllm/test_vllm_server.py.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import msgpack
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wsd import WorkspaceManager
from wsd.families import FAMILIES
from wsd.integrations.vllm import install, metrics
from wsd.manager.config import LockedGrowthPolicy
from wsd.manager.violationlog import ViolationLog
from wsd.slotstats import SLOT_NUMBERS

IDENTITY = {"model_name": "tiny", "engine": "0", "rank": 1, "tp_group": 0, "wsd_engine": "node-a-tiny",
            "coordinator": "", "host": "node-a", "pid": os.getpid(), "device": "cpu", "rank_pod": "llm-0",
            "rank_namespace": "serving", "rank_node": "", "UUID": ""}


def scrape(directory, **options) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One scrape of a registry holding only the workers' collector: samples by name."""
    registry = CollectorRegistry()
    registry.register(metrics.WorkerCollector(str(directory), **options))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def publisher(manager, directory, **identity) -> metrics.Publisher:
    return metrics.Publisher(manager, {**IDENTITY, **identity}, directory=str(directory), step=lambda: 7)


def test_a_workers_slots_reach_vllms_metrics_under_vllms_labels(tmp_path):
    manager = WorkspaceManager("cpu", 2)
    manager.get_simultaneous(((1000,), torch.uint8))
    publisher(manager, tmp_path).publish()
    samples = scrape(tmp_path)
    for number in SLOT_NUMBERS:
        labels = [set(s) for s, _ in samples[number.metric]]
        assert labels == [set(metrics.labels(number.metric))] * 2, number.metric
    capacity = {(s["ubatch"], s["lane"]): v for s, v in samples["wsd_slot_capacity_bytes"]}
    assert capacity == {("0", "0"): 1024.0, ("1", "0"): 0.0}
    ((labels, _),) = samples["wsd_slot_requests_total"][:1]
    assert (labels["model_name"], labels["engine"], labels["rank"], labels["tp_group"]) == ("tiny", "0", "1", "0")
    ((info, value),) = samples["wsd_rank_info"]
    assert value == 1 and info["wsd_engine"] == "node-a-tiny" and info["rank_pod"] == "llm-0"
    assert samples["wsd_rank_last_step"][0][1] == 7 and samples["wsd_rank_ubatches"][0][1] == 2
    assert samples["wsd_rank_workspace_bytes"][0][1] == 1024


def test_labels_are_vllms_first_then_wsds_without_its_engine():
    assert metrics.labels("wsd_slot_capacity_bytes") == ("model_name", "engine", "rank", "tp_group", "ubatch", "lane")
    info = metrics.labels("wsd_rank_info")
    assert info[:2] == ("model_name", "engine") and info.count("model_name") == 1
    assert set(info) == {*FAMILIES["wsd_rank_info"][1], "wsd_engine", "coordinator"}
    assert set(metrics.EXPORTED) <= set(FAMILIES)


def test_unchanged_figures_are_only_marked_current_and_changed_ones_replaced(tmp_path):
    manager = WorkspaceManager("cpu", 1)
    writer = publisher(manager, tmp_path)
    writer.publish()
    path = Path(writer.path)
    first = path.read_bytes()
    os.utime(writer.path, (1000.0, 1000.0))
    writer.publish()
    assert path.read_bytes() == first and os.stat(writer.path).st_mtime > 1000.0
    manager.get_simultaneous(((300,), torch.uint8))
    writer.publish()
    assert msgpack.unpackb(path.read_bytes())["stats"]["slots"]["capacity_bytes"] == [512]
    assert sorted(os.listdir(tmp_path)) == [f"{os.getpid()}.msgpack"]  # nothing left aside


def test_the_age_says_how_long_ago_the_worker_last_looked(tmp_path):
    writer = publisher(WorkspaceManager("cpu", 1), tmp_path)
    writer.publish()
    os.utime(writer.path, (5000.0, 5000.0))
    (age,) = scrape(tmp_path, wall=lambda: 5012.5)["wsd_rank_stats_age_seconds"]
    assert age[1] == 12.5


def test_a_publisher_writes_on_its_own_and_takes_its_figures_away_when_stopped(tmp_path):
    manager = WorkspaceManager("cpu", 1)
    writer = metrics.Publisher(manager, IDENTITY, directory=str(tmp_path), step=lambda: None, interval=0.01)
    writer.start()
    try:
        manager.get_simultaneous(((4096,), torch.uint8))
        deadline = 200
        while deadline and scrape(tmp_path).get("wsd_slot_capacity_bytes", [({}, 0)])[0][1] != 4096:
            deadline -= 1
            writer._stop.wait(0.05)
        assert deadline, "the publisher never wrote the grown slot"
        assert "wsd_rank_last_step" not in scrape(tmp_path)  # no step yet: no sample
    finally:
        writer.stop()
    assert os.listdir(tmp_path) == [] and "wsd_slot_capacity_bytes" not in scrape(tmp_path)


def test_a_gone_workers_figures_are_removed_and_a_bad_file_left_out_once(tmp_path, caplog):
    publisher(WorkspaceManager("cpu", 1), tmp_path, rank=0).publish()
    gone = tmp_path / "4242.msgpack"
    gone.write_bytes((tmp_path / f"{os.getpid()}.msgpack").read_bytes())
    bad = tmp_path / "4343.msgpack"
    bad.write_bytes(msgpack.packb({**IDENTITY, "rank": "one", "step": 1, "stats": {}}))
    (tmp_path / "4444.msgpack").write_bytes(b"\xc1 not msgpack")
    (tmp_path / "notes.txt").write_text("not a worker's")
    registry = CollectorRegistry()
    registry.register(metrics.WorkerCollector(str(tmp_path), alive={os.getpid(), 4343, 4444}.__contains__))
    caplog.set_level(logging.WARNING, logger=metrics.__name__)
    for _ in range(2):
        text = generate_latest(registry).decode()
        assert [s.labels["rank"] for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "wsd_rank_info"] == ["0"]
    assert not gone.exists() and bad.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # each bad file said once, however often scraped
    assert any("4343.msgpack: ValueError: rank: expected an integer, got str" in line for line in lines)


def test_a_file_larger_than_any_worker_writes_is_not_read(tmp_path, caplog):
    (tmp_path / f"{os.getpid()}.msgpack").write_bytes(b"\x00" * (metrics.MAX_FILE_BYTES + 1))
    caplog.set_level(logging.WARNING, logger=metrics.__name__)
    assert "wsd_rank_info" not in scrape(tmp_path)
    assert "more than" in caplog.records[0].getMessage()


def test_violations_never_go_down_when_a_slot_goes(tmp_path):
    manager = WorkspaceManager("cpu", 2, on_locked_growth="fallback", ubatch_id=lambda: 1)
    writer = publisher(manager, tmp_path)
    registry = CollectorRegistry()
    registry.register(metrics.WorkerCollector(str(tmp_path)))

    def total() -> float:
        value = registry.get_sample_value("wsd_rank_lock_violations_total",
                                          dict(zip(metrics.labels("wsd_rank_lock_violations_total"),
                                                   ("tiny", "0", "1", "0"))))
        assert value is not None
        return value

    manager.lock()
    for _ in range(3):
        manager.get_simultaneous(((64,), torch.uint8))
    writer.publish()
    assert total() == 3
    manager.unlock()
    manager.set_num_ubatches(1)  # slot 1 goes, with its count
    writer.publish()
    assert total() == 3


def test_the_directory_is_made_once_for_the_processes_this_one_starts(tmp_path, monkeypatch):
    monkeypatch.delenv(metrics.DIRECTORY, raising=False)
    monkeypatch.setattr(metrics.tempfile, "tempdir", str(tmp_path))
    made = metrics.share_directory()
    assert os.environ[metrics.DIRECTORY] == made and os.path.dirname(made) == str(tmp_path)
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert metrics.share_directory() == made  # named already: kept
    monkeypatch.setenv(metrics.DIRECTORY, "/named/by/the/parent")
    assert metrics.share_directory() == "/named/by/the/parent"


def test_a_killed_vllms_metrics_directory_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """The plugin's standalone metrics folder was left in TMPDIR after every SIGKILL of vLLM and
    never reclaimed: the next start removes this user's folders whose process is gone, and
    nothing else (a live process's, another name, a link)."""
    import subprocess
    import sys

    monkeypatch.delenv(metrics.DIRECTORY, raising=False)
    monkeypatch.setattr(metrics.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True, timeout=30)
    prefix = f"wsd-vllm-metrics-{os.getuid()}-"
    stale = tmp_path / f"{prefix}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{prefix}{os.getppid()}-def"
    other = tmp_path / "wsd-vllm-metrics-somethingelse"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "1.msgpack").write_bytes(b"x")
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / f"{prefix}{gone.stdout.strip()}-link").symlink_to(victim)
    made = metrics.share_directory()
    assert not stale.exists() and live.exists() and other.exists() and victim.exists()
    assert os.path.basename(made).startswith(f"{prefix}{os.getpid()}-")


def test_the_registry_vllm_serves_gets_the_collector_once(tmp_path, monkeypatch):
    """The API server's part: whatever ``get_prometheus_registry`` returns to vLLM's
    ``attach_router`` holds the workers' figures, however often it is asked."""
    monkeypatch.setenv(metrics.DIRECTORY, str(tmp_path))
    publisher(WorkspaceManager("cpu", 1), tmp_path).publish()
    served = CollectorRegistry()

    class Instrumentator:  # the shape of vllm.entrypoints.serve.instrumentator.metrics
        @staticmethod
        def get_prometheus_registry():
            return served

    install.install_api_server(Instrumentator, metrics.serve_workers)
    assert Instrumentator.get_prometheus_registry() is served
    assert Instrumentator.get_prometheus_registry() is served  # a second registration would raise
    assert served.get_sample_value("wsd_rank_ubatches", dict(zip(metrics.labels("wsd_rank_ubatches"),
                                                                  ("tiny", "0", "1", "0")))) == 1


# -- violations in the process's log ----------------------------------------------------------


def test_the_first_refusal_of_each_slot_is_said_at_once_then_one_line_a_minute(caplog):
    now = [0.0]
    log = ViolationLog(logging.getLogger("wsd.test"), rank=3, policy=LockedGrowthPolicy.FALLBACK,
                       clock=lambda: now[0])
    manager = WorkspaceManager("cpu", 2, on_locked_growth="fallback", ubatch_id=lambda: ubatch[0])
    manager.add_violation_listener(log)
    ubatch = [0]
    manager.lock()
    caplog.set_level(logging.WARNING, logger="wsd.test")
    for ubatch[0], now[0] in ((0, 1.0), (0, 2.0), (1, 3.0), (0, 30.0), (0, 64.0)):
        manager.get_simultaneous(((5000,), torch.uint8))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # slot 0's first, slot 1's first, then one a minute after that
    assert "rank 3's workspace is locked: slot (ubatch 0, lane 0) holds 0 B, a request for 5.0 KiB" in lines[0]
    assert "test_vllm_metrics.py:" in lines[0]  # the caller, outside the manager
    assert "served from a one-off buffer (on_locked_growth = fallback)" in lines[0]
    assert "(ubatch 1, lane 0)" in lines[1] and "; 1 more since the last line" in lines[1]
    assert lines[2].endswith("; 1 more since the last line. Lock later, or reserve more before the lock")


def test_a_raised_refusal_says_the_caller_fails(caplog):
    manager = WorkspaceManager("cpu", 1)
    manager.add_violation_listener(ViolationLog(logging.getLogger("wsd.test"), rank=0,
                                                policy=LockedGrowthPolicy.RAISE))
    manager.lock()
    caplog.set_level(logging.WARNING, logger="wsd.test")
    with pytest.raises(AssertionError):
        manager.get_simultaneous(((64,), torch.uint8))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "refused (on_locked_growth = raise: the caller fails)" in line
