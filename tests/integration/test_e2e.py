"""End to end: ``wsd coordinator`` and ``torchrun`` workers as real processes, driven by wsctl.

One cluster for the whole module (start-ups cost seconds): a coordinator
started as ``wsd coordinator --config FILE`` on ports the OS picks (read from
its ready line), and ``torchrun --standalone --nproc-per-node 2 -m wsd.worker``
on gloo running the built-in engine loop until stopped. Everything is
observed and steered only through the installed ``wsctl --json`` run as a
subprocess: its stdout parsed as JSON, its exit code checked, every call
bounded (``--timeout`` and a subprocess timeout), so none can hang the suite.

The tests share that cluster and run in file order: the last ones kill a
rank and then stop everything. Each test still stands alone under ``-k``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import wait_until
from procs import (
    COORDINATOR_READY,
    WSD,
    Proc,
    Result,
    coordinator_section,
    processes,
    torchrun,
    wait_gone,
    worker_env,
    write_config,
    wsctl,
)

WARMUP_STEPS = 20
HEARTBEAT_TIMEOUT = 1.5
# Small shapes; 0.15 s a step keeps two ranks light on a shared 2-core machine,
# and warm-up (20 steps, about 3 s) long enough for several wsctl samples.
# lock = false: the workspace stays unlocked until `wsctl lock`, and
# oversize requests happen only while locked, so every violation seen is the
# lock command's doing; half the locked steps ask for more than warm-up reached.
WORKLOAD = {"hidden_size": 32, "ffn_size": 64, "layers": 2, "max_tokens": 64,
            "warmup_steps": WARMUP_STEPS, "pace": 0.15, "lock": False, "oversize_chance": 0.5}


def check_peaks(stats: dict[str, Any]) -> None:
    """No slot that never refused a request shows a peak request above its capacity."""
    for rank in stats["ranks"]:
        for slot in rank["slots"]:
            if slot["lock_violations"] == 0:
                assert slot["peak_requested_bytes"] <= slot["capacity_bytes"], (rank["rank"], slot)


def ranks_by_number(stats: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in stats["ranks"]}


def applied_at_one_step(result: Result) -> int:
    """The step at which both ranks applied a command; fails unless both did, at the same one."""
    doc = result.doc
    assert result.code == 0 and doc is not None, result
    assert doc["complete"] and not (doc["failed"] or doc["pending"] or doc["missing"]), doc
    steps = {a["rank"]: a["step"] for a in doc["acked"] if a["ok"]}
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], doc
    assert doc["same_step"] == {"0": True}, doc
    return steps[0]


@dataclass
class Cluster:
    endpoint: str
    coordinator: Proc
    workers: Proc
    warmup: list[dict[str, Any]] = field(default_factory=list)
    """Every ``stats`` document taken while the workers started and warmed up, in order."""

    def stats(self, **kw: Any) -> dict[str, Any]:
        result = wsctl(self.endpoint, "stats", **kw)
        assert result.code == 0, result
        check_peaks(result.doc)
        return result.doc

    def stats_when(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        """The first ``stats`` (exit 0, both ranks reporting) for which ``predicate`` holds."""
        def probe() -> dict[str, Any] | None:
            doc = self.stats()
            return doc if len(doc["ranks"]) == 2 and predicate(ranks_by_number(doc)) else None
        return wait_until(probe, timeout, what, interval=0.05)

    def events(self, kind: str) -> list[dict[str, Any]]:
        result = wsctl(self.endpoint, "events", "--since", "0")
        assert result.code == 0, result
        return [e for e in result.doc["events"] if e["kind"] == kind]

    def pids(self) -> set[int]:
        """Every process of the cluster seen so far (and now)."""
        self.coordinator.tree()
        self.workers.tree()
        return {self.coordinator.pid, self.workers.pid} | self.coordinator.seen | self.workers.seen


def sample_warmup(endpoint: str, workers: Proc) -> list[dict[str, Any]]:
    """``stats`` as often as wsctl can, from before the ranks register to the end of warm-up."""
    samples = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        result = wsctl(endpoint, "stats", timeout=2.0)
        # 3 (partial) until both ranks have registered; the world size is configured.
        assert result.code in (0, 3), result
        doc = result.doc
        if doc["ranks"]:
            samples.append(doc)
        if len(doc["ranks"]) == 2 and all(r["step"] >= WARMUP_STEPS for r in doc["ranks"]):
            return samples
        assert workers.popen.poll() is None, workers.output()
        if not doc["ranks"]:
            time.sleep(0.3)  # still importing torch: poll gently, do not slow the start-up down
    pytest.fail(f"warm-up did not end within 90 s; workers' output:\n{workers.output()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("e2e")
    config = write_config(tmp / "wsd.toml", {
        "coordinator": {**coordinator_section(tmp), "heartbeat_timeout": HEARTBEAT_TIMEOUT,
                        "world_size": 2, "stats_timeout": 1.0},
        # A rank left alone in a collective after its peer died gives up in
        # seconds, so torchrun ends without waiting out the default 300 s.
        "worker": {"collective_timeout": 10.0},
        "workspace": {"num_ubatches": 2},
        "workload": WORKLOAD,
    })
    with processes() as start:
        coordinator = start([WSD, "coordinator", "--config", config], name="wsd coordinator")
        agents, endpoint = coordinator.wait_for(COORDINATOR_READY, 30).groups()
        workers = start(torchrun(2, config), name="torchrun",
                        env=worker_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
        cluster = Cluster(endpoint, coordinator, workers)
        cluster.warmup = sample_warmup(endpoint, workers)
        cluster.pids()
        yield cluster


# -- a running cluster --------------------------------------------------------------------


def test_two_ranks_registered(cluster):
    """`ranks` and `status` exit 0 and show both torchrun ranks live, as the processes they are.

    Fails if a rank does not register, registers under the wrong rank or TP
    group, or if exit code 0 were given with a rank missing.
    """
    ranks = wsctl(cluster.endpoint, "ranks")
    assert ranks.code == 0, ranks
    assert [(r["rank"], r["state"], r["tp_group"]) for r in ranks.doc["ranks"]] == [
        (0, "live", 0), (1, "live", 0)]
    assert ranks.doc["missing"] == []
    # The pids reported are torchrun's two worker processes, not anything else.
    assert {r["pid"] for r in ranks.doc["ranks"]} <= cluster.workers.tree() - {cluster.workers.pid}
    status = wsctl(cluster.endpoint, "status")
    assert status.code == 0, status
    assert status.doc["world_size"] == 2 and status.doc["tp_size"] == 2
    assert status.doc["ranks"] == {"live": 2, "stalled": 0, "lost": 0, "stopped": 0, "missing": 0}
    groups = status.doc["groups"]
    assert [(g["tp_group"], g["ranks"], g["missing"]) for g in groups] == [(0, [0, 1], [])]


def test_capacity_grows_during_warmup_and_peak_never_exceeds_it(cluster):
    """Sampled while warm-up runs: every slot's capacity only grows, and is seen growing; no
    sample shows a peak request above the capacity that served it (no violation yet).

    Fails if warm-up did not grow the workspace step by step (sampled only at
    the end it would show one size), if a slot ever shrank, or if a request
    were served beyond the slot's capacity.
    """
    samples = cluster.warmup
    assert any(r["step"] < WARMUP_STEPS for s in samples for r in s["ranks"]), \
        "no sample was taken before warm-up ended"
    history: dict[tuple[int, int], list[int]] = {}
    for stats in samples:
        for rank in stats["ranks"]:
            assert rank["lock_violations"] == 0 and not rank["locked"], rank
            for slot in rank["slots"]:
                assert slot["peak_requested_bytes"] <= slot["capacity_bytes"], slot
                key = (rank["rank"], slot["ubatch"])
                history.setdefault(key, []).append(slot["capacity_bytes"])
    assert sorted(history) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key, capacities in history.items():
        assert capacities == sorted(capacities), f"(rank, ubatch) {key} shrank: {capacities}"
        assert capacities[0] < capacities[-1], f"(rank, ubatch) {key} never grew: {capacities}"
    assert len({capacities[-1] for capacities in history.values()}) == 1  # all warmed to one size
    assert samples[-1]["complete"] and samples[-1]["missing"] == []


def test_set_ubatches_applies_at_the_same_step_on_both_ranks(cluster):
    """`set-ubatches 3` is acknowledged by both ranks at one step; then both run 3 slots.

    Fails if the command applied on one rank only, at different steps (the
    TP group's all_reduces would then disagree in count), or not at all.
    """
    step = applied_at_one_step(wsctl(cluster.endpoint, "set-ubatches", "3", timeout=10.0))
    assert step >= WARMUP_STEPS

    def runs_three(rank: dict[str, Any]) -> bool:
        slots = rank["slots"]
        return rank["num_ubatches"] == 3 and len(slots) == 3 and slots[2]["requests"] > 0

    stats = cluster.stats_when(lambda ranks: all(map(runs_three, ranks.values())),
                               20, "both ranks to run 3 ubatch slots")
    assert [s["ubatch"] for s in stats["ranks"][0]["slots"]] == [0, 1, 2]
    assert stats["groups"][0]["num_ubatches_consistent"]
    status = wsctl(cluster.endpoint, "status")
    assert status.code == 0 and status.doc["desired"]["num_ubatches"] == 3, status


def test_lock_then_oversize_request_shows_a_violation_and_unlock_ends_them(cluster):
    """After `lock`, the engine's over-size requests are refused and reported in `events` with
    rank, slot, caller and sizes, all between the lock's step and the unlock's; `unlock` applies
    on both ranks at one step, and no violation follows it.

    Fails if lock did not reach the managers (no violation), if violations were
    not reported to the coordinator or lost their rank/slot/caller, or if
    unlock did not take effect (violations would go on).
    """
    # Unlocked, the workload asks only for what warm-up reached.
    assert cluster.events("lock_violation") == []
    warm = cluster.stats()
    warm_capacity = max(s["capacity_bytes"] for r in warm["ranks"] for s in r["slots"])

    locked_at = applied_at_one_step(wsctl(cluster.endpoint, "lock", timeout=10.0))

    def from_both_ranks() -> list[dict[str, Any]] | None:
        violations = cluster.events("lock_violation")
        return violations if {e["rank"] for e in violations} == {0, 1} else None

    violations = wait_until(from_both_ranks, 30, "a violation from each rank in `wsctl events`",
                            interval=0.1)
    for event in violations:
        assert event["tp_group"] == 0 and event["lane"] == 0 and 0 <= event["ubatch"] < 3, event
        assert "workload.py" in event["caller"], event  # the engine's own call site
        assert event["requested"] > event["capacity"], event
        assert event["step"] >= locked_at, (event, locked_at)
    assert any(e["requested"] > warm_capacity for e in violations)  # beyond all warm-up reached
    cluster.stats_when(lambda ranks: all(r["locked"] and r["lock_violations"] > 0 for r in ranks.values()), 10,
                       "the violations in each rank's pushed snapshot")

    unlocked_at = applied_at_one_step(wsctl(cluster.endpoint, "unlock", timeout=10.0))
    # Eight more steps, each with an even chance of an over-size request: were
    # the workspace still locked, a violation would show with odds 255 in 256.
    cluster.stats_when(lambda ranks: all(r["step"] >= unlocked_at + 8 and not r["locked"]
                                         for r in ranks.values()),
                       20, "eight steps after unlock")
    for event in cluster.events("lock_violation"):
        # The refused forward pass runs before the boundary that applies unlock.
        assert locked_at <= event["step"] < unlocked_at, (event, locked_at, unlocked_at)


# -- a rank dies, then everything stops -------------------------------------------------------


def test_killed_rank_makes_wsctl_exit_3_naming_it(cluster):
    """A rank killed with SIGKILL: `stats`, `status` and `ranks` exit 3 and name it lost within
    a bounded time, and every call returns (none waits on the dead rank).

    Fails if a dead rank went unreported, were reported only after far longer
    than the heartbeat timeout, or if wsctl exited 0 with a rank missing.
    """
    before = wsctl(cluster.endpoint, "ranks")
    assert before.code == 0, before
    victim = next(r for r in before.doc["ranks"] if r["rank"] == 1)
    assert victim["pid"] in cluster.pids()
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)

    def lost_in_stats() -> Result | None:
        result = wsctl(cluster.endpoint, "stats")
        assert result.code in (0, 3), result
        reasons = {m["rank"]: m["reason"] for m in result.doc["missing"]}
        return result if reasons.get(1, "").startswith("lost at") else None

    stats = wait_until(lost_in_stats, 20, "stats to report rank 1 lost", interval=0.1)
    elapsed = time.monotonic() - killed
    assert stats.code == 3 and not stats.doc["complete"], stats
    assert 1 not in {r["rank"] for r in stats.doc["ranks"]}
    assert elapsed < HEARTBEAT_TIMEOUT + 8, f"rank 1 reported lost {elapsed:.1f} s after SIGKILL"

    status = wsctl(cluster.endpoint, "status")
    assert status.code == 3 and status.doc["ranks"]["lost"] >= 1, status
    assert 1 in [m["rank"] for m in status.doc["groups"][0]["missing"]], status.doc
    ranks = wsctl(cluster.endpoint, "ranks")
    assert ranks.code == 3, ranks
    dead = next(r for r in ranks.doc["ranks"] if r["rank"] == 1)
    assert dead["state"] == "lost" and dead["lost_at"] is not None, dead


def test_stopping_the_cluster_leaves_no_process_behind(cluster):
    """SIGTERM to torchrun (if the lost rank has not ended it already) and to the coordinator:
    every process the cluster ever had is gone, and the coordinator exits 0.

    Fails if a worker, torchrun or the coordinator outlives its stop.
    """
    pids = cluster.pids()
    assert len(pids) >= 4, pids  # the coordinator, torchrun, two workers
    cluster.workers.send(signal.SIGTERM)
    cluster.workers.wait(45)  # its code reports the killed rank; it must just end
    cluster.coordinator.send(signal.SIGTERM)
    assert cluster.coordinator.wait(15) == 0, cluster.coordinator.output()
    wait_gone(pids, 10, "the cluster's processes")
    assert cluster.coordinator.count("coordinator stopped") == 1
    assert cluster.coordinator.count("Traceback") == 0, cluster.coordinator.output()
