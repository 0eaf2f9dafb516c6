"""The agent's protocol logic (wsd.agent.core.AgentCore) driven directly: no sockets, a clock we pass."""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
from corekit import FakeTarget

from wsd.agent.core import AgentCore
from wsd.wire import protocol as p
from wsd.wire.protocol import Op


def sent_ops(frames: list[bytes]) -> list[Op]:
    return [p.decode(f).op for f in frames]


def registered(epoch: str = "e1", baseline: int = 0, desired: dict[str, Any] | None = None) -> bytes:
    return p.encode(Op.REGISTERED, {"epoch": epoch, "baseline_seq": baseline, "desired": desired,
                                    "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0, "stats_interval": 1.0})


def command(seq: int, action: str = "equalize", group: int | None = None, **args: Any) -> bytes:
    return p.encode(Op.COMMAND, {"seq": seq, "action": action, "args": args, "group": group})


LOCKED_3 = {"locked": True, "num_ubatches": 3, "reserve_bytes": 4096}


def register_times(link: AgentCore, count: int, *, unsent: int = 0) -> list[float]:
    """The times at which the link sends its first ``count`` REGISTERs, each asked at ``due()``;
    the driver reports the first ``unsent`` of them as not sent (no connection yet)."""
    times: list[float] = []
    now = 0.0
    while len(times) < count:
        assert link.on_time(now - 0.001) == [], "sent before it was due"
        if sent_ops(link.on_time(now)) == [Op.REGISTER]:
            times.append(now)
            if len(times) <= unsent:
                link.unsent(now)
        now = link.due()
    return times


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 6) for a, b in itertools.pairwise(times)]


def test_an_unsent_registration_is_retried_soon():
    """A first REGISTER refused before the connection is up must not delay start-up by an interval."""
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0)
    assert gaps(register_times(link, 5, unsent=3)) == [0.05, 0.05, 0.05, 1.0]


def test_a_sent_registration_waits_an_interval_for_its_answer():
    """Retrying a sent registration sooner would only add to a busy coordinator's start-up storm
    (and show up as a rank registering twice)."""
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0)
    assert gaps(register_times(link, 4)) == [1.0, 1.0, 1.0]


def test_quick_retries_start_again_after_the_coordinator_forgets_us():
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0)
    link.on_time(0.0)
    link.on_frame(registered(), 0.06)
    assert link.registered.is_set()
    assert sent_ops(link.on_time(0.06)) == [Op.STATS_PUSH]  # its first heartbeat pushes its snapshot whole
    link.on_frame(p.encode(Op.PULSE, {"epoch": "e2", "registered": True}), 0.5)
    assert not link.registered.is_set()
    assert sent_ops(link.on_time(0.5)) == [Op.REGISTER]
    link.unsent(0.5)
    assert link.on_time(0.54) == []
    assert sent_ops(link.on_time(0.55)) == [Op.REGISTER]


def test_commands_held_in_order_and_applied_once_in_idle_mode():
    """Replays of a seq already held or applied are dropped: a command is applied at most once."""
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1, idle=True)
    link.on_frame(registered(), 0.0)
    command = {"seq": 2, "action": "lock", "args": {}, "group": None}
    assert link.on_frame(p.encode(Op.COMMAND, command), 0.1) == []  # seq 1 missing: held back
    first = {"seq": 1, "action": "set_ubatches", "args": {"n": 2}, "group": None}
    acks = link.on_frame(p.encode(Op.COMMAND, first), 0.2)
    assert [p.decode(a).body["seq"] for a in acks] == [1, 2]
    assert link.on_frame(p.encode(Op.COMMAND, first), 0.3) == []
    assert link.on_frame(p.encode(Op.COMMAND, command), 0.3) == []
    assert target.applied == [("set_ubatches", {"n": 2}), ("lock", {})]
    assert link.applied == link.held == 2


def test_waker_is_safe_after_close():
    """A late wake-up (an ack from the engine thread while the agent stops) must not
    write into a descriptor number the process has since reused for something else."""
    import os

    from wsd.wire.transport import Waker

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


def test_fresh_process_takes_on_the_desired_state_when_its_group_agrees():
    """Without it a restarted process keeps its configured slot count, unlocked,
    while its group is locked with 3 ubatches. It must wait for the group to agree
    on the baseline (the MIN agreement stays below it until every member registered),
    apply it in a safe order before any later command, jump to the baseline, and
    never apply it twice."""
    target = FakeTarget()
    link = AgentCore(target, rank=1, world_size=2, tp_size=2)
    assert link.registration()["applied_seq"] is None  # fresh
    link.on_frame(registered(baseline=4, desired=LOCKED_3), 0.0)
    link.on_frame(command(5, "set_ubatches", n=2), 0.1)
    assert link.held == 5 and link.applied == 0
    assert link.apply_up_to(0) == [] and link.apply_up_to(3) == []  # a peer not registered yet
    assert target.applied == [] and link.applied == 0
    done = link.apply_up_to(5)
    assert target.applied == [("set_ubatches", {"n": 3}), ("reserve", {"bytes": 4096}), ("lock", {}),
                               ("set_ubatches", {"n": 2})]
    assert [seq for seq, _ in done] == [5]  # the start is no command: nothing acknowledged for it
    assert link.applied == 5
    assert link.apply_up_to(5) == [] and len(target.applied) == 4
    assert link.on_frame(command(4), 0.2) == [] and link.on_frame(command(5), 0.2) == []


