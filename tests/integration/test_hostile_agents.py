"""Well-formed but malicious agent messages, thousands of them, against a live coordinator.

``test_hostile.py`` throws malformed input at both endpoints; here every frame is
a valid message (each passes ``wsd.wire.protocol.decode`` before it is sent) that
lies: registrations for live ranks, for ranks beyond the world, of another world,
claiming sequence numbers never issued (up to 2**63 - 1), with wrong proofs and
junk acknowledgements, states and configurations; heartbeats, acknowledgements,
events, unsolicited or junk stats replies and goodbyes for ranks the sender does
not hold. A seeded generator (``hostile_kit.SEED``; ``WSD_HOSTILE_SEED``
repeats a run) sends them from many connections to a coordinator thread on
random loopback ports, with four simulated ranks (``wsd.agent.simulated``) as its real
agents and, without an agent token, attackers holding the unused ranks of the
world. The test issues commands and stats requests of its own meanwhile.

Then what must hold: every real rank is still live and was never lost,
superseded or stopped; the sequence moved only by the test's commands; a
command issued afterwards is applied and acknowledged by every real rank;
``status`` and ``events --limit 100`` answer fast and small; the refusals are
counted by reason; the coordinator logged no internal error. Once without an
agent token, once with one (then no registration gets in at all).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
from conftest import coordinator_config, one_engine, wait_until
from hostile_kit import hostile_inputs_counted, rng, tried  # noqa: F401 (a fixture)
from zmqkit import Sockets

from wsd.agent.simulated import SimulatedManager, SimulatedRanks
from wsd.coordinator.loop import Coordinator
from wsd.security import registration_proof
from wsd.wire import protocol as p
from wsd.wire.protocol import AGENT_OPS, COORDINATOR_OPS, ErrorCode, Op
from wsd_client.client import Client

TRIED = tried(__file__)

WORLD, TP = 8, 2
REAL = (0, 1, 2, 3)
"""Simulated ranks, well-behaved: TP groups 0 and 1."""
SPARE = (4, 5, 6, 7)
"""Never started: without an agent token, attackers may register as these."""
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 3.0
FRAMES = 5_000
"""Malicious frames per run of the barrage (two runs: without and with a token)."""
CONNECTIONS = 48
TOKEN = b"hostile-agents-token-0123456789ab"
INT64 = 2**63 - 1
# A refused registration is all a valid message can earn: never a protocol refusal.
REGISTRATION_REFUSALS = {str(ErrorCode.FORBIDDEN), str(ErrorCode.CONFLICT), str(ErrorCode.MISMATCH),
                         # a rank's whole snapshot from a connection that no longer holds it
                         str(ErrorCode.TOO_LARGE)}
# The one engine the real ranks and the test's own requests use: attackers may open others.
REAL_ENGINE = "default"
# A manager's most slots: a push of it, then deltas on it, cost by the snapshot they change.
WIDE = SimulatedManager(64, 64).snapshot()
_ASCII = "abcxyz019 _-./:\"'\\{}[]\x00\x7f"
_ALPHABET = _ASCII + "éß☃\u202e\U0001f600"
# Names that may hold no control, format (bidi) or line-separator character (the wire refuses
# them there: tests/unit/test_protocol.py).
_PRINTABLE = "".join(c for c in _ALPHABET if c.isprintable())


# -- the generator ---------------------------------------------------------------------------------


@dataclass
class Attacker:
    sock: zmq.Socket
    rank: int | None = None  # the spare rank it claimed (held by it, or by the other claimer)
    holds: bool = False  # it registered as that rank


class Malice:
    """Well-formed agent messages that lie, drawn from a seeded ``random.Random``."""

    def __init__(self, rand: random.Random, issued: Callable[[], int]) -> None:
        self.r = rand
        self.issued = issued  # () -> the coordinator's sequence as the test knows it
        self.ops = [Op.REGISTER, Op.HEARTBEAT, Op.ACK, Op.EVENT, Op.STATS_REPLY, Op.STATS_PUSH, Op.GOODBYE]
        self.weights = [4, 3, 2, 2, 2, 3, 1]

    def text(self, most: int, alphabet: str = _ALPHABET) -> str:
        n = self.r.choice([0, 1, self.r.randint(0, most), most])
        return "".join(self.r.choices(alphabet, k=n))

    def seq(self) -> int:
        s = self.issued()
        return self.r.choice([0, 1, s, s + 1, s + self.r.randint(2, 1000), self.r.randint(0, INT64), INT64])

    def number(self) -> int:
        return self.r.choice([0, 1, self.r.randint(0, 1 << 32), self.r.randint(0, INT64), INT64])

    def rank(self, own: int | None) -> int:
        pools = [REAL, SPARE, (self.r.randint(0, 1 << 20), 1 << 20, WORLD)] + ([(own,)] if own is not None else [])
        return self.r.choice(self.r.choice(pools))

    def junk(self, depth: int = 2) -> Any:
        kind = self.r.randrange(10 if depth else 7)
        if kind == 0:
            return None
        if kind == 1:
            return self.r.random() < 0.5
        if kind == 2:
            return self.r.choice([-(2**63), -1, 0, 7, INT64, 2**64 - 1])
        if kind == 3:
            return self.r.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, self.r.random()])
        if kind in (4, 5):
            return self.text(64)
        if kind == 6:
            return self.r.randbytes(self.r.randint(0, 32))
        if kind in (7, 8):
            return [self.junk(depth - 1) for _ in range(self.r.randint(0, 4))]
        return self.junk_map(4, depth - 1)

    def junk_map(self, most: int, depth: int = 1) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for _ in range(self.r.randint(0, most)):
            key: Any = self.text(16) if self.r.random() < 0.9 else self.r.randbytes(4)
            out[key] = self.junk(depth)
        return out

    def state(self) -> dict[Any, Any]:
        """A manager state that lies: junk keys, and locked/num_ubatches of any type."""
        out = self.junk_map(6)
        if self.r.random() < 0.5:
            out["locked"] = self.r.choice([True, False, None, 1, "yes", [True]])
            out["num_ubatches"] = self.r.choice([-1, 0, 1, 64, INT64, 2**64 - 1, 1.5, "8", None])
        return out

    def message(self, attacker: Attacker) -> tuple[Op, dict[str, Any]]:
        op = self.r.choices(self.ops, self.weights)[0]
        return op, getattr(self, f"_{op}")(attacker)

    def _register(self, a: Attacker) -> dict[str, Any]:
        r = self.r
        rank = self.rank(a.rank)
        world = r.choice([WORLD, WORLD, WORLD * 2, 1, min(rank + 1, 1 << 20), 1 << 20])
        tp = r.choice([TP, TP, TP, 1, 4, 1 << 20])
        instance = r.choice([None, "", self.text(64), "0" * 32])
        nonce = r.choice([None, "n", self.text(64)])
        challenge = r.choice([None, None, "c" * 32, self.text(64)])  # none sent to this peer: never the real one
        proof = r.choice([None, "", "0" * 64, r.randbytes(32).hex(), self.text(128),
                          registration_proof(b"not-the-token-0123456789abcdef", rank, instance or "", None,
                                             nonce or "", challenge or ""),
                          # seen for another rank, or for a challenge never sent
                          registration_proof(TOKEN, (rank + 1) % WORLD, instance or "", None, nonce or "",
                                             challenge or ""),
                          registration_proof(TOKEN, rank, instance or "", None, nonce or "", challenge or "")])
        acks: list[Any] = [[self.seq(), self.number(), r.random() < 0.5, r.choice([None, self.text(100)])]
                           for _ in range(r.choice([0, 0, 1, 5, 64]))]
        if acks and r.random() < 0.3:  # an entry an ack never is
            acks[r.randrange(len(acks))] = self.junk()
        return {
            "rank": rank, "world_size": world, "tp_size": tp,
            "tp_group": rank // tp if r.random() < 0.8 else r.randint(0, 1 << 20),
            "host": self.text(255, _PRINTABLE), "pid": r.randint(0, 1 << 31), "device": self.text(64, _PRINTABLE),
            "applied_seq": r.choice([None, None, self.seq()]), "acks": acks, "step": self.number(),
            "idle": r.random() < 0.5, "state": self.state(), "config": self.junk_map(64, 0),
            "instance": instance, "proof": proof, "nonce": nonce, "challenge": challenge,
            # engines of their own, up to and past max_engines (names the wire refuses are
            # test_hostile.py's and tests/unit/test_protocol.py's)
            "engine": r.choice([None] * 6 + ["evil", f"evil-{r.randrange(200)}"]),
        }

    def _heartbeat(self, a: Attacker) -> dict[str, Any]:
        return {"rank": self.rank(a.rank), "step": self.number(), "applied_seq": self.seq(),
                "held_seq": self.seq(), "state": self.state()}

    def _ack(self, a: Attacker) -> dict[str, Any]:
        return {"rank": self.rank(a.rank), "seq": max(1, self.seq()), "step": self.number(),
                "ok": self.r.random() < 0.5, "error": self.r.choice([None, self.text(3000)])}

    def _event(self, a: Attacker) -> dict[str, Any]:
        detail = self.junk_map(30)
        for key in self.r.sample(["id", "time", "kind", "rank", "tp_group", "agent_kind", "caller", "seq"], 2):
            detail[key] = self.r.choice([self.text(2000), self.junk()])  # reserved keys, long text
        kind = self.r.choice(["lock_violation", "lost", "command", "started", "suppressed", self.text(64, _PRINTABLE)])
        return {"rank": self.rank(a.rank), "kind": kind, "detail": detail}

    def _stats_reply(self, a: Attacker) -> dict[str, Any]:
        stats = self.r.choice([{}, self.junk_map(64), {"device": self.junk(), "slots": self.junk(),
                                                       "num_ubatches": self.junk(), "columns": self.junk()}])
        return {"rank": self.rank(a.rank), "request": self.r.choice([0, 1, 2, 3, self.r.randint(1, 64), INT64]),
                "stats": stats, "step": self.number()}

    def _stats_push(self, a: Attacker) -> dict[str, Any]:
        """A whole snapshot of junk, a delta of junk on a version the coordinator may hold
        (a real attacker's own push), or one that points outside the slots."""
        r = self.r
        body: dict[str, Any] = {"rank": self.rank(a.rank), "version": r.choice([1, 2, r.randint(1, 64), INT64]),
                                "step": self.number(), "applied_seq": self.seq(), "held_seq": self.seq(),
                                "state": self.state()}
        kind = r.randrange(5)
        if kind == 4:  # a manager's most slots, whole or a one-slot delta on the version before
            version = body["version"]
            if a.holds and r.random() < 0.2:  # a rank's holder: past the unregistered bound
                body.update(base=None, stats=WIDE)
            else:
                body.update(base=max(1, version - 1), delta={"columns": {"requests": [[version % 4096], [version]]}})
        elif kind == 0:
            body.update(base=None, stats=r.choice([{}, self.junk_map(64), {
                "device": self.junk(), "slots": self.junk(), "num_ubatches": self.junk(), "locked": self.junk()}]))
        elif kind == 1:
            body.update(base=r.choice([1, 2, r.randint(1, 64), INT64]), delta=self.junk_map(8))
        elif kind == 2:
            index = r.choice([-1, 0, 7, 8, 4096, INT64, "0", None, 1.5])
            body.update(base=r.choice([1, 2]), delta=r.choice([
                {"columns": {r.choice(["requests", "capacity_bytes", "ubatch", "x"]): [[index], [self.junk()]]}},
                {"columns": {"requests": self.junk()}},
                {"fields": self.junk_map(6)},
                {"fields": {"num_ubatches": self.junk(), "locked": self.junk()}},
                {"tables": {r.choice(["persistent", "last_violation", "slots"]): self.junk()}}]))
        else:
            body.update(base=r.choice([None, 1]), stats=None, delta=None)
        return body

    def _goodbye(self, a: Attacker) -> dict[str, Any]:
        return {"rank": self.rank(None), "step": self.number(), "applied_seq": self.r.choice([None, self.seq()]),
                "held_seq": self.r.choice([None, self.seq()]), "state": self.state()}


# -- the coordinator, its real ranks, the attackers -------------------------------------------------


class LogCapture(logging.Handler):
    """Every record of the ``wsd`` loggers, whatever another test did to propagation."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger("wsd")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> LogCapture:
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > logging.WARNING:
            self._logger.setLevel(logging.WARNING)
        logging.getLogger("wsd.coordinator.core").warning("hostile agents: log capture probe")
        assert any("capture probe" in r.getMessage() for r in self.records), "the wsd log is not captured"
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def internal_errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


class Barrage:
    """Attackers' sockets, the test's own raw client socket, and every answer checked."""

    def __init__(self, coordinator: Coordinator, client: Client, rand: random.Random, *, token: bytes | None):
        self.coordinator = coordinator
        self.client = client
        self.token = token
        self.r = rand
        self.sockets = Sockets()
        self.attackers = [Attacker(self._socket(coordinator.agent_endpoint)) for _ in range(CONNECTIONS)]
        self.own = self._socket(coordinator.client_endpoint)  # the test's own commands, not waited for
        self.seq: int = one_engine(client.status(engine=REAL_ENGINE))["seq"]
        self.issued = 0  # commands the test issued during the barrage
        self.asked = 0  # requests on ``own`` not yet answered
        self.answers: Counter[str] = Counter()
        self.redrawn = 0  # frames drawn again for being too large
        self.malice = Malice(rand, lambda: self.seq)

    def _socket(self, endpoint: str) -> zmq.Socket:
        return self.sockets.socket(zmq.DEALER, connect=endpoint, sndhwm=0)

    def close(self) -> None:
        self.sockets.close()

    def claim_spare_ranks(self) -> None:
        """Two attackers register for each unused rank, at the coordinator's sequence:
        without a token one gets it and the other is refused as the rank is live; with
        one, both are refused as forbidden."""
        claimers = self.attackers[: 2 * len(SPARE)]
        poller = zmq.Poller()
        for i, (a, rank) in enumerate(zip(claimers, SPARE * 2)):
            a.rank = rank
            a.sock.send(p.encode(Op.REGISTER, {
                "rank": rank, "world_size": WORLD, "tp_size": TP, "tp_group": rank // TP, "host": "attacker",
                "pid": 1, "device": "cpu", "applied_seq": self.r.choice([None, 0, self.seq]),
                "instance": f"attacker-{i}"}))
            poller.register(a.sock, zmq.POLLIN)
            TRIED["agent malicious claim"] += 1
        expected = ErrorCode.CONFLICT if self.token is None else ErrorCode.FORBIDDEN
        registered: dict[int, Attacker] = {}
        answered: set[int] = set()
        deadline = time.monotonic() + 5
        while len(answered) < len(claimers):
            left = deadline - time.monotonic()
            assert left > 0, f"{len(claimers) - len(answered)} registrations unanswered"
            ready = dict(poller.poll(int(left * 1000)))
            for i, a in enumerate(claimers):
                for message in self._read(a.sock) if a.sock in ready else []:
                    if message.op is Op.REGISTERED:
                        assert a.rank is not None
                        registered[a.rank] = a
                        a.holds = True
                        answered.add(i)
                    elif message.op is Op.REJECTED:
                        assert message.body["code"] == str(expected), message.body
                        answered.add(i)
        # without a token one attacker holds each spare rank (the other keeps claiming it)
        assert sorted(registered) == ([] if self.token else list(SPARE)), registered

    def run(self, frames: int) -> None:
        for i in range(frames):
            a = self.r.choice(self.attackers)
            a.sock.send(self._valid(a))
            if i % 250 == 0:
                self._own_request()
            if i % 64 == 0:
                self.read_answers()

    def _valid(self, a: Attacker) -> bytes:
        """A frame that decodes: one beyond its operation's size limits (a junk state can
        grow past a heartbeat's 4 KiB) is drawn again, as test_hostile.py covers those."""
        while True:
            op, body = self.malice.message(a)
            frame = p.encode(op, body, self.r.randint(0, 1 << 32))
            try:
                p.decode(frame, AGENT_OPS)
            except p.ProtocolError as e:
                if e.code is not ErrorCode.TOO_LARGE:  # the generator's bug, not the coordinator's
                    raise AssertionError(f"the generator made an invalid {op}: {e}; body {body!r}") from e
                self.redrawn += 1
                continue
            TRIED[f"agent malicious {op}"] += 1
            return frame

    def _own_request(self) -> None:
        """A command (not waited for) or a stats round of the test's own, amid the barrage."""
        kind = self.r.choice(["lock", "unlock", "stats"])
        body: dict[str, Any] = {"timeout": 0.5} if kind == "stats" else {"wait": False}
        body["engine"] = REAL_ENGINE
        self.own.send(p.encode(Op(kind), body, 1_000 + self.asked + self.answers["own"]))
        self.asked += 1
        if kind != "stats":
            self.issued += 1
            self.seq += 1

    def read_answers(self) -> None:
        for a in self.attackers:
            for _ in self._read(a.sock):
                pass
        while self.own.poll(0):
            reply = p.decode_reply(self.own.recv())
            assert reply.ok, (reply.code, reply.message)  # no internal error on a command or a stats round
            self.asked -= 1
            self.answers["own"] += 1

    def _read(self, sock: zmq.Socket) -> list[p.Message]:
        out = []
        while sock.poll(0):
            message = p.decode(sock.recv(), COORDINATOR_OPS)
            self.answers[str(message.op)] += 1
            if message.op is Op.REJECTED:
                assert message.body["code"] in REGISTRATION_REFUSALS, message.body
            if message.op is Op.REGISTERED:
                assert self.token is None, f"an attacker without the token registered: {message.body}"
            out.append(message)
        return out

    def settle(self) -> None:
        """Read every answer still coming (the test's stats rounds time out in 0.5 s)."""
        deadline = time.monotonic() + 5
        while self.asked and self.own.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self.read_answers()
        self.read_answers()
        assert self.asked == 0, f"{self.asked} of the test's own requests went unanswered"

    def goodbye(self) -> None:
        """Every attacker says goodbye for every spare rank (only a holder's counts)."""
        for a in self.attackers:
            for rank in SPARE:
                a.sock.send(p.encode(Op.GOODBYE, {"rank": rank}))


def _timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    answer = call()
    return answer, time.monotonic() - started


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_malicious_agent_messages_leave_the_real_ranks_and_the_state_untouched(tmp_path, token):
    """Without the agent endpoint's checks a registration claiming a seq never issued wedged
    the cluster, a registration for a live rank flapped it, a heartbeat claiming held_seq 0
    cost thousands of resends, and an event flood grew memory and the events answer; any
    of these would break one of the invariants below."""
    seed_rand = rng(f"agents:{'token' if token else 'open'}")
    coordinator = Coordinator(coordinator_config(
        tmp_path, world_size=WORLD, tp_size=TP, heartbeat_interval=HEARTBEAT_INTERVAL,
        heartbeat_timeout=HEARTBEAT_TIMEOUT), agent_token=token).start()
    client = Client(coordinator.client_endpoint, timeout=5, retries=0)
    sim = SimulatedRanks(coordinator.agent_endpoint, REAL, world_size=WORLD, tp_size=TP, num_ubatches=2,
                         heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT, token=token)
    barrage = None
    try:
        with LogCapture() as log:
            sim.start()
            assert sim.wait_registered(20), "the real ranks did not register"
            first = client.lock(timeout=5, engine=REAL_ENGINE)
            assert sorted(first.steps()) == list(REAL), first
            barrage = Barrage(coordinator, client, seed_rand, token=token)
            barrage.claim_spare_ranks()
            started = time.monotonic()
            barrage.run(FRAMES)
            barrage.settle()
            took = time.monotonic() - started

            # the coordinator's state: moved only by the test's own commands
            status, answered = _timed(lambda: client.status(engine=REAL_ENGINE))
            assert answered < 2.0, f"status took {answered:.2f} s after the barrage"
            assert len(msgpack.packb(status.doc)) < 32 << 10, "status grew with what peers claimed"
            assert status["seq"] == first.seq + barrage.issued == barrage.seq, (status["seq"], barrage.issued)
            assert status["world_size"] == WORLD and status["tp_size"] == TP

            # the real ranks: live, theirs, never lost or taken over
            ranks = {r["rank"]: r for r in client.ranks(engine=REAL_ENGINE)["ranks"]}
            for rank in REAL:
                assert ranks[rank]["state"] == "live" and ranks[rank]["pid"] == os.getpid(), ranks[rank]
            if token is not None:
                assert sorted(ranks) == list(REAL), "a rank without the proof got in"
            events, answered = _timed(lambda: client.events(limit=10_000, engine=REAL_ENGINE)["events"])
            by_rank = {rank: Counter(e["kind"] for e in events if e.get("rank") == rank) for rank in REAL}
            for rank, kinds in by_rank.items():
                assert kinds["joined"] == 1, (rank, kinds)
                assert not kinds["lost"] and not kinds["superseded"] and not kinds["stopped"] \
                    and not kinds["back"] and not kinds["command_failed"], (rank, kinds)
            assert [e["seq"] for e in events if e["kind"] == "command"][:1] == [first.seq], "real events pushed out"
            recent, answered = _timed(lambda: client.events(cursor=max(0, events[-1]["id"] - 100), limit=100))
            size = len(msgpack.packb(recent.doc))
            assert answered < 2.0 and size < 1 << 20, (answered, size)

            # the refusals, counted by reason (the barrage reached each check)
            refused = status["agents_refused"]
            assert refused.get("heartbeat beyond the issued seq", 0) > 0, refused
            if token is None:
                assert refused.get("registration conflict", 0) > 0 and refused.get("registration mismatch", 0) > 0
            else:
                assert refused.get("registration forbidden", 0) > 0, refused
                assert set(refused) & {"registration conflict", "registration mismatch"} == set(), refused

            # a command afterwards: applied and acknowledged by every real rank
            barrage.goodbye()
            wait_until(lambda: client.status(engine=REAL_ENGINE)["ranks"]["live"] == len(REAL),
                       2 * HEARTBEAT_TIMEOUT + 5, "the attackers' ranks gone")
            after = client.lock(timeout=10, engine=REAL_ENGINE)
            assert sorted(after.steps()) == list(REAL) and not after.failed and not after.lost \
                and not after.pending and after.seq == barrage.seq + 1, after
            assert coordinator.serving
            # engines the attackers opened: never more than the coordinator serves at most
            engines = client.engines().engines
            assert len(coordinator.core.engines) <= coordinator.config.max_engines
            if token is not None:
                assert [e.name for e in engines] == [REAL_ENGINE], "an engine opened without the token"
            assert log.internal_errors() == [], log.internal_errors()[:5]
            print(f"\n{'token' if token else 'no token'}: {FRAMES} malicious frames in {took:.1f} s; "
                  f"({barrage.redrawn} too large, drawn again); answers {dict(barrage.answers)}; refused {refused}; "
                  f"the real ranks' loop at most {sim.max_lag:.2f} s late")
    finally:
        if barrage is not None:
            barrage.close()
        client.close()
        sim.stop()
        coordinator.stop(timeout=10)


def test_a_proof_that_is_not_ascii_is_refused_not_an_internal_error(tmp_path):
    """Found by the barrage: with an agent token, a registration whose proof holds a
    non-ASCII character makes ``hmac.compare_digest`` raise; the coordinator logs an
    internal error with its traceback (for every such frame: a log flood) and answers
    nothing, where it should refuse it as forbidden and count it."""
    from wsd.coordinator.core import CoordinatorCore

    core = CoordinatorCore(coordinator_config(tmp_path, world_size=WORLD, tp_size=TP), agent_token=TOKEN)
    body = {"rank": 0, "world_size": WORLD, "tp_size": TP, "tp_group": 0, "host": "h", "pid": 1,
            "device": "cpu", "instance": "i", "proof": "é" * 64}
    TRIED["agent malicious register"] += 1
    with LogCapture() as log:
        sent = core.handle_agent((b"attacker",), p.encode(Op.REGISTER, body))
    assert log.internal_errors() == []
    assert [p.decode(frame, COORDINATOR_OPS).body["code"] for _, _, frame in sent] == [str(ErrorCode.FORBIDDEN)]
