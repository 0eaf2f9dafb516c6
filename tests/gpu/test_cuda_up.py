"""The GPU tier: ``wsd up`` with the nccl backend on one GPU, as real processes."""

from __future__ import annotations

import signal

import pytest
import torch
from conftest import wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    coordinator_section,
    python,
    spawn,
    worker_env,
    write_config,
)

from wsd_client.client import Client

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")

SMALL_WORKLOAD = {"hidden_size": 32, "ffn_size": 64, "max_tokens": 32, "warmup_steps": 4, "pace": 0.05}


@pytest.mark.timeout(300)
def test_wsd_up_runs_a_rank_on_nccl_and_stops_cleanly(tmp_path, spawn):  # noqa: F811
    """Every other process test runs gloo on the CPU. With [worker] backend = "nccl" the
    worker initialises NCCL on cuda:LOCAL_RANK, builds its manager there and runs the
    built-in workload on the GPU; were any of that broken, the rank would never register,
    would register on the wrong device, or would not stop cleanly on SIGTERM (exit 0)."""
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": coordinator_section(tmp_path),
        "worker": {"backend": "nccl"},
        "workload": SMALL_WORKLOAD,
    })
    up = spawn(python("-m", "wsd.programs.cli", "up", "--nproc", "1", "--config", config), env=worker_env(),
               name="wsd up")
    endpoint = up.wait_for(r"wsd up: clients on (\S+)", 60).group(1)
    with Client(endpoint, timeout=5) as client:
        wait_until(lambda: client.status().counts.live == 1, 120, "the rank to register", interval=0.2)
        (rank,) = client.ranks().ranks
        assert rank.device == "cuda:0", rank.doc
    up.wait_for(r"rank 0/1 .* warm-up done", 60)
    up.send(signal.SIGTERM)
    assert up.wait(90) == 0, up.output()
    assert up.count("stopped cleanly after") == 1, up.output()
    assert up.count("Traceback") == 0, up.output()
