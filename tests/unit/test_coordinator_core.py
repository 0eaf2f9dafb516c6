"""The coordinator's decisions (wsd.coordinator.core.CoordinatorCore), driven directly.

No sockets and no sleeping: a small fake transport of our own feeds agent and
client frames to the core, advances a fake monotonic clock and a fake wall
clock, and decodes the ``(AGENT | CLIENT, route, frame)`` it returns.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from typing import Any

import msgpack
import pytest
from corekit import (
    CLIENT_ROUTE,
    WALL0,
    Harness,
    Sent,
    decode_all,
    make,
    only_reply,
    ops,
    peer_of,
    replies,
    snapshot,
    to_agents,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsd.coordinator.commandlog import CommandLog
from wsd.coordinator.registry import RankState
from wsd.errors import StateFileError
from wsd.slotstats import (
    SLOT_KEY,
    SLOT_NUMBERS,
    SPARSE,
    LockViolation,
    ManagerStats,
    PersistentStats,
    RetainedStats,
    SlotStats,
)
from wsd.wire import protocol as p
from wsd.wire.protocol import PROTOCOL_VERSION, ErrorCode, Op
from wsd_client.rows import group_columns, group_slots, rank_columns, table_rows


@pytest.fixture
def h(tmp_path) -> Harness:
    return make(tmp_path)


# -- imports ---------------------------------------------------------------


def test_coordinator_imports_no_torch():
    """The coordinator runs as a sidecar on machines without torch."""
    code = "import sys, wsd.coordinator.core, wsd.coordinator.loop; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- registration ----------------------------------------------------------


def test_registration_accepted(h):
    sent = h.register(1, step=7)
    registered = to_agents(sent, Op.REGISTERED)[peer_of(1)]
    assert registered == {"epoch": h.core.epoch, "baseline_seq": 0, "heartbeat_interval": 1.0,
                          "heartbeat_timeout": 5.0, "stats_interval": 1.0, "stall_after": 60.0,
                          "desired": {"locked": None, "num_ubatches": None, "reserve_bytes": None},
                          "rebase": False, "presize": None, "proof": None}  # no agent token: nothing to prove
    info = h.core.engine().registry.ranks[1]
    assert info.state is RankState.LIVE and info.tp_group == 0 and info.step == 7
    joined = h.events("joined")
    assert [(e["rank"], e["tp_group"], e["time"]) for e in joined] == [(1, 0, WALL0)]


@pytest.mark.parametrize(("overrides", "named"), [
    ({"world_size": 8}, "world_size=8"),
    ({"tp_size": 4, "tp_group": 0}, "tp_size=4"),
    ({"tp_group": 0}, "tp_group=0"),          # rank 3 belongs to group 1
    ({"rank": 4, "tp_group": 2}, "rank 4"),   # beyond the world
])
def test_registration_refused_on_mismatch(h, overrides, named):
    """A worker launched with the wrong world must be told exactly what is wrong."""
    body = {"rank": 3, **overrides}
    rank = body.pop("rank")
    sent = h.register(rank, **body)
    rejected = to_agents(sent, Op.REJECTED)[peer_of(rank)]
    assert rejected["code"] == str(ErrorCode.MISMATCH) and named in rejected["message"]
    assert ops(sent) == [Op.REJECTED]
    assert h.core.engine().registry.ranks == {}
    assert h.events("rejected")[0]["reason"] == rejected["message"]


def test_second_registration_supersedes(h):
    """An agent that reconnected (the same instance on a new connection) replaces its old
    record at once; the old peer stops counting."""
    h.register(0, peer=peer_of(0, 0))
    h.advance(1)
    sent = h.register(0, peer=peer_of(0, 1))
    assert ops(sent) == [Op.REGISTERED]
    assert [e["rank"] for e in h.events("superseded")] == [0]
    live = h.core.engine().registry.live()
    assert [(i.rank, i.peer) for i in live] == [(0, peer_of(0, 1))]
    # the old peer's heartbeat is not a sign of life: it is asked to register again
    pulse = to_agents(h.heartbeat(0, peer=peer_of(0, 0)), Op.PULSE)[peer_of(0, 0)]
    assert pulse["registered"] is False
    # commands and pulses go to the new peer only
    sent = h.client(Op.LOCK, {"wait": False})
    assert set(to_agents(sent, Op.COMMAND)) == {peer_of(0, 1)}
    assert set(to_agents(h.advance(1), Op.PULSE)) == {peer_of(0, 1)}


def test_a_repeated_registration_on_the_same_connection_is_no_news(h):
    """A rank whose answer came late asks again on the same connection: it is answered again,
    but it is not logged as superseding itself (operators would read a restart into it)."""
    h.register(0)
    sent = h.register(0)
    assert ops(sent) == [Op.REGISTERED]
    assert h.events("superseded") == []
    assert [e["rank"] for e in h.events("joined")] == [0]
    assert [(i.rank, i.peer) for i in h.core.engine().registry.live()] == [(0, peer_of(0))]


def test_heartbeats_keep_a_rank_live(h):
    h.register(0)
    for step in range(1, 5):
        h.advance(4.0)  # less than the 5 s timeout each time, 16 s in all
        h.heartbeat(0, step=step)
        assert h.core.engine().registry.ranks[0].state is RankState.LIVE
    assert h.events("lost") == []
    assert h.core.engine().registry.ranks[0].step == 4


def test_silence_marks_lost_with_time_and_last_step_then_back(h):
    h.register(0)
    h.register(1)
    h.advance(2)
    h.heartbeat(0, step=42)
    h.heartbeat(1, step=42)
    h.advance(4)
    h.heartbeat(1, step=43)
    h.advance(0.9)  # 4.9 s silent: still live
    assert h.core.engine().registry.ranks[0].state is RankState.LIVE
    lost_wall = h.wall.now + 0.2
    h.advance(0.2)  # 5.1 s silent
    assert h.core.engine().registry.ranks[0].state is RankState.LOST
    assert h.core.engine().registry.ranks[1].state is RankState.LIVE
    [lost] = h.events("lost")
    assert lost["rank"] == 0 and lost["time"] == lost_wall and lost["last_step"] == 42
    assert lost["silent_for"] == pytest.approx(5.1)
    # pulses stop going to a lost rank; its heartbeat asks it to register again
    assert peer_of(0) not in to_agents(h.advance(1), Op.PULSE)
    assert to_agents(h.heartbeat(0), Op.PULSE)[peer_of(0)]["registered"] is False
    # it is back when it registers again
    assert ops(h.register(0, peer=peer_of(0, 1), applied_seq=0)) == [Op.REGISTERED]
    assert h.core.engine().registry.ranks[0].state is RankState.LIVE
    assert [e["rank"] for e in h.events("back")] == [0]


def test_heartbeat_from_unknown_peer_asks_to_register(h):
    sent = h.heartbeat(2, peer=b"stranger")
    assert to_agents(sent, Op.PULSE) == {b"stranger": {"epoch": h.core.epoch, "registered": False}}
    assert h.core.engine().registry.ranks == {}


def test_pulses_to_live_agents_every_interval(h):
    h.register_all()
    assert set(to_agents(h.tick(), Op.PULSE)) == {peer_of(r) for r in range(4)}
    assert to_agents(h.advance(0.5), Op.PULSE) == {}
    assert len(to_agents(h.advance(0.5), Op.PULSE)) == 4


# -- goodbye: a clean shutdown ------------------------------------------------


def goodbye(h: Harness, rank: int, *, peer: bytes | None = None, step: int = 0) -> list[Sent]:
    return h.agent(peer or peer_of(rank), Op.GOODBYE, {"rank": rank, "step": step})


def test_goodbye_records_where_the_rank_last_stood(h):
    """A command applied just before shutdown reaches the coordinator by its ack, not by
    a heartbeat the stopping worker will never send: the goodbye carries the rank's last
    applied seq and manager state, so ranks shows the stopped rank as it really ended."""
    h.register(0)
    issue_three(h)
    h.agent(peer_of(0), Op.GOODBYE, {"rank": 0, "step": 7, "applied_seq": 3, "held_seq": 3,
                                     "state": {"locked": True, "num_ubatches": 2}})
    info = h.core.engine().registry.ranks[0]
    assert (info.step, info.applied_seq, info.held_seq) == (7, 3, 3)
    assert info.manager_state == {"locked": True, "num_ubatches": 2}


def test_goodbye_marks_the_rank_stopped_and_silence_never_makes_it_lost(h):
    """Without GOODBYE a cleanly stopped worker would read as crashed: ``lost`` a
    heartbeat timeout later. Stopped, it must stay stopped however long it is silent,
    be shown so in ranks, status and missing, and be live again when it registers."""
    h.register(0)
    h.register(1)
    h.advance(2)
    stopped_wall = h.wall.now
    assert goodbye(h, 0, step=42) == []  # no answer: the agent is closing its socket
    info = h.core.engine().registry.ranks[0]
    assert info.state is RankState.STOPPED and info.stopped_at == stopped_wall and info.step == 42
    [event] = h.events("stopped")
    assert (event["rank"], event["tp_group"], event["last_step"], event["time"]) == (0, 0, 42, stopped_wall)
    h.heartbeat(1)
    for _ in range(5):  # 20 s: four heartbeat timeouts, rank 1 kept alive
        h.advance(4)
        h.heartbeat(1)
    assert info.state is RankState.STOPPED and h.events("lost") == []
    [rank0] = [r for r in h.ok(Op.RANKS)["ranks"] if r["rank"] == 0]
    assert rank0["state"] == "stopped" and rank0["stopped_at"] == stopped_wall and rank0["lost_at"] is None
    assert h.core.engine().registry.missing()[0] == "stopped (said goodbye at 2023-11-14T22:13:22Z, last step 42)"
    status = h.ok(Op.STATUS)
    assert status["ranks"] == {"live": 1, "stalled": 0, "lost": 0, "stopped": 1, "missing": 2}
    assert status["groups"][0]["live"] == [1]
    assert status["groups"][0]["missing"] == [{"rank": 0, "reason": h.core.engine().registry.missing()[0]}]
    assert peer_of(0) not in to_agents(h.advance(1), Op.PULSE)  # no pulses to a stopped rank
    # A new process of rank 0 is live again, and logged as back.
    assert ops(h.register(0, peer=peer_of(0, 1))) == [Op.REGISTERED]
    assert h.core.engine().registry.ranks[0].state is RankState.LIVE
    assert [e["rank"] for e in h.events("back")] == [0]


def test_goodbye_from_anyone_but_the_ranks_own_connection_is_ignored(h):
    """An impostor (or a rank's superseded old process) must not be able to stop a
    live rank by naming it: only the connection that registered the rank may."""
    h.register(0, peer=peer_of(0, 0))
    h.register(1)
    assert goodbye(h, 0, peer=b"stranger") == []
    assert goodbye(h, 0, peer=peer_of(1)) == []  # a registered peer naming another rank
    h.register(0, peer=peer_of(0, 1))  # rank 0 reconnected: the old connection is superseded
    assert goodbye(h, 0, peer=peer_of(0, 0)) == []  # the old process's late goodbye
    assert [i.state for i in h.core.engine().registry.ranks.values()] == [RankState.LIVE, RankState.LIVE]
    assert h.events("stopped") == []
    assert h.ok(Op.STATUS)["ranks"]["stopped"] == 0


def test_rank_stopping_while_command_pending_completes_it_without_calling_it_lost(h):
    h.register_all()
    h.client(Op.LOCK)
    for rank in (0, 1, 2):
        h.ack(rank, 1, step=5)
    h.advance(1)
    reply = only_reply(goodbye(h, 3, step=9))  # answered at once, not at the command timeout
    result = reply.result
    assert result["lost"] == [] and result["pending"] == [] and result["complete"] is False
    assert [m["rank"] for m in result["missing"]] == [3]
    assert result["missing"][0]["reason"].startswith("stopped (said goodbye at ")


def test_rank_stopping_while_asked_for_stats(h):
    h.register_all()
    request, _ = stats_round(h, {"group": 1, "timeout": 30.0})
    stats_reply(h, 2, request, snapshot([8]))
    result = only_reply(goodbye(h, 3)).result
    assert result["ranks"]["rank"] == [2] and result["complete"] is False
    [missing] = result["missing"]
    assert missing["rank"] == 3 and missing["reason"].startswith("stopped (said goodbye at ")


def test_a_group_stopped_whole_restarts_from_its_desired_state(h):
    """As for a group lost whole: its baseline is forgotten, so a fresh process starts
    from the current seq and the group's desired state, not from an old baseline."""
    h.register_all([0, 1])
    h.client(Op.SET_UBATCHES, {"n": 3, "wait": False})
    h.client(Op.LOCK, {"group": 0, "wait": False})
    goodbye(h, 0)
    goodbye(h, 1)
    sent = h.register(1, peer=peer_of(1, 1))
    assert to_agents(sent, Op.REGISTERED)[peer_of(1, 1)]["baseline_seq"] == 2
    assert desired_sent(sent, 1, 1) == {"locked": True, "num_ubatches": 3, "reserve_bytes": None}
    assert ops(sent) == [Op.REGISTERED]


# -- commands --------------------------------------------------------------


def test_command_numbered_and_persisted_before_it_is_sent(h, monkeypatch):
    """A restarted coordinator knows every command it ever sent."""
    h.register_all()
    order: list[tuple[str, Any]] = []
    write, encode = h.core.engine().log._append_record, p.encode

    def spy_write(record):
        write(record)
        on_disk = CommandLog(h.config.state_file, 100)
        on_disk.load()
        order.append(("on disk", on_disk.seq))

    def spy_encode(op, body=None, request_id=0):
        order.append(("encoded", op))
        return encode(op, body, request_id)
    monkeypatch.setattr(h.core.engine().log, "_append_record", spy_write)
    monkeypatch.setattr(p, "encode", spy_encode)
    sent = h.client(Op.SET_UBATCHES, {"n": 4, "wait": False})
    monkeypatch.undo()
    assert ("on disk", 1) in order and ("encoded", Op.COMMAND) in order
    assert order.index(("on disk", 1)) < order.index(("encoded", Op.COMMAND))
    commands = to_agents(sent, Op.COMMAND)
    assert {c["seq"] for c in commands.values()} == {1}
    fresh = CommandLog(h.config.state_file, 100)
    assert fresh.load() and fresh.seq == 1
    assert [(c.seq, c.action, c.args) for c in fresh.entries] == [(1, "set_ubatches", {"n": 4})]
    assert fresh.desired(0)["num_ubatches"] == 4
    assert to_agents(h.client(Op.LOCK, {"wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 2


def test_command_not_sent_when_state_file_cannot_be_written(tmp_path):
    """If the command cannot be recorded it must not reach any agent (nor use a seq)."""
    folder = tmp_path / "state"
    folder.mkdir()
    h = make(tmp_path, state_file=str(folder / "coordinator.state"))
    h.register_all()
    folder.rmdir()
    sent = h.client(Op.LOCK)
    assert ops(sent) == []
    reply = only_reply(sent)
    assert not reply.ok and reply.code is ErrorCode.STORAGE and "coordinator.state" in reply.message
    assert h.core.engine().log.seq == 0 and h.core.engine().log.default["locked"] is None


def test_reply_waits_for_every_ack_with_steps_and_same_step(h):
    h.register_all()
    sent = h.client(Op.LOCK, request_id=5)
    assert set(to_agents(sent, Op.COMMAND)) == {peer_of(r) for r in range(4)}
    assert replies(sent) == []
    assert replies(h.ack(0, 1, step=10)) == []
    assert replies(h.ack(1, 1, step=10)) == []
    assert replies(h.ack(2, 1, step=11)) == []
    reply = only_reply(h.ack(3, 1, step=12))
    assert reply.ok and reply.id == 5
    result = reply.result
    assert result["seq"] == 1 and result["action"] == "lock" and result["complete"] is True
    assert {a["rank"]: a["step"] for a in result["acked"]} == {0: 10, 1: 10, 2: 11, 3: 12}
    assert result["same_step"] == {"0": True, "1": False}
    assert result["pending"] == [] and result["lost"] == [] and result["missing"] == []
    # the command is done: a late duplicate ack changes nothing
    assert h.ack(3, 1, step=12) == [] and h.ok(Op.STATUS)["pending_commands"] == []


def test_failed_ack_is_reported(h):
    h.register_all()
    h.client(Op.EQUALIZE)
    for rank in (0, 1, 2):
        h.ack(rank, 1, step=1)
    result = only_reply(h.ack(3, 1, step=1, ok=False, error="WorkspaceLockedError: x")).result
    assert result["failed"] == [3]
    assert [e["rank"] for e in h.events("command_failed")] == [3]


def test_command_times_out_with_pending_ranks(h):
    h.register_all()
    h.client(Op.UNLOCK)
    for rank in (0, 1, 2):
        h.ack(rank, 1, step=3)
    for _ in range(4):  # keep everyone live, so the timeout is the command's own
        assert replies(h.advance(2.4)) == []
        for rank in range(4):
            h.heartbeat(rank)
    reply = only_reply(h.advance(0.5))  # 10.1 s after the command
    assert reply.result["complete"] is False and reply.result["pending"] == [3]
    assert sorted(a["rank"] for a in reply.result["acked"]) == [0, 1, 2]


def test_client_timeout_overrides_command_timeout(h):
    h.register_all()
    h.client(Op.LOCK, {"timeout": 1.0})
    assert replies(h.advance(0.9)) == []
    assert only_reply(h.advance(0.2)).result["pending"] == [0, 1, 2, 3]


def test_rank_lost_while_command_pending_completes_it(h):
    h.register_all()
    h.client(Op.LOCK)
    for rank in (0, 1, 2):
        h.ack(rank, 1, step=5)
    h.advance(3)
    for rank in (0, 1, 2):
        h.heartbeat(rank)
    reply = only_reply(h.advance(2.5))  # rank 3 silent for 5.5 s, well before the 10 s command timeout
    assert reply.result["lost"] == [3] and reply.result["pending"] == []
    assert reply.result["complete"] is False


def test_no_wait_replies_at_once_with_seq(h):
    h.register_all()
    sent = h.client(Op.SET_UBATCHES, {"n": 3, "wait": False}, request_id=8)
    reply = only_reply(sent)
    assert reply.id == 8 and reply.result == {"seq": 1, "action": "set_ubatches", "group": None, "waited": False,
                                              "complete": False, "acked": [], "failed": [], "same_step": None,
                                              "pending": [], "lost": [], "missing": []}
    assert len(to_agents(sent, Op.COMMAND)) == 4
    for rank in range(4):
        assert replies(h.ack(rank, 1, step=1)) == []
    applied = h.events("command_applied")
    assert applied[-1]["seq"] == 1 and applied[-1]["complete"] is True


def test_group_command_targets_only_that_group(h):
    """Every live rank holds every seq (so seqs stay gap-free), but only the
    target group's ranks must acknowledge; a never-registered one is missing."""
    h.register_all([0, 1, 2])
    sent = h.client(Op.LOCK, {"group": 1})
    assert set(to_agents(sent, Op.COMMAND)) == {peer_of(0), peer_of(1), peer_of(2)}
    assert {c["group"] for c in to_agents(sent, Op.COMMAND).values()} == {1}
    assert replies(h.ack(0, 1, step=1)) == []  # not a target: does not count
    result = only_reply(h.ack(2, 1, step=4)).result
    assert [a["rank"] for a in result["acked"]] == [2]
    assert result["missing"] == [{"rank": 3, "reason": "never registered"}]
    assert result["complete"] is False and result["same_step"] == {"1": True}
    assert h.core.engine().log.desired(1)["locked"] is True and h.core.engine().log.desired(0)["locked"] is None


@pytest.mark.parametrize("op", [Op.RESERVE, Op.TRIM], ids=str)
def test_reserve_and_trim_refused_while_locked(h, op):
    h.register_all()
    h.client(Op.LOCK, {"group": 1, "wait": False})
    body = {"bytes": 4096} if op is Op.RESERVE else {}
    for group in (None, 1):
        reply = h.call(op, {**body, "group": group})
        assert not reply.ok and reply.code is ErrorCode.CONFLICT and "unlock" in reply.message
    assert h.core.engine().log.seq == 1
    fresh = CommandLog(h.config.state_file, 10)
    assert fresh.load() and fresh.seq == 1
    # group 0 is not locked: allowed there
    assert to_agents(h.client(op, {**body, "group": 0, "wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 2


def test_group_out_of_range(h):
    reply = h.call(Op.LOCK, {"group": 2})
    assert reply.code is ErrorCode.BAD_FIELD and "group" in reply.message and "0..1" in reply.message
    assert h.core.engine().log.seq == 0
    reply = h.call(Op.STATS, {"group": 5})
    assert reply.code is ErrorCode.BAD_FIELD and "group" in reply.message


def test_command_with_no_live_target_replies_at_once(h):
    h.register_all([0, 1])
    result = only_reply(h.client(Op.LOCK, {"group": 1})).result
    assert result["seq"] == 1 and result["acked"] == [] and result["complete"] is False
    assert [m["rank"] for m in result["missing"]] == [2, 3]


# -- stats -----------------------------------------------------------------


def stats_round(h: Harness, body: dict[str, Any] | None = None) -> tuple[int, set[bytes]]:
    """A fresh stats round (``wsctl stats --fresh``): every live rank asked now."""
    sent = h.client(Op.STATS, {"fresh": True, **(body or {})}, request_id=21)
    requests = to_agents(sent, Op.STATS_REQUEST)
    assert replies(sent) == []
    [request] = {r["request"] for r in requests.values()}
    return request, set(requests)


def stats_reply(h: Harness, rank: int, request: int, stats: dict[str, Any], step: int = 0) -> list[Sent]:
    return h.agent(peer_of(rank), Op.STATS_REPLY, {"rank": rank, "request": request, "stats": stats, "step": step})


def test_stats_aggregated_per_rank_slot_and_group(h):
    h.register_all()
    request, asked = stats_round(h)
    assert asked == {peer_of(r) for r in range(4)}
    assert stats_reply(h, 0, request, snapshot([1000, 3000]), step=5) == []
    assert stats_reply(h, 1, request, snapshot([4000, 3000], persistent=256), step=5) == []
    assert stats_reply(h, 2, request, snapshot([0, 0])) == []
    reply = only_reply(stats_reply(h, 3, request, snapshot([512, 0], locked=True)))
    assert reply.id == 21
    result = reply.result
    assert result["complete"] is True and result["missing"] == []
    by_rank = {r["rank"]: r for r in table_rows(result["ranks"])}
    assert by_rank[0]["total_bytes"] == 4000 and by_rank[0]["step"] == 5
    assert by_rank[1]["total_bytes"] == 7256 and by_rank[1]["capacity_bytes"] == 7000
    slots = rank_columns(result)
    assert slots[1]["capacity_bytes"] == [4000, 3000]
    assert slots[1]["persistent"] == {"slot": [0], "key": ["k"], "kind": ["tensor"], "nbytes": [256]}
    assert result["persistent"]["rank"] == [1]  # every rank's persistent buffers, one table
    assert result["total_bytes"] == 4000 + 7256 + 0 + 512
    g0, g1 = table_rows(result["groups"])
    assert (g0["tp_group"], g0["ranks"], g0["reporting"]) == (0, [0, 1], [0, 1])
    assert (g0["total_bytes"], g0["rank_bytes_min"], g0["rank_bytes_max"], g0["skew_bytes"]) == (
        11256, 4000, 7256, 3256)
    summaries = group_columns(result)
    s = summaries[0]
    assert result["group_slots"]["tp_group"] == [0, 0, 1, 1]  # every group's rows, one table
    assert (s["ubatch"], s["lane"]) == ([0, 1], [0, 0])
    assert [row["ranks"] for row in group_slots(result, 0)] == [[0, 1], [0, 1]]
    assert (s["capacity_min"], s["capacity_max"], s["capacity_total"], s["skew_bytes"]) == (
        [1000, 3000], [4000, 3000], [5000, 6000], [3000, 0])
    assert s["requests"] == [2, 2] and s["peak_requested_max"] == [4000, 3000]
    assert summaries[1]["capacity_max"] == [512, 0] and summaries[1]["skew_bytes"] == [512, 0]
    assert g0["locked_consistent"] is True and g1["locked_consistent"] is False
    assert g1["skew_bytes"] == 512


def test_stats_group_with_ranks_disagreeing_on_slots(h):
    """Ranks of a group mid-reconfiguration hold different slots: the group's
    per-slot summary matches slots by (ubatch, lane) and names who has each,
    instead of pairing the columns by position (which would fold rank 0's
    third slot into nothing, or misalign them)."""
    h.register_all([0, 1])
    request, _ = stats_round(h, {"group": 0})
    stats_reply(h, 0, request, snapshot([100, 200, 300]))
    result = only_reply(stats_reply(h, 1, request, snapshot([50, 400]))).result
    [g0] = table_rows(result["groups"])
    s = group_columns(result)[0]
    assert s["ubatch"] == [0, 1, 2] and [row["ranks"] for row in group_slots(result, 0)] == [[0, 1], [0, 1], [0]]
    assert (s["capacity_min"], s["capacity_max"], s["skew_bytes"]) == ([50, 200, 300], [100, 400, 300], [50, 200, 0])
    assert g0["num_ubatches_consistent"] is False


def test_stats_missing_ranks_and_timeout_partial(h):
    """A silent rank yields a partial answer naming it at the stats timeout, never a hang."""
    h.register_all([0, 1, 2])
    request, asked = stats_round(h)
    assert asked == {peer_of(0), peer_of(1), peer_of(2)}
    stats_reply(h, 0, request, snapshot([64]))
    stats_reply(h, 1, request, snapshot([64]))
    assert replies(h.advance(1.9)) == []
    result = only_reply(h.advance(0.2)).result
    assert result["complete"] is False
    assert result["missing"] == [{"rank": 2, "reason": "no reply within the stats timeout"},
                                 {"rank": 3, "reason": "never registered"}]
    assert result["ranks"]["rank"] == [0, 1]
    assert result["groups"]["reporting"][1] == [] and result["groups"]["total_bytes"][1] == 0


def test_stats_for_one_group_and_lost_rank(h):
    h.register_all()
    request, asked = stats_round(h, {"group": 1, "timeout": 30.0})
    assert asked == {peer_of(2), peer_of(3)}
    stats_reply(h, 2, request, snapshot([8]))
    h.advance(3)
    for rank in (0, 1, 2):
        h.heartbeat(rank)
    result = only_reply(h.advance(2.5)).result  # rank 3 lost while asked
    assert result["ranks"]["rank"] == [2]
    assert result["missing"] == [{"rank": 3, "reason": "lost while asked"}]
    assert result["groups"]["tp_group"] == [1]


def test_stats_reply_from_a_rank_not_asked_is_ignored(h):
    h.register_all()
    request, _ = stats_round(h, {"group": 0})
    assert stats_reply(h, 2, request, snapshot([1])) == []
    stats_reply(h, 0, request, snapshot([1]))
    result = only_reply(stats_reply(h, 1, request, snapshot([1]))).result
    assert result["ranks"]["rank"] == [0, 1]


def _without_slots(stats):
    del stats["slots"]


def _slots_as_rows(stats):  # the old row form, one map per slot
    stats["slots"] = [{"ubatch": 0, "lane": 0, "capacity_bytes": 128}]


def _column_not_a_list(stats):
    stats["slots"]["capacity_bytes"] = 128


def _text_capacity(stats):
    stats["slots"]["capacity_bytes"][0] = "128"


def _text_ubatch(stats):  # sorting slots of several ranks would compare str with int
    stats["slots"]["ubatch"][0] = "0"


def _without_requests(stats):
    del stats["slots"]["requests"]


def _ragged_columns(stats):  # rows would silently be cut to the shortest column
    stats["slots"]["resizes"].append(1)


def _boolean_violations(stats):  # True is an int in Python, never a count
    stats["slots"]["lock_violations"][0] = True


def _violation_of_no_slot(stats):  # a client expanding the rows would index past the end
    stats["slots"]["last_violation"] = {"slot": [5], "caller": ["f.py:1:g"], "requested": [2],
                                        "capacity": [1], "time": [1.0]}


def _persistent_key_not_text(stats):
    stats["slots"]["persistent"] = {"slot": [0], "key": [7], "kind": ["tensor"], "nbytes": [1]}


def _persistent_without_sizes(stats):
    stats["slots"]["persistent"] = {"slot": [0], "key": ["k"], "kind": ["tensor"]}


@pytest.mark.parametrize(("spoil", "named"), [
    (_without_slots, "slots: missing"),
    (_slots_as_rows, "slots: expected map, got list"),
    (_column_not_a_list, "slots.capacity_bytes: expected list, got int"),
    (_text_capacity, "slots.capacity_bytes[0]: expected int, got str"),
    (_text_ubatch, "slots.ubatch[0]"),
    (_without_requests, "slots.requests: missing"),
    (_ragged_columns, "slots.resizes: 2 entries, expected 1"),
    (_boolean_violations, "slots.lock_violations[0]: expected int, got bool"),
    (_violation_of_no_slot, "slots.last_violation.slot[0]: slot index 5 out of range"),
    (_persistent_key_not_text, "slots.persistent.key[0]: expected str, got int"),
    (_persistent_without_sizes, "slots.persistent.nbytes: missing"),
], ids=["no-slots", "slots-as-rows", "column-not-a-list", "text-capacity", "text-ubatch", "column-missing",
        "ragged", "bool-count", "violation-of-no-slot", "persistent-key", "persistent-column-missing"])
def test_invalid_stats_snapshot_does_not_break_the_round(h, spoil, named):
    """A snapshot the aggregator cannot read (a buggy or newer agent) must not
    lose the client its answer (it used to raise inside the aggregation, after
    the request was dropped) nor stop the core: the rank is missing with why."""
    h.register_all([0, 1])
    request, _ = stats_round(h)
    stats_reply(h, 0, request, snapshot([128]))
    bad_stats = snapshot([128])
    spoil(bad_stats)
    result = only_reply(stats_reply(h, 1, request, bad_stats)).result
    assert result["ranks"]["rank"] == [0]
    [bad] = [m for m in result["missing"] if m["rank"] == 1]
    assert "invalid stats snapshot" in bad["reason"] and named in bad["reason"]
    assert h.core.dropped_bad_agent_frames == 1
    assert h.ok(Op.PING)["seq"] == 0


# Values that no column of a snapshot ever accepts, per the column's kind.
_NEVER = {
    int: [None, "7", 1.5, True, [], {}, b"7"],
    str: [None, 7, 1.5, False, [], {}, b"k"],
    float: [None, "1.0", True, [], {}],
}
_SLOT_KINDS = {**{f"slots.{c}": int for c in SLOT_KEY}, **{f"slots.{n.name}": n.kind for n in SLOT_NUMBERS},
               **{f"slots.last_violation.{c}": k
                  for c, k in zip(SPARSE["last_violation"].columns, (int, str, int, int, float))},
               **{f"slots.persistent.{c}": k for c, k in zip(SPARSE["persistent"].columns, (int, str, str, int))},
               **{f"slots.retained.{c}": k for c, k in zip(SPARSE["retained"].columns, (int, str, int))}}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_wrong_entry_in_any_snapshot_column_is_named(tmp_path_factory, data):
    """The fast check of the columnar snapshot looks at whole columns at once;
    whatever entry of whichever column is wrong, the rank must be reported
    missing with the column named (not let through to the clients, whose row
    expansion would fail or print junk), and the other rank's answer kept."""
    h = make(tmp_path_factory.mktemp("core"))
    h.register_all([0, 1])
    where = data.draw(st.sampled_from(sorted(_SLOT_KINDS)), "column")
    bad_value = data.draw(st.sampled_from(_NEVER[_SLOT_KINDS[where]]), "value")
    stats = ManagerStats("cpu", 3, 1, False, tuple(
        SlotStats.of(i, capacity_bytes=64 * i, peak_requested_bytes=64 * i, requests=i, resizes=1, lock_violations=1,
                     last_violation=LockViolation("m.py:1:f", 128, 64 * i, 2.5),
                     persistent=(PersistentStats("k", "tensor", 8),), retained=RetainedStats("kv", 16 * i))
        for i in range(3))).to_wire()
    *path, name = where.split(".")[1:]
    column = stats["slots"][path[0]][name] if path else stats["slots"][name]
    column[data.draw(st.integers(0, len(column) - 1), "entry")] = bad_value
    request, _ = stats_round(h, {"group": 0})
    stats_reply(h, 0, request, snapshot([128]))
    result = only_reply(stats_reply(h, 1, request, stats)).result
    assert result["ranks"]["rank"] == [0]
    [bad] = [m for m in result["missing"] if m["rank"] == 1]
    assert f"{where}[" in bad["reason"], bad["reason"]


def test_invalid_stats_snapshot_at_the_timeout(h):
    """The same through tick(): an exception there would stop the server loop."""
    h.register_all([0, 1, 2])
    request, _ = stats_round(h)
    stats_reply(h, 0, request, snapshot([128]))
    bad_stats = snapshot([128])
    _text_ubatch(bad_stats)
    assert stats_reply(h, 1, request, bad_stats) == []
    result = only_reply(h.advance(2.1)).result
    assert result["ranks"]["rank"] == [0]
    assert [m["rank"] for m in result["missing"]] == [1, 2, 3]


def test_stats_with_no_live_rank_replies_at_once(h):
    result = only_reply(h.client(Op.STATS)).result
    assert table_rows(result["ranks"]) == [] and [m["rank"] for m in result["missing"]] == [0, 1, 2, 3]


# -- events, status, ranks, ping -------------------------------------------


def test_events_cursor(h):
    h.register_all()
    all_events = h.ok(Op.EVENTS)["events"]
    assert [e["kind"] for e in all_events] == ["started"] + ["joined"] * 4
    ids = [e["id"] for e in all_events]
    assert ids == sorted(ids) and len(set(ids)) == 5
    first = h.ok(Op.EVENTS, {"limit": 2})
    assert [e["id"] for e in first["events"]] == ids[:2] and first["cursor"] == ids[1]
    rest = h.ok(Op.EVENTS, {"cursor": first["cursor"]})
    assert [e["id"] for e in rest["events"]] == ids[2:] and rest["cursor"] == ids[-1]
    idle = h.ok(Op.EVENTS, {"cursor": rest["cursor"]})
    assert idle == {"events": [], "cursor": rest["cursor"], "epoch": h.core.epoch}
    h.client(Op.LOCK, {"wait": False})
    new = h.ok(Op.EVENTS, {"cursor": rest["cursor"]})
    assert [e["kind"] for e in new["events"]] == ["command"] and new["events"][0]["seq"] == 1


def test_status(h):
    h.register_all([0, 1, 2])
    h.client(Op.SET_UBATCHES, {"n": 4, "group": 0, "wait": False})
    h.client(Op.LOCK)
    for rank in (0, 1):
        h.heartbeat(rank, seq=2, state={"locked": True, "num_ubatches": 4})
    h.heartbeat(2, seq=1, state={"locked": False, "num_ubatches": 2})
    status = h.ok(Op.STATUS)
    assert status["seq"] == 2 and status["epoch"] == h.core.epoch and status["recovered"] is False
    assert (status["world_size"], status["tp_size"]) == (4, 2)
    assert status["ranks"] == {"live": 3, "stalled": 0, "lost": 0, "stopped": 0, "missing": 1}
    assert status["desired"]["locked"] is True and status["desired"]["num_ubatches"] is None
    assert status["pending_commands"] == [1, 2]  # unacknowledged, waited for or not
    g0, g1 = status["groups"]
    assert g0["desired"] == {"locked": True, "num_ubatches": 4, "reserve_bytes": None}
    assert g0["live"] == [0, 1] and g0["applied_seq"] == [2] and g0["locked"] == [True]
    assert g1["live"] == [2] and g1["missing"] == [{"rank": 3, "reason": "never registered"}]
    assert g1["num_ubatches"] == [2]


def test_group_inconsistency_event(h):
    """Ranks of a group that settled on the same seq but disagree on lock state are flagged,
    once the disagreement has held a heartbeat interval (and cleared likewise)."""
    h.register_all([0, 1])
    h.heartbeat(0, seq=0, state={"locked": True, "num_ubatches": 2})
    h.heartbeat(1, seq=0, state={"locked": False, "num_ubatches": 2})
    assert h.events("group_inconsistent") == []  # not for long enough yet
    h.mono.now += h.config.heartbeat_interval
    h.heartbeat(1, seq=0, state={"locked": False, "num_ubatches": 2})
    [event] = h.events("group_inconsistent")
    assert event["tp_group"] == 0 and set(event["ranks"]) == {"0", "1"}
    assert h.ok(Op.STATUS)["groups"][0]["consistent"] is False
    h.heartbeat(1, seq=0, state={"locked": True, "num_ubatches": 2})
    h.mono.now += h.config.heartbeat_interval
    h.heartbeat(0, seq=0, state={"locked": True, "num_ubatches": 2})
    assert len(h.events("group_consistent")) == 1 and h.ok(Op.STATUS)["groups"][0]["consistent"] is True


def test_a_rank_flipping_its_report_at_every_heartbeat_flips_no_group_flag(h):
    """A rank reporting locked and unlocked in turn once made a flip event at each heartbeat,
    within its source's budget only; a flip now counts once it has held an interval."""
    h.register_all([0, 1])
    for i in range(100):
        h.mono.now += h.config.heartbeat_interval / 2
        h.heartbeat(0, seq=0, state={"locked": bool(i % 2), "num_ubatches": 2})
        h.heartbeat(1, seq=0, state={"locked": False, "num_ubatches": 2})
    kinds = {e["kind"] for e in h.events()}
    assert not kinds & {"group_inconsistent", "group_consistent"}
    assert h.ok(Op.STATUS)["groups"][0]["consistent"] is True


def test_malformed_manager_state_does_not_break_status(h):
    """status sorts and compares what agents report; an unhashable value used to
    make every status call an INTERNAL error while that rank was live."""
    h.register_all([0, 1])
    h.register(2, state={"locked": {"x": 1}, "num_ubatches": True})
    h.heartbeat(0, state={"locked": [1], "num_ubatches": "2"})
    h.heartbeat(1, state={"locked": True, "num_ubatches": 3})
    status = h.ok(Op.STATUS)
    assert status["groups"][0]["locked"] == [None, True] and status["groups"][0]["num_ubatches"] == [3, None]
    assert status["groups"][1]["locked"] == [None]
    ranks = {r["rank"]: r for r in h.ok(Op.RANKS)["ranks"]}
    assert (ranks[0]["locked"], ranks[0]["num_ubatches"]) == (None, None)
    assert (ranks[1]["locked"], ranks[1]["num_ubatches"]) == (True, 3)


def test_the_manager_state_agents_report_is_the_one_declared_and_read_through_it(h):
    """``wsd.rankrow.ManagerState`` is the one declaration of what an agent reports of its
    manager: fails if an agent reports a key it lacks (or misses one), if the coordinator
    keeps a key of its own, or if a rank's row, a TP group in ``status`` or an engine in
    ``engines`` shows the agreed keys from a list of their own."""
    import dataclasses
    import importlib.util
    import threading
    import time
    import typing

    from wsd.agent.simulated import SimulatedManager
    from wsd.rankrow import AGREED, ManagerState, RankRow, read_manager_state

    declared = typing.get_type_hints(ManagerState)
    reported = [SimulatedManager(num_ubatches=2).state()]
    if importlib.util.find_spec("torch") is not None:
        from wsd import WorkspaceManager
        from wsd.agent.stacks import StepClock
        from wsd.agent.thread import _ManagerTarget

        target = _ManagerTarget(WorkspaceManager("cpu", 2), threading.Event(), StepClock(time.monotonic))
        reported.append(target.state())
    for state in reported:
        assert set(state) <= set(declared) and set(AGREED) <= set(state), state
        assert read_manager_state(state) == state  # every key it sends, of the declared type
    assert read_manager_state({"locked": True, "num_ubatches": 2, "warming": False, "other": 1}) == {
        "locked": True, "num_ubatches": 2, "warming": False}
    assert set(declared) <= {f.name for f in dataclasses.fields(RankRow)}
    h.register_all([0, 1])
    h.heartbeat(0, state={"locked": True, "num_ubatches": 3})
    h.heartbeat(1, state={"locked": True, "num_ubatches": 3})
    [group] = [g for g in h.ok(Op.STATUS)["groups"] if g["tp_group"] == 0]
    assert {key: group[key] for key in AGREED} == {"locked": [True], "num_ubatches": [3]}
    [engine] = h.ok(Op.ENGINES)["engines"]
    assert {key: engine[key] for key in AGREED} == {"locked": True, "num_ubatches": 3}


def test_ranks_and_ping(h):
    h.register_all([1])
    result = h.ok(Op.RANKS)
    assert [(r["rank"], r["state"], r["tp_group"], r["pid"]) for r in result["ranks"]] == [(1, "live", 0, 1001)]
    assert [m["rank"] for m in result["missing"]] == [0, 2, 3]
    assert h.ok(Op.PING) == {"epoch": h.core.epoch, "time": WALL0, "seq": 0, "engines": {"default": 0}}


def test_a_ranks_row_is_the_declared_row_field_for_field(h):
    """Fails if the registry builds a row of its own beside ``wsd.rankrow.RankRow`` (a key added
    there alone would reach neither the client's ``RankEntry`` nor docs/wsctl.md)."""
    from dataclasses import fields

    from wsd.rankrow import RankRow

    h.register_all([0])
    [row] = h.ok(Op.RANKS)["ranks"]
    assert list(row) == [f.name for f in fields(RankRow)]
    assert row["engine"] == "default" and row["state"] == "live"


def test_lock_violation_event_from_agent(h):
    h.register_all([0])
    detail = {"slot": 1, "caller": "moe.py:12:fwd", "requested": 2048, "capacity": 1024, "kind": "spoof"}
    assert h.agent(peer_of(0), Op.EVENT, {"rank": 0, "kind": "lock_violation", "detail": detail}) == []
    [event] = h.events("lock_violation")
    assert (event["rank"], event["tp_group"], event["caller"], event["requested"], event["capacity"]) == (
        0, 0, "moe.py:12:fwd", 2048, 1024)
    assert event["kind"] == "lock_violation"  # the agent's detail cannot overwrite the event's own keys


def test_agent_event_detail_cannot_clash_with_the_events_own_keys(h):
    """A detail naming rank or tp_group used to raise inside the handler and the event was lost."""
    h.register_all([3])
    detail = {"rank": 0, "tp_group": 0, "agent_kind": "x", "time": 1.0, "note": "kept"}
    h.agent(peer_of(3), Op.EVENT, {"rank": 3, "kind": "custom", "detail": detail})
    [event] = h.events("agent_event")
    assert (event["rank"], event["tp_group"], event["agent_kind"], event["time"]) == (3, 1, "custom", WALL0)
    assert event["note"] == "kept"


# -- restart -----------------------------------------------------------------


def issue_three(h: Harness) -> None:
    h.client(Op.LOCK, {"wait": False})
    h.client(Op.SET_UBATCHES, {"n": 4, "group": 1, "wait": False})
    h.client(Op.UNLOCK, {"group": 0, "wait": False})


def test_restart_restores_seq_and_desired_state(tmp_path):
    first = make(tmp_path)
    first.register_all()
    issue_three(first)
    second = make(tmp_path)
    assert second.core.recovered is True and second.core.engine().log.seq == 3
    assert second.core.engine().log.default == first.core.engine().log.default
    assert second.core.engine().log.desired(0) == {"locked": False, "num_ubatches": None, "reserve_bytes": None}
    assert second.core.engine().log.desired(1) == {"locked": True, "num_ubatches": 4, "reserve_bytes": None}
    assert second.core.epoch != first.core.epoch
    assert second.ok(Op.STATUS)["recovered"] is True
    assert second.events("started")[0]["recovered"] is True
    # numbering continues: no seq is reused
    second.register_all()
    assert to_agents(second.client(Op.TRIM, {"group": 0, "wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 4


def test_reregistering_agent_gets_exactly_the_commands_it_missed(tmp_path):
    first = make(tmp_path)
    issue_three(first)
    second = make(tmp_path)
    sent = second.register(2, applied_seq=1)
    assert to_agents(sent, Op.REGISTERED)[peer_of(2)]["baseline_seq"] == 1
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [2, 3]
    assert ops(sent) == [Op.REGISTERED, Op.COMMAND, Op.COMMAND]  # registered first, then in order
    caught_up = second.register(3, applied_seq=3)
    assert ops(caught_up) == [Op.REGISTERED]


def test_agent_ahead_of_the_log_is_refused_until_the_operator_resumes(tmp_path):
    """If the state file was lost, agents' applied seqs must not be handed out again; but
    no peer's claim moves the coordinator's numbering (one register claiming seq 1,000
    ahead used to wedge the cluster for good): the operator says where to resume."""
    first = make(tmp_path)
    issue_three(first)
    for name in ("coordinator.state", "coordinator.state.journal"):  # snapshot and journal
        (tmp_path / name).unlink()
    second = make(tmp_path)
    assert second.core.engine().log.seq == 0 and second.core.recovered is False
    rejected = to_agents(second.register(0, applied_seq=3), Op.REJECTED)[peer_of(0)]
    assert rejected["code"] == "mismatch"
    assert "applied_seq 3" in rejected["message"] and "resume_seq = 3" in rejected["message"]
    assert second.core.engine().log.seq == 0 and second.core.engine().registry.live() == []
    assert second.events("rejected")[-1]["reason"] == rejected["message"]
    assert CommandLog(second.config.state_file, 10).load() is False  # nothing persisted
    # the documented recovery: restart with resume_seq
    third = make(tmp_path, resume_seq=3)
    assert third.core.engine().log.seq == 3 and [e["seq"] for e in third.events("resumed")] == [3]
    assert ops(third.register(0, applied_seq=3)) == [Op.REGISTERED]
    assert to_agents(third.client(Op.LOCK, {"wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 4
    fresh = CommandLog(third.config.state_file, 10)
    assert fresh.load() and fresh.seq == 4
    assert make(tmp_path, resume_seq=3).core.engine().log.seq == 4  # left in the file: no effect once past


def test_fresh_agent_joining_a_live_group_gets_the_baseline(h):
    """A fresh process must replay what its live TP peer applied since the group's
    start, or the two would run with different workspace state."""
    h.register(0)  # fresh, at seq 0: group 0's baseline is 0
    issue_three(h)
    sent = h.register(1)  # fresh, while rank 0 is live
    assert to_agents(sent, Op.REGISTERED)[peer_of(1)]["baseline_seq"] == 0
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [1, 2, 3]
    # a fresh agent of a group with no live member starts from the current seq
    sent = h.register(2)
    assert to_agents(sent, Op.REGISTERED)[peer_of(2)]["baseline_seq"] == 3
    assert ops(sent) == [Op.REGISTERED]


def desired_sent(sent: list[Sent], rank: int, generation: int = 0) -> Any:
    return to_agents(sent, Op.REGISTERED)[peer_of(rank, generation)]["desired"]


def test_fresh_process_is_sent_its_groups_desired_state(h):
    """Without it a restarted process comes up unlocked with its configured slot
    count while its group is meant to be locked with 3 ubatches: the desired state
    outlives the processes, and the coordinator's restarts."""
    h.register_all([0, 1])
    h.client(Op.SET_UBATCHES, {"n": 3, "wait": False})
    h.client(Op.LOCK, {"group": 0, "wait": False})
    h.advance(6.0)  # both lost: the group's baseline is forgotten
    sent = h.register(1, peer=peer_of(1, 1))
    assert to_agents(sent, Op.REGISTERED)[peer_of(1, 1)]["baseline_seq"] == 2
    assert desired_sent(sent, 1, 1) == {"locked": True, "num_ubatches": 3, "reserve_bytes": None}
    assert ops(sent) == [Op.REGISTERED]  # the desired state stands for seqs 1 and 2


def test_desired_state_is_the_one_at_an_older_baseline(h):
    """A fresh member joining a live peer's older baseline replays the commands after
    it: the desired state it starts from must be the one *at* the baseline, or the
    replayed unlock would be undone by a current 'locked' (or a reserve doubled)."""
    h.client(Op.SET_UBATCHES, {"n": 3, "wait": False})  # seq 1, before anyone registered
    h.register(0)  # fresh: group 0's baseline is seq 1, with 3 ubatches
    h.client(Op.LOCK, {"group": 0, "wait": False})  # seq 2
    h.client(Op.SET_UBATCHES, {"group": 0, "n": 5, "wait": False})  # seq 3
    h.client(Op.UNLOCK, {"group": 0, "wait": False})  # seq 4
    h.client(Op.RESERVE, {"group": 0, "bytes": 4096, "wait": False})  # seq 5
    h.client(Op.LOCK, {"group": 0, "wait": False})  # seq 6
    assert h.core.engine().log.desired(0) == {"locked": True, "num_ubatches": 5, "reserve_bytes": 4096}
    sent = h.register(1)  # fresh, while rank 0 is live
    assert to_agents(sent, Op.REGISTERED)[peer_of(1)]["baseline_seq"] == 1
    assert desired_sent(sent, 1) == {"locked": None, "num_ubatches": 3, "reserve_bytes": None}
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [2, 3, 4, 5, 6]


def test_desired_state_at_a_re_registered_baseline_is_rebuilt_from_the_log(tmp_path):
    """After a coordinator restart a surviving peer sets the group's baseline at what
    it applied, behind the log: a fresh member joining it must get the state at that
    seq (rebuilt from the kept commands), not the current one."""
    first = make(tmp_path)
    first.register_all([0, 1])
    first.client(Op.SET_UBATCHES, {"n": 3, "wait": False})  # seq 1
    first.client(Op.LOCK, {"wait": False})  # seq 2
    first.client(Op.SET_UBATCHES, {"n": 4, "wait": False})  # seq 3
    second = make(tmp_path)
    second.register(0, applied_seq=1)  # applied seq 1, not yet 2 and 3
    sent = second.register(1, peer=peer_of(1, 1))  # a replacement of rank 1
    assert to_agents(sent, Op.REGISTERED)[peer_of(1, 1)]["baseline_seq"] == 1
    assert desired_sent(sent, 1, 1) == {"locked": None, "num_ubatches": 3, "reserve_bytes": None}
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [2, 3]


def test_desired_state_not_sent_to_a_process_that_re_registers(tmp_path):
    """A process that already has its state (it re-registers after a coordinator
    restart) must not be sent the desired state again: it would apply it twice."""
    first = make(tmp_path)
    first.register_all([0, 1])
    first.client(Op.LOCK, {"wait": False})
    second = make(tmp_path)
    sent = second.register(0, applied_seq=1)
    assert desired_sent(sent, 0) is None and ops(sent) == [Op.REGISTERED]


def test_resent_acks_in_registration_complete_a_pending_command(h):
    """Acks sent while the coordinator could not hear them arrive with the next registration."""
    h.register_all([0, 1])
    h.client(Op.LOCK, {"group": 0}, request_id=31)
    h.ack(0, 1, step=6)
    sent = h.register(1, peer=peer_of(1, 1), applied_seq=1, acks=[[1, 6, True, None], "junk", [9, 1]])
    reply = only_reply(sent)
    assert reply.id == 31 and {a["rank"]: a["step"] for a in reply.result["acked"]} == {0: 6, 1: 6}
    assert reply.result["same_step"] == {"0": True}
    assert ops(sent) == [Op.REGISTERED]  # applied_seq=1: nothing to replay


def test_malformed_resent_acks_are_ignored(h):
    """Resent acks are checked like ACK messages: a step that is not an integer
    used to be recorded and then break the command's reply."""
    h.register_all([0, 1])
    h.client(Op.LOCK, {"group": 0}, request_id=32)
    h.ack(0, 1, step=6)
    bad = [[1, [6], True, None], [1, 6, "yes", None], [1, True, True, None], [1, -1, True, None]]
    sent = h.register(1, peer=peer_of(1, 1), applied_seq=1, acks=bad)
    assert replies(sent) == [] and ops(sent) == [Op.REGISTERED]
    reply = only_reply(h.agent(peer_of(1, 1), Op.ACK, {"rank": 1, "seq": 1, "step": 7, "ok": True}))
    assert {a["rank"]: a["step"] for a in reply.result["acked"]} == {0: 6, 1: 7}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "wrong_format", "wrong_shape"])
def test_damaged_state_file_refuses_to_start(tmp_path, damage):
    """Never silently start afresh and reuse sequence numbers."""
    first = make(tmp_path)
    issue_three(first)
    path = tmp_path / "coordinator.state"
    data = path.read_bytes()
    damaged = {
        "garbage": b"\xc1not msgpack at all",
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "wrong_format": msgpack.packb({"format": 99, "seq": 3}),
        "wrong_shape": msgpack.packb({"format": 1, "seq": 3, "default": {}, "groups": [], "log": []}),
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(StateFileError, match=r"coordinator.state"):
        make(tmp_path)
    assert path.read_bytes() == damaged  # left for the operator to repair


def test_torn_last_journal_record_is_dropped_and_reported(tmp_path):
    """A crash mid-append leaves part of a record that was never sent: the coordinator
    must start from the commands before it and say so in an event, not refuse to start
    (nor replay half a command). The journal's header counts a record only once it is
    on disk, so the crash leaves the header of two commands and part of the third."""
    first = make(tmp_path)
    journal = tmp_path / "coordinator.state.journal"
    first.client(Op.LOCK, {"wait": False})
    first.client(Op.SET_UBATCHES, {"n": 4, "group": 1, "wait": False})
    two = journal.read_bytes()
    first.client(Op.UNLOCK, {"group": 0, "wait": False})
    journal.write_bytes(two + journal.read_bytes()[len(two):-3])  # the third record cut short, never counted
    second = make(tmp_path)
    assert second.core.recovered is True and second.core.engine().log.seq == 2
    assert second.core.engine().log.desired(0)["locked"] is True  # the unlock of group 0 was torn
    (repaired,) = second.events("state_repaired")
    assert "coordinator.state.journal" in repaired["detail"] and "never sent" in repaired["detail"]
    assert make(tmp_path).events("state_repaired") == []  # repaired once, for good


# -- bad input -------------------------------------------------------------


@pytest.mark.parametrize("frame", [
    b"\xc1\xc1",
    msgpack.packb([1, 2]),
    p.encode(Op.LOCK),                                         # a client op on the agent socket
    p.encode(Op.HEARTBEAT, {"rank": -1, "step": 0, "applied_seq": 0, "held_seq": 0}),
    p.encode(Op.REGISTER, {"rank": 0}),
], ids=["not-msgpack", "not-a-map", "client-op", "negative-rank", "missing-fields"])
def test_garbage_agent_frames_rejected_and_counted(h, frame):
    h.register_all([0])
    out = decode_all(h.core.handle_agent((peer_of(0),), frame))
    [rejected] = to_agents(out, Op.REJECTED).values()
    assert rejected["code"] in {str(c) for c in ErrorCode} and rejected["message"]
    assert h.core.dropped_bad_agent_frames == 1
    assert h.core.engine().registry.ranks[0].state is RankState.LIVE


def test_oversized_client_frame(tmp_path):
    h = make(tmp_path, max_message_bytes=1024)
    frame = p.encode(Op.PING, {}, 3)
    assert only_reply(decode_all(h.core.handle_client(CLIENT_ROUTE, frame))).ok
    big = msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 4, "body": {"pad": "x" * 2000}})
    reply = only_reply(decode_all(h.core.handle_client(CLIENT_ROUTE, big)))
    assert reply.code is ErrorCode.TOO_LARGE and "max_message_bytes=1024" in reply.message


def test_bad_client_frames_get_error_replies(h):
    out = decode_all(h.core.handle_client(CLIENT_ROUTE, b"\x00\x01garbage"))
    assert only_reply(out).code is ErrorCode.BAD_MESSAGE
    out = decode_all(h.core.handle_client(CLIENT_ROUTE, p.encode(Op.HEARTBEAT, {}, 4)))
    reply = only_reply(out)
    assert reply.code is ErrorCode.UNKNOWN_OP and reply.id == 4
    reply = h.call(Op.SET_UBATCHES, {"n": 0}, request_id=6)
    assert reply.code is ErrorCode.BAD_FIELD and reply.id == 6 and "set_ubatches.n" in reply.message


def test_handler_exception_becomes_internal_error_and_core_keeps_serving(h, monkeypatch):
    def broken(route, message):
        raise RuntimeError("boom")
    monkeypatch.setitem(h.core._client_ops, Op.STATUS, broken)
    reply = h.call(Op.STATUS, request_id=44)
    assert not reply.ok and reply.code is ErrorCode.INTERNAL and reply.id == 44 and "boom" in reply.message
    assert h.ok(Op.PING)["seq"] == 0
    monkeypatch.setitem(h.core.engine().agent_ops, Op.HEARTBEAT, lambda peer, body: 1 / 0)
    h.register_all([0])
    assert h.heartbeat(0) == []
    assert h.ok(Op.RANKS)["ranks"][0]["state"] == "live"


# -- robustness ------------------------------------------------------------


def test_command_lost_in_transit_is_resent_after_a_heartbeat_interval(h):
    """Without the resend a dropped COMMAND frame would hold the rank's TP group back for ever."""
    h.register_all()
    h.call(Op.LOCK, {"wait": False})
    # At once, a heartbeat still lacking seq 1 gets nothing: the frame may be in flight.
    assert to_agents(h.heartbeat(0, seq=0), Op.COMMAND) == {}
    h.advance(1.0)
    resent = to_agents(h.heartbeat(0, seq=0), Op.COMMAND)
    assert resent == {peer_of(0): {"seq": 1, "action": "lock", "args": {}, "group": None, "mac": None}}
    # A rank that holds it is not sent it again.
    assert to_agents(h.heartbeat(1, seq=1), Op.COMMAND) == {}


def test_times_shown_to_operators_are_wall_clock(h):
    """``ranks`` and the reason a rank is missing give wall-clock times, not the monotonic clock."""
    h.register(0)
    h.advance(2)
    [rank] = h.ok(Op.RANKS)["ranks"]
    assert rank["registered_at"] == WALL0
    assert rank["last_seen"] == pytest.approx(WALL0)
    h.advance(6)
    [rank] = [r for r in h.ok(Op.RANKS)["ranks"] if r["rank"] == 0]
    assert rank["state"] == "lost" and rank["lost_at"] == pytest.approx(WALL0 + 8)
    reason = h.core.engine().registry.missing()[0]
    assert reason == "lost at 2023-11-14T22:13:28Z (last step 0)"


def test_events_reply_carries_the_epoch(h):
    """A follower tells a restarted coordinator (ids start again) by its epoch."""
    assert h.ok(Op.EVENTS)["epoch"] == h.core.epoch


# -- the state file: refused at start-up, storage unavailable while running -----


def test_state_file_in_a_missing_folder_stops_the_coordinator_at_start(tmp_path):
    """Found by attack: such a coordinator started fine and failed at the first command."""
    with pytest.raises(StateFileError, match=f"^{tmp_path / 'gone' / 'coordinator.state'}: the folder"):
        make(tmp_path, state_file=str(tmp_path / "gone" / "coordinator.state"))


@pytest.mark.parametrize("damage", ["cut at the last record", "deleted"])
def test_journal_missing_acknowledged_commands_stops_the_coordinator(tmp_path, damage):
    """Found by attack: a journal cut exactly between records, or deleted, started a
    coordinator that had forgotten acknowledged commands, without a word."""
    first = make(tmp_path)
    journal = tmp_path / "coordinator.state.journal"
    first.client(Op.LOCK, {"wait": False})
    two = journal.read_bytes()
    first.client(Op.UNLOCK, {"wait": False})
    if damage == "deleted":
        journal.unlink()
    else:
        journal.write_bytes(journal.read_bytes()[:len(two)])
    with pytest.raises(StateFileError, match=f"^{journal}: "):
        make(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /dev/full")
def test_full_disk_is_answered_storage_and_numbers_nothing(tmp_path):
    """Found by attack: a full disk was answered ``internal`` ("a bug in wsd"). The
    journal pointed at /dev/full (the kernel's own ENOSPC): the reply is ``storage``
    naming the file, nothing is sent or numbered, and the next command after that
    goes through."""
    h = make(tmp_path)
    h.register_all()
    assert to_agents(h.client(Op.LOCK, {"wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 1
    journal = tmp_path / "coordinator.state.journal"
    journal.unlink()
    journal.symlink_to("/dev/full")
    sent = h.client(Op.UNLOCK, {"wait": False})
    assert ops(sent) == []
    reply = only_reply(sent)
    assert not reply.ok and reply.code is ErrorCode.STORAGE
    assert reply.message.startswith(f"{journal}: storage unavailable (no space left on device)"), reply.message
    assert h.core.engine().log.seq == 1 and h.core.engine().log.default["locked"] is True
    # the next command writes a fresh snapshot and journal first (replacing the link)
    assert to_agents(h.client(Op.UNLOCK, {"wait": False}), Op.COMMAND)[peer_of(0)]["seq"] == 2
    assert make(tmp_path).core.engine().log.seq == 2


def test_a_bug_met_on_every_frame_is_answered_each_time_and_logged_at_a_bounded_rate(h, caplog):
    """Each bad push once logged two tracebacks, without a limit (24,200 tracebacks, 26 MiB in
    5 s). A failure while handling a frame stays that frame's: the client is answered every
    time, the loop goes on, and the traceback is logged a bounded number of times."""
    def broken(*_: Any) -> list[Any]:
        raise RuntimeError("a bug")

    h.register_all()
    h.core._client_ops[Op.PING] = broken
    h.core.engine().agent_ops[Op.HEARTBEAT] = broken
    caplog.set_level("ERROR", logger="wsd.coordinator.core")
    for i in range(500):
        reply = h.call(Op.PING, request_id=i + 1)
        assert not reply.ok and reply.code == ErrorCode.INTERNAL
        assert h.agent(peer_of(0), Op.HEARTBEAT, {"rank": 0, "step": i, "applied_seq": 0, "held_seq": 0}) == []
    logged = [r for r in caplog.records if r.exc_info]
    assert 2 <= len(logged) <= 100, len(logged)  # the event budget's burst, of 1,000 failures
    assert h.core.handle_client(CLIENT_ROUTE, p.encode(Op.STATUS, {}, 9999))  # still serving


def test_a_registration_cannot_set_an_absurd_world(tmp_path):
    """A worker with a wrong WORLD_SIZE (or a peer) set a world of 2**20 with the first
    registration, and every status then blocked the loop 14-17 s for a 185 MB answer. Without
    a configured world, a registration may set one of at most MAX_CLAIMED_WORLD ranks."""
    from wsd.coordinator.registry import MAX_CLAIMED_WORLD

    h = make(tmp_path, world_size=None, tp_size=None)
    sent = h.register(0, world_size=1 << 20, tp_size=1, tp_group=0)
    rejected = to_agents(sent, Op.REJECTED)[peer_of(0)]
    assert rejected["code"] == str(ErrorCode.MISMATCH) and "[coordinator] world_size" in rejected["message"]
    assert h.core.engine().registry.world_size is None
    assert ops(h.register(0, world_size=MAX_CLAIMED_WORLD, tp_size=1, tp_group=0))[0] is Op.REGISTERED
    assert h.core.engine().registry.world_size == MAX_CLAIMED_WORLD
    (tmp_path / "big").mkdir()
    configured = make(tmp_path / "big", world_size=1 << 16, tp_size=8)
    assert ops(configured.register(0, world_size=1 << 16, tp_size=8, tp_group=0))[0] is Op.REGISTERED


def test_an_agent_behind_resume_seq_starts_again_from_the_log_instead_of_waiting_for_ever(tmp_path):
    """The documented recovery from a lost state file (resume_seq = the highest applied_seq
    reported) left every agent behind that number waiting for commands that do not exist:
    no event, only a stuck seq. It is told to start again from the log's seq with the
    desired state, as a fresh process, and a `rebased` event says so."""
    first = make(tmp_path)
    issue_three(first)
    for name in ("coordinator.state", "coordinator.state.journal"):
        (tmp_path / name).unlink()
    second = make(tmp_path, resume_seq=3)
    second.ok(Op.LOCK, {"wait": False})  # seq 4: the desired state is locked
    sent = second.register(0, applied_seq=1)  # it had applied only seq 1 of the lost log
    registered = to_agents(sent, Op.REGISTERED)[peer_of(0)]
    assert registered["rebase"] is True and registered["baseline_seq"] == 4
    assert registered["desired"]["locked"] is True
    assert ops(sent) == [Op.REGISTERED]  # nothing to resend: it starts at the log's seq
    (event,) = second.events("rebased")
    assert (event["rank"], event["applied_seq"], event["baseline_seq"]) == (0, 1, 4)
    assert second.core.engine().registry.ranks[0].applied_seq == 4
    # an agent the log can bring up to date is sent what it lacks, as before
    sent = second.register(1, applied_seq=3)
    assert to_agents(sent, Op.REGISTERED)[peer_of(1)]["rebase"] is False
    assert [s.message.body["seq"] for s in sent if s.message.op is Op.COMMAND] == [4]


def test_an_agent_older_than_the_kept_log_starts_again_from_the_log(tmp_path):
    """The same when the commands it lacks are older than log_capacity: it once got a
    replay_gap event and waited for ever for the seqs that were gone."""
    h = make(tmp_path, log_capacity=2)
    issue_three(h)  # seqs 1..3; the log keeps 2 and 3
    sent = h.register(0, applied_seq=0, step=5)
    registered = to_agents(sent, Op.REGISTERED)[peer_of(0)]
    assert registered["rebase"] is True and registered["baseline_seq"] == 3
    assert [e["oldest_kept"] for e in h.events("rebased")] == [2]


def test_a_peer_flipping_fast_cannot_flood_the_event_log(h):
    """superseded, joined, back and stopped, and a group's consistency flips, once arrived at
    963-1,752 a second from one source and pushed the operator's command event out of the
    log within 15 s. Every kind a peer's doing makes is within its source's budget; the rest
    are counted in one suppressed event."""
    h.register_all()
    h.ok(Op.LOCK, {"wait": False})
    for i in range(300):  # rank 0 says goodbye and comes back, from one connection after another
        h.agent(peer_of(0, i), Op.GOODBYE, {"rank": 0, "step": i})
        h.register(0, peer=peer_of(0, i + 1), applied_seq=1)
        state = {"locked": bool(i % 2), "num_ubatches": 2}  # and flips its group's consistency
        h.agent(peer_of(0, i + 1), Op.HEARTBEAT, {"rank": 0, "step": i, "applied_seq": 1, "held_seq": 1,
                                                  "state": state})
        h.agent(peer_of(1), Op.HEARTBEAT, {"rank": 1, "step": i, "applied_seq": 1, "held_seq": 1,
                                           "state": {"locked": False, "num_ubatches": 2}})
    kinds = Counter(e["kind"] for e in h.ok(Op.EVENTS, {"limit": 10_000})["events"])
    peer_made = sum(kinds[k] for k in ("stopped", "back", "joined", "superseded",
                                      "group_inconsistent", "group_consistent"))
    assert peer_made <= 150, kinds  # of about 900 without a budget
    assert kinds["command"] == 1
    h.advance(1.0)
    (suppressed,) = h.events("suppressed")
    # counted, not lost without a word (the flips, faster than a heartbeat interval, make none)
    assert sum(suppressed["counts"].values()) >= 500 and "group_inconsistent" not in kinds


def test_a_command_event_says_who_issued_it(h):
    """The user and host a client says (the envelope's ``by``: a claim) and, apart, with CURVE,
    the role and key the transport proved: an operator reading the event log sees who locked
    what, and nothing a client sends can read as proven (a host claimed as ``ops-1(admin)``
    once rendered exactly like a CURVE-proven admin)."""
    from wsd_client.render import event_line

    h.register_all()
    h.core.handle_client(CLIENT_ROUTE, p.encode(Op.LOCK, {"wait": False}, 1, by={"user": "alice",
                                                                                  "host": "ops-1(admin)"}))
    h.core.handle_client(CLIENT_ROUTE, p.encode(Op.UNLOCK, {"wait": False}, 2, by={"user": "bob", "host": "ops-2"}),
                         role="admin", key="bob-laptop")
    h.core.handle_client(CLIENT_ROUTE, p.encode(Op.LOCK, {"wait": False}, 3))  # an older client: says nothing
    commands = [e for e in h.ok(Op.EVENTS)["events"] if e["kind"] == "command"]
    assert [(e["action"], e.get("by"), e.get("proven")) for e in commands] == [
        ("lock", {"user": "alice", "host": "ops-1(admin)"}, None),
        ("unlock", {"user": "bob", "host": "ops-2"}, {"role": "admin", "key": "bob-laptop"}),
        ("lock", None, None)]
    lines = [event_line(e) for e in commands]
    assert "by=alice@ops-1(admin) (claimed)" in lines[0] and "proven" not in lines[0]
    assert "by=bob@ops-2 (claimed)" in lines[1] and "proven=admin key bob-laptop" in lines[1]


def test_stats_and_ranks_read_the_same_step_for_a_snapshot_a_heartbeat_confirmed(h):
    """An operator once saw `stats` and `ranks` give the same rank different steps at the
    same moment: stats showed the step of the last push, ranks that of the last heartbeat.
    A heartbeat that finds the snapshot unchanged makes it current at its step, and both
    read that step."""
    h.register_all([0])
    h.agent(peer_of(0), Op.STATS_PUSH, {"rank": 0, "version": 1, "step": 3, "applied_seq": 0, "held_seq": 0,
                                        "state": {}, "stats": snapshot([128])})
    assert table_rows(h.ok(Op.STATS)["ranks"])[0]["step"] == 3
    h.agent(peer_of(0), Op.HEARTBEAT, {"rank": 0, "step": 9, "applied_seq": 0, "held_seq": 0, "state": {},
                                       "stats_version": 1})
    (rank,) = [r for r in h.ok(Op.RANKS)["ranks"] if r["rank"] == 0]
    assert rank["step"] == 9 and table_rows(h.ok(Op.STATS)["ranks"])[0]["step"] == 9
