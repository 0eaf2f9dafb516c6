"""More than one machine: two torchrun launchers as two nodes, one external coordinator.

Each launcher is what one node runs (``--nnodes 2 --nproc-per-node 2``, c10d
rendezvous on loopback), as deploy/slurm and deploy/kubernetes do; ``[worker]
tp_size = 4`` makes the one TP group span both launchers, so its per-step
agreement (a gloo all_reduce) and its commands cross "nodes". Observed only
through the coordinator's client socket and the processes themselves. Then
deploy/slurm/wsd.sbatch itself, on two "nodes" of this host, with test doubles
of srun and scontrol.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from pathlib import Path

import pytest
from conftest import wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    COORDINATOR_READY,
    coordinator_section,
    python,
    spawn,
    wait_gone,
    worker_env,
    write_config,
)

from wsd_client.client import Client

NODES = 2
PER_NODE = 2
WORLD = NODES * PER_NODE


def _free_port() -> int:
    """A loopback port free now, for the c10d rendezvous.

    Both launchers must be told the rendezvous endpoint before either starts,
    and torchrun cannot bind port 0 and tell the other launcher what it got
    (unlike our coordinator, which prints its ports). So the OS picks a free
    port here, we release it, and node 0 binds it right after. Another process
    could take it in between, but no fixed port is ever assumed free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(node: int, port: int, run_id: str, config: str) -> list[str]:
    return python(
        "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
        "--nproc-per-node", str(PER_NODE),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        # Both launchers run on this host: say which one hosts the rendezvous store,
        # rather than have both try and one fall back.
        "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
        "--local-addr", "127.0.0.1",
        "-m", "wsd.worker", "--config", config,
    )


@pytest.mark.timeout(90)
def test_two_launchers_form_one_job_with_a_tp_group_across_them(tmp_path, spawn):  # noqa: F811
    """All four ranks register (host and pid each, the pids those of the two launchers'
    workers), one TP group of 4 spans both launchers, and set_ubatches is applied at the
    same step on all four. Without the c10d rendezvous the launchers would form two jobs
    of 2; without the group-wide agreement the ranks on the two nodes would apply the
    command at different steps."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": {**coordinator_section(tmp_path), "world_size": WORLD, "tp_size": WORLD},
        "workspace": {"num_ubatches": 2},
        "worker": {"tp_size": WORLD, "backend": "gloo"},
        "workload": {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05},
    })
    coordinator = spawn(["wsd", "coordinator", "--config", config], name="wsd coordinator")
    agents, clients = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    env = worker_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents)
    run_id = f"wsd-multinode-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    launchers = [spawn(_launcher(node, port, run_id, config), env=env, name=f"node {node}")
                 for node in range(NODES)]

    with Client(clients, timeout=5) as client:
        def live():
            ranks = [r for r in client.ranks()["ranks"] if r["state"] == "live"]
            return ranks if len(ranks) == WORLD else None
        ranks = {r["rank"]: r for r in wait_until(live, 60, "all four ranks to register", interval=0.2)}
        assert sorted(ranks) == list(range(WORLD))

        # Each rank names its host and pid; every pid is a worker of one of the launchers,
        # each launcher runs two of them, and global ranks are contiguous per node.
        assert {r["host"] for r in ranks.values()} == {socket.gethostname()}
        trees = [launcher.tree() - {launcher.pid} for launcher in launchers]
        node_of = {}
        for rank, info in ranks.items():
            (node,) = [n for n, tree in enumerate(trees) if info["pid"] in tree]
            node_of[rank] = node
        assert sorted(node_of.values()) == [0, 0, 1, 1], node_of
        assert node_of[0] == node_of[1] != node_of[2] == node_of[3], node_of

        # One TP group of four, spanning both launchers, as configured.
        assert {r["tp_group"] for r in ranks.values()} == {0}
        status = client.status()
        assert status["world_size"] == WORLD and status["tp_size"] == WORLD
        assert [g["ranks"] for g in status["groups"]] == [list(range(WORLD))]

        # Wait for the loop to be stepping on every rank, then one command for the group.
        wait_until(lambda: all(r["step"] > 0 for r in client.ranks()["ranks"]), 30, "every rank to step",
                   interval=0.1)
        result = client.set_ubatches(3, timeout=15)
        assert result.complete, result
        steps = result.steps()
        assert sorted(steps) == list(range(WORLD)), steps
        assert len(set(steps.values())) == 1, f"applied at different steps: {steps}"
        assert result.same_step == {0: True}, result
        # Each rank pushes its snapshot at once after applying: the coordinator's answer follows.
        wait_until(lambda: [r["num_ubatches"] for r in client.stats(timeout=5).ranks] == [3] * WORLD, 5,
                   "every rank's snapshot after set-ubatches")

    # Stop: SIGTERM to every worker. They vote at the step boundary, so all four leave at the
    # same step, both launchers see their workers succeed and exit 0, and nothing remains.
    pids = set().union(*trees)
    for launcher in launchers:
        pids |= launcher.tree()
    for info in ranks.values():
        os.kill(info["pid"], signal.SIGTERM)
    for launcher in launchers:
        assert launcher.wait(40) == 0, launcher.output()
    wait_gone(pids, 10, "the launchers' processes")
    stopped = [line for launcher in launchers for line in launcher.lines if "stopped cleanly after" in line]
    assert len(stopped) == WORLD, "\n".join(launcher.output() for launcher in launchers)
    assert len({line.split("after")[1] for line in stopped}) == 1, stopped  # the same step count
    assert not any("Traceback" in launcher.output() for launcher in launchers)
    coordinator.send(signal.SIGTERM)
    assert coordinator.wait(15) == 0


# -- deploy/slurm/wsd.sbatch on two simulated nodes ------------------------------------------------

SBATCH = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "wsd.sbatch"

# Test doubles of Slurm's commands, enough for the sbatch script: `scontrol show hostnames`
# lists the nodes; `srun --nodes=N ... CMD` runs CMD once per "node" here, with SLURM_NODEID
# set, and passes SIGTERM and SIGINT on to them, as srun does to its tasks.
_FAKE_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
tr ',' '\\n' <<<"$3"
"""
_FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
args, nodes = sys.argv[1:], 1
while args and args[0].startswith("-"):
    option = args.pop(0)
    if option.startswith("--nodes="):
        nodes = int(option.split("=", 1)[1])
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)}})
         for i in range(nodes)]
