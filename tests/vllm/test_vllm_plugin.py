"""The vLLM plugin's parts without an engine: when it turns on, how it fails, waking, reporting.

The engine itself is in test_vllm_engine.py (heavy); these run in a second.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
from conftest import wait_until

from wsd import WorkspaceManager
from wsd.agent.stacks import StepClock
from wsd.agent.thread import Agent
from wsd.errors import ConfigError
from wsd.integrations.vllm import layout, lifecycle, metrics, plugin
from wsd.integrations.vllm.lifecycle import Engine, Wake
from wsd.integrations.vllm.wake import (
    WSD_STEP,
    WakeListener,
    WakeSender,
    wake_endpoint,
    wake_folder,
)
from wsd.names import engine_name_problem
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


def test_standalone_needs_no_coordinator_and_off_wins_over_one(tmp_path):
    coordinator = {"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:7600"}
    assert plugin.mode({"WSD_VLLM": "standalone"}) is plugin.Mode.STANDALONE
    assert plugin.mode({"WSD_VLLM": " Standalone ", **coordinator}) is plugin.Mode.STANDALONE
    assert plugin.mode(coordinator) is plugin.Mode.COORDINATOR
    assert plugin.mode({"WSD_VLLM": "off", **coordinator}) is None
    assert plugin.mode({"WSD_VLLM": ""}) is None
    with pytest.raises(ConfigError, match=r"WSD_VLLM='on': expected standalone .* or off"):
        plugin.mode({"WSD_VLLM": "on"})


def test_an_engine_being_snapshotted_runs_wsd_standalone_and_says_so_once(monkeypatch, caplog):
    """``vllm snapshot create`` runs the engine as ``python -m vllm.snapshot.server`` and refuses
    a process tree with a TCP connection out of it: there, with a coordinator configured, the
    workers attach standalone; the root says so in one WARNING line and tells its children."""
    from importlib.machinery import ModuleSpec

    endpoints: list[str] = []
    _unloaded_plugin(monkeypatch, {"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://10.0.0.9:7600"})
    monkeypatch.setattr(plugin, "_install", lambda config, endpoint: endpoints.append(endpoint))
    monkeypatch.setenv(plugin.SNAPSHOT, "0")  # the plugin sets it: gone again after the test
    main = sys.modules["__main__"]
    caplog.set_level("WARNING", logger=plugin.__name__)
    plugin.register()
    assert endpoints == ["tcp://10.0.0.9:7600"] and not caplog.records, "an engine not snapshotted"
    monkeypatch.setattr(plugin, "_installed", False)
    monkeypatch.setattr(main, "__spec__", ModuleSpec("vllm.snapshot.server", None), raising=False)
    plugin.register()
    assert endpoints[-1] == "", "the snapshot's root joined the coordinator"
    assert os.environ[plugin.SNAPSHOT] == "1"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "vllm snapshot create" in warned[0] and "standalone" in warned[0], warned
    monkeypatch.setattr(plugin, "_installed", False)
    monkeypatch.setattr(main, "__spec__", None, raising=False)  # a child: the engine core, a worker
    plugin.register()
    assert endpoints[-1] == "" and len(caplog.records) == 1


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


def test_each_part_patches_exactly_the_points_its_table_names(monkeypatch):
    """Fails if an install keeps its own list of what it patches beside ``patches.POINTS``: a
    wrapper or object for a point the table lacks, or a point of the table left unpatched."""
    from wsd.integrations.vllm import install, patches

    applied: dict[str, tuple[set[str], set[str]]] = {}
    monkeypatch.setattr(patches, "apply_points", lambda part, wrappers, objects, module: applied.setdefault(
        part, (set(wrappers), set(objects))))
    hooks = plugin.Engine(print)
    install.install_worker(None, manager_class=WorkspaceManager, attach=print, detach=print, engine=hooks)
    install.install_engine_core(None)
    install.install_api_server(None, print)
    expected = {part: ({p.name for p in patches.POINTS if p.part == part and p.how == "wrapped"},
                       {p.name for p in patches.POINTS if p.part == part and p.how in ("replaced", "added")})
                for part in (patches.WORKER, patches.ENGINE_CORE, patches.API_SERVER)}
    assert applied == expected
    assert {p.name for p in patches.POINTS if p.cpu_worker} <= expected[patches.WORKER][0]


def test_a_patch_table_and_an_install_that_differ_patch_nothing():
    from wsd.integrations.vllm import patches

    with pytest.raises(ValueError, match="are not POINTS'"):
        patches.apply_points(patches.API_SERVER, {"get_prometheus_registry": print, "attach_router": print}, {}, None)


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


def test_an_agent_wakes_its_engine_only_for_a_command_addressed_to_its_group(start_coordinator):
    """A command for TP group 1 must not wake group 0's idle engine: each wake costs an
    engine a step (and, in vLLM, its queue readers a second of spinning)."""
    coordinator = start_coordinator(world_size=2, tp_size=1)
    wakes = []
    agent = Agent(WorkspaceManager("cpu", 1), endpoint=coordinator.agent_endpoint, rank=0,
                  world_size=2, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                  on_pending=lambda: wakes.append(time.monotonic())).start()
    try:
        assert agent.wait_registered(10)
        agent.step()  # takes on the baseline
        with Client(coordinator.client_endpoint, timeout=5) as client:
            client.lock(group=1, wait=False)
            wait_until(lambda: agent.held_seq == 1, 5, "the command for group 1 to be held")
            observe(0.6)
            assert wakes == [], "woken for another group's command"
            client.lock(group=0, wait=False)
            wait_until(lambda: wakes, 5, "a wake-up for its own group's command")
        assert agent.step() == [2] and agent.applied_seq == 2 and agent.manager.is_locked()
    finally:
        agent.stop()


# -- fail-safe: no wsd error stops vLLM unless asked -------------------------------------------


def _unloaded_plugin(monkeypatch, env: dict[str, str]) -> None:
    """This process as vLLM's plugin loader finds it: only ``env`` of wsd's variables set, and
    the plugin not yet installed (each test undoes both)."""
    for name in [n for n in os.environ if n.startswith("WSD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin, "_installed", False)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == plugin.__name__ and r.levelname == "ERROR"]


@pytest.mark.parametrize("env, cause", [
    ({"WSD_CONFIG": "{path}"}, "not valid TOML"),
    ({"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:7600", "WSD_TYPO_KEY": "1"},
     "unknown section 'typo'"),
])
def test_a_broken_configuration_turns_wsd_off_in_one_line_and_vllm_runs_on(
        tmp_path, monkeypatch, caplog, env, cause):
    """vLLM aborts every process whose plugin function raises: a bad WSD_CONFIG or an
    unknown WSD_* variable once stopped every vLLM process. Now one ERROR line says why
    and how to make it fatal; WSD_VLLM_STRICT=1 makes it fatal."""
    config = tmp_path / "wsd.toml"
    config.write_text("[coordinator\n")
    _unloaded_plugin(monkeypatch, {name: value.format(path=config) for name, value in env.items()})
    monkeypatch.setattr(plugin, "_install", lambda config, endpoint: None)  # never patch this process's vLLM
    caplog.set_level("INFO", logger=plugin.__name__)
    plugin.register()
    (line,) = _errors(caplog)
    assert cause in line and "vLLM runs on" in line and "WSD_VLLM_STRICT=1" in line
    assert not plugin._installed
    monkeypatch.setenv("WSD_VLLM_STRICT", "1")
    with pytest.raises(ConfigError, match=cause):
        plugin.register()


class _Group:
    rank, world_size, rank_in_group, cpu_group = 0, 1, 0, None


class _Worker:
    """The parts of a vLLM worker that attaching reads."""

    device = torch.device("cpu")
    local_rank = 0

    class vllm_config:
        class model_config:
            served_model_name = "tiny"

        class parallel_config:
            tensor_parallel_size = 1
            data_parallel_rank = 0
            data_parallel_size = 1
            enable_dbo = False
            distributed_executor_backend = "mp"
            nnodes = 1


@pytest.fixture
def one_rank_vllm(tmp_path, monkeypatch):
    """vLLM's groups of a one-rank world, wsd's manager class in vLLM's place, and the
    figures' directory in ``tmp_path``; the manager and any attachment gone afterwards."""
    pytest.importorskip("vllm")
    import vllm.v1.worker.workspace as vllm_workspace
    from vllm.distributed import parallel_state

    from wsd.integrations.vllm import workspace

    monkeypatch.setattr(parallel_state, "get_world_group", lambda: _Group)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: _Group)
    monkeypatch.setattr(vllm_workspace, "WorkspaceManager", workspace.WorkspaceManager)
    monkeypatch.setenv(metrics.DIRECTORY, str(tmp_path))
    try:
        yield vllm_workspace
    finally:
        plugin._detach()
        vllm_workspace.reset_workspace_manager()