def test_start_applies_at_the_baseline_even_with_nothing_after_it():
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1)
    link.on_frame(registered(baseline=2, desired={"locked": False, "num_ubatches": 3, "reserve_bytes": 512}), 0.0)
    assert link.apply_up_to(2) == []
    # Unlocked wanted: the unlock comes first, so that the reserve applies even if
    # the engine locked itself meanwhile.
    assert target.applied == [("unlock", {}), ("set_ubatches", {"n": 3}), ("reserve", {"bytes": 512})]
    assert link.applied == 2


def test_idle_process_takes_on_the_desired_state_on_receipt():
    """An idle worker has no step boundary: it must apply the start when registered."""
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1, idle=True)
    link.on_frame(registered(baseline=7, desired={"locked": True, "num_ubatches": None, "reserve_bytes": None}), 0.0)
    assert target.applied == [("lock", {})] and link.applied == link.held == 7


def test_re_registration_never_applies_the_start_again():
    """After a coordinator restart the process is no longer fresh: it reports its
    baseline, and a desired state in the new REGISTERED (which a coordinator should
    not send) is ignored, or the process would apply it a second time."""
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1)
    link.on_frame(registered(baseline=3, desired=LOCKED_3), 0.0)
    assert link.registration()["applied_seq"] == 3  # registered, not yet agreed: it will reach 3
    link.on_frame(p.encode(Op.PULSE, {"epoch": "e2"}), 1.0)  # the coordinator restarted
    assert link.registration()["applied_seq"] == 3
    link.on_frame(registered(epoch="e2", baseline=3, desired=LOCKED_3), 1.1)
    link.apply_up_to(3)
    assert target.applied == [("set_ubatches", {"n": 3}), ("reserve", {"bytes": 4096}), ("lock", {})]
    link.on_frame(registered(epoch="e3", baseline=3, desired={**LOCKED_3, "num_ubatches": 8}), 2.0)
    link.on_frame(command(4, "unlock"), 2.1)
    link.apply_up_to(4)
    assert target.applied[3:] == [("unlock", {})]


class FailingReserve(FakeTarget):
    def apply(self, action: str, args: dict[str, Any]) -> None:
        if action == "reserve":
            raise RuntimeError("no memory")
        super().apply(action, args)


def test_a_failing_start_action_is_reported_not_raised():
    """A failure must reach the coordinator as an agent event, and the engine must
    never see the exception; the other actions still apply."""
    target = FailingReserve()
    link = AgentCore(target, rank=0, world_size=1)
    link.on_frame(registered(baseline=1, desired=LOCKED_3), 0.0)
    link.apply_up_to(1)
    assert target.applied == [("set_ubatches", {"n": 3}), ("lock", {})] and link.applied == 1
    events = [p.decode(f) for f in link.on_time(0.5)]
    reported = [m.body for m in events if m.op is Op.EVENT]
    assert len(reported) == 1 and reported[0]["kind"] == "start_failed"
    assert reported[0]["detail"]["action"] == "reserve" and "no memory" in reported[0]["detail"]["error"]
    assert [m.op for m in (p.decode(f) for f in link.on_time(0.6))] == []  # reported once


def test_goodbye_only_once_registered_and_names_the_rank_and_step():
    """A rank the coordinator never accepted has nothing to take leave of; a registered one
    names itself, its last step, seqs and state, which the coordinator shows for the
    stopped rank."""
    link = AgentCore(FakeTarget(), rank=3, world_size=4)
    assert link.goodbye() is None
    link.on_frame(registered(), 0.0)
    link.steps = 17
    message = p.decode(link.goodbye(), p.AGENT_OPS)
    assert message.op is Op.GOODBYE
    assert message.body == {"rank": 3, "step": 17, "applied_seq": link.applied,
                            "held_seq": link.held, "state": FakeTarget().state()}


class FailingLoudly(FakeTarget):
    def apply(self, action: str, args: dict[str, Any]) -> None:
        raise RuntimeError("é" * 10_000)  # an exception with a very long, multi-byte message


def test_an_ack_of_a_command_failing_with_a_long_message_is_one_the_coordinator_accepts():
    """Found by the hostile barrage: an error of any length went into the ack, past the
    ack's size bound, so the coordinator refused it and the command stayed pending."""
    link = AgentCore(FailingLoudly(), rank=0, world_size=1)
    link.on_frame(registered(), 0.0)
    link.on_frame(command(1, "equalize"), 0.1)
    [(_seq, frame)] = link.apply_up_to(1)
    ack = p.decode(frame, p.AGENT_OPS)  # as the coordinator decodes it: within every bound
    assert ack.op is Op.ACK and ack.body["ok"] is False and ack.body["error"].startswith("RuntimeError: éé")
    assert len(ack.body["error"]) < 1100 and ack.body["error"].endswith("more characters)")


