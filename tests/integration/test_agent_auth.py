"""Agents believe only the real coordinator, and a proof seen on the wire is worth nothing.

With the agent token, every registration is a handshake over two fresh nonces
(``wsd.security``): the agent's first REGISTER carries its nonce; the
coordinator's CHALLENGE carries its own and proves it holds the token; the
agent's second REGISTER proves it does, over both; REGISTERED proves it is the
coordinator's answer; every COMMAND carries a MAC under a key of the two nonces.
The attacks of the trust review, tried again: a process standing in for the
coordinator on its endpoint during a restart (it got four valid proofs and had
its ``reserve`` and ``lock`` applied), and a registration sniffed on the wire and
replayed (it took a live rank, before and after a coordinator restart).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from conftest import coordinator_config, wait_until
from corekit import FakeTarget, Harness, make, ops, to_agents

from wsd.agent.core import AgentCore
from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.core import CoordinatorCore
from wsd.coordinator.loop import Coordinator
from wsd.errors import BindError
from wsd.security import challenge_proof, command_mac, registration_proof, session_key
from wsd.wire import protocol as p
from wsd.wire.protocol import Op
from wsd_client.client import Client

TOKEN = b"0123456789abcdef0123456789abcdef"


def with_token(tmp_path) -> Harness:
    h = make(tmp_path)
    return Harness(CoordinatorCore(h.config, clock=h.mono, wall=h.wall, agent_token=TOKEN), h.mono, h.wall, h.config)


def body(rank: int, instance: str, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "world_size": 4, "tp_size": 2, "tp_group": rank // 2, "host": "node", "pid": 1000 + rank,
            "device": "cpu", "applied_seq": None, "acks": [], "step": 0, "idle": True, "state": {},
            "instance": instance, **extra}


def handshake(h: Harness, peer: bytes, rank: int, nonce: str = "agent-nonce") -> tuple[dict[str, Any], list]:
    """A real agent's two registrations on connection ``peer``: the second one's body (what a
    sniffer sees), and what the coordinator sent back to it."""
    challenge = to_agents(h.agent(peer, Op.REGISTER, body(rank, f"i{rank}", nonce=nonce)), Op.CHALLENGE)[peer]
    assert challenge["proof"] == challenge_proof(TOKEN, nonce, challenge["nonce"])
    second = body(rank, f"i{rank}", nonce=nonce, challenge=challenge["nonce"],
                  proof=registration_proof(TOKEN, rank, f"i{rank}", None, nonce, challenge["nonce"]))
    return second, h.agent(peer, Op.REGISTER, second)


def test_a_registration_replayed_on_another_connection_or_later_is_refused(tmp_path):
    """A sniffed registration once took the live rank at once, from any connection, and still
    did after a coordinator restart: its proof was bound to nothing fresh."""
    h = with_token(tmp_path)
    sniffed, sent = handshake(h, b"real", 1)
    assert ops(sent) == [Op.REGISTERED]
    h.mono.now += h.config.heartbeat_timeout + 1  # the real rank silent: a takeover would be allowed now
    assert ops(h.agent(b"attacker", Op.REGISTER, sniffed)) == [Op.REJECTED]  # no challenge sent to it
    # nor on the connection it was sent on, the challenge spent, nor after asking for one of its own
    assert ops(h.agent(b"real", Op.REGISTER, sniffed)) == [Op.REJECTED]
    assert ops(h.agent(b"attacker", Op.REGISTER, body(1, "i1", nonce="agent-nonce"))) == [Op.CHALLENGE]
    assert ops(h.agent(b"attacker", Op.REGISTER, sniffed)) == [Op.REJECTED]
    restarted = Harness(CoordinatorCore(h.config, clock=h.mono, wall=h.wall, agent_token=TOKEN), h.mono, h.wall,
                        h.config)
    assert ops(restarted.agent(b"real", Op.REGISTER, sniffed)) == [Op.REJECTED]
    assert h.core.engine().registry.ranks[1].peer == b"real"
    refused = [e for e in h.events("rejected") if e["rank"] == 1]
    assert len(refused) == 3 and all(e["code"] == "forbidden" for e in refused)


def test_an_agent_without_the_token_or_too_old_to_be_challenged_is_told_what_to_do(tmp_path):
    h = with_token(tmp_path)
    sent = h.agent(b"old", Op.REGISTER, body(0, "i0", proof="0" * 64))
    message = to_agents(sent, Op.REJECTED)[b"old"]["message"]
    assert "sends no nonce" in message and "WSD_AGENT_TOKEN" in message and "upgrade it" in message


def test_every_command_is_authenticated_under_its_ranks_own_registration(tmp_path):
    h = with_token(tmp_path)
    keys = {}
    for rank in range(4):
        peer = f"peer-{rank}".encode()
        second, sent = handshake(h, peer, rank, nonce=f"n{rank}")
        registered = to_agents(sent, Op.REGISTERED)[peer]
        assert registered["proof"]  # checked by the agent: test_an_agent_believes_only_a_coordinator_...
        keys[peer] = session_key(TOKEN, f"n{rank}", second["challenge"])
    commands = to_agents(h.client(Op.LOCK, {"wait": False}), Op.COMMAND)
    assert set(commands) == set(keys)
    for peer, command in commands.items():
        assert command["mac"] == command_mac(keys[peer], command)
        others = [k for q, k in keys.items() if q != peer]
        assert all(command["mac"] != command_mac(k, command) for k in others)  # one rank's is no other's


def test_an_agent_believes_only_a_coordinator_that_proves_it_holds_the_token():
    """Standing in for the coordinator without the token: no challenge it sends gets a proof,
    no answer registers the agent, and no command applies."""
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1, heartbeat_interval=1.0, token=TOKEN)
    [first] = link.on_time(0.0)
    nonce = p.decode(first).body["nonce"]
    assert nonce and p.decode(first).body["proof"] is None  # nothing to replay in a first registration
    fake = {"epoch": "e", "baseline_seq": 0, "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0,
            "stats_interval": 1.0, "desired": {"locked": True, "num_ubatches": 1, "reserve_bytes": None}}
    assert link.on_frame(p.encode(Op.CHALLENGE, {"nonce": "c" * 32, "proof": "0" * 64}), 0.1) == []
    assert link.on_frame(p.encode(Op.REGISTERED, {**fake, "proof": "0" * 64}), 0.2) == []
    assert link.on_frame(p.encode(Op.REGISTERED, fake), 0.3) == []
    assert link.on_frame(p.encode(Op.COMMAND, {"seq": 1, "action": "lock", "args": {}, "group": None}), 0.4) == []
    assert not link.registered.is_set() and link.held == 0 and target.applied == [] and link.unauthenticated == 4
    # The real one: its challenge answered with a proof, its answer believed, its command applied.
    link.on_time(2.0)
    nonce = link.registration()["nonce"]
    [second] = link.on_frame(p.encode(Op.CHALLENGE, {"nonce": "d" * 32,
                                                     "proof": challenge_proof(TOKEN, nonce, "d" * 32)}), 2.1)
    assert p.decode(second).body["proof"] == registration_proof(TOKEN, 0, link.instance, None, nonce, "d" * 32)


def test_a_process_standing_in_for_the_coordinator_during_a_restart_gets_nothing(tmp_path, zmq_socket):
    """The takeover of the trust review: while the coordinator restarts, a process without the
    token binds its agent port and answers as a coordinator would. It used to get all four
    agents' registrations and have its reserve and lock applied; the real coordinator then
    refused all four. Now no agent registers with it or applies its commands, and all four
    join the real coordinator once it is back."""
    with socket.socket() as s:  # a port the coordinator and the squatter take in turn
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"

    def again(bind: Callable[[], Any]) -> Any:
        """``bind()`` until the port is free: ZeroMQ closes a socket's listener on its own
        thread, a moment after close() returns."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return bind()
            except (BindError, zmq.ZMQError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the pace of retries, not a wait for a condition

    def real() -> Coordinator:
        config = coordinator_config(tmp_path, agent_endpoint=endpoint, world_size=4, tp_size=2)
        return again(lambda: Coordinator(config, agent_token=TOKEN).start())

    coordinator = real()
    with SimulatedRanks(endpoint, range(4), world_size=4, tp_size=2, num_ubatches=2, heartbeat_interval=0.2,
                        heartbeat_timeout=1.0, token=TOKEN) as sim:
        assert sim.wait_registered(20)
        coordinator.stop()
        squatter = zmq_socket(zmq.ROUTER)
        again(lambda: squatter.bind(endpoint))
        # Until every agent has tried it (each re-registers once it misses the coordinator)
        proofs, deadline = 0, time.monotonic() + 30.0
        while not all(link.unauthenticated > 0 for link in sim.links):
            assert time.monotonic() < deadline, [link.unauthenticated for link in sim.links]
            if not squatter.poll(100):
                continue
            peer, frame = squatter.recv_multipart()
            message = p.decode(frame)
            if message.op is not Op.REGISTER:
                continue
            proofs += message.body["proof"] is not None
            # what it can say without the token: a challenge, its answer, and commands
            squatter.send_multipart([peer, p.encode(Op.CHALLENGE, {"nonce": "f" * 32, "proof": "0" * 64})])
            squatter.send_multipart([peer, p.encode(Op.REGISTERED, {
                "epoch": "squatter", "baseline_seq": 0, "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0,
                "desired": {"locked": True, "num_ubatches": 2, "reserve_bytes": 64 << 20}})])
            for seq, action, args in ((1, "reserve", {"bytes": 64 << 20}), (2, "lock", {})):
                squatter.send_multipart([peer, p.encode(Op.COMMAND, {"seq": seq, "action": action, "args": args,
                                                                     "group": None})])
        assert proofs == 0, "an agent handed the squatter a proof"
        assert not any(m.locked for m in sim.managers), "an agent applied the squatter's lock"
        assert all(link.unauthenticated > 0 for link in sim.links)
        squatter.close(linger=0)
        coordinator = real()  # back on its port, with its state file
        try:
            with Client(coordinator.client_endpoint, timeout=5) as client:
                wait_until(lambda: client.status()["ranks"]["live"] == 4, 20, "all four ranks back")
                assert client.lock().complete  # and the real coordinator's commands apply
            assert all(m.locked for m in sim.managers)
        finally:
            coordinator.stop()


@pytest.mark.parametrize("token", [None, TOKEN])
def test_simulated_ranks_register_and_apply_with_or_without_a_token(start_coordinator, token):
    coordinator = start_coordinator(world_size=2, tp_size=1, agent_token=token)
    with SimulatedRanks(coordinator.agent_endpoint, range(2), world_size=2, num_ubatches=1,
                        heartbeat_interval=0.2, heartbeat_timeout=2.0, token=token) as sim:
        assert sim.wait_registered(20)
        with Client(coordinator.client_endpoint, timeout=5) as client:
            assert client.lock().complete
        assert all(m.locked for m in sim.managers)


def test_challenges_asked_for_by_many_connections_cost_bounded_memory(tmp_path):
    """Every first registration is answered with a challenge the coordinator remembers until
    it is answered: connections that ask and never answer keep at most MAX_CHALLENGES, the
    oldest forgotten first (its connection asks again, as an agent does each interval)."""
    from wsd.coordinator.admission import MAX_CHALLENGES

    h = with_token(tmp_path)
    for i in range(MAX_CHALLENGES + 500):
        h.core.gate.challenge(f"peer-{i}".encode(), "n")
    assert len(h.core.gate._challenges) == MAX_CHALLENGES
    # the newest still answer; the oldest were forgotten and are refused
    assert ops(h.agent(b"peer-0", Op.REGISTER, body(0, "i0", nonce="n", challenge="x", proof="0" * 64))) == [
        Op.REJECTED]
    _, sent = handshake(h, b"late", 0)
    assert ops(sent) == [Op.REGISTERED]