def test_an_attach_that_fails_turns_wsd_off_in_that_worker_only(tmp_path, monkeypatch, caplog, one_rank_vllm):
    """A worker whose attach fails (here: an agent token file that is not there) runs on
    without wsd, with one ERROR line; strict, the worker's start fails."""
    from wsd.config import load_config

    config = load_config(None, env={"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:9",
                                    "WSD_SECURITY_AGENT_TOKEN_FILE": str(tmp_path / "no-such-token")})
    caplog.set_level("INFO", logger=plugin.__name__)
    plugin._attach(_Worker(), config, "tcp://127.0.0.1:9")
    (line,) = _errors(caplog)
    assert "attaching this vLLM worker failed" in line and "no-such-token" in line
    assert plugin._attachment is None and os.listdir(tmp_path) == []  # its figures went with it
    monkeypatch.setenv("WSD_VLLM_STRICT", "1")
    with pytest.raises(Exception, match="no-such-token"):
        plugin._attach(_Worker(), config, "tcp://127.0.0.1:9")


def test_a_standalone_worker_has_wsds_manager_its_log_lines_and_its_figures_no_agent(
        tmp_path, monkeypatch, caplog, one_rank_vllm):
    from wsd.config import load_config
    from wsd.integrations.vllm import workspace

    config = load_config(None, env={"WSD_WORKSPACE_ON_LOCKED_GROWTH": "fallback"})
    monkeypatch.setattr(one_rank_vllm, "WorkspaceManager", workspace.configured(config.workspace))
    caplog.set_level("INFO", logger=plugin.__name__)
    plugin._attach(_Worker(), config, "")
    attachment = plugin._attachment
    assert attachment is not None and attachment.agent is None and attachment.wake is None
    (said,) = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert "rank 0 of 1 (TP group 0 of size 1) of engine" in said and "attached standalone (no coordinator)" in said
    assert os.listdir(tmp_path) == [f"{os.getpid()}.msgpack"]
    record = msgpack.unpackb((tmp_path / f"{os.getpid()}.msgpack").read_bytes())
    assert (record["model_name"], record["engine"], record["rank"], record["coordinator"]) == ("tiny", "0", 0, "")
    manager = one_rank_vllm.current_workspace_manager()
    manager.lock()
    manager.get_simultaneous(((64,), torch.uint8))  # fallback: served, and said
    (warned,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "rank 0's workspace is locked" in warned and "test_vllm_plugin.py:" in warned
    plugin._detach()
    assert plugin._attachment is None and os.listdir(tmp_path) == []


# -- where the step comes from ---------------------------------------------------------------------


class _FakeAgent:
    def __init__(self) -> None:
        self.steps: list[bool | str] = []  # each step's agree, "count", "warm", and pauses
        self.clock = StepClock(time.monotonic)
        self.held = self.applied_seq = 0

    def step(self, *, agree: bool) -> list[int]:
        self.steps.append(agree)
        return []

    def count_step(self) -> None:
        self.steps.append("count")

    def mark_warm(self) -> None:
        self.steps.append("warm")

    def pause(self, paused: bool) -> None:
        self.steps.append("pause" if paused else "resume")

    def offer(self) -> int:
        return self.held

    def settle(self, agreed: int) -> list[int]:
        self.steps.append(f"settle {agreed}")
        self.applied_seq = agreed
        return [agreed]


def test_a_worker_inside_its_engine_core_asks_the_listener_in_its_own_process(tmp_path, monkeypatch):
    """The uni executor builds the worker inside the engine core: its parent is the front end,
    where nothing listens, and its wake-ups were lost. It must ask its own process's listener."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    inbox: queue.Queue = queue.Queue()
    listener = WakeListener(inbox)
    wake = Wake(Engine(print), rank=0, tp_size=1, apply_every=16)
    try:
        wake()
        assert inbox.get(timeout=5) == (WSD_STEP, None)
    finally:
        wake.close()
        listener.close()


def test_a_one_rank_group_steps_between_the_engines_own_steps(monkeypatch):
    """With no engine core to ask (an engine in the caller's process), a TP group of one
    rank agrees on the agent's thread: only while the engine is warm, awake and not busy."""
    agent = _FakeAgent()
    engine = Engine(print)
    engine.attach(agent, stream=False, group=0)
    wake = Wake(engine, rank=0, tp_size=1, apply_every=16)
    try:
        assert engine.enter()  # the warm-up: compilation and capture may take minutes, and are no step
        assert agent.clock.inside() is None
        wake()
        engine.leave()
        assert agent.steps == [], "stepped before the engine's warm-up returned"
        engine.warmed()
        assert agent.steps == ["warm"], "the agent was not told of the warm-up"
        agent.steps.clear()
        assert engine.enter()
        wake()
        assert agent.clock.inside() is not None, "a warm engine's step is not counted as one"
        engine.leave()
        assert agent.steps == [], "stepped inside one of the engine's own steps"
        assert agent.clock.inside() is None
        engine.sleeping(True)
        wake()
        assert agent.steps == ["pause"], "stepped while the engine sleeps"
        engine.woke(["weights"])
        wake()
        assert agent.steps == ["pause"], "awake with only the weights back: the KV cache is still gone"
        engine.woke(["kv_cache"])
        wake()
        assert agent.steps == ["pause", "resume", True]
        engine.step()
        assert agent.steps[-1] is False
        engine.sleeping(True)
        assert engine.agree_now() == [] and agent.steps[-2:] == [False, "pause"], "agreed asleep"
    finally:
        wake.close()


def test_a_call_vllm_makes_from_inside_another_passes_straight_through():
    """vLLM's GPU warm-up calls the worker's own execute_model and sample_tokens: they once
    took a lock the warm-up held, and the engine hung. A call reached from inside another
    is no step, marks nothing warm, and only the outermost warm-up's return makes it warm."""
    from wsd.integrations.vllm import install

    agent = _FakeAgent()
    engine = Engine(print)
    engine.attach(agent, stream=True, group=0)
    calls: list[str] = []

    class Worker:
        def execute_model(self, scheduler_output):
            calls.append("execute")
            return "output"

        def sample_tokens(self, grammar_output):
            calls.append("sample")

        def compile_or_warm_up_model(self):
            assert self.execute_model(None) == "output"  # as vLLM's JIT warm-up does
            self.sample_tokens(None)
            return "compiled"

    Worker.execute_model = install._stepping(engine)(Worker.execute_model)
    Worker.sample_tokens = install._inside(engine)(Worker.sample_tokens)
    Worker.compile_or_warm_up_model = install._lifecycle(print, engine)["compile_or_warm_up_model"](
        Worker.compile_or_warm_up_model)
    worker = Worker()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.compile_or_warm_up_model(), done.set()), daemon=True).start()
    assert done.wait(10), "vLLM's warm-up hung in wsd's wrappers"
    assert calls == ["execute", "sample"]
    assert engine.steps == 0 and agent.steps == ["warm"], "a step inside the warm-up counted, or no warm"
    assert worker.execute_model(None) == "output" and agent.steps == ["warm", "count"]
    assert not engine.inside and agent.clock.inside() is None


