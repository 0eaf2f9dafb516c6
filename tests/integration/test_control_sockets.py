"""The real coordinator on random loopback ports with in-process agents and the client."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq
from conftest import one_engine, wait_until

from wsd import WorkspaceLockedError, WorkspaceManager, use_ubatch
from wsd.agent.thread import Agent
from wsd.wire.protocol import PROTOCOL_VERSION, ErrorCode
from wsd_client.client import Client, ClientError, Unavailable
from wsd_client.rows import rank_columns, rank_slots


@pytest.fixture
def agents():
    made: list[Agent] = []

    def make(coordinator, rank: int, world: int, *, idle: bool = True, ubatches: int = 2) -> Agent:
        agent = Agent(WorkspaceManager("cpu", ubatches), endpoint=coordinator.agent_endpoint,
                      rank=rank, world_size=world, idle=idle,
                      heartbeat_interval=0.2, heartbeat_timeout=1.0).start()
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop(timeout=10)


def registered(coordinator, *agents_: Agent) -> None:
    for agent in agents_:
        assert agent.wait_registered(10), f"rank {agent.rank} did not register"


def test_idle_agents_apply_commands_on_receipt(start_coordinator, agents):
    coordinator = start_coordinator()
    a0, a1 = agents(coordinator, 0, 2), agents(coordinator, 1, 2)
    registered(coordinator, a0, a1)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        result = client.lock()
        assert result.complete and result.seq == 1 and sorted(result.steps()) == [0, 1]
        assert a0.manager.is_locked() and a1.manager.is_locked()
        assert client.unlock().seq == 2
        assert not a0.manager.is_locked()
        result = client.set_ubatches(4)
        assert result.complete and a1.manager.num_ubatches == 4
        assert client.reserve_bytes(4096).complete
        assert all(s.capacity_bytes == 4096 for s in a0.manager.stats().slots)
        assert client.trim().complete
        assert a0.manager.stats().total_bytes == 0


def test_stepping_agent_applies_only_at_step(start_coordinator, agents):
    coordinator = start_coordinator()
    agent = agents(coordinator, 0, 1, idle=False)
    registered(coordinator, agent)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        result = client.lock(wait=False)
        assert not result.waited and result.seq == 1
        wait_until(lambda: agent.held_seq == 1, 5, "the command to arrive")
        assert not agent.manager.is_locked()  # received, not yet applied
        agent.step()
        assert agent.step() == []
        assert agent.manager.is_locked() and agent.applied_seq == 1


@pytest.mark.parametrize("idle", [True, False], ids=["idle", "stepping"])
def test_replacement_process_comes_up_in_the_desired_state(start_coordinator, agents, idle):
    """A brand-new process for a rank that already served (torchrun restarted it)
    registers fresh: without the desired state in REGISTERED it would come up
    unlocked with its configured 2 slots while its group should be locked with 3."""
    coordinator = start_coordinator()
    a0, a1 = agents(coordinator, 0, 2), agents(coordinator, 1, 2)
    registered(coordinator, a0, a1)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        assert client.lock().complete and client.set_ubatches(3).complete
        a1.stop()  # the old process of rank 1 is gone
        fresh = agents(coordinator, 1, 2, idle=idle)
        registered(coordinator, fresh)
        if not idle:  # applied at the engine's step boundary, not before
            assert not fresh.manager.is_locked() and fresh.manager.num_ubatches == 2
            assert fresh.step() == []  # the start is no command: it applies no seq
        wait_until(lambda: fresh.manager.is_locked() and fresh.manager.num_ubatches == 3, 5,
                   "the replacement to take on the desired state")
        assert fresh.applied_seq == 2
        desired = client.status()["groups"][1]["desired"]
        assert desired["locked"] is True and desired["num_ubatches"] == 3
        wait_until(lambda: {r["rank"]: (r["locked"], r["num_ubatches"]) for r in client.ranks()["ranks"]}
                   == {0: (True, 3), 1: (True, 3)}, 5, "heartbeats with every rank in the desired state")


def rank_states(client: Client) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in one_engine(client.ranks())["ranks"]}


def test_a_stopped_agent_says_goodbye_and_is_never_lost(start_coordinator, agents):
    """Without the goodbye a worker that shut down cleanly would read as crashed:
    ``lost`` one heartbeat timeout (1 s here) after it stopped, with a ``lost`` event.
    It must be ``stopped`` at once and stay so; ``goodbye=False`` (a worker dying of
    an error) still leaves the rank to be lost."""
    coordinator = start_coordinator(world_size=3, tp_size=1)
    timeout = coordinator.core.config.heartbeat_timeout
    a0, a1, a2 = (agents(coordinator, rank, 3) for rank in range(3))
    registered(coordinator, a0, a1, a2)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        started = time.monotonic()
        a1.stop()
        assert time.monotonic() - started < 2.0, "stop() waited on the goodbye"
        wait_until(lambda: rank_states(client)[1] == "stopped", timeout / 2, "rank 1 to be shown stopped")
        # Watched for twice the heartbeat timeout: the silence of a stopped rank is no loss.
        watch_until = time.monotonic() + 2 * timeout
        while time.monotonic() < watch_until:
            assert rank_states(client) == {0: "live", 1: "stopped", 2: "live"}
            time.sleep(0.05)
        [rank1] = [r for r in client.ranks()["ranks"] if r["rank"] == 1]
        assert rank1["stopped_at"] is not None and rank1["lost_at"] is None
        status = client.status()
        assert status["ranks"] == {"live": 2, "stalled": 0, "lost": 0, "stopped": 1, "missing": 0}
        [missing] = status["groups"][1]["missing"]
        assert missing["rank"] == 1 and missing["reason"].startswith("stopped (said goodbye at ")
        kinds = [(e["kind"], e.get("rank")) for e in client.events()["events"]]
        assert ("stopped", 1) in kinds and not [k for k in kinds if k[0] == "lost"]

        a2.stop(goodbye=False)  # as a worker dying of an error: no goodbye, so lost
        wait_until(lambda: rank_states(client)[2] == "lost", timeout + 5, "rank 2 to be lost")
        assert rank_states(client)[1] == "stopped"


def test_stop_is_bounded_when_the_coordinator_is_gone(start_coordinator, agents):
    """A goodbye to a coordinator that is not there must neither hang nor fail stop()."""
    coordinator = start_coordinator()
    agent = agents(coordinator, 0, 1)
    registered(coordinator, agent)
    coordinator.stop(timeout=10)
    assert agent.registered.is_set()  # it has not noticed yet: it will try to say goodbye
    started = time.monotonic()
    agent.stop(timeout=5)
    assert time.monotonic() - started < 2.0


def test_stats_per_rank_and_slot(start_coordinator, agents):
    coordinator = start_coordinator()
    a0, a1 = agents(coordinator, 0, 2), agents(coordinator, 1, 2)
    registered(coordinator, a0, a1)
    with use_ubatch(1):
        a0.manager.get_simultaneous(((1000,), torch.float32))
    a1.manager.get_simultaneous(((10,), torch.float32))
    with Client(coordinator.client_endpoint, timeout=5) as client:
        stats = client.stats(fresh=True)  # every rank asked now: the numbers of this moment
        # What the ranks push reaches the same numbers within an interval, each with its age.
        pushed = wait_until(lambda: (s := client.stats()).ranks and [
            {k: v for k, v in r.items() if k != "confirmed_at"} for r in s.ranks] == [
            {k: v for k, v in r.items() if k != "confirmed_at"} for r in stats.ranks] and s,
            5, "the pushed snapshots to match the fresh ones")
    assert not pushed["fresh"] and stats["fresh"]
    assert stats["complete"] and stats["missing"] == []
    assert [r["rank"] for r in stats.ranks] == [0, 1]
    assert stats["slots"]["rank"] == [0, 0, 1, 1]  # the compact answer: every rank's slots, one table
    assert stats["slots"]["capacity_bytes"] == [0, 4096, 256, 0]
    assert rank_columns(stats)[1]["requests"] == [1, 0]
    assert [s["capacity_bytes"] for s in rank_slots(stats, 0)] == [0, 4096]  # the documented rows
    assert stats["total_bytes"] == 4096 + 256


def test_lock_violation_reaches_the_event_log(start_coordinator, agents):
    coordinator = start_coordinator()
    agent = agents(coordinator, 0, 1)
    registered(coordinator, agent)
    agent.manager.lock()
    with pytest.raises(WorkspaceLockedError):
        agent.manager.get_simultaneous(((64,), torch.float32))
    with Client(coordinator.client_endpoint, timeout=5) as client:
        def violation():
            events = client.events()["events"]
            return [e for e in events if e["kind"] == "lock_violation"]
        (event,) = wait_until(violation, 5, "the lock violation event")
    assert event["rank"] == 0 and event["requested"] == 256 and event["capacity"] == 0
    assert event["caller"].endswith("test_lock_violation_reaches_the_event_log")


def test_events_cursor_follows(start_coordinator, agents):
    coordinator = start_coordinator()
    with Client(coordinator.client_endpoint, timeout=5) as client:
        first = client.events()
        agent = agents(coordinator, 0, 1)
        registered(coordinator, agent)
        later = wait_until(lambda: client.events(first["cursor"])["events"], 5, "a new event")
    assert [e["kind"] for e in later] == ["joined"]
    assert all(e["id"] > first["cursor"] for e in later)


def test_agent_reregisters_after_coordinator_restart(start_coordinator, agents, tmp_path):
    coordinator = start_coordinator()
    agent = agents(coordinator, 0, 1)
    registered(coordinator, agent)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        client.lock()
    agent_endpoint, client_endpoint = coordinator.agent_endpoint, coordinator.client_endpoint
    first_epoch = agent.epoch
    coordinator.stop()
    again = start_coordinator(agent_endpoint=agent_endpoint, client_endpoint=client_endpoint)
    assert again.core.recovered and again.core.engine().log.seq == 1
    wait_until(lambda: agent.registered.is_set() and agent.epoch != first_epoch, 10, "re-registration")
    with Client(client_endpoint, timeout=5) as client:
        assert client.unlock().seq == 2
    assert agent.applied_seq == 2 and not agent.manager.is_locked()


def test_client_times_out_without_coordinator(zmq_context, zmq_socket):
    silent = zmq_socket(zmq.ROUTER, bind=True)  # bound, never answers
    client = Client(silent.LAST_ENDPOINT.decode(), timeout=0.3, retries=1, context=zmq_context)
    with pytest.raises(Unavailable, match="2 attempts"):
        client.ping()
    client.close()


def test_bad_client_frames_get_error_replies_and_service_goes_on(start_coordinator, zmq_socket):
    coordinator = start_coordinator()
    sock = zmq_socket(zmq.DEALER, connect=coordinator.client_endpoint)
    for frame, code in [
        (b"\xc1garbage", ErrorCode.BAD_MESSAGE),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "explode", "id": 3}), ErrorCode.UNKNOWN_OP),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "set_ubatches", "id": 4, "body": {"n": 0}}), ErrorCode.BAD_FIELD),
        (b"\x00" * (2 << 20), ErrorCode.TOO_LARGE),
    ]:
        sock.send(frame)
        assert sock.poll(5000), f"no reply to {frame[:20]!r}"
        reply = msgpack.unpackb(sock.recv())
        assert reply["ok"] is False and reply["error"]["code"] == code
    with Client(coordinator.client_endpoint, timeout=5) as client:
        assert client.ping()["seq"] == 0


def test_client_error_carries_code(start_coordinator):
    coordinator = start_coordinator(world_size=2, tp_size=1)
    with Client(coordinator.client_endpoint, timeout=5) as client, pytest.raises(ClientError) as info:
        client.lock(group=7)
    assert info.value.code == ErrorCode.BAD_FIELD and "group" in info.value.message
