"""A real frozen rank: ``torchrun`` workers on gloo, one stopped with SIGSTOP mid-run.

The frozen worker's agent freezes with it, so its rank turns ``lost``; its peer's
engine thread sits in the TP collective that waits for it while its agent still
answers, so that rank turns ``stalled``, its agent sends its stacks once, and the
coordinator keeps them in the ``stalled`` event. ``wsctl stacks`` reads the same
thread live. SIGCONT lets the group go on, and the stall ends. Everything is
observed through the installed ``wsctl --json``.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import wait_until
from procs import COORDINATOR_READY, WSD, coordinator_section, processes, torchrun, worker_env, write_config, wsctl

STALL_AFTER = 3.0

pytestmark = pytest.mark.timeout(240)


def engine_frames(threads: list[dict]) -> list[str]:
    (engine,) = [t for t in threads if t["engine"]]
    assert threads[0] is engine, "the engine's thread comes first"
    return engine["frames"]


def test_a_frozen_rank_is_lost_and_its_peer_stalled_in_the_collective_with_its_stacks_kept(tmp_path):
    config = write_config(tmp_path / "wsd.toml", {
        "coordinator": {**coordinator_section(tmp_path), "heartbeat_timeout": 1.5, "world_size": 2,
                        "stall_after": STALL_AFTER, "stats_timeout": 2.0},
        # The peer left alone in the collective waits far longer than the test does.
        "worker": {"collective_timeout": 120.0},
        "workload": {"hidden_size": 32, "ffn_size": 64, "layers": 2, "max_tokens": 64, "warmup_steps": 5,
                     "pace": 0.05, "lock": False},
    })
    with processes() as start:
        coordinator = start([WSD, "coordinator", "--config", config], name="wsd coordinator")
        agents, endpoint = coordinator.wait_for(COORDINATOR_READY, 30).groups()
        workers = start(torchrun(2, config), name="torchrun", env=worker_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))

        def stepping() -> dict | None:
            doc = wsctl(endpoint, "ranks").doc
            ranks = {r["rank"]: r for r in doc["ranks"]}
            return ranks if len(ranks) == 2 and all(r["state"] == "live" and r["step"] > 10
                                                   for r in ranks.values()) else None

        ranks = wait_until(stepping, 120, "both ranks live and stepping", interval=0.5)
        assert workers.popen.poll() is None, workers.output()
        frozen = ranks[1]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        try:
            def stalled() -> dict | None:
                doc = wsctl(endpoint, "ranks").doc
                states = {r["rank"]: r for r in doc["ranks"]}
                return states if states[0]["state"] == "stalled" and states[1]["state"] == "lost" else None

            states = wait_until(stalled, 60, "rank 0 stalled and rank 1 lost", interval=0.5)
            assert states[0]["in_step"] >= STALL_AFTER

            def event() -> dict | None:
                found = [e for e in wsctl(endpoint, "events", "--since", "0").doc["events"]
                         if e["kind"] == "stalled"]
                return found[0] if found else None

            kept = wait_until(event, 30, "the stalled event", interval=0.5)
            assert (kept["rank"], kept["peers"], kept["waits_for"]) == (0, {"1": "lost"}, [1]), kept
            frames = engine_frames(kept["stacks"])
            assert any("torch/distributed" in f for f in frames), frames  # inside the collective
            assert any("wsd/worker/workload.py" in f for f in frames), frames

            live = wsctl(endpoint, "stacks", "--rank", "0", timeout=5.0)
            assert live.code == 0, live
            (rank0,) = live.doc["ranks"]
            assert rank0["rank"] == 0 and rank0["in_step"] >= STALL_AFTER
            assert any("torch/distributed" in f for f in engine_frames(rank0["threads"]))
            every = wsctl(endpoint, "stacks", timeout=5.0)
            assert every.code == 3 and [m["rank"] for m in every.doc["missing"]] == [1], every
            assert every.doc["missing"][0]["reason"].startswith("lost")
        finally:
            os.kill(frozen, signal.SIGCONT)

        def going_on() -> bool:
            doc = wsctl(endpoint, "ranks").doc
            return all(r["state"] == "live" for r in doc["ranks"])

        wait_until(going_on, 60, "both ranks live again after SIGCONT", interval=0.5)
        # Rank 0's stall ends. Rank 1, woken inside the step it froze in, may read stalled for
        # a moment too (it was inside that step all along) before it leaves it: every stall ends.
        events = wsctl(endpoint, "events", "--since", "0").doc["events"]
        stalled = [e["rank"] for e in events if e["kind"] == "stalled"]
        ended = [e["rank"] for e in events if e["kind"] == "unstalled"]
        assert stalled[0] == 0 and 0 in ended and sorted(set(stalled)) == sorted(set(ended)), events