def test_a_round_settles_each_group_at_its_lowest_offer():
    """The engine core's round: each TP group applies the lowest number any member holds;
    a group with nothing new, or a worker that takes no part, makes no second call."""
    from wsd.integrations.vllm.stream import agree

    assert agree([{"group": 0, "held": 3, "applied": 1}, {"group": 0, "held": 2, "applied": 1},
                  {"group": 1, "held": 4, "applied": 4}, {"group": 1, "held": 5, "applied": 4}]) == {0: 2}
    assert agree([{"group": 0, "held": 3, "applied": 3}, {"group": 0, "held": 3, "applied": 3}]) is None
    assert agree([{"group": 0, "held": 3, "applied": 1}, None]) is None
    assert agree([]) is None
    agent = _FakeAgent()
    engine = Engine(print)
    engine.attach(agent, stream=True, group=1)
    agent.held = 7
    assert engine.offer() == {"group": 1, "held": 7, "applied": 0}
    assert engine.settle({0: 9}) == [] and engine.settle({1: 7}) == [7]
    engine.sleeping(True)
    assert engine.offer() is None and engine.settle({1: 9}) == []


def test_an_engine_core_whose_executor_sleeps_calls_no_worker_for_a_round(monkeypatch):
    """A wake-up reaching a sleeping engine core makes no round: no call reaches its workers
    (a checkpointed executor refuses every one) until the executor is awake again."""
    from wsd.integrations.vllm import install, patches
    from wsd.integrations.vllm.stream import WSD_APPLY, WSD_OFFER

    wrappers: dict[str, object] = {}
    monkeypatch.setattr(patches, "apply_points",
                        lambda part, wrapped, objects, module: wrappers.update(wrapped))
    install.install_engine_core(None)
    handle = wrappers["_handle_client_request"](lambda *a: pytest.fail("a wsd step reached vLLM's own handler"))
    calls: list[str] = []

    class Executor:
        def __init__(self) -> None:
            self.sleeping_tags = {"kv_cache"}

        @property
        def is_sleeping(self) -> bool:
            return bool(self.sleeping_tags)

    def collective_rpc(method, args=()):
        calls.append(method)
        return [{"group": 0, "held": 2, "applied": 1}] if method == WSD_OFFER else [[2]]

    core = SimpleNamespace(model_executor=Executor(), collective_rpc=collective_rpc,
                           vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
                               distributed_executor_backend="mp", nnodes=1)))
    handle(core, WSD_STEP, None)
    assert calls == [], "a round reached the workers of a sleeping executor"
    core.model_executor.sleeping_tags = set()
    handle(core, WSD_STEP, None)
    assert calls == [WSD_OFFER, WSD_APPLY]


