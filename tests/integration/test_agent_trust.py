"""The agent endpoint believes nothing a peer claims: each way a peer once could, one test each.

Attacks tried as a peer that can reach the agent endpoint would (the default
deployment: loopback, no CURVE), first on the coordinator's core with its
clocks in hand, then over real ZeroMQ sockets against a coordinator thread with
real agents beside the attacker. Each test failed on the code before the fix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import coordinator_config, wait_until
from corekit import Harness, make, ops, peer_of, to_agents
from procs import python, spawn  # noqa: F401  (spawn is a fixture)

from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.core import RESEND_WINDOW
from wsd.security import challenge_proof, registration_proof
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode, Op
from wsd_client.client import Client

TOKEN = b"0123456789abcdef0123456789abcdef"


def decode_sent(out: list) -> list[p.Message]:
    return [p.decode(frame, p.COORDINATOR_OPS) for _, _, frame in out]


@pytest.fixture
def h(tmp_path) -> Harness:
    return make(tmp_path)


def issue(h: Harness, n: int) -> None:
    for _ in range(n):
        h.client(Op.LOCK, {"wait": False})
        h.client(Op.UNLOCK, {"wait": False})


# -- sequence numbers: never adopted from a peer ----------------------------------------------


@pytest.mark.parametrize("claim", [1_000, 2**63 - 1])
def test_a_registration_claiming_numbers_never_issued_is_refused_and_changes_nothing(tmp_path, claim):
    """One register with applied_seq far ahead used to move the coordinator's sequence for
    good (persisted; at 2**63 - 1 past the protocol's own bound after a restart)."""
    h = make(tmp_path)
    h.register_all([0, 1])
    issue(h, 2)
    sent = h.register(2, applied_seq=claim, peer=b"attacker")
    assert ops(sent) == [Op.REJECTED] and to_agents(sent, Op.REJECTED)[b"attacker"]["code"] == "mismatch"
    assert h.core.engine().log.seq == 4
    again = make(tmp_path)  # the same state file, as after a restart
    assert again.core.engine().log.seq == 4
    again.client(Op.LOCK, {"wait": False})
    assert again.core.engine().log.seq == 5


def test_heartbeat_claims_beyond_the_issued_seq_are_not_believed(h):
    h.register_all([0, 1])
    issue(h, 1)
    h.agent(peer_of(0), Op.HEARTBEAT, {"rank": 0, "step": 1, "applied_seq": 10**12, "held_seq": 10**12})
    info = h.core.engine().registry.ranks[0]
    assert info.applied_seq <= 2 and info.held_seq <= 2
    assert h.ok(Op.STATUS)["agents_refused"]["heartbeat beyond the issued seq"] == 1


# -- the world: from configuration, never from the first peer -----------------------------------


def test_a_registration_claiming_another_world_is_refused_and_status_stays_small(tmp_path):
    """With the world configured, a peer claiming 2**20 ranks used to lock out the real
    ones (with the world unset); now it is refused, and status answers a few KB."""
    h = make(tmp_path, world_size=4, tp_size=2)
    sent = h.register(0, world_size=1 << 20, tp_size=1, tp_group=0, peer=b"attacker")
    assert to_agents(sent, Op.REJECTED)[b"attacker"]["code"] == "mismatch"
    h.register_all()
    status = h.ok(Op.STATUS)
    assert status["world_size"] == 4 and status["ranks"]["live"] == 4
    assert len(msgpack.packb(status)) < 8 << 10


def test_wsd_coordinator_refuses_to_start_without_a_world_or_a_token(tmp_path, monkeypatch):
    from wsd.config import WsdConfig
    from wsd.errors import ConfigError
    from wsd.programs.coordinator import serve_coordinator

    monkeypatch.delenv("WSD_AGENT_TOKEN", raising=False)
    config = WsdConfig(coordinator=coordinator_config(tmp_path))
    with pytest.raises(ConfigError, match="world_size is not set and agents are not authenticated"):
        serve_coordinator(config)


# -- identity: a live rank passes only to its own process --------------------------------------


def registration(rank: int, instance: str, *, proof: str | None = None, world: int = 4) -> dict[str, Any]:
    return {"rank": rank, "world_size": world, "tp_size": 2, "tp_group": rank // 2, "host": "node",
            "pid": 1000 + rank, "device": "cpu", "applied_seq": None, "acks": [], "step": 0,
            "idle": True, "state": {}, "instance": instance, "proof": proof}


def test_a_live_rank_is_not_superseded_by_another_process_until_it_falls_silent(h):
    """Any peer could register as a live rank and take it over; the real one took it
    back at its next heartbeat, so the rank flapped and the impostor got its commands."""
    h.register_all()
    for attempt in range(5):
        sent = h.agent(b"impostor", Op.REGISTER, registration(1, f"impostor-{attempt}"))
        assert to_agents(sent, Op.REJECTED)[b"impostor"]["code"] == "conflict"
        h.heartbeat(1)
        h.advance(0.5)
    assert h.events("superseded") == [] and h.core.engine().registry.ranks[1].peer == peer_of(1)
    assert set(to_agents(h.client(Op.LOCK, {"wait": False}), Op.COMMAND)) == {peer_of(r) for r in range(4)}
    # once rank 1 has been silent past the heartbeat timeout, another process may take it
    for rank in (0, 2, 3):
        h.heartbeat(rank)
    h.mono.now += h.config.heartbeat_timeout + 0.1
    sent = h.agent(peer_of(1, 1), Op.REGISTER, registration(1, "restarted"))
    assert ops(sent)[0] is Op.REGISTERED


def test_one_connection_holds_one_rank(h):
    """A connection registered as one rank and then as another left the first live and
    unheard, to be marked lost a timeout later."""
    h.register(0)
    sent = h.agent(peer_of(0), Op.REGISTER, registration(1, "agent-0"))
    assert to_agents(sent, Op.REJECTED)[peer_of(0)]["code"] == "conflict"
    registry = h.core.engine().registry
    assert [i.rank for i in registry.live()] == [0] and registry.by_peer(peer_of(0)).rank == 0


def challenged(h: Harness, peer: bytes, nonce: str = "n0") -> str:
    """A first registration's challenge, checked to prove the coordinator holds the token."""
    sent = h.agent(peer, Op.REGISTER, {**registration(0, "x"), "nonce": nonce})
    challenge = to_agents(sent, Op.CHALLENGE)[peer]
    assert challenge["proof"] == challenge_proof(TOKEN, nonce, challenge["nonce"])
    return challenge["nonce"]


def test_with_an_agent_token_only_a_registration_that_proves_it_is_accepted(tmp_path):
    from wsd.coordinator.core import CoordinatorCore

    h = make(tmp_path)
    core = CoordinatorCore(h.config, clock=h.mono, wall=h.wall, agent_token=TOKEN)
    h = Harness(core, h.mono, h.wall, h.config)

    def register(peer: bytes, body: dict[str, Any]) -> list:
        return ops(h.agent(peer, Op.REGISTER, body))

    assert register(b"a", registration(0, "x")) == [Op.REJECTED]  # no nonce: an agent too old to be challenged

    def answer(rank: int, instance: str, proof: str | None) -> dict[str, Any]:
        return {**registration(rank, instance, proof=proof), "nonce": "n0", "challenge": challenged(h, b"a")}

    assert register(b"a", answer(0, "x", None)) == [Op.REJECTED]  # no proof
    assert register(b"a", answer(0, "x", "0" * 64)) == [Op.REJECTED]  # a wrong one
    # a proof is good for its own rank, instance and challenge only
    body = answer(1, "x", None)
    body["proof"] = registration_proof(TOKEN, 0, "x", None, "n0", body["challenge"])
    assert register(b"a", body) == [Op.REJECTED]
    body = answer(0, "x", None)
    body["proof"] = registration_proof(TOKEN, 0, "x", None, "n0", body["challenge"])
    assert register(b"a", body) == [Op.REGISTERED]
    refused = h.events("rejected")
    assert len(refused) == 4 and all(e["code"] == "forbidden" for e in refused)
    assert h.ok(Op.STATUS)["agents_authenticated"] is True


# -- bounded memory: events ------------------------------------------------------------------


def test_event_details_are_cut_to_size_and_a_flood_is_rate_limited(h):
    """2,500 lock-violation events with a 200 KB caller used to grow the coordinator by
    600 MB, and `events --limit 100` answered 18.8 MB."""
    h.register_all()
    sent = h.agent(peer_of(0), Op.EVENT, {"rank": 0, "kind": "lock_violation", "detail": {"caller": "x" * 200_000}})
    assert to_agents(sent, Op.REJECTED)[peer_of(0)]["code"] == "too_large"
    for i in range(2_500):
        h.agent(peer_of(i % 4), Op.EVENT, {"rank": i % 4, "kind": "lock_violation",
                                             "detail": {"caller": "x" * 12_000, "nested": [[1] * 100] * 10}})
    kept = h.events("lock_violation")
    assert 0 < len(kept) <= 4 * 60  # each rank's burst, then its rate
    assert all(len(e["caller"]) < 1_100 and len(e["nested"]) < 300 for e in kept)
    answer = h.core.handle_client((b"c",), p.encode(Op.EVENTS, {"limit": 100}, 1))[0][2]
    assert len(answer) < 200 << 10
    h.advance(h.config.heartbeat_interval)  # the flood is summed up in one event
    suppressed = h.events("suppressed")[-1]["counts"]["lock_violation"]
    unread = h.ok(Op.STATUS)["agents_refused"].get("rate", 0)  # past each connection's byte rate
    assert suppressed > 0 and len(kept) + suppressed + unread == 2_500


def test_refused_registrations_cannot_push_real_events_out(tmp_path):
    h = make(tmp_path, event_capacity=1_000)
    h.register_all()
    h.client(Op.LOCK, {"wait": False})
    for i in range(10_000):
        h.agent(f"stranger-{i}".encode(), Op.REGISTER, registration(i % 4, f"i{i}", world=8))
    assert [e["seq"] for e in h.events("command")] == [1]
    assert len(h.events("rejected")) <= 60
    assert h.ok(Op.STATUS)["agents_refused"]["registration mismatch"] == 10_000


# -- bounded resends, on the monotonic clock ---------------------------------------------------


def test_a_heartbeat_claiming_nothing_held_gets_a_window_of_resends_at_most_once_an_interval(h):
    """A heartbeat claiming held_seq 0 made the coordinator resend up to 4,096 commands;
    475 of them in 5 s cost 4.3 s of its CPU."""
    h.register_all()
    issue(h, 100)
    h.advance(h.config.heartbeat_interval * 2)
    for rank in range(4):
        h.heartbeat(rank, seq=200)
    # the registered peer claims to hold nothing: no more than what it held is believed
    assert [s for s in h.agent(peer_of(0), Op.HEARTBEAT, {"rank": 0, "step": 0, "applied_seq": 0,
                                                           "held_seq": 0, "state": {}})
            if s.message.op is Op.COMMAND] == []
    # a fresh registration at seq 0 is behind by 200: a window now, the rest paced
    sent = h.register(1, peer=peer_of(1, 1), applied_seq=0)
    assert len([s for s in sent if s.message.op is Op.COMMAND]) == RESEND_WINDOW
    heartbeat = {"rank": 1, "step": 0, "applied_seq": 0, "held_seq": 0, "state": {}}
    assert [s for s in h.agent(peer_of(1, 1), Op.HEARTBEAT, heartbeat) if s.message.op is Op.COMMAND] == []
    h.advance(h.config.heartbeat_interval)
    sent = h.agent(peer_of(1, 1), Op.HEARTBEAT, {**heartbeat, "held_seq": RESEND_WINDOW})
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == \
        list(range(RESEND_WINDOW + 1, 2 * RESEND_WINDOW + 1))


def test_resends_follow_the_monotonic_clock_not_the_wall_clock(h):
    """Stepping the wall clock back an hour stopped the resend of a missed command for an hour."""
    h.register_all()
    h.client(Op.LOCK, {"wait": False})  # rank 3's copy is lost on the way
    h.wall.now -= 3600
    h.advance(h.config.heartbeat_interval + 0.01)
    sent = h.heartbeat(3, seq=0)
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [1]


# -- liveness and metering, on the core ------------------------------------------------------


def test_a_rank_is_judged_silent_only_up_to_when_every_waiting_frame_was_read(h):
    """Frames queued unread behind a burst are the coordinator's delay, not the rank's
    silence: the loop passes the time up to which it has read everything."""
    h.register_all()
    h.mono.now += h.config.heartbeat_timeout * 1.5
    h.core.tick(heard_until=h.mono.now - h.config.heartbeat_timeout * 1.5)
    assert len(h.core.engine().registry.live()) == 4 and h.events("lost") == []
    h.core.tick(heard_until=h.mono.now)  # now everything was read, and they said nothing
    assert h.core.engine().registry.live() == [] and len(h.events("lost")) == 4


def test_a_flood_that_keeps_frames_waiting_delays_finding_a_dead_rank_by_one_timeout_at_most(h):
    """Judged only up to when every waiting frame was read, a dead rank was never found
    while a flood kept frames waiting: the lag is capped at one heartbeat timeout."""
    h.register_all()
    flood_began = h.mono.now
    timeout = h.config.heartbeat_timeout
    for _ in range(40):  # the loop never finds the socket empty again; ranks 0-2 are heard
        h.advance(timeout / 10)
        h.core.note_heard(flood_began)
        for rank in range(3):
            h.heartbeat(rank)
        h.tick()
        if h.events("lost"):
            break
    lost = h.events("lost")
    assert [e["rank"] for e in lost] == [3] and h.mono.now - flood_began <= 2 * timeout + timeout / 10
    # and while frames waited, a live rank was not handed to another process either
    h.register_all([0, 1, 2])
    h.core.note_heard(h.mono.now - timeout * 0.9)
    h.mono.now += timeout * 0.5
    sent = h.agent(b"other", Op.REGISTER, registration(0, "another-process"))
    assert to_agents(sent, Op.REJECTED)[b"other"]["code"] == "conflict"


def test_a_stats_reply_not_asked_for_is_dropped_before_it_is_decoded(h):
    """A registered peer's 3.9 MB reply of empty lists took the loop 2 s to decode;
    one that no stats round waits for is not decoded at all, and one that is asked
    for is decoded without the garbage collector (a fifth of the time)."""
    h.register_all()
    hostile = p.encode(Op.STATS_REPLY, {"rank": 0, "request": 1, "step": 0,
                                        "stats": {"x": [[]] * ((39 << 20) // 10)}})
    started = time.perf_counter()
    assert h.core.handle_agent((peer_of(0),), hostile) == []
    assert time.perf_counter() - started < 0.1
    assert h.ok(Op.STATUS)["agents_refused"] == {"stats reply not asked for": 1}


def test_an_unregistered_frame_too_large_is_answered_once_with_why(h):
    """A registration too large was dropped without a word, and its agent retried for ever."""
    big = p.encode(Op.REGISTER, {**registration(0, "x"), "config": {"k": "x" * p.REGISTER_BYTES}})
    sent = decode_sent(h.core.handle_agent((b"big",), big))
    assert [m.op for m in sent] == [Op.REJECTED] and sent[0].body["code"] == "too_large"


def test_frames_are_metered_per_connection_before_they_are_decoded(h):
    h.register_all()
    big = b"\x00" * (p.REGISTER_BYTES + 1)  # not even msgpack: never decoded, only refused for its size
    assert [m.body["code"] for m in decode_sent(h.core.handle_agent((b"stranger",), big))] == ["too_large"]
    assert h.core.dropped_bad_agent_frames == 0
    small = p.encode(Op.HEARTBEAT, {"rank": 9, "step": 0, "applied_seq": 0, "held_seq": 0})
    answered = sum(1 for _ in range(5_000) if h.core.handle_agent((b"stranger",), small))
    assert 0 < answered < 2_000  # the first ones are answered; then the connection's rate runs out
    assert h.ok(Op.STATUS)["agents_refused"] == {"rate": 5_000 - answered, "too large before registering": 1}
    assert len(h.core.engine().registry.live()) == 4  # the registered ranks are metered apart


# -- real sockets: bounded cost, and no false loss -------------------------------------------


def test_decode_heavy_frames_neither_stall_the_loop_nor_make_a_live_rank_lost(start_coordinator, spawn):  # noqa: F811
    """Two 15 MB frames of millions of empty lists kept the loop decoding for 30 s and
    every real rank was marked lost. Now: big frames from a connection that has not
    registered are dropped unread, small ones are metered per connection, and a rank
    is judged silent only up to the time every frame waiting for the loop was read.
    The issue's attack as it was: 15 MB frames under the 16 MiB frame limit of the
    time. The attacker and the real ranks are processes of their own, as they would
    be; a 4 s timeout, so that the real ranks' own share of two busy cores never
    decides the result (the old decoder stalled for about 15 s)."""
    coordinator = start_coordinator(world_size=4, tp_size=2, heartbeat_interval=0.5, heartbeat_timeout=4.0,
                                    max_agent_message_bytes=16 << 20)
    sim = spawn(python("-m", "wsd.agent.simulated", "--endpoint", coordinator.agent_endpoint, "--ranks", "4",
                       "--tp-size", "2", "--ubatches", "2", "--heartbeat-interval", "0.5",
                       "--heartbeat-timeout", "4.0"), name="real ranks")
    client = Client(coordinator.client_endpoint, timeout=5)
    try:
        wait_until(lambda: client.status()["ranks"]["live"] == 4, 30, "four live ranks")
        flood = spawn(python(str(Path(__file__).parents[1] / "flood.py"), coordinator.agent_endpoint, "8",
                             str(15 << 20)), name="flood")  # two heartbeat timeouts of flooding
        sent = int(flood.wait_for(r"sent (\d+)", 60).group(1))
        assert flood.wait(10) == 0
        started = time.monotonic()
        status = client.status()
        answered = time.monotonic() - started
        events = client.events(limit=10_000)["events"]
    finally:
        client.close()
    assert [e for e in events if e["kind"] in ("lost", "superseded")] == [], events
    assert status["ranks"]["live"] == 4 and sim.popen.poll() is None  # the real ranks ran throughout
    assert answered < 2.0, f"status took {answered:.2f} s after the flood"
    assert sent > 1000
    refused = status["agents_refused"]
    assert refused["too large before registering"] == 2, refused  # the big ones, never decoded


def test_an_impostor_holding_the_token_cannot_take_over_a_live_rank(start_coordinator, zmq_socket):
    """With the token (the same one all workers share), a registration for a live rank
    from another process used to supersede it, and the rank flapped."""
    coordinator = start_coordinator(world_size=2, tp_size=1, agent_token=TOKEN)
    impostor = zmq_socket(zmq.DEALER, connect=coordinator.agent_endpoint)
    with SimulatedRanks(coordinator.agent_endpoint, range(2), world_size=2, num_ubatches=1,
                        heartbeat_interval=0.2, heartbeat_timeout=1.0, token=TOKEN) as sim:
        assert sim.wait_registered(20)
        answers = []
        deadline = time.monotonic() + 2.0
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            body = registration(1, "impostor", world=2)
            body.update(tp_size=1, tp_group=1, nonce=f"n{attempt}")
            impostor.send(p.encode(Op.REGISTER, body))  # its challenge first, then its proof
            challenge = None
            while challenge is None and impostor.poll(200):
                m = p.decode(impostor.recv(), p.COORDINATOR_OPS)
                if m.op is Op.CHALLENGE and m.body["proof"] == challenge_proof(TOKEN, body["nonce"], m.body["nonce"]):
                    challenge = m.body["nonce"]  # ours: not one to an earlier attempt
                elif m.op is not Op.CHALLENGE:
                    answers.append(m)
            if challenge is None:
                continue  # sent before the connection was made: again
            body.update(challenge=challenge, proof=registration_proof(TOKEN, 1, "impostor", None, body["nonce"],
                                                                      challenge))
            impostor.send(p.encode(Op.REGISTER, body))
            while impostor.poll(200):
                m = p.decode(impostor.recv(), p.COORDINATOR_OPS)
                if m.op is not Op.CHALLENGE:  # a late challenge to an earlier attempt is no answer
                    answers.append(m)
                    break
        assert answers and all(m.op is Op.REJECTED and m.body["code"] == "conflict" for m in answers)
        with Client(coordinator.client_endpoint, timeout=5) as client:
            events = client.events(limit=10_000)["events"]
            ranks = client.ranks()["ranks"]
        assert [e for e in events if e["kind"] == "superseded"] == []
        assert {r["rank"]: r["pid"] for r in ranks}[1] != 1001
        # a stranger without the token is refused as such
        stranger = registration(0, "stranger", world=2)
        stranger.update(tp_size=1, tp_group=0)
        impostor.send(p.encode(Op.REGISTER, stranger))
        assert impostor.poll(5000)
        assert p.decode(impostor.recv(), p.COORDINATOR_OPS).body["code"] == str(ErrorCode.FORBIDDEN)


def test_status_of_a_world_of_many_groups_is_a_page(tmp_path):
    """A configured world of 2**20 ranks of TP size 1 made a status answer of 185 MB, built
    for 14-17 s on the loop. It lists a page of groups (512 by default, 4,096 at most) and
    says how many there are."""
    h = make(tmp_path, world_size=1 << 16, tp_size=1)
    started = time.monotonic()
    status = h.ok(Op.STATUS)
    assert time.monotonic() - started < 5.0
    assert status["groups_total"] == 1 << 16 and len(status["groups"]) == 512
    assert len(msgpack.packb(status)) < 512 << 10
    page = h.ok(Op.STATUS, {"offset": 60_000, "limit": 4096})
    assert [g["tp_group"] for g in page["groups"]] == list(range(60_000, 64_096))
    assert h.call(Op.STATUS, {"limit": 4097}).code is ErrorCode.BAD_FIELD
