"""Faults with real processes: the coordinator killed, stopped or its state file damaged;
a worker stalled. What must hold through each: nothing the coordinator numbered is
forgotten, a damaged state is refused rather than started afresh, the engines step on
while the coordinator is away, and a stalled rank is seen lost and then back.

The coordinator runs as ``python -m wsd.programs.cli coordinator`` (``wsd coordinator``)
under ``tests/procs.py``, so that it can be SIGKILLed and SIGSTOPped; the
workers are ``tests/mp.py`` processes in one gloo world, each with a real
agent and a paced engine loop that can be paused and can measure its own step
rate. (A rank SIGKILLed and named in every reply is in test_multiprocess.py.)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from conftest import wait_until
from mp import Rank, Workers, recording_manager
from procs import COORDINATOR_READY, coordinator_section, python, spawn, write_config  # noqa: F401

from wsd.agent.collectives import tp_groups
from wsd.agent.thread import Agent
from wsd_client.client import Client

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0
# The engine's pace: a short sleep per step keeps two busy workers from
# starving the coordinator on a two-core machine.
STEP_PAUSE = 0.002


def _stop_arrives(me: Rank, timeout: float) -> bool:
    """Whether the next messages from the test, within ``timeout`` s, include ``stop``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = me.poll()
        if message is not None and message[0] == "stop":
            return True
        time.sleep(0.01)
    return False


def paced_engine(me: Rank, endpoint: str, tp_size: int) -> None:
    """A worker: manager, agent and an engine loop the test can pause and time.

    Messages: ``state``; ``pause`` / ``resume`` (stop and restart calling
    ``agent.step()``, as an engine stuck elsewhere would); ``window seconds``
    (report the steps run in the next ``seconds`` and the longest single
    ``step()`` among them); ``stop``. Every command the agent applies is
    recorded through the manager's own methods.
    """
    manager, calls = recording_manager()
    agent = Agent(manager, endpoint=endpoint, rank=me.rank, world_size=me.world_size, tp_size=tp_size,
                  tp_group=tp_groups(me.rank, me.world_size, tp_size, None)[1], idle=False,
                  heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT).start()
    applied: list[list[int]] = []
    paused = False
    window: dict[str, Any] | None = None
    try:
        me.report("ready")
        while True:
            message = me.poll()
            if message is not None:
                kind, *args = message
                if kind == "stop":
                    break
                if kind == "state":
                    me.report("state", steps=agent.steps, applied_seq=agent.applied_seq,
                              held_seq=agent.held_seq, applied=list(applied), calls=list(calls),
                              locked=manager.is_locked(), epoch=agent.epoch,
                              registered=agent.registered.is_set())
                elif kind in ("pause", "resume"):
                    paused = kind == "pause"
                    me.report(kind)
                elif kind == "window":
                    window = {"until": time.monotonic() + args[0], "start": time.monotonic(),
                              "steps": agent.steps, "max_step": 0.0}
                else:
                    raise ValueError(f"paced_engine: unknown message {kind!r}")
            if not paused:
                manager.get_simultaneous(((256,), torch.float32))
                started = time.monotonic()
                try:
                    done = agent.step()
                except RuntimeError:
                    # The test stops every rank: one that read its stop first has left the
                    # group this step's agreement waited on. That, and only that, ends the
                    # loop here: our own stop must be on its way.
                    if _stop_arrives(me, 5.0):
                        break
                    raise
                took = time.monotonic() - started
                applied += [[seq, agent.steps] for seq in done]
                if window is not None:
                    window["max_step"] = max(window["max_step"], took)
            if window is not None and time.monotonic() >= window["until"]:
                seconds = time.monotonic() - window["start"]
                steps = agent.steps - window["steps"]
                me.report("window", steps=steps, seconds=seconds, rate=steps / seconds,
                          max_step=window["max_step"])
                window = None
            time.sleep(STEP_PAUSE)
    finally:
        agent.stop()


# -- the coordinator as a process ------------------------------------------------------------


def coordinator_file(tmp_path: Any, name: str = "wsd.toml", **overrides: Any) -> str:
    section = {**coordinator_section(tmp_path), "world_size": 2, "tp_size": 1, **overrides}
    return write_config(tmp_path / name, {"coordinator": section})


def run_coordinator(spawn: Any, config: str) -> tuple[Any, str, str]:  # noqa: F811
    """``wsd coordinator`` started and bound: (its Proc, agent endpoint, client endpoint)."""
    proc = spawn(python("-m", "wsd.programs.cli", "coordinator", "--config", config), name="wsd coordinator")
    agents, clients = proc.wait_for(COORDINATOR_READY, 30).groups()
    return proc, agents, clients


def state(workers: Workers, rank: int) -> dict[str, Any]:
    return workers.ask(rank, "state")


def live(client: Client) -> int:
    return client.status()["ranks"]["live"]


