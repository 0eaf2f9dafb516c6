"""The agent's protocol logic (wsd.link.AgentLink) driven directly: no sockets, a clock we pass."""

from __future__ import annotations

from typing import Any

from wsd import protocol as p
from wsd.link import AgentLink
from wsd.protocol import Op


class Backend:
    device = "cpu"

    def __init__(self) -> None:
        self.applied: list[tuple[str, dict[str, Any]]] = []

    def state(self) -> dict[str, Any]:
        return {"locked": False, "num_ubatches": 1}

    def snapshot(self) -> dict[str, Any]:
        return {}

    def apply(self, action: str, args: dict[str, Any]) -> None:
        self.applied.append((action, args))


def sent_ops(frames: list[bytes]) -> list[Op]:
    return [p.decode(f).op for f in frames]


def registered(epoch: str = "e1", baseline: int = 0) -> bytes:
    return p.encode(Op.REGISTERED, {"epoch": epoch, "baseline_seq": baseline,
                                    "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0})


def register_times(link: AgentLink, count: int) -> list[float]:
    """The times at which the link sends its first ``count`` REGISTERs, each asked at ``due()``."""
    times, now = [], 0.0
    while len(times) < count:
        assert link.on_time(now - 0.001) == [], "sent before it was due"
        if sent_ops(link.on_time(now)) == [Op.REGISTER]:
            times.append(now)
        now = link.due()
    return times


def test_registration_is_retried_soon_then_every_interval():
    """A first REGISTER lost before the connection is up must not delay start-up by a whole interval."""
    link = AgentLink(Backend(), rank=0, world_size=1, heartbeat_interval=1.0)
    times = register_times(link, 7)
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]


def test_quick_retries_start_again_after_the_coordinator_forgets_us():
    link = AgentLink(Backend(), rank=0, world_size=1, heartbeat_interval=1.0)
    link.on_time(0.0)
    link.on_time(0.05)
    link.on_frame(registered(), 0.06)
    assert link.registered.is_set()
    assert sent_ops(link.on_time(0.06)) == [Op.HEARTBEAT]
    link.on_frame(p.encode(Op.PULSE, {"epoch": "e2", "registered": True}), 0.5)
    assert not link.registered.is_set()
    assert sent_ops(link.on_time(0.5)) == [Op.REGISTER]
    assert link.on_time(0.54) == []
    assert sent_ops(link.on_time(0.55)) == [Op.REGISTER]


def test_commands_held_in_order_and_applied_once_in_idle_mode():
    """Replays of a seq already held or applied are dropped: a command is applied at most once."""
    backend = Backend()
    link = AgentLink(backend, rank=0, world_size=1, idle=True)
    link.on_frame(registered(), 0.0)
    command = {"seq": 2, "action": "lock", "args": {}, "group": None}
    assert link.on_frame(p.encode(Op.COMMAND, command), 0.1) == []  # seq 1 missing: held back
    first = {"seq": 1, "action": "set_ubatches", "args": {"n": 2}, "group": None}
    acks = link.on_frame(p.encode(Op.COMMAND, first), 0.2)
    assert [p.decode(a).body["seq"] for a in acks] == [1, 2]
    assert link.on_frame(p.encode(Op.COMMAND, first), 0.3) == []
    assert link.on_frame(p.encode(Op.COMMAND, command), 0.3) == []
    assert backend.applied == [("set_ubatches", {"n": 2}), ("lock", {})]
    assert link.applied == link.held == 2


def test_waker_is_safe_after_close():
    """A late wake-up (an ack from the engine thread while the agent stops) must not
    write into a descriptor number the process has since reused for something else."""
    import os

    from wsd.transport import Waker

    waker = Waker()
    waker.wake()
    waker.drain()
    waker.close()
    reused_r, reused_w = os.pipe()  # likely the numbers the waker just freed
    try:
        waker.wake()
        waker.close()
        os.set_blocking(reused_r, False)
        try:
            leaked = os.read(reused_r, 16)
        except BlockingIOError:
            leaked = b""
        assert leaked == b"", "a closed Waker wrote into a reused descriptor"
    finally:
        os.close(reused_r)
        os.close(reused_w)
