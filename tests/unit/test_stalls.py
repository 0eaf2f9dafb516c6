"""Stalled ranks and stacks: the coordinator's side with fake clocks, and the agent's reading of
its own threads.

A TP group hung on one frozen rank: the frozen rank is lost (its agent froze with it), and
its peer, whose agent still answers, sits inside the collective that waits for it. The real
thing, a worker stopped with SIGSTOP under torchrun, is in tests/integration/test_stalls_live.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from corekit import AGENT, Harness, make, ops, peer_of, to_agents

from wsd.agent.stacks import MAX_FRAMES, StepClock, thread_stacks
from wsd.coordinator.registry import RankState
from wsd.coordinator.stacks import checked_threads
from wsd.wire.protocol import ErrorCode, Op

THREADS = [{"name": "MainThread", "ident": 1, "engine": True, "daemon": False, "dropped": 0,
            "frames": ["worker.py:10:main", "torch/distributed/distributed_c10d.py:2501:all_reduce"]}]


@pytest.fixture
def h(tmp_path) -> Harness:
    return make(tmp_path, stall_after=10.0)


def beat(h: Harness, rank: int, in_step: float | None, step: int = 5) -> list[Any]:
    return h.agent(peer_of(rank), Op.HEARTBEAT, {"rank": rank, "step": step, "applied_seq": 0, "held_seq": 0,
                                                  "state": {}, "in_step": in_step})


def stacks_from(h: Harness, rank: int, request: int, *, in_step: float | None = 12.0,
                threads: list[Any] | None = None) -> list[Any]:
    return h.agent(peer_of(rank), Op.STACKS_REPLY, {"rank": rank, "request": request, "step": 5,
                                                     "in_step": in_step, "threads": threads or THREADS})


def shown(h: Harness) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in h.ok(Op.RANKS)["ranks"]}


def test_a_rank_inside_one_step_past_stall_after_is_stalled_and_names_the_peer_it_waits_for(h):
    h.register_all([0, 1])
    for second in range(1, 11):  # rank 0 inside one step; rank 1 between steps, never stalled
        h.advance(1)
        beat(h, 0, second - 0.5)
        beat(h, 1, None)
        assert shown(h) == {0: "live", 1: "live"}
    h.advance(0.6)
    beat(h, 0, 10.1)  # over stall_after, as the coordinator sees it
    assert shown(h) == {0: "stalled", 1: "live"}
    status = h.ok(Op.STATUS)
    assert status["ranks"]["stalled"] == 1 and status["ranks"]["live"] == 1
    assert h.events("stalled") == []  # waiting a moment for the stacks the agent sends
    stacks_from(h, 0, 0, in_step=10.6)
    (event,) = h.events("stalled")
    assert (event["rank"], event["step"], event["peers"], event["waits_for"]) == (0, 5, {"1": "live"}, [1])
    assert event["stacks"][0]["engine"] and event["stacks"][0]["frames"][-1].endswith(":all_reduce")
    beat(h, 0, None)  # the step ended: no longer stalled
    assert shown(h) == {0: "live", 1: "live"}
    (ended,) = h.events("unstalled")
    assert ended["rank"] == 0 and ended["why"] == "its engine left the step"


def test_a_peer_that_froze_whole_is_lost_and_the_stalled_rank_waits_for_it(h):
    h.register_all([0, 1])
    for _ in range(12):  # rank 1 froze: no word from it; rank 0 sits inside the step
        h.advance(1)
        beat(h, 0, 1.0 + _)
    assert shown(h) == {0: "stalled", 1: "lost"}
    h.advance(2.5)  # no stacks came (an agent that sends none): the event goes without them
    beat(h, 0, 15.0)
    (event,) = h.events("stalled")
    assert event["peers"] == {"1": "lost"} and event["waits_for"] == [1] and event["stacks"] is None


def test_a_stalled_rank_lost_or_stopped_is_no_longer_stalled(h):
    h.register_all([0, 1])
    beat(h, 0, 30.0)
    assert shown(h)[0] == "stalled"
    stacks_from(h, 0, 0, in_step=30.0)  # the stalled event, with its stacks
    h.agent(peer_of(0), Op.GOODBYE, {"rank": 0, "step": 5})
    assert shown(h)[0] == "stopped"
    assert [e["why"] for e in h.events("unstalled")] == ["stopped"]


def test_a_stall_that_ends_before_its_event_is_written_writes_neither(h):
    """Every unstalled event follows its stalled one: a rank that leaves the step while its
    event still waits for its stacks (a frozen rank woken inside the step it froze in) reads
    stalled for that moment, and the log says nothing of it."""
    h.register_all([0, 1])
    beat(h, 1, 30.0)
    assert shown(h)[1] == "stalled"
    beat(h, 1, None)
    assert shown(h)[1] == "live" and h.events("stalled") == [] and h.events("unstalled") == []


def test_a_stall_event_keeps_a_few_kb_and_the_whole_stacks_stay_for_an_admins_stacks(h):
    """A rank's whole stacks (64 threads of 64 frames of 256 characters: about 1 MB) once went
    into each stalled event: two ranks flipping evicted an operator's commands in seconds. The
    event keeps the innermost frames of the engine's thread and one other; ``stacks`` still
    shows everything the agent sent at the stall, while it lasts."""
    from wsd.coordinator.stalls import STALL_FRAMES, innermost

    threads = [{"name": f"t{i}", "ident": i, "engine": i == 5, "daemon": True, "dropped": 0,
                "frames": [f"{'x' * 200}.py:{j}:f{j}" for j in range(64)]} for i in range(64)]
    h.register_all([0, 1])
    beat(h, 0, 30.0)
    stacks_from(h, 0, 0, in_step=30.0, threads=threads)
    (event,) = h.events("stalled")
    assert [t["name"] for t in event["stacks"]] == ["t5", "t0"]
    assert event["stacks"][0]["frames"] == [f"{'x' * 200}.py:{j}:f{j}" for j in range(64 - STALL_FRAMES, 64)]
    assert event["stacks"][0]["dropped"] == 64 - STALL_FRAMES
    import msgpack
    assert len(msgpack.packb(event)) < 6000
    request = to_agents(h.client(Op.STACKS, {"rank": 0}), Op.STACKS_REQUEST)[peer_of(0)]["request"]
    (reply,) = [s.reply for s in stacks_from(h, 0, request, in_step=31.0)]
    assert len(reply.result["ranks"][0]["at_stall"]) == 64, "the whole stacks of the stall, for an admin"
    assert innermost(None) is None


def test_a_viewer_sees_no_frames_in_events(h):
    """A CURVE viewer key may not call ``stacks``; it must not read the same frames through
    ``events``. An admin key (or no CURVE) sees them."""
    h.register_all([0, 1])
    beat(h, 0, 30.0)
    stacks_from(h, 0, 0, in_step=30.0)
    as_viewer = h.call(Op.EVENTS, {"cursor": 0}, role="viewer").result["events"]
    (stalled,) = [e for e in as_viewer if e["kind"] == "stalled"]
    assert stalled["stacks"] is None and stalled["stacks_withheld"]
    as_admin = h.call(Op.EVENTS, {"cursor": 0}, role="admin").result["events"]
    assert next(e for e in as_admin if e["kind"] == "stalled")["stacks"][0]["frames"] == THREADS[0]["frames"]


def test_the_stall_metric_and_the_count_by_state(h):
    h.register_all([0, 1])
    beat(h, 0, 30.0)
    view = h.core.engine().core_view()
    rows = {r.rank: r for r in view.ranks}
    assert rows[0].stalled and rows[0].waits_for == (1,) and not rows[1].stalled
    assert dict(view.states)["stalled"] == 1


def test_stacks_asks_the_live_ranks_named_and_answers_once_each_did(h):
    h.register_all([0, 1, 2])
    sent = h.client(Op.STACKS, {"group": 0})
    asked = to_agents(sent, Op.STACKS_REQUEST)
    assert set(asked) == {peer_of(0), peer_of(1)} and ops(sent, AGENT) == [Op.STACKS_REQUEST] * 2
    request = asked[peer_of(0)]["request"]
    assert stacks_from(h, 0, request) == []  # rank 1 still owes its answer
    (reply,) = [s.reply for s in stacks_from(h, 1, request, in_step=None)]
    assert reply.ok
    assert [(r["rank"], r["host"], r["in_step"]) for r in reply.result["ranks"]] == [(0, "node", 12.0),
                                                                                       (1, "node", None)]
    assert reply.result["missing"] == []


def test_a_second_stacks_request_joins_the_round_in_flight_and_a_rank_is_asked_once_a_second(h):
    """8 stepping ranks answered 99-148 stacks requests a second and their steps slowed 17-22%:
    one round per engine at a time (another request joins it), and a rank whose stacks were
    gathered less than MIN_INTERVAL ago is not interrupted again: its last reply answers."""
    from wsd.coordinator.stacks import MIN_INTERVAL

    h.register_all([0, 1])
    first = h.client(Op.STACKS, {"group": 0}, request_id=1)
    asked = to_agents(first, Op.STACKS_REQUEST)
    joined = h.client(Op.STACKS, {"rank": 1}, request_id=2)
    assert ops(joined, AGENT) == [], "a second round while one runs"
    request = asked[peer_of(0)]["request"]
    assert stacks_from(h, 0, request) == []
    replies = {s.reply.id: s.reply for s in stacks_from(h, 1, request) if s.reply is not None}
    assert [r["rank"] for r in replies[1].result["ranks"]] == [0, 1]
    assert [r["rank"] for r in replies[2].result["ranks"]] == [1] and replies[2].result["missing"] == []
    h.advance(0.5)
    again = h.client(Op.STACKS, {"group": 0}, request_id=3)
    assert ops(again, AGENT) == []  # both replied half a second ago: answered with those replies
    (reply,) = [s.reply for s in again if s.reply is not None]
    assert [(r["rank"], r["age"]) for r in reply.result["ranks"]] == [(0, 0.5), (1, 0.5)]
    assert reply.result["missing"] == []
    h.advance(MIN_INTERVAL)
    assert set(to_agents(h.client(Op.STACKS, {"group": 0}, request_id=4), Op.STACKS_REQUEST)) == {peer_of(0),
                                                                                                 peer_of(1)}


def test_stacks_of_a_rank_that_never_answers_or_is_gone_say_why(h):
    h.register_all([0])
    sent = h.client(Op.STACKS, {"timeout": 1.0})
    assert set(to_agents(sent, Op.STACKS_REQUEST)) == {peer_of(0)}
    (reply,) = [s.reply for s in h.advance(1.5) if s.reply is not None]
    missing = {m["rank"]: m["reason"] for m in reply.result["missing"]}
    assert missing[0] == "no reply within the timeout"
    assert missing[1].startswith("never registered") and set(missing) == {0, 1, 2, 3}


def test_stacks_of_more_ranks_than_one_request_may_ask_are_refused_naming_the_way_out(tmp_path):
    """Each rank answers with up to 1 MiB of stacks: a request for every rank of a large world
    would hold them all in the coordinator's memory at once."""
    from wsd.coordinator.engine import MAX_STACK_RANKS

    big = make(tmp_path, world_size=2 * MAX_STACK_RANKS, tp_size=8)
    reply = big.call(Op.STACKS, {})
    assert not reply.ok and reply.code is ErrorCode.BAD_FIELD
    assert f"stacks of {2 * MAX_STACK_RANKS} ranks asked, at most {MAX_STACK_RANKS}" in reply.message
    assert ops(big.client(Op.STACKS, {"group": 3}), AGENT) == []  # a group is fine (none registered: none asked)