def test_a_registration_resending_64_acks_of_long_failures_fits_its_bounds():
    """With 64 remembered acks of 1,000-character errors a registration outgrew its own
    bound: after any reconnect the coordinator dropped it unread, and the rank never
    registered again."""
    link = AgentCore(FailingLoudly(), rank=0, world_size=1)
    link.on_frame(registered(), 0.0)
    for seq in range(1, p.ACK_MEMORY + 1):
        link.on_frame(command(seq, "equalize"), 0.1)
    link.apply_up_to(p.ACK_MEMORY)
    frame = p.encode(Op.REGISTER, link.registration())
    assert len(frame) <= p.REGISTER_BYTES
    message = p.decode(frame, p.AGENT_OPS)
    assert len(message.body["acks"]) == p.ACK_MEMORY
    acks = [p.AckRecord.from_wire(a, 0) for a in message.body["acks"]]
    assert all(a.error is not None and len(a.error) == p.ACK_MEMORY_ERROR for a in acks)


def test_a_rank_still_live_on_an_older_connection_is_asked_for_again_each_interval():
    """A restarted worker whose old process the coordinator has not missed yet is refused
    (conflict) until then: it asks again each heartbeat interval, not each timeout."""
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0, heartbeat_timeout=5.0)
    assert sent_ops(link.on_time(0.0)) == [Op.REGISTER]
    link.on_frame(p.encode(Op.REJECTED, {"code": "conflict", "message": "rank 0 is live elsewhere"}), 0.5)
    assert link.due() == 1.5
    link.on_frame(p.encode(Op.REJECTED, {"code": "mismatch", "message": "another world"}), 2.0)
    assert link.due() == 7.0


def test_a_coordinator_older_than_pushes_is_sent_heartbeats_only():
    """A REGISTERED without stats_interval comes from a coordinator that asks for snapshots
    (stats_request) instead: a push or a stats_version would be refused there."""
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0)
    link.on_frame(p.encode(Op.REGISTERED, {"epoch": "old", "baseline_seq": 0, "heartbeat_interval": 1.0,
                                           "heartbeat_timeout": 5.0}), 0.0)
    for now in (0.0, 1.0, 2.0):
        (frame,) = link.on_time(now)
        message = p.decode(frame)
        assert message.op is Op.HEARTBEAT and "stats_version" not in msgpack.unpackb(frame)["body"]
    link.push.urgent = True
    assert link.due() == 3.0
    assert sent_ops(link.on_frame(p.encode(Op.STATS_REQUEST, {"request": 4}), 2.5)) == [Op.STATS_REPLY]


def test_a_silent_coordinator_is_given_up_on_at_the_very_time_due_says():
    """due() says last_heard + timeout; on_time at exactly that time did nothing (the check
    was "later than"), so due() stayed where it was: the simulator's timer loop, which calls
    on_time at the due time, spun at 100% of a core for ever after any outage longer than the
    timeout, and its stop() failed. Every due time must make progress."""
    link = AgentCore(FakeTarget(), rank=0, world_size=1, heartbeat_interval=1.0, heartbeat_timeout=5.0)
    link.on_time(0.0)
    link.on_frame(registered(), 0.0)
    now, seen = 0.0, set()
    for _ in range(100):  # heartbeats and pushes at their times, the coordinator silent
        link.on_time(now)
        if not link.registered.is_set():
            break
        due = link.due()
        assert due > now or due not in seen, f"due() stuck at {due}"
        seen.add(due)
        now = due
    assert not link.registered.is_set() and now == 5.0, "not given up on at last_heard + timeout"


def test_a_rebase_starts_again_from_the_coordinators_baseline_with_the_desired_state():
    """A coordinator whose kept log cannot bring this process up to date (a resume_seq past
    what it applied, or commands older than the log) tells it to start again; without that it
    waited for ever for commands that do not exist. It takes on the desired state at the new
    baseline, once, then the commands after it."""
    target = FakeTarget()
    link = AgentCore(target, rank=0, world_size=1)
    link.on_frame(registered(baseline=0), 0.0)
    link.on_frame(command(1, "equalize"), 0.1)
    link.on_frame(command(3, "trim"), 0.1)  # seq 2 never comes
    link.apply_up_to(1)
    assert link.applied == 1 and link.held == 1
    link.on_frame(p.encode(Op.PULSE, {"epoch": "e2"}), 1.0)
    assert link.registration()["applied_seq"] == 1
    body = msgpack.unpackb(registered(epoch="e2", baseline=7, desired=LOCKED_3))
    body["body"]["rebase"] = True
    link.on_frame(msgpack.packb(body), 1.1)
    assert link.held == 7 and link.waiting()
    link.apply_up_to(7)
    assert target.applied == [("equalize", {}), ("set_ubatches", {"n": 3}), ("reserve", {"bytes": 4096}),
                              ("lock", {})]
    assert link.applied == 7 and link.registration()["applied_seq"] == 7
    link.on_frame(command(8, "unlock"), 2.0)
    link.apply_up_to(8)
    assert target.applied[-1] == ("unlock", {})