def forward(signum, frame):
    for task in tasks:
        if task.poll() is None:
            task.send_signal(signum)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
codes = [task.wait() for task in tasks]
sys.exit(next((c for c in codes if c), 0))
"""


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("scontrol", _FAKE_SCONTROL), ("srun", _FAKE_SRUN.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


@pytest.mark.timeout(90)
def test_slurm_script_runs_a_coordinator_and_one_torchrun_per_node(tmp_path, spawn):  # noqa: F811
    """deploy/slurm/wsd.sbatch with srun and scontrol doubles and two "nodes" on this host:
    the coordinator on the first node, both torchruns joined by c10d into one job of four
    ranks whose agents reach the coordinator at connect_endpoint, TP groups of two within
    each node; SIGTERM (Slurm's --signal=B:TERM) stops everything it started."""
    _fake_slurm(tmp_path / "bin")
    env = worker_env(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", SLURM_SUBMIT_DIR=str(tmp_path),
        CONFIG=str(SBATCH.parent / "wsd.toml"),
        NPROC_PER_NODE=str(PER_NODE), RDZV_PORT=str(_free_port()), AGENT_PORT=str(_free_port()),
        # The example is for 8-GPU nodes: shrink it to two CPU processes per node.
        WSD_WORKER_TP_SIZE="2", WSD_COORDINATOR_TP_SIZE="2", WSD_WORKER_BACKEND="gloo",
        WSD_COORDINATOR_CLIENT_ENDPOINT="tcp://127.0.0.1:0", WSD_COORDINATOR_HEARTBEAT_INTERVAL="0.2",
        WSD_COORDINATOR_HEARTBEAT_TIMEOUT="1.0", WSD_WORKLOAD_HIDDEN_SIZE="32", WSD_WORKLOAD_FFN_SIZE="64",
        WSD_WORKLOAD_LAYERS="1", WSD_WORKLOAD_DTYPE="float32", WSD_WORKLOAD_MAX_TOKENS="32",
        WSD_WORKLOAD_WARMUP_STEPS="4", WSD_WORKLOAD_PACE="0.05",
    )
    job = spawn(["bash", str(SBATCH)], env=env, cwd=tmp_path, name="wsd.sbatch")
    clients = job.wait_for(r"wsd-slurm: coordinator on 127\.0\.0\.1: .* clients (\S+)", 30).group(1)
    job.wait_for(r"wsd-slurm: 2 nodes x 2 workers \(4 ranks\) under torchrun", 10)
    with Client(clients, timeout=5) as client:
        def live():
            ranks = [r for r in client.ranks()["ranks"] if r["state"] == "live"]
            return ranks if len(ranks) == WORLD else None
        ranks = {r["rank"]: r for r in wait_until(live, 60, "all four ranks to register", interval=0.2)}
        assert {r: info["tp_group"] for r, info in ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
        status = client.status()
        assert status["world_size"] == WORLD  # the script told the coordinator NNODES x NPROC_PER_NODE
        # and made the job a token, which every worker on every node proved it holds
        assert status["agents_authenticated"] is True and status["agents_refused"] == {}
        result = client.set_ubatches(3, timeout=15)
        assert result.complete and result.same_step == {0: True, 1: True}, result
    # The coordinator's state went where the script put it, beside the job's logs.
    assert (tmp_path / "wsd-4242" / "coordinator.state").exists()
    assert list((tmp_path / "wsd-4242" / "logs").rglob("stderr.log")), "no per-rank logs"
    pids = job.tree()
    job.send(signal.SIGTERM)
    assert job.wait(60) == 0, job.output()
    wait_gone(pids, 10, "the job's processes")
    assert job.count("wsd-slurm: stopped by SIGTERM") == 1
    assert job.count("coordinator stopped") == 1, job.output()
    # torchrun reports the SIGTERM it got with a traceback of its own (SignalException); the
    # workers under it stop cleanly, all at one step: local rank 0 of each node says so.
    stopped = [line for line in job.lines if "stopped cleanly after" in line]
    assert len(stopped) == NODES and len({line.split("after")[1] for line in stopped}) == 1, job.output()