def test_a_rank_beyond_the_world_is_refused_naming_it(h):
    reply = h.call(Op.STACKS, {"rank": 9})
    assert not reply.ok and reply.code is ErrorCode.BAD_FIELD and "no rank 9" in reply.message


def test_bad_stacks_from_an_agent_are_left_out_naming_why(h):
    h.register_all([0])
    request = to_agents(h.client(Op.STACKS, {"rank": 0}), Op.STACKS_REQUEST)[peer_of(0)]["request"]
    (reply,) = [s.reply for s in stacks_from(h, 0, request, threads=[{"name": 7, "frames": []}])]
    assert reply.result["ranks"] == []
    assert "sent invalid stacks" in reply.result["missing"][0]["reason"]
    assert h.core.engine().registry.ranks[0].state is RankState.LIVE  # the rank itself is fine


def test_an_agents_stacks_are_cut_to_size_and_made_printable():
    long = "x" * 1000
    (thread,) = checked_threads([{"name": "evil\x1b[31m", "frames": [long, "a.py:1:\x07f"], "dropped": 3}])
    assert "\x1b" not in thread["name"] and "\x07" not in thread["frames"][1]
    assert len(thread["frames"][0]) < 300  # cut, saying how much was left out
    with pytest.raises(ValueError, match="at most 64 strings"):
        checked_threads([{"name": "t", "frames": ["f"] * 65}])