@pytest.mark.timeout(90)
def test_coordinator_killed_mid_command_restarts_from_its_state_file(tmp_path, spawn):  # noqa: F811
    """A command numbered and written, applied by rank 0, held but not yet applied by a
    paused rank 1, when the coordinator dies by SIGKILL. Without the state file the new
    coordinator would restart at seq 0 with a blank desired state (and reuse numbers the
    agents hold); without re-registration the agents would never hear from it; without
    the at-most-once check by seq, rank 0 (replayed to) or rank 1 (holding it twice)
    would apply the command again."""
    config = coordinator_file(tmp_path)
    first, agents, clients = run_coordinator(spawn, config)
    with Workers(tmp_path, 2, paced_engine, agents, 1) as workers, Client(clients, timeout=5) as client:
        for r in (0, 1):
            workers.expect(r, "ready", 60)
        wait_until(lambda: live(client) == 2, 20, "both ranks live")
        assert client.set_ubatches(3).complete
        workers.ask(1, "pause")
        pending = client.lock(wait=False)
        assert pending.seq == 2
        wait_until(lambda: state(workers, 0)["applied_seq"] == 2 and state(workers, 1)["held_seq"] == 2,
                   10, "rank 0 to apply seq 2 and rank 1 to hold it")
        before = client.status()
        assert before["pending_commands"] == [2] and before["seq"] == 2, before  # mid-command
        assert before["desired"]["locked"] is True and before["desired"]["num_ubatches"] == 3
        epoch = before["epoch"]

        first.send(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL

        _second, _, _ = run_coordinator(spawn, coordinator_file(
            tmp_path, "restart.toml", agent_endpoint=agents, client_endpoint=clients))
        restarted = time.monotonic()
        after = client.status()
        assert after["epoch"] != epoch and after["recovered"] is True
        assert (after["seq"], after["desired"]) == (before["seq"], before["desired"])
        # A few heartbeats: the agents notice the new epoch (pulse) or are asked to register.
        wait_until(lambda: live(client) == 2, HEARTBEAT_TIMEOUT + 5 * HEARTBEAT_INTERVAL,
                   "both agents to rejoin the restarted coordinator by themselves")
        rejoined = time.monotonic() - restarted
        assert all(state(workers, r)["epoch"] == after["epoch"] for r in (0, 1))

        workers.ask(1, "resume")
        wait_until(lambda: state(workers, 1)["applied_seq"] == 2, 10, "rank 1 to apply seq 2")
        unlocked = client.unlock()
        assert unlocked.seq == 3 and unlocked.complete and sorted(unlocked.steps()) == [0, 1], unlocked
        for r in (0, 1):
            final = state(workers, r)
            assert [seq for seq, _ in final["applied"]] == [1, 2, 3], (r, final["applied"])
            assert final["calls"] == [["set_num_ubatches", [3]], ["lock", []], ["unlock", []]], (r, final)
        assert client.status()["seq"] == 3
    print(f"\nagents rejoined the restarted coordinator {rejoined:.2f} s after it was ready")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_damaged_state_file_is_refused_at_start_up_and_left_alone(tmp_path, spawn, damage):  # noqa: F811
    """The snapshot damaged (the commands are in its journal beside it). Without the
    check a coordinator would start afresh at seq 0 and hand out numbers that agents
    already applied (they would skip those commands); without leaving the file alone,
    the operator could not repair it."""
    config = coordinator_file(tmp_path)
    proc, _, clients = run_coordinator(spawn, config)
    with Client(clients, timeout=5) as client:
        assert [client.lock().seq, client.set_ubatches(4).seq] == [1, 2]  # no rank yet: recorded at once
    proc.send(signal.SIGKILL)
    proc.wait(10)
    path = tmp_path / "state"
    good = path.read_bytes()
    damaged = {"truncated": good[: len(good) // 2], "garbage": b"\xc1" + os.urandom(64), "empty": b""}[damage]
    path.write_bytes(damaged)
    refused = spawn(python("-m", "wsd.programs.cli", "coordinator", "--config", config), name="wsd coordinator")
    code = refused.wait(30)
    out = refused.output()
    assert code != 0, out
    assert f"{path}: not a valid coordinator state file" in out, out
    assert "Traceback" not in out and "wsd coordinator ready" not in out, out
    assert path.read_bytes() == damaged, "the damaged state file was overwritten"


@pytest.mark.timeout(60)
def test_journal_cut_short_by_a_crash_is_recovered_and_reported(tmp_path, spawn):  # noqa: F811
    """A crash mid-append leaves the journal's last record cut short, after the records
    its header counts; that command was never sent (the header counts a record once it
    is fsynced, and sending follows). Without the repair the coordinator could not
    start again; without the event the operator would not know."""
    config = coordinator_file(tmp_path)
    proc, _, clients = run_coordinator(spawn, config)
    journal = tmp_path / "state.journal"
    with Client(clients, timeout=5) as client:
        assert client.lock().seq == 1
        one = journal.read_bytes()  # the header counting one record, and that record
        assert client.set_ubatches(4).seq == 2
    proc.send(signal.SIGKILL)
    proc.wait(10)
    journal.write_bytes(one + journal.read_bytes()[len(one):-5])  # the crash came before the count
    _, _, clients = run_coordinator(spawn, config)
    with Client(clients, timeout=5) as client:
        status = client.status()
        assert status["seq"] == 1 and status["desired"]["locked"] is True, status
        assert status["desired"]["num_ubatches"] is None, status
        (repaired,) = [e for e in client.events()["events"] if e["kind"] == "state_repaired"]
        assert str(journal) in repaired["detail"], repaired
        assert client.unlock().seq == 2  # the torn number is handed out again: no agent saw it


@pytest.mark.timeout(90)
def test_engine_step_rate_holds_while_the_coordinator_is_stopped(tmp_path, spawn):  # noqa: F811
    """SIGSTOP the coordinator for longer than the heartbeat timeout: the agents find it
    silent and try to register again, yet the TP group's step rate (agreement collective
    included) stays within 20% and no step() waits on the network. Without the agent's
    non-blocking sends and its own I/O thread, steps would stall for the whole outage."""
    config = coordinator_file(tmp_path, tp_size=2)
    coordinator, agents, clients = run_coordinator(spawn, config)
    with Workers(tmp_path, 2, paced_engine, agents, 2) as workers, Client(clients, timeout=5) as client:
        for r in (0, 1):
            workers.expect(r, "ready", 60)
        wait_until(lambda: live(client) == 2, 20, "both ranks live")
        assert client.lock().complete

        def window(seconds: float) -> list[dict[str, Any]]:
            for r in (0, 1):
                workers.send(r, "window", seconds)
            return [workers.expect(r, "window", seconds + 20) for r in (0, 1)]

        before = window(2.0)
        coordinator.send(signal.SIGSTOP)
        try:
            during = window(3 * HEARTBEAT_TIMEOUT)
            assert not any(state(workers, r)["registered"] for r in (0, 1)), \
                "the agents did not notice the silent coordinator: the outage was not one"
        finally:
            coordinator.send(signal.SIGCONT)
        for r in (0, 1):
            b, d = before[r], during[r]
            print(f"\nrank {r}: {b['rate']:.0f} steps/s before ({b['steps']} steps), {d['rate']:.0f} "
                  f"during the outage ({d['steps']} steps); longest step() {d['max_step'] * 1000:.1f} ms")
            assert b["steps"] >= 200 and d["steps"] >= 200, (b, d)
            assert d["rate"] >= 0.8 * b["rate"], (r, b, d)
            assert d["max_step"] < HEARTBEAT_INTERVAL, (r, d)  # never waited for the coordinator
        wait_until(lambda: live(client) == 2, HEARTBEAT_TIMEOUT + 5, "both ranks live again")
        unlocked = client.unlock()
        assert unlocked.complete and unlocked.same_step == {0: True}, unlocked


@pytest.mark.timeout(90)
def test_stalled_worker_is_lost_within_the_timeout_and_back_when_resumed(tmp_path, spawn):  # noqa: F811
    """A worker process frozen by SIGSTOP (its agent's I/O thread with it) sends nothing:
    without heartbeat expiry it would stay "live" and commands would wait on it; without
    re-registration after SIGCONT it would stay lost. Rank 0 (its own TP group) runs on."""
    _, agents, clients = run_coordinator(spawn, coordinator_file(tmp_path))
    with Workers(tmp_path, 2, paced_engine, agents, 1) as workers, Client(clients, timeout=5) as client:
        for r in (0, 1):
            workers.expect(r, "ready", 60)
        wait_until(lambda: live(client) == 2, 20, "both ranks live")
        pid = workers.processes[1].pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            def rank1() -> dict[str, Any]:
                return {r["rank"]: r for r in client.ranks()["ranks"]}[1]
            wait_until(lambda: rank1()["state"] == "lost", HEARTBEAT_TIMEOUT + 2, "rank 1 to be lost")
            lost_after = time.monotonic() - stopped
            (lost,) = [e for e in client.events()["events"] if e["kind"] == "lost"]
            assert lost["rank"] == 1 and lost["silent_for"] <= HEARTBEAT_TIMEOUT + HEARTBEAT_INTERVAL + 0.5
            partial = client.lock(timeout=5)  # does not wait for the frozen rank
            assert sorted(partial.steps()) == [0] and [m["rank"] for m in partial.missing] == [1]
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(lambda: rank1()["state"] == "live", HEARTBEAT_TIMEOUT + 5, "rank 1 to be back")
        back_after = time.monotonic() - resumed
        assert [e["rank"] for e in client.events()["events"] if e["kind"] == "back"] == [1]
        # Back, it catches up on the command it missed, and takes part in the next.
        wait_until(lambda: state(workers, 1)["applied_seq"] == partial.seq, 10, "rank 1 to catch up")
        unlocked = client.unlock()
        assert unlocked.complete and sorted(unlocked.steps()) == [0, 1], unlocked
        assert state(workers, 1)["calls"] == [["lock", []], ["unlock", []]]
        assert [e["rank"] for e in client.events()["events"] if e["kind"] == "lost"] == [1]  # rank 0 never
    print(f"\nrank 1 lost {lost_after:.2f} s after SIGSTOP, back {back_after:.2f} s after SIGCONT")
