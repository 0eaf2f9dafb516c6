"""The vLLM plugin's parts without an engine: when it turns on, how it fails, waking, reporting.

The engine itself is in test_vllm_engine.py (heavy); these run in a second.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_until

from wsd import WorkspaceManager
from wsd.agent.thread import Agent
from wsd.errors import ConfigError
from wsd.integrations.vllm import plugin
from wsd.integrations.vllm.wake import (
    WSD_STEP,
    WakeListener,
    WakeSender,
    wake_endpoint,
    wake_folder,
)
from wsd_client.client import Client


def observe(seconds: float) -> None:
    """An observation window: asserting that something does *not* happen needs one."""
    threading.Event().wait(seconds)


# -- when the plugin turns on -------------------------------------------------------


def test_unconfigured_the_plugin_does_nothing(tmp_path):
    assert not plugin.enabled({})
    config = tmp_path / "wsd.toml"
    config.write_text("[workspace]\nnum_ubatches = 2\n")
    assert not plugin.enabled({"WSD_CONFIG": str(config)})  # says nothing of where agents connect


def test_an_endpoint_in_the_environment_or_the_file_turns_it_on(tmp_path):
    assert plugin.enabled({"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:7600"})
    config = tmp_path / "wsd.toml"
    config.write_text('[coordinator]\nagent_endpoint = "tcp://127.0.0.1:7600"\n')
    assert plugin.enabled({"WSD_CONFIG": str(config)})


def test_a_bad_config_file_fails_naming_it(tmp_path):
    config = tmp_path / "wsd.toml"
    config.write_text("[coordinator\n")
    with pytest.raises(ConfigError, match=r"wsd\.toml: not valid TOML"):
        plugin.enabled({"WSD_CONFIG": str(config)})


# -- the patch points -------------------------------------------------------------------


def test_patch_points_hold_for_the_installed_vllm():
    pytest.importorskip("vllm")
    from wsd.integrations.vllm import patches

    patches.check()


def test_a_changed_internal_fails_loudly_naming_the_version(monkeypatch):
    """A vLLM whose internals moved must be refused at start, not fail mid-step."""
    pytest.importorskip("vllm")
    from vllm.v1.engine import core

    from wsd.integrations.vllm import patches

    monkeypatch.delattr(core.EngineCoreProc, "_handle_client_request")
    with pytest.raises(patches.VllmIntegrationError,
                       match=rf"vLLM {patches.vllm_version()} has no vllm\.v1\.engine\.core\."
                             r"EngineCoreProc\._handle_client_request.*checked against vLLM 0\.32\.0"):
        patches.check()


def test_a_changed_signature_fails_loudly(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.v1.worker.workspace as vllm_workspace

    from wsd.integrations.vllm import patches

    class Other:
        def __init__(self, device, num_ubatches=None):
            pass

    monkeypatch.setattr(vllm_workspace, "WorkspaceManager", Other)
    with pytest.raises(patches.VllmIntegrationError, match="alloc_context"):
        patches.check()


def test_wrap_wraps_once():
    class Owner:
        def method(self):
            return 1

    calls = []

    def make(original):
        def wrapper(self):
            calls.append(1)
            return original(self) + 1
        return wrapper

    from wsd.integrations.vllm.patches import wrap

    wrap(Owner, "method", make)
    wrap(Owner, "method", make)  # a second load of the plugin must not wrap twice
    assert Owner().method() == 2 and calls == [1]


# -- waking an idle engine ------------------------------------------------------------------


def test_wake_ups_become_one_queued_step_until_it_runs(tmp_path, monkeypatch):
    """Every worker of a group wakes the engine core together: one WSD_STEP serves
    them all, and once it has run the next wake-up queues another."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    inbox: queue.Queue = queue.Queue()
    listener = WakeListener(inbox)
    senders = [WakeSender(listener.endpoint) for _ in range(2)]
    try:
        # Until the connections are up (a send before that is dropped, by design).
        wait_until(lambda: [send() for send in senders] and not inbox.empty(), 5, "the first step")
        assert inbox.get_nowait() == (WSD_STEP, None)
        for send in senders:  # still queued: no second step
            send()
        observe(0.3)
        assert inbox.empty()
        listener.queued.clear()  # the engine core ran it
        senders[0]()
        assert inbox.get(timeout=5) == (WSD_STEP, None)
    finally:
        for send in senders:
            send.close()
        listener.close()
    assert not list(Path(wake_folder()).iterdir()), "the socket file outlived the listener"


def test_a_sender_with_no_engine_core_neither_blocks_nor_fails(tmp_path):
    send = WakeSender(f"ipc://{tmp_path}/nobody")
    began = time.monotonic()
    for _ in range(100):
        send()
    send.close()
    assert time.monotonic() - began < 2


# -- the agent's side -------------------------------------------------------------------------


def test_an_agent_wakes_its_idle_engine_only_while_a_command_waits(start_coordinator):
    """No step for a while and a command held: on_pending is called (and again while it
    waits); applied by a step: no more calls. Nothing held: never called."""
    coordinator = start_coordinator()
    wakes = []
    agent = Agent(WorkspaceManager("cpu", 1), endpoint=coordinator.agent_endpoint, rank=0,
                  world_size=1, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                  on_pending=lambda: wakes.append(time.monotonic())).start()
    try:
        assert agent.wait_registered(10)
        wait_until(lambda: agent.applied_seq == 0 and agent.held_seq == 0, 5, "baseline")
        agent.step()
        observe(0.6)
        assert wakes == [], "woken with nothing pending"
        with Client(coordinator.client_endpoint, timeout=5) as client:
            client.lock(wait=False)
        wait_until(lambda: len(wakes) >= 2, 5, "two wake-ups while the lock waits")
        assert agent.step() == [1] and agent.manager.is_locked()
        seen = len(wakes)
        observe(0.6)
        assert len(wakes) == seen, "woken after the command was applied"
    finally:
        agent.stop()


