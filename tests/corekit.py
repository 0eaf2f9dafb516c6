"""A fake transport for the coordinator's core (``wsd.coordinator.core.CoordinatorCore``):
frames in, frames out, decoded, with fake monotonic and wall clocks that move only when told.

No sockets and no sleeping; what the unit tier's core tests, and the integration tests
that drive a core beside a real agent, share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wsd.config import CoordinatorConfig
from wsd.coordinator.core import AGENT, CLIENT, CoordinatorCore
from wsd.slotstats import ManagerStats, PersistentStats, SlotStats
from wsd.wire import protocol as p
from wsd.wire.protocol import Op

__all__ = ["AGENT", "CLIENT", "CLIENT_ROUTE", "MONO0", "WALL0", "FakeClock", "FakeTarget", "Harness", "Sent",
           "decode_all", "make", "only_reply", "ops", "peer_of", "replies", "snapshot", "to_agents"]

WALL0 = 1_700_000_000.0
MONO0 = 500.0


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class Sent:
    """One frame the core asked to send, decoded."""

    kind: str
    route: tuple[bytes, ...]
    message: p.Message | None = None  # to an agent
    reply: p.Reply | None = None      # to a client


@dataclass
class Harness:
    core: CoordinatorCore
    mono: FakeClock
    wall: FakeClock
    config: CoordinatorConfig
    steps: dict[int, int] = field(default_factory=dict)

    # -- time ----------------------------------------------------------------

    def advance(self, seconds: float) -> list[Sent]:
        """Move both clocks forward and run the core's timers."""
        self.mono.now += seconds
        self.wall.now += seconds
        return self.tick()

    def tick(self) -> list[Sent]:
        return decode_all(self.core.tick())

    # -- agents --------------------------------------------------------------

    def agent(self, peer: bytes, op: Op, body: dict[str, Any]) -> list[Sent]:
        return decode_all(self.core.handle_agent((peer,), p.encode(op, body)))

    def register(self, rank: int, *, peer: bytes | None = None, applied_seq: int | None = None,
                 acks: list | None = None, step: int = 0, **overrides: Any) -> list[Sent]:
        world = self.config.world_size or 4
        tp = self.config.tp_size or 2
        body = {"rank": rank, "world_size": world, "tp_size": tp, "tp_group": rank // tp,
                "host": "node", "pid": 1000 + rank, "device": "cpu", "applied_seq": applied_seq,
                "acks": acks or [], "step": step, "idle": False,
                "state": {"locked": False, "num_ubatches": 2},
                # One agent process per rank unless a test says otherwise: a new
                # connection of the same instance is that agent reconnecting.
                "instance": f"agent-{rank}"}
        body.update(overrides)
        return self.agent(peer or peer_of(rank), Op.REGISTER, body)

    def register_all(self, ranks: range | list[int] | None = None) -> None:
        if ranks is None:
            assert self.config.world_size is not None, "no ranks given and no world size configured"
            ranks = range(self.config.world_size)
        for rank in ranks:
            assert ops(self.register(rank), AGENT) == [Op.REGISTERED]

    def heartbeat(self, rank: int, *, peer: bytes | None = None, step: int = 0, seq: int = 0,
                  state: dict | None = None) -> list[Sent]:
        return self.agent(peer or peer_of(rank), Op.HEARTBEAT, {
            "rank": rank, "step": step, "applied_seq": seq, "held_seq": seq, "state": state or {}})

    def ack(self, rank: int, seq: int, step: int, *, ok: bool = True, error: str | None = None) -> list[Sent]:
        return self.agent(peer_of(rank), Op.ACK, {"rank": rank, "seq": seq, "step": step, "ok": ok, "error": error})

    # -- clients -------------------------------------------------------------

    def client(self, op: Op, body: dict[str, Any] | None = None, request_id: int = 1,
               role: str | None = None) -> list[Sent]:
        """A client's request; ``role``: its CURVE role as the transport proved it (None: no CURVE)."""
        return decode_all(self.core.handle_client(CLIENT_ROUTE, p.encode(op, body, request_id), role))

    def call(self, op: Op, body: dict[str, Any] | None = None, request_id: int = 1,
             role: str | None = None) -> p.Reply:
        """A request answered at once: its one reply."""
        return only_reply(self.client(op, body, request_id, role))

    def ok(self, op: Op, body: dict[str, Any] | None = None) -> Any:
        reply = self.call(op, body)
        assert reply.ok, f"{op} failed: {reply.code} {reply.message}"
        return reply.result

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        events = self.ok(Op.EVENTS, {"limit": 10_000})["events"]
        return [e for e in events if kind is None or e["kind"] == kind]