def test_under_fault_tolerance_a_group_no_stream_drives_reports_and_joins_no_collective():
    """vLLM's --enable-fault-tolerance runs a barrier on the TP group's cpu_group every step and
    asks that nothing else run on it: where no engine core drives the workers through its
    stream, a TP group of several ranks is not steered (no agreement, no offer, no wake-up)."""
    from wsd.integrations.vllm.stream import steered

    ft = SimpleNamespace(enable_fault_tolerance=True)
    assert steered(ft, stream=True, tp_size=4), "through the stream: no collective at all"
    assert steered(ft, stream=False, tp_size=1), "a group of one rank agrees alone"
    assert not steered(ft, stream=False, tp_size=2)
    assert steered(SimpleNamespace(), stream=False, tp_size=2), "0.32: no fault tolerance"
    agent = _FakeAgent()
    agent.held = 3
    engine = Engine(print)
    engine.attach(agent, stream=False, group=0, steered=False)
    engine.warmed()
    for _ in range(40):
        assert engine.enter()
        engine.step()
        engine.leave()
    assert agent.steps == ["warm", *["count"] * 40], "an unsteered rank agreed at its steps"
    assert engine.agree_now() == [] and engine.offer() is None and engine.settle({0: 3}) == []
    engine.step_between()
    assert agent.steps == ["warm", *["count"] * 40]