def test_a_raised_violation_waits_for_its_report_to_leave(start_coordinator):
    """The refusal may end the worker (vLLM's does): the event must already be sent."""
    coordinator = start_coordinator()
    manager = WorkspaceManager("cpu", 1)
    agent = Agent(manager, endpoint=coordinator.agent_endpoint, rank=0, world_size=1,
                  heartbeat_interval=0.2, heartbeat_timeout=2.0).start()
    try:
        assert agent.wait_registered(10)
        manager.lock()
        with pytest.raises(AssertionError):
            manager.get_simultaneous(((64,), torch.uint8))
        assert agent._sent >= agent._queued == 1  # sent before the raise came back
        with Client(coordinator.client_endpoint, timeout=5) as client:
            events = wait_until(
                lambda: [e for e in client.events()["events"] if e["kind"] == "lock_violation"],
                5, "the violation event")
        assert events[0]["policy"] == "raise" and events[0]["requested"] == 256
    finally:
        agent.stop()


def test_the_class_put_in_vllms_place_takes_the_workspace_section():
    """vLLM builds its manager with its own counts only: [workspace]'s policies reach it
    through the class, and the engine's positional arguments still mean what they mean."""
    from wsd.config import WorkspaceConfig
    from wsd.integrations.vllm import workspace

    cls = workspace.configured(WorkspaceConfig(on_locked_growth="fallback", growth="granular",
                                               granularity=4096))
    manager = cls(torch.device("cpu"), 2, 1)
    assert isinstance(manager, workspace.WorkspaceManager)
    assert (manager.num_ubatches, manager.num_lanes) == (2, 1)
    manager.get_simultaneous(((100,), torch.uint8))
    assert manager._current_workspaces[0].numel() == 4096
    manager.lock()
    (big,) = manager.get_simultaneous(((8192,), torch.uint8))  # served: fallback
    assert big.numel() == 8192 and manager.stats().lock_violations == 1


def test_a_killed_engine_cores_socket_is_removed_by_the_next(tmp_path, monkeypatch):
    """vLLM's default shutdown SIGKILLs the engine core, which then cannot remove its
    socket file: the next engine core on the machine removes those of dead pids."""
    import subprocess
    import sys

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(wake_folder())
    (folder / f"wsd-vllm-wake-{dead}").touch()
    (folder / f"wsd-vllm-wake-{os.getppid()}").touch()  # a live pid: left alone
    listener = WakeListener(queue.Queue())
    try:
        names = {p.name for p in folder.iterdir()}
        assert f"wsd-vllm-wake-{dead}" not in names
        assert f"wsd-vllm-wake-{os.getppid()}" in names
    finally:
        listener.close()


def test_a_busy_engine_that_agrees_seldom_is_asked_for_an_agreement_step(start_coordinator):
    """With apply_every=16 a busy engine's steps do not agree; a waiting command still
    asks for one agreement step (step(agree=True), as vLLM's woken wsd_step) after 0.2 s."""
    from wsd.config import AgentConfig

    coordinator = start_coordinator()
    wakes = []
    agent = Agent(WorkspaceManager("cpu", 1), endpoint=coordinator.agent_endpoint, rank=0,
                  world_size=1, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                  config=AgentConfig(apply_every=16), on_pending=lambda: wakes.append(1)).start()
    try:
        assert agent.wait_registered(10)
        agent.step()  # step 1: the baseline is not taken before a step agrees
        with Client(coordinator.client_endpoint, timeout=5) as client:
            client.lock(wait=False)
        wait_until(lambda: agent.held_seq == 1, 5, "the lock to be held")
        for _ in range(12):  # steps 2..13 over 0.6 s, none a 16th: the engine keeps stepping
            assert agent.step() == []
            observe(0.05)
        assert wakes, "not woken while the engine stepped without agreeing"
        assert not agent.manager.is_locked()
        assert agent.step(agree=True) == [1] and agent.manager.is_locked()
    finally:
        agent.stop()


def test_wake_sockets_live_in_a_folder_only_this_user_may_enter(tmp_path, monkeypatch):
    """In a shared temp folder another user could squat a future engine core's socket name
    (its unlink then failed and took the engine core down) or send it wake-ups: the sockets
    live in <tmp>/wsd-<uid>, mode 0700, and a folder of that name that is not so is refused."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = Path(wake_folder())
    assert folder.parent == tmp_path and folder.stat().st_mode & 0o777 == 0o700
    listener = WakeListener(queue.Queue())
    try:
        assert listener.endpoint == f"ipc://{folder}/wsd-vllm-wake-{os.getpid()}"
        assert wake_endpoint(os.getpid()) == listener.endpoint  # where its workers look
    finally:
        listener.close()
    folder.chmod(0o755)  # as if someone else had made it, open to all
    with pytest.raises(PermissionError, match="mode 0755"):
        WakeListener(queue.Queue())
    folder.rmdir()
    folder.symlink_to(tmp_path)  # a link planted in its place
    with pytest.raises(PermissionError, match="not a folder"):
        wake_folder()
