"""The worker: the torchrun environment reader, the engine loop, real torchrun workers.

Tiers: the env reader and the token plan as pure functions; the engine loop
on a one-rank gloo group in this process; then ``torchrun --nproc-per-node 2``
workers on gloo with a coordinator, observed only through the Python client.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import coordinator_config, wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    Proc,
    python,
    spawn,
    torchrun,
    wait_gone,
    worker_env,
    write_config,
)

from wsd.config import WorkloadConfig
from wsd.coordinator.loop import Coordinator
from wsd.errors import TorchrunEnvError
from wsd.manager.core import WorkspaceManager
from wsd.worker.distributed import read_torchrun_env
from wsd.worker.workload import TensorParallelMlp, run_workload, steady_tokens, warmup_tokens
from wsd_client.client import Client
from wsd_client.rows import stats_rows

GOOD_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}

# Small shapes and short phases: each torchrun test takes seconds.
WORKLOAD = {"hidden_size": 32, "ffn_size": 64, "layers": 2, "max_tokens": 64,
            "warmup_steps": 16, "pace": 0.1}


# -- the torchrun environment ---------------------------------------------------------


def test_env_reader_reads_every_variable():
    env = read_torchrun_env(GOOD_ENV)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)


@pytest.mark.parametrize("name", sorted(GOOD_ENV))
def test_env_reader_names_a_missing_variable(name):
    """Without the check a missing LOCAL_RANK would silently become device 0 on every rank."""
    env = {k: v for k, v in GOOD_ENV.items() if k != name}
    with pytest.raises(TorchrunEnvError, match=f"environment variable {name} is not set"):
        read_torchrun_env(env)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"RANK": "one"}, "RANK must be an integer, got 'one'"),
        ({"LOCAL_RANK": ""}, "LOCAL_RANK is not set"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1, got 0"),
        ({"RANK": "4"}, r"RANK must be in 0..3 \(WORLD_SIZE=4\), got 4"),
        ({"RANK": "-1"}, r"RANK must be in 0..3 \(WORLD_SIZE=4\), got -1"),
        ({"LOCAL_WORLD_SIZE": "8"}, r"LOCAL_WORLD_SIZE must be in 1..4 \(WORLD_SIZE\), got 8"),
        ({"LOCAL_RANK": "2"}, r"LOCAL_RANK must be in 0..1 \(LOCAL_WORLD_SIZE=2\), got 2"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT must be in 1..65535, got 70000"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR is not set"),
    ],
)
def test_env_reader_names_a_malformed_variable(overrides, expected):
    with pytest.raises(TorchrunEnvError, match=expected):
        read_torchrun_env({**GOOD_ENV, **overrides})


def test_worker_outside_torchrun_exits_2_naming_the_variable(tmp_path):
    """The entry point turns the reader's error into one line and exit code 2, not a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in GOOD_ENV}
    result = subprocess.run(python("-m", "wsd.worker"), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "environment variable RANK is not set" in result.stderr
    assert "Traceback" not in result.stderr


# -- the engine loop, one rank in this process ---------------------------------------------


def test_warmup_token_counts_rise_to_the_maximum():
    config = WorkloadConfig(max_tokens=100, warmup_steps=7)
    tokens = warmup_tokens(config)
    assert len(tokens) == 7 and tokens[-1] == 100
    assert all(a < b for a, b in itertools.pairwise(tokens))


def test_steady_tokens_exceed_warmup_only_while_locked_and_agree_across_ranks():
    """Ranks of a TP group draw the same counts (else their all_reduce shapes differ)."""
    config = WorkloadConfig(max_tokens=50, warmup_steps=5, oversize_chance=0.5)
    a, b = random.Random(3), random.Random(3)
    unlocked = [steady_tokens(a, config, locked=False) for _ in range(200)]
    assert unlocked == [steady_tokens(b, config, locked=False) for _ in range(200)]
    assert max(unlocked) <= 50
    locked = [steady_tokens(a, config, locked=True) for _ in range(200)]
    assert any(t > 50 for t in locked) and any(t <= 50 for t in locked)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_engine_loop_grows_locks_and_survives_violations(one_rank_group):
    """A locked over-size request is counted and reported, and the loop runs on.

    Without the fallback the first refusal would raise out of the loop (and,
    on a real group, leave the other ranks waiting in the all_reduce).
    """
    config = WorkloadConfig(hidden_size=16, ffn_size=32, layers=2, max_tokens=32, warmup_steps=4,
                            steps=6, pace=0, oversize_chance=1.0)
    manager = WorkspaceManager("cpu", 2)
    mlp = TensorParallelMlp(config, tp_rank=0, tp_size=1, device=torch.device("cpu"), group=one_rank_group)
    seen = []
    boundaries = []
    manager.add_violation_listener(lambda u, lane, v: seen.append((u, v.caller)))
    result = run_workload(manager, mlp, config, step_boundary=lambda: boundaries.append(1),
                          should_stop=lambda: False)
    assert result.steps == 4 + 6 and len(boundaries) == 10
    assert result.violations == 6 * 2  # every steady step, on each of the 2 ubatch slots
    stats = manager.stats()
    assert stats.locked
    full = 32 * 4 * (16 + 2 * (32 + 16))  # tokens x 4 bytes x (input + 2 layers x (hidden + out))
    assert [s.capacity_bytes for s in stats.slots] == [full, full]  # every slot warmed, none grew after
    assert [s.lock_violations for s in stats.slots] == [6, 6]
    assert {u for u, _ in seen} == {0, 1} and all("workload.py" in caller for _, caller in seen)


def test_engine_loop_stops_when_asked(one_rank_group):
    config = WorkloadConfig(hidden_size=8, ffn_size=8, layers=1, max_tokens=8, warmup_steps=2, steps=0, pace=0)
    manager = WorkspaceManager("cpu", 1)
    mlp = TensorParallelMlp(config, tp_rank=0, tp_size=1, device=torch.device("cpu"), group=one_rank_group)
    calls = []
    result = run_workload(manager, mlp, config, step_boundary=lambda: None,
                          should_stop=lambda: calls.append(1) or len(calls) >= 5)
    assert result.steps == 5


# -- torchrun workers with a coordinator -------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A coordinator (in this process) and two torchrun workers; warm-up sampled as it happens."""
    tmp = tmp_path_factory.mktemp("cluster")
    coordinator = Coordinator(coordinator_config(tmp)).start()
    # The agents retry registration at the heartbeat interval: short, so that
    # they are registered well before warm-up ends.
    config = write_config(tmp / "wsd.toml", {
        "workspace": {"num_ubatches": 2}, "workload": {**WORKLOAD, "warmup_steps": 24},
        "coordinator": {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0},
    })
    proc = Proc(torchrun(2, config), env=worker_env(
        WSD_COORDINATOR_CONNECT_ENDPOINT=coordinator.agent_endpoint), name="torchrun")
    client = Client(coordinator.client_endpoint, timeout=5)
    samples = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = stats_rows(client.stats(timeout=2))
            if stats["ranks"]:
                samples.append(stats)
            if len(stats["ranks"]) == 2 and all(r["locked"] for r in stats["ranks"]):
                break
            if proc.popen.poll() is not None:
                break
            time.sleep(0.02)
        yield proc, client, samples
    finally:
        client.close()
        proc.kill_all()
        coordinator.stop(timeout=10)


def test_both_ranks_register(cluster):
    _proc, client, _ = cluster
    ranks = wait_until(lambda: [r for r in client.ranks()["ranks"] if r["state"] == "live"], 30, "live ranks")
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert {r["tp_group"] for r in ranks} == {0}  # tp_size defaults to the node's 2 ranks
    assert client.status()["tp_size"] == 2


def test_capacity_grows_during_warmup_and_peak_never_exceeds_it(cluster):
    """Sampled while warm-up runs: each slot grows step by step, and no sample ever shows a
    peak request above the capacity that served it."""
    proc, _client, samples = cluster
    assert samples and all(r["locked"] for r in samples[-1]["ranks"]), proc.output()
    history: dict[tuple[int, int], list[int]] = {}
    for stats in samples:
        for rank in stats["ranks"]:
            for slot in rank["slots"]:
                assert slot["peak_requested_bytes"] <= slot["capacity_bytes"], slot
                history.setdefault((rank["rank"], slot["ubatch"]), []).append(slot["capacity_bytes"])
    assert sorted(history) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key, capacities in history.items():
        assert capacities == sorted(capacities), f"capacity of {key} shrank: {capacities}"
        assert len(set(capacities) - {0}) >= 3, f"slot {key} was not seen growing: {sorted(set(capacities))}"
    finals = {capacities[-1] for capacities in history.values()}
    assert len(finals) == 1  # every slot of both ranks warmed to the same size


def test_set_ubatches_applies_at_the_same_step_on_both_ranks(cluster):
    proc, client, _ = cluster
    result = client.set_ubatches(3, timeout=10)
    assert result.complete, result
    steps = result.steps()
    assert sorted(steps) == [0, 1] and steps[0] == steps[1], steps
    assert result.same_step and all(result.same_step.values())

    def three_slots_used():
        ranks = stats_rows(client.stats(timeout=2))["ranks"]
        return len(ranks) == 2 and all(
            r["num_ubatches"] == 3 and len(r["slots"]) == 3 and r["slots"][2]["requests"] > 0 for r in ranks
        ) and ranks
    ranks = wait_until(three_slots_used, 20, "both ranks to run 3 ubatch slots")
    for rank in ranks:
        added = rank["slots"][2]
        # Locked when it was added: pre-sized to the others, so it never needed to grow.
        assert added["capacity_bytes"] == rank["slots"][0]["capacity_bytes"] and added["lock_violations"] == 0
    assert proc.count("Traceback") == 0, proc.output()


def test_idle_worker_serves_the_manager_and_applies_on_receipt(tmp_path, spawn, start_coordinator):  # noqa: F811
    """--idle runs no compute (no step boundary), so commands must apply as they arrive;
    SIGTERM ends it cleanly, with a goodbye (without one its rank would be lost)."""
    coordinator = start_coordinator()
    config = write_config(tmp_path / "wsd.toml", {"workspace": {"num_ubatches": 2}})
    proc = spawn(torchrun(1, config, "--idle"), name="torchrun",
                 env=worker_env(WSD_COORDINATOR_CONNECT_ENDPOINT=coordinator.agent_endpoint))
    with Client(coordinator.client_endpoint, timeout=5) as client:
        wait_until(lambda: client.status()["ranks"]["live"] == 1, 60, "the idle rank to register")
        assert client.set_ubatches(4, timeout=10).complete
        assert client.reserve_bytes(4096, timeout=10).complete
        rank = stats_rows(client.stats(fresh=True))["ranks"][0]
        assert rank["num_ubatches"] == 4 and [s["capacity_bytes"] for s in rank["slots"]] == [4096] * 4
        assert all(s["requests"] == 0 for s in rank["slots"])  # nothing computed
        pids = proc.tree()
        proc.send(signal.SIGTERM)
        proc.wait(30)
        wait_gone(pids, 10, "the idle worker")
        assert proc.count(r"stopped cleanly \(idle\)") == 1, proc.output()
        # Its goodbye reached the coordinator before the process exited: stopped, not lost.
        [rank] = wait_until(lambda: [r for r in client.ranks()["ranks"] if r["state"] != "live"], 10,
                            "the rank to leave")
        assert rank["state"] == "stopped", rank


def test_sigterm_to_torchrun_ends_every_process_cleanly(tmp_path, spawn):  # noqa: F811
    """Embedded coordinator, started by rank 0; SIGTERM to torchrun stops both ranks at the same
    step (no rank left in a collective), the coordinator child too, and nothing remains."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": {"mode": "embedded", "agent_endpoint": "tcp://127.0.0.1:0",
                        "client_endpoint": "tcp://127.0.0.1:0", "state_file": str(tmp_path / "state"),
                        "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0},
        "workload": {**WORKLOAD, "warmup_steps": 4, "pace": 0.02},
    })
    proc = spawn(torchrun(2, config), env=worker_env(), name="torchrun")
    endpoint = proc.wait_for(r"embedded coordinator: clients on (\S+)", 60).group(1)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status()["ranks"]["live"] == 2, 30, "both ranks to register")
    proc.wait_for(r"warm-up done", 30)
    pids = proc.tree()
    assert len(pids) >= 4, pids  # torchrun, two workers, the coordinator
    started = time.monotonic()
    proc.send(signal.SIGTERM)
    proc.wait(40)
    wait_gone(pids, 10, "torchrun's processes")
    assert time.monotonic() - started < 25  # well inside torchrun's 30 s SIGKILL grace
    out = proc.output()
    stopped = [line for line in proc.lines if "stopped cleanly after" in line]
    assert len(stopped) == 2, out
    assert len({line.split("after")[1] for line in stopped}) == 1, stopped  # same step count
    assert "coordinator stopped" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