def test_only_workers_their_engine_core_spawned_or_holds_take_commands_through_its_stream():
    from wsd.integrations.vllm.stream import ENGINE_CORE_PID, driven_by_engine_core

    mp = SimpleNamespace(distributed_executor_backend="mp", nnodes=1)
    env = {ENGINE_CORE_PID: "100"}
    assert driven_by_engine_core(mp, env, pid=200, ppid=100)  # spawned by its engine core
    assert driven_by_engine_core(SimpleNamespace(distributed_executor_backend="uni"), env, pid=100, ppid=1)
    assert not driven_by_engine_core(mp, {}, pid=200, ppid=100), "an engine in the caller's process"
    assert not driven_by_engine_core(mp, env, pid=200, ppid=300), "another engine core's grandchild"
    assert not driven_by_engine_core(SimpleNamespace(distributed_executor_backend="mp", nnodes=2), env, 200, 100)
    assert not driven_by_engine_core(SimpleNamespace(distributed_executor_backend="ray"), env, 200, 100)
    assert not driven_by_engine_core(SimpleNamespace(distributed_executor_backend="external_launcher"),
                                     env, 100, 1)


def test_a_worker_no_engine_core_can_wake_says_so_once(tmp_path, monkeypatch, caplog):
    """Ray workers and multi-node followers have no engine core to wake: the command waits
    for the engine's own agreement step, and the log says so once (never a silent drop)."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    caplog.set_level("WARNING", logger=plugin.__name__)
    caplog.set_level("WARNING", logger=lifecycle.__name__)
    wake = Wake(Engine(print), rank=3, tp_size=2, apply_every=16)
    try:
        wake()
        wake()
    finally:
        wake.close()
    lines = [r.getMessage() for r in caplog.records if r.name == lifecycle.__name__]
    assert len(lines) == 1 and "rank 3 cannot wake its engine" in lines[0]


@pytest.mark.parametrize("tp, world", [(1, 1), (2, 4), (2, 8), (4, 8)])
def test_placement_takes_vllms_world_and_contiguous_tp_groups(tp, world):
    class Parallel:
        tensor_parallel_size = tp

    places = [layout.placement(Parallel, rank, world) for rank in range(world)]
    assert [p.rank for p in places] == list(range(world))
    assert {p.world_size for p in places} == {world}
    assert [p.tp_group for p in places] == [r // tp for r in range(world)]


def test_placement_refuses_a_world_of_partial_tp_groups():
    class Parallel:
        tensor_parallel_size = 4

    with pytest.raises(ValueError, match="whole TP groups of 4"):
        layout.placement(Parallel, 1, 6)


def _vllm_config(model: str, served: object = None, dp_size: int = 1, dp_index: int | None = 0) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(model=model, served_model_name=served),
                           parallel_config=SimpleNamespace(data_parallel_size=dp_size, data_parallel_index=dp_index))


@pytest.mark.parametrize("config, env, name", [
    (_vllm_config("/models/llama"), {}, "node-a-models-llama"),
    (_vllm_config("/models/llama", served=["meta-llama/Llama-3.1-8B", "alias"]), {}, "node-a-meta-llama-Llama-3-1-8B"),
    (_vllm_config("m", served="m"), {"CUDA_VISIBLE_DEVICES": "2,3"}, "node-a-m-gpu2"),
    (_vllm_config("m", served="m", dp_size=1, dp_index=3), {}, "node-a-m-dp3"),  # a dense DP replica
    (_vllm_config("m", served="m", dp_size=4, dp_index=3), {}, "node-a-m"),  # MoE DP: one engine
])
def test_a_vllm_engine_is_named_after_its_host_model_gpus_and_dense_dp_replica(config, env, name):
    """Stable across a restart of the same replica, and apart for replicas that differ in
    model, GPUs or dense DP index; always a valid engine name."""
    assert layout.default_engine(config, "node-a", env) == name
    assert engine_name_problem(name) is None


def _parts_applied(monkeypatch) -> list[str]:
    """The parts of the patches that this process applies from now on, named as each applies
    instead of patching vLLM (the checks before them run as they are); hooks still waiting
    for a module when the test ends are dropped."""
    from wsd.integrations.vllm import imports, install

    applied: list[str] = []
    monkeypatch.setattr(install, "install_worker", lambda *a, **k: applied.append("worker"))
    monkeypatch.setattr(install, "install_cpu_worker", lambda *a, **k: applied.append("cpu worker"))
    monkeypatch.setattr(install, "install_engine_core", lambda *a, **k: applied.append("engine core"))
    monkeypatch.setattr(imports, "_hooks", {})
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not imports._finder])
    return applied


def test_a_vllm_whose_internals_moved_keeps_its_own_engine_core_and_runs_on(monkeypatch, caplog):
    """A patch point that is not there leaves its part of vLLM as it is, with one line naming
    the vLLM version and the point; the other part, whose points hold, applies."""
    pytest.importorskip("vllm")
    import vllm.v1.worker.cpu_worker  # noqa: F401 (imported: its part applies at once)
    from vllm.v1.engine import core

    from wsd.integrations.vllm import patches

    _unloaded_plugin(monkeypatch, {"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:7600"})
    applied = _parts_applied(monkeypatch)
    monkeypatch.delattr(core.EngineCoreProc, "_handle_client_request")
    caplog.set_level("INFO", logger=plugin.__name__)
    plugin.register()
    (line,) = _errors(caplog)
    assert f"vLLM {patches.vllm_version()} has no vllm.v1.engine.core.EngineCoreProc" in line
    assert "patching vLLM's engine core failed" in line
    assert applied == ["worker", "cpu worker"]


def test_nothing_applies_before_the_engines_warm_up_and_the_rank_reads_warming(start_coordinator):
    """A lock replayed into a fresh engine once landed before its warm-up: the built-in
    engine then refused its own warm-up's growth (478 violations per rank in 15 s), and on
    a GPU it would land before vLLM's CUDA-graph capture. Until the engine says it is warm,
    the agent applies nothing, wakes nothing, and its rank reads warming."""
    coordinator = start_coordinator(world_size=1, tp_size=1)
    wakes = []
    with Client(coordinator.client_endpoint, timeout=5) as client:
        client.lock(wait=False)  # the desired state a fresh rank takes on: locked
        agent = Agent(WorkspaceManager("cpu", 1), endpoint=coordinator.agent_endpoint, rank=0,
                      world_size=1, heartbeat_interval=0.2, heartbeat_timeout=2.0, warm=False,
                      on_pending=lambda: wakes.append(1)).start()
        try:
            assert agent.wait_registered(10)
            wait_until(lambda: client.ranks().ranks and client.ranks().ranks[0].warming, 5, "warming")
            for _ in range(5):  # warm-up steps: they grow the workspace, and must be able to
                assert agent.step(agree=True) == []
                agent.manager.get_simultaneous(((1024 * (_ + 1),), torch.uint8))
            observe(0.5)
            assert not agent.manager.is_locked() and wakes == [], "locked or woken while warming"
            agent.mark_warm()
            wait_until(lambda: wakes, 5, "a wake-up once warm")
            agent.step()
            assert agent.manager.is_locked() and agent.manager.stats().lock_violations == 0
            wait_until(lambda: not client.ranks().ranks[0].warming and client.ranks().ranks[0].locked,
                       5, "the rank live, warm and locked")
        finally:
            agent.stop()


def test_a_vllm_whose_workspace_has_more_than_wsds_keeps_its_own_class(monkeypatch, caplog):
    """A release that adds to the workspace API (0.34's get_retained was one): a class swap
    would hand vLLM's kernels a manager without it. wsd leaves vLLM's class in place and
    names what it lacks, in one line."""
    pytest.importorskip("vllm")
    import vllm.v1.worker.workspace as vllm_workspace

    from wsd.integrations.vllm import patches

    def get_leased(self, key):  # what a future release might add
        return key

    monkeypatch.setattr(vllm_workspace.WorkspaceManager, "get_leased", get_leased, raising=False)
    with pytest.raises(patches.VllmIntegrationError,
                       match=r"has what wsd's stand-in lacks: WorkspaceManager\.get_leased; wsd leaves vLLM's"):
        patches.check()

    import vllm.v1.engine.core  # imported: its part applies at once
    import vllm.v1.worker.cpu_worker  # noqa: F401

    _unloaded_plugin(monkeypatch, {"WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:7600"})
    applied = _parts_applied(monkeypatch)
    caplog.set_level("INFO", logger=plugin.__name__)
    plugin.register()
    (line,) = _errors(caplog)
    assert "WorkspaceManager.get_leased" in line and "patching vLLM's worker failed" in line
    assert applied == ["engine core"], "the worker's part, the class swap with it, stays vLLM's own"


def test_an_unverified_release_leaves_wsd_off_in_one_line_unless_opted_in(monkeypatch, caplog):
    """A hang is worse than no wsd: on a vLLM release wsd has not run, the plugin stays off,
    saying so once with the release and the variable that opts in; opted in, it runs."""
    pytest.importorskip("vllm")
    import vllm

    from wsd.integrations.vllm import patches

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    caplog.set_level("WARNING", logger=patches.__name__)
    _unloaded_plugin(monkeypatch, {"WSD_VLLM": "standalone"})
    applied = _parts_applied(monkeypatch)
    plugin.register()
    (line,) = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    assert "wsd is off: vLLM 0.35.0 is not a release wsd was verified with (0.32.0, 0.33.0, 0.34.0)" in line
    assert "WSD_VLLM_UNVERIFIED=1" in line and applied == []
    caplog.clear()
    assert patches.verified({"WSD_VLLM_UNVERIFIED": "1"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == patches.__name__]
    assert "WSD_VLLM_UNVERIFIED=1: wsd runs on it" in line
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    assert patches.verified({})


# -- each part applies in the processes that load it -------------------------------------------


_PROCESS_PARTS = """
import sys
from wsd.integrations.vllm import plugin

plugin.register()
import vllm.entrypoints.openai.api_server  # what vLLM's API server process loads
import vllm.v1.worker.workspace as vllm_workspace
import vllm.entrypoints.serve.instrumentator.metrics as served  # as its app is built
print("api server:", sorted(m for m in ("vllm.v1.worker.gpu_worker", "vllm.v1.engine.core") if m in sys.modules),
      vllm_workspace.WorkspaceManager.__module__, getattr(served.get_prometheus_registry, "__wsd_wrapped__", False))
import vllm.v1.worker.cpu_worker as cpu_worker  # a worker process: the worker's part applies as it loads
worker = sys.modules["vllm.v1.worker.gpu_worker"].Worker
print("worker:", vllm_workspace.WorkspaceManager.__module__,
      all(getattr(getattr(worker, name), "__wsd_wrapped__", False)
          for name in ("init_device", "execute_model", "compile_or_warm_up_model", "shutdown")),
      getattr(cpu_worker.CPUWorker.compile_or_warm_up_model, "__wsd_wrapped__", False),
      "vllm.v1.engine.core" in sys.modules)
import vllm.v1.engine.core as core  # an engine core process
print("engine core:", getattr(core.EngineCoreProc.run_busy_loop, "__wsd_wrapped__", False))
import inspect
print("source:", "class Worker" in inspect.getsource(sys.modules["vllm.v1.worker.gpu_worker"]))
"""


def test_an_api_server_loads_no_worker_and_each_part_applies_as_its_module_loads(tmp_path):
    """vLLM loads plugins in every process. Checking the worker's patch points once imported
    vLLM's GPU worker and model runner (hundreds of modules, half a second) in the API
    server too; now each part is checked and applied when its module is imported."""
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSD_")}
    env.update(WSD_COORDINATOR_CONNECT_ENDPOINT="tcp://127.0.0.1:9", PYTHONWARNINGS="ignore")
    import subprocess

    done = subprocess.run([sys.executable, "-c", _PROCESS_PARTS], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.split(":")[0] in
             ("api server", "worker", "engine core", "source")]
    assert lines == ["api server: [] vllm.v1.worker.workspace True",
                     "worker: wsd.integrations.vllm.workspace True True False",
                     "engine core: True",
                     "source: True"], done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("env, why", [
    ({}, "neither WSD_VLLM=standalone nor a coordinator"),
    ({"WSD_VLLM": "off", "WSD_COORDINATOR_CONNECT_ENDPOINT": "tcp://127.0.0.1:9"}, "WSD_VLLM=off"),
])
def test_off_each_worker_says_so_and_why_and_nothing_is_patched(tmp_path, env, why):
    pytest.importorskip("vllm")
    import subprocess

    script = ("from wsd.integrations.vllm import plugin\nplugin.register()\n"
              "import vllm.logger\nvllm.logger._configure_vllm_root_logger()\n"  # as a worker process has it
              "import vllm.v1.worker.gpu_worker, vllm.v1.worker.workspace as w\n"
              "print('manager:', w.WorkspaceManager.__module__)\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("WSD_")}
    environment.update(env, PYTHONWARNINGS="ignore", VLLM_LOGGING_LEVEL="INFO")
    done = subprocess.run([sys.executable, "-c", script], env=environment, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "manager: vllm.v1.worker.workspace" in output
    assert output.count("wsd is off in this worker") == 1 and why in output, output[-3000:]


def test_a_hook_runs_once_its_module_has_run_or_at_once_if_it_has(tmp_path, monkeypatch):
    from wsd.integrations.vllm import imports

    monkeypatch.setattr(imports, "_hooks", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "wsd_hooked_a.py").write_text("import sys\nVALUE = 1\nHOOKED_DURING = 'seen' in sys.modules\n")
    seen: list[tuple[str, int]] = []
    imports.when_imported("wsd_hooked_a", lambda m: seen.append((m.__name__, m.VALUE)))
    assert seen == [] and "wsd_hooked_a" not in sys.modules
    try:
        import wsd_hooked_a

        assert seen == [("wsd_hooked_a", 1)], "after the module's code, before the import returned"
        assert type(wsd_hooked_a.__loader__).__name__ == "SourceFileLoader", "the module keeps its own loader"
        assert imports._finder not in sys.meta_path, "no finder left once no hook waits"
        imports.when_imported("wsd_hooked_a", lambda m: seen.append(("again", m.VALUE)))
        assert seen[-1] == ("again", 1), "an imported module: at once"
    finally:
        sys.modules.pop("wsd_hooked_a", None)


def test_a_hook_that_raises_fails_the_import_and_every_later_one_without_running_it_again(tmp_path, monkeypatch):
    """A second import once executed the module a second time, unhooked (a strict plugin's
    refusal undone by whoever caught it and imported again)."""
    from wsd.integrations.vllm import imports

    monkeypatch.setattr(imports, "_hooks", {})
    monkeypatch.setattr(imports, "_failed", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    runs = tmp_path / "runs"
    (tmp_path / "wsd_hooked_b.py").write_text(f"open({str(runs)!r}, 'a').write('ran ')\nVALUE = 2\n")

    def refuse(module):
        raise RuntimeError("strict: refused")

    imports.when_imported("wsd_hooked_b", refuse)
    try:
        with pytest.raises(RuntimeError, match="strict: refused"):
            import wsd_hooked_b
        assert "wsd_hooked_b" not in sys.modules
        with pytest.raises(ImportError, match=r"not imported again: wsd's hook failed .*strict: refused"):
            import wsd_hooked_b  # noqa: F401
        assert runs.read_text() == "ran ", "the module's code ran again"
    finally:
        sys.modules.pop("wsd_hooked_b", None)
        if imports._finder in sys.meta_path:
            sys.meta_path.remove(imports._finder)


def test_while_a_hook_waits_the_modules_loader_answers_as_its_own(tmp_path, monkeypatch):
    """runpy, pkgutil and coverage ask a module's loader for its code, source and data before
    it runs: the hook's loader once had none of them."""
    import importlib.util

    from wsd.integrations.vllm import imports

    monkeypatch.setattr(imports, "_hooks", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "wsd_hooked_c.py").write_text("VALUE = 3\n")
    imports.when_imported("wsd_hooked_c", lambda m: None)
    try:
        spec = importlib.util.find_spec("wsd_hooked_c")
        assert spec is not None and type(spec.loader).__name__ == "_Loader"
        assert spec.loader.get_source("wsd_hooked_c") == "VALUE = 3\n"
        assert spec.loader.get_code("wsd_hooked_c") is not None and not spec.loader.is_package("wsd_hooked_c")
        assert spec.loader.get_filename("wsd_hooked_c").endswith("wsd_hooked_c.py")
    finally:
        imports._hooks.clear()
        if imports._finder in sys.meta_path:
            sys.meta_path.remove(imports._finder)
