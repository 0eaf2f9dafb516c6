"""``wsd up`` and ``wsd coordinator`` as real processes, observed through the Python client."""

from __future__ import annotations

import os
import signal
import socket

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


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigterm"])
def test_wsd_up_runs_a_cluster_and_leaves_no_process_behind(tmp_path, spawn, sig, group):  # noqa: F811
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to `wsd up` stops the
    workers, torchrun and the coordinator; every process it started is gone."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": coordinator_section(tmp_path),
        "workload": {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05},
    })
    up = spawn(["wsd", "up", "--nproc", "2", "--config", config],
               env=worker_env(), name="wsd up")
    endpoint = up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)
    up.wait_for(rf"wsd up: try +WSD_ENDPOINT={endpoint} wsctl status", 5)
    with Client(endpoint, timeout=5) as client:
        first = client.status()
        if first["ranks"]["live"] == 0:  # always, in practice: the workers are still importing torch
            # wsd up told the coordinator the world size, so it names ranks not yet seen.
            assert first["world_size"] == 2 and first["ranks"]["never_registered"] == 2, first
        wait_until(lambda: client.status()["ranks"]["live"] == 2, 60, "both ranks to register")
    up.wait_for(r"warm-up done", 30)
    pids = up.tree()
    assert len(pids) >= 5, pids  # wsd up, the coordinator, torchrun, two workers
    up.send(sig, group=group)
    assert up.wait(60) == 0, up.output()
    wait_gone(pids, 10, "processes started by wsd up")
    assert up.count("stopped cleanly after") == 2, up.output()
    assert up.count(f"wsd up: stopped by {signal.Signals(sig).name}") == 1
    assert up.count("Traceback") == 0, up.output()


def test_wsd_up_refuses_a_bad_config_before_starting_anything(tmp_path):
    import subprocess

    config = write_config(tmp_path / "bad.toml", {"workload": {"max_tokens": 0}})
    result = subprocess.run(["wsd", "up", "--config", config], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "max_tokens must be between 1 and" in result.stderr


def test_wsd_coordinator_runs_without_torch_and_stops_on_sigterm(tmp_path, spawn):  # noqa: F811
    """With every `import torch` failing, the coordinator serves clients; SIGTERM stops it, exit 0."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {**coordinator_section(tmp_path), "world_size": 1}})
    code = ("import sys; sys.modules['torch'] = None\n"
            "from wsd.cli import main\n"
            f"sys.exit(main(['coordinator', '--config', {config!r}]))\n")
    proc = spawn(python("-c", code), name="wsd coordinator")
    endpoint = proc.wait_for(COORDINATOR_READY, 30).group(2)
    with Client(endpoint, timeout=5) as client:
        assert client.ping() is not None
        status = client.status()
        assert status["ranks"] == {"live": 0, "lost": 0, "stopped": 0, "never_registered": 1}
    proc.send(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()
    assert proc.count("coordinator stopped") == 1 and proc.count("Traceback") == 0


def test_wsd_coordinator_stops_on_ctrl_c(tmp_path, spawn):  # noqa: F811
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {**coordinator_section(tmp_path), "world_size": 1}})
    proc = spawn(["wsd", "coordinator", "--config", config], name="wsd coordinator")
    proc.wait_for(COORDINATOR_READY, 30)
    proc.send(signal.SIGINT, group=True)
    assert proc.wait(15) == 0, proc.output()
    assert proc.count("Traceback") == 0


def test_wsd_up_exits_2_when_its_coordinator_cannot_bind(tmp_path, spawn):  # noqa: F811
    """A port already taken is the configuration's fault: wsd up says so and exits 2 (it
    used to wait for the coordinator's ready line, then exit 1), starting no worker."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn(["wsd", "up", "--nproc", "1"], name="wsd up", env={
            **os.environ, "WSD_COORDINATOR_CLIENT_ENDPOINT": f"tcp://127.0.0.1:{port}",
            "WSD_COORDINATOR_AGENT_ENDPOINT": "tcp://127.0.0.1:0",
            "WSD_COORDINATOR_STATE_FILE": str(tmp_path / "state")})
        assert proc.wait(60) == 2, proc.output()
    assert f"cannot bind tcp://127.0.0.1:{port}" in proc.output()
    assert "torchrun" not in proc.output() and "Traceback" not in proc.output()