CLIENT_ROUTE = (b"client-1",)


def peer_of(rank: int, generation: int = 0) -> bytes:
    return f"rank{rank}-gen{generation}".encode()


def decode_all(out: list[tuple[str, tuple[bytes, ...], bytes]]) -> list[Sent]:
    sent = []
    for kind, route, frame in out:
        assert kind in (AGENT, CLIENT) and isinstance(route, tuple) and isinstance(frame, bytes)
        if kind == AGENT:
            sent.append(Sent(kind, route, message=p.decode(frame, p.COORDINATOR_OPS)))
        else:
            sent.append(Sent(kind, route, reply=p.decode_reply(frame)))
    return sent


def ops(sent: list[Sent], kind: str = AGENT) -> list[Op]:
    return [s.message.op for s in sent if s.kind == kind and s.message is not None]


def to_agents(sent: list[Sent], op: Op) -> dict[bytes, dict[str, Any]]:
    """The body of each ``op`` frame sent, by peer (one each)."""
    out: dict[bytes, dict[str, Any]] = {}
    for s in sent:
        if s.kind == AGENT and s.message is not None and s.message.op is op:
            assert s.route[0] not in out, f"two {op} frames to {s.route[0]!r}"
            out[s.route[0]] = s.message.body
    return out


def replies(sent: list[Sent]) -> list[p.Reply]:
    return [s.reply for s in sent if s.kind == CLIENT and s.reply is not None]


def only_reply(sent: list[Sent]) -> p.Reply:
    got = replies(sent)
    assert len(got) == 1, f"expected one client reply, got {got}"
    assert [s.route for s in sent if s.kind == CLIENT] == [CLIENT_ROUTE]
    return got[0]


def make(tmp_path, **overrides: Any) -> Harness:
    options: dict[str, Any] = {
        "state_file": str(tmp_path / "coordinator.state"),
        "world_size": 4, "tp_size": 2,
        "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0,
        "command_timeout": 10.0, "stats_timeout": 2.0,
    }
    options.update(overrides)
    config = CoordinatorConfig(**options)
    mono, wall = FakeClock(MONO0), FakeClock(WALL0)
    return Harness(CoordinatorCore(config, clock=mono, wall=wall), mono, wall, config)


def snapshot(capacities: list[int], *, persistent: int = 0, locked: bool = False,
             peak: int | None = None, requests: int = 1) -> dict[str, Any]:
    """A snapshot in the agent's wire form (ManagerStats.to_wire: slots as columns), one lane."""
    slots = tuple(
        SlotStats.of(i, capacity_bytes=c, peak_requested_bytes=c if peak is None else peak,
                     requests=requests, resizes=1 if c else 0,
                     persistent=(PersistentStats("k", "tensor", persistent),) if persistent and i == 0 else ())
        for i, c in enumerate(capacities))
    return ManagerStats("cpu", len(capacities), 1, locked, slots).to_wire()


class FakeTarget:
    """A rank as an agent's protocol logic (``wsd.agent.core.AgentCore``) sees it, with no manager."""

    device = "cpu"

    def __init__(self) -> None:
        self.applied: list[tuple[str, dict[str, Any]]] = []

    def state(self) -> dict[str, Any]:
        return {"locked": False, "num_ubatches": 1}

    def snapshot(self) -> dict[str, Any]:
        return {}

    def in_step(self) -> tuple[int, float] | None:
        return None

    def stacks(self) -> list[dict[str, Any]]:
        return []

    def apply(self, action: str, args: dict[str, Any]) -> None:
        self.applied.append((action, args))
