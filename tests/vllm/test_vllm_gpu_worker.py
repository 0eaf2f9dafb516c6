"""vLLM's own GPU worker life cycle with wsd loaded, on CPU: only the device-bound leaves stubbed.

The vLLM tier's engines run vLLM's CPU worker, whose warm-up calls no step. The GPU
worker's warm-up calls the worker's own ``execute_model`` and ``sample_tokens``
(``warmup_kernels``, the V2 runner's JIT warm-up, on by default), which wsd wraps:
its wrappers once took a lock the warm-up wrapper held, and the default CUDA engine
hung in warm-up, silently. ``gpu_worker_script.py`` runs vLLM 0.32's own
``Worker`` methods (``init_device`` to ``shutdown``) with wsd loaded by vLLM's own
``load_general_plugins()``; each phase has a bound, and a phase that does not
return within it fails the test with the threads' stacks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from wsd_client.client import Client

pytest.importorskip("vllm")

SCRIPT = Path(__file__).with_name("gpu_worker_script.py")


def free_port() -> int:
    """A loopback port free now, for the worker's one-rank gloo rendezvous (vLLM binds it itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_worker(tmp_path: Path, env: dict[str, str]) -> dict[str, dict]:
    """The script's phases, by name; fails naming the phase that hung or raised."""
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("WSD_")}, **env,
            "GPU_WORKER_TMP": str(tmp_path), "GPU_WORKER_PORT": str(free_port()), "VLLM_PLUGINS": "wsd"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=full, capture_output=True, text=True, timeout=240)
    phases = {}
    for line in done.stdout.splitlines():
        if line.startswith("PHASE "):
            _, name, body = line.split(" ", 2)
            phases[name] = json.loads(body)
    assert done.returncode == 0, f"vLLM's GPU worker did not get through its life cycle (exit {done.returncode}); " \
        f"phases {list(phases)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return phases


def assert_life_cycle(phases: dict[str, dict]) -> None:
    assert phases["loaded"]["manager"] == "wsd.integrations.vllm.workspace"
    assert set(phases["loaded"]["wrapped"]) >= {"init_device", "compile_or_warm_up_model", "execute_model",
                                                 "sample_tokens", "sleep", "wake_up", "shutdown"}
    assert phases["init_device"]["manager"] == "wsd.integrations.vllm.workspace"
    warm_up = phases["warm_up"]
    # vLLM's JIT warm-up reached vLLM's own execute_model through wsd's wrapper, and then capture.
    assert warm_up["events"] == ["kernel_warmup", "warmup_kernels", "runner.execute_model",
                                 "runner.sample_tokens", "runner.capture_model"]
    (inner,) = warm_up["inner"]
    assert inner == {"steps": 0, "warm": False, "locked": False}, "the warm-up's own step counted as one"
    assert warm_up["locked"] and warm_up["wsd"]["warm"], "not warm after vLLM's lock after capture"
    assert warm_up["wsd"]["steps"] == 0
    assert phases["steps"]["wsd"]["steps"] == 3 and not phases["steps"]["wsd"]["inside"]
    assert phases["sleep"]["wsd"]["asleep"]
    assert phases["wake_weights"]["wsd"]["asleep"], "awake with the weights only: the KV cache is still gone"
    assert not phases["wake"]["wsd"]["asleep"]
    assert "runner.shutdown" in phases["shutdown"]["events"]


def test_standalone_vllms_gpu_worker_warms_up_steps_sleeps_and_stops(tmp_path):
    phases = run_worker(tmp_path, {"WSD_VLLM": "standalone"})
    assert_life_cycle(phases)
    assert not phases["steps"]["wsd"]["agent"]


def test_with_a_coordinator_vllms_gpu_worker_joins_and_gets_through_its_life_cycle(tmp_path, start_coordinator):
    coordinator = start_coordinator(world_size=1, tp_size=1)
    phases = run_worker(tmp_path, {"WSD_COORDINATOR_CONNECT_ENDPOINT": coordinator.agent_endpoint,
                                   "WSD_AGENT_ENGINE": "gpu-worker"})
    assert_life_cycle(phases)
    assert phases["steps"]["wsd"]["agent"], "the worker never joined its coordinator"
    with Client(coordinator.client_endpoint, timeout=5) as client:
        (rank,) = client.ranks(engine="gpu-worker").ranks
        assert rank.state == "stopped" and not rank.warming