def test_a_frame_can_forge_no_line_and_reorder_no_text():
    """A token holder's frame holding a newline printed a forged line in ``wsctl stacks``
    (``rank 1 (...): inside its step for 912.0 s``); one holding U+202E reversed what followed."""
    (thread,) = checked_threads([{"name": "main\u2028x", "dropped": 0, "frames": [
        "a.py:1:f\nrank 1 (host): inside its step for 912.0 s", "b.py:2:\u202eg\u2029h\tz"]}])
    assert thread["frames"] == ["a.py:1:f\\nrank 1 (host): inside its step for 912.0 s",
                                "b.py:2:\\u202eg\\u2029h\\tz"]
    assert thread["name"] == "main\\u2028x"
    assert all("\n" not in f and f.isprintable() for f in thread["frames"])


# -- the agent's reading of its own threads ----------------------------------------------------


def test_the_engine_thread_comes_first_with_the_frame_it_waits_in():
    clock = StepClock(time.monotonic)
    inside, release = threading.Event(), threading.Event()

    def engine_step() -> None:
        clock.enter()
        inside.set()
        release.wait(10)  # a collective waiting for a frozen peer
        clock.leave()

    thread = threading.Thread(target=engine_step, name="engine", daemon=True)
    thread.start()
    try:
        assert inside.wait(10)
        step, seconds = clock.step, clock.inside()
        assert step == 1 and seconds is not None and seconds >= 0
        stacks = thread_stacks(clock.thread, skip=threading.get_ident())
        assert stacks[0]["name"] == "engine" and stacks[0]["engine"]
        assert stacks[0]["frames"][-1].endswith(":wait") and any(":engine_step" in f for f in stacks[0]["frames"])
        assert all(t["ident"] != threading.get_ident() for t in stacks)
    finally:
        release.set()
        thread.join(10)
    assert clock.inside() is None


def test_a_deep_stack_keeps_its_innermost_frames_and_counts_the_rest():
    ready, release = threading.Event(), threading.Event()

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            ready.set()
            release.wait(10)

    thread = threading.Thread(target=deep, args=(200,), daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        (mine,) = [t for t in thread_stacks() if t["ident"] == thread.ident]
        assert len(mine["frames"]) == MAX_FRAMES and mine["dropped"] > 150
        assert mine["frames"][-1].endswith(":wait")
    finally:
        release.set()
        thread.join(10)


def test_an_agreement_inside_a_step_counts_as_one_step():
    now = [100.0]
    clock = StepClock(lambda: now[0])
    clock.enter()
    now[0] = 101.0
    clock.enter()  # the agreement, inside the step
    clock.leave()
    now[0] = 105.0
    assert clock.inside() == 5.0 and clock.step == 1
    clock.leave()
    assert clock.inside() is None
