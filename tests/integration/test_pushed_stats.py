"""Stats pushed, not gathered: what the agents push rebuilds their snapshots in the coordinator.

The I/O-free tier drives an agent's protocol logic (``AgentCore``) against
the coordinator's memory (``LatestStats``) and core directly, with a clock we
pass, through reconnections, lost pushes, lost acknowledgements and a
coordinator that forgot. The real tier runs a coordinator on random loopback
ports with simulated ranks on real sockets.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from conftest import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsd.agent.core import AgentCore
from wsd.agent.simulated import SimulatedRanks
from wsd.config import CoordinatorConfig
from wsd.coordinator.admission import FRAMES_PER_SECOND
from wsd.coordinator.core import CLIENT, CoordinatorCore
from wsd.coordinator.pushed import NO_SNAPSHOT, LatestStats
from wsd.slotstats import (
    SLOT_NUMBERS,
    LockViolation,
    ManagerStats,
    PersistentStats,
    SlotStats,
    apply_snapshot_delta,
    snapshot_delta,
)
from wsd.wire import protocol as p
from wsd.wire.protocol import Op
from wsd_client.client import Client
from wsd_client.results import Stats
from wsd_client.rows import ages, group_columns, group_slots, rank_columns, stats_rows, table_rows

INTERVAL = 1.0
TIMEOUT = 5.0


class Target:
    """A rank's manager as the protocol sees it, whose snapshot the test sets."""

    device = "cpu"

    def __init__(self, stats: ManagerStats) -> None:
        self.stats = stats

    def state(self) -> dict[str, Any]:
        return {"locked": self.stats.locked, "num_ubatches": self.stats.num_ubatches}

    def snapshot(self) -> dict[str, Any]:
        return self.stats.to_wire()

    def in_step(self) -> tuple[int, float] | None:
        return None

    def stacks(self) -> list[dict[str, Any]]:
        return []

    def apply(self, action: str, args: dict[str, Any]) -> None:
        raise AssertionError("no commands in these tests")


_small = st.integers(0, 1 << 20)
_violation = st.none() | st.builds(LockViolation, caller=st.sampled_from(["a.py:1:f", "b.py:9:g"]),
                                   requested=_small, capacity=_small, time=st.floats(0, 1e9))
_persistent = st.lists(st.builds(PersistentStats, key=st.sampled_from(["k", "moe"]),
                                 kind=st.sampled_from(["tensor", "resource"]), nbytes=_small), max_size=2)


@st.composite
def snapshots(draw: st.DrawFn) -> ManagerStats:
    ubatches = draw(st.integers(1, 4))
    slots = tuple(SlotStats.of(
        i, 0, **{n.name: draw(_small) for n in SLOT_NUMBERS}, last_violation=draw(_violation),
        persistent=tuple(draw(_persistent))) for i in range(ubatches))
    return ManagerStats("cpu", ubatches, 1, draw(st.booleans()), slots)


def one_slot(capacity: int = 64) -> ManagerStats:
    """A manager of one slot that served one request, as big as ``capacity``."""
    return ManagerStats("cpu", 1, 1, False, (SlotStats.of(capacity_bytes=capacity, peak_requested_bytes=capacity,
                                                         requests=1, resizes=1),))


def _roundtrip(frame: bytes) -> p.Message:
    return p.decode(frame)


class Pair:
    """One agent's link and the coordinator's memory, and the frames between them."""

    def __init__(self, stats: ManagerStats) -> None:
        self.now = 0.0
        self.target = Target(stats)
        self.link = AgentCore(self.target, rank=0, world_size=1, heartbeat_interval=INTERVAL,
                              heartbeat_timeout=TIMEOUT)
        self.latest = LatestStats()
        self.registered()

    def registered(self) -> None:
        """The agent registers (again): the coordinator forgets what it held of it."""
        self.latest.forget(0)
        self.link.on_frame(p.encode(Op.REGISTERED, {
            "epoch": "e", "baseline_seq": 0, "heartbeat_interval": INTERVAL, "heartbeat_timeout": TIMEOUT,
            "stats_interval": INTERVAL}), self.now)

    def step(self, *, lose_push: bool = False, lose_ack: bool = False) -> None:
        """Time passes to the agent's next look; its frames reach the coordinator (or not),
        and the coordinator's heartbeat reaches the agent."""
        self.now = max(self.now, self.link.due())
        self.link.on_frame(p.encode(Op.PULSE, {"epoch": "e"}), self.now)
        for frame in self.link.on_time(self.now):
            message = _roundtrip(frame)
            version = message.body.get("stats_version")
            if message.op is Op.HEARTBEAT and version is not None and not self.latest.confirm(0, version, self.now,
                                                                                                   message.body["step"]):
                self.link.on_frame(p.encode(Op.STATS_ACK, {"version": version, "ok": False}), self.now)
            if message.op is not Op.STATS_PUSH or lose_push:
                continue
            ok = self.latest.push(0, 0, message.body, self.now)
            if not lose_ack:
                self.link.on_frame(p.encode(Op.STATS_ACK, {"version": message.body["version"], "ok": ok}),
                                   self.now)

    def settle(self) -> None:
        """Enough quiet steps for whatever was lost to be pushed again."""
        for _ in range(int(TIMEOUT / INTERVAL) + 4):
            self.step()

    def held(self) -> ManagerStats:
        return ManagerStats.from_wire(self.latest.ranks[0].wire)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=snapshots(), changes=st.lists(st.tuples(
    snapshots(), st.sampled_from(["push", "lose push", "lose ack", "reconnect", "coordinator forgot"])),
    max_size=12))
def test_pushed_deltas_rebuild_exactly_the_snapshot_the_agent_holds(first, changes):
    """Whatever is lost on the way (a push, an acknowledgement, the agent's connection,
    the coordinator's memory), once the frames flow again the coordinator holds exactly
    the agent's snapshot, and while they flow it never holds one the agent did not."""
    pair = Pair(first)
    pair.settle()
    assert pair.held() == first
    seen = [first]
    for stats, what in changes:
        pair.target.stats = stats
        seen.append(stats)
        if what == "reconnect":
            pair.registered()
        elif what == "coordinator forgot":
            pair.latest = LatestStats()
        pair.step(lose_push=what == "lose push", lose_ack=what == "lose ack")
        if 0 in pair.latest.ranks:
            assert pair.held() in seen  # never a mix of two snapshots
        pair.settle()
        assert pair.held() == stats
        # What was checked and encoded again from deltas answers as a whole snapshot would.
        whole = LatestStats()
        whole.push(0, 0, {"base": None, "stats": stats.to_wire(), "step": pair.link.steps, "version": 1}, pair.now)
        assert (msgpack.unpackb(pair.latest.answer({0: [0]}, {}, pair.now, pair.now, 1e9, key=0, version=0))
                == msgpack.unpackb(whole.answer({0: [0]}, {}, pair.now, pair.now, 1e9, key=0, version=0)))


@settings(max_examples=200, deadline=None)
@given(old=snapshots(), new=snapshots())
def test_a_delta_applied_to_its_base_gives_the_new_snapshot(old, new):
    a, b = old.to_wire(), new.to_wire()
    delta = snapshot_delta(a, b)
    if delta is None:  # the slots themselves changed: pushed whole
        assert [s.ubatch for s in old.slots] != [s.ubatch for s in new.slots]
        return
    assert apply_snapshot_delta(a, delta) == b
    assert a == old.to_wire()  # the base is left as it was
    if a == b:
        assert delta == {"fields": {}, "columns": {}, "tables": {}}


def test_an_unchanged_snapshot_is_confirmed_by_heartbeats_not_pushed_again():
    stats = one_slot()
    pair = Pair(stats)
    pair.step()
    assert pair.latest.ranks[0].confirmed == pair.now
    version = pair.latest.ranks[0].version
    for _ in range(3):
        pair.now += INTERVAL
        frames = [_roundtrip(f) for f in pair.link.on_time(pair.now)]
        assert [m.op for m in frames] == [Op.HEARTBEAT]
        assert frames[0].body["stats_version"] == version
        pair.latest.confirm(0, version, pair.now, frames[0].body["step"])
    assert pair.latest.ages(pair.now) == {0: 0.0}


def test_an_answer_kept_between_pushes_shows_each_later_confirmation():
    """The body of an answer stands from push to push; each rank's confirmed_at and the stale
    list are read as the answer is sent. Fails if a confirmation does not move them."""
    latest = LatestStats()
    wire = one_slot().to_wire()
    for rank in (0, 1):
        assert latest.push(rank, 0, {"version": 1, "base": None, "step": 1, "stats": wire}, 10.0)

    def answer(now: float, offset: float = 1000.0) -> Stats:  # the wall clock ahead of the monotonic one
        return Stats(msgpack.unpackb(latest.answer({0: [0, 1]}, {}, now, now + offset, stale_after=3.0,
                                                   key=0, version=0)))

    first = answer(11.0)
    assert first.ages() == {0: 1.0, 1: 1.0} and first.complete
    assert latest.confirm(0, 1, 13.5, step=40)
    later = answer(14.0)
    assert later.doc["ranks"]["confirmed_at"] == [1013.5, 1010.0]
    # The step the heartbeat was sent at, as `ranks` shows it; the other rank's is its push's.
    assert later.doc["ranks"]["step"] == [40, 1] and first.doc["ranks"]["step"] == [1, 1]
    assert later.ages() == {0: 0.5, 1: 4.0} and later.stale == [1] and not later.complete
    assert later.doc["slots"] == first.doc["slots"] and later.groups == first.groups
    stepped = answer(14.0, offset=1060.0)  # the wall clock stepped a minute: times follow it, ages do not
    assert stepped.doc["ranks"]["confirmed_at"] == [1073.5, 1070.0] and stepped.ages() == later.ages()


def test_a_command_applied_is_pushed_at_once_not_at_the_next_interval():
    stats = one_slot()
    pair = Pair(stats)
    pair.step()
    pair.now += 0.2
    pair.target.stats = ManagerStats("cpu", 1, 1, True, stats.slots)
    pair.link.push.urgent = True  # what apply_up_to and a lock violation set
    assert pair.link.due() <= pair.now
    pair.step()
    assert pair.now < INTERVAL and pair.held().locked


def test_numbers_no_manager_makes_are_refused_and_every_other_ranks_stats_still_answer():
    """A pushed 2**64 - 1 once overflowed msgpack in the aggregates: `wsctl stats` answered
    `internal` for every client. Every number of a slot is bounded (MAX_NUMBER), and so is the
    slot count (a manager's most), whole or in a delta; the other ranks' answer is unharmed."""
    from wsd.coordinator.snapshotcheck import MAX_NUMBER, MAX_SLOTS

    latest = LatestStats()
    body = {"rank": 0, "version": 1, "base": None, "step": 1, "applied_seq": 0, "held_seq": 0, "state": {}}
    good = one_slot().to_wire()
    assert latest.push(1, 0, {**body, "rank": 1, "stats": good}, 1.0)
    huge = {**good, "slots": {**good["slots"], "requests": [(1 << 64) - 1]}}
    with pytest.raises(ValueError, match=rf"slots.requests\[0\]: {(1 << 64) - 1} out of range 0..{MAX_NUMBER}"):
        latest.push(0, 0, {**body, "stats": huge}, 1.0)
    negative = {**good, "slots": {**good["slots"], "capacity_bytes": [-1]}}
    with pytest.raises(ValueError, match="out of range"):
        latest.push(0, 0, {**body, "stats": negative}, 1.0)
    many = MAX_SLOTS + 1
    wide = {**good, "slots": {**{c: [0] * many for c in good["slots"] if isinstance(good["slots"][c], list)},
                              "last_violation": good["slots"]["last_violation"],
                              "persistent": good["slots"]["persistent"]}}
    with pytest.raises(ValueError, match=f"{many} entries, more than a manager's {MAX_SLOTS} slots"):
        latest.push(0, 0, {**body, "stats": wide}, 1.0)
    assert latest.push(0, 0, {**body, "stats": good}, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        latest.push(0, 0, {**body, "version": 2, "base": 1, "stats": None,
                           "delta": {"columns": {"requests": [[0], [MAX_NUMBER + 1]]}}}, 2.0)
    answer = msgpack.unpackb(latest.answer({0: [0, 1]}, {}, 2.0, 2.0, 3.0, key=0, version=0))
    assert answer["missing"] == [] and len(answer["ranks"]["rank"]) == 2


def test_invalid_pushes_are_refused_naming_why_and_the_rank_shows_missing():
    latest = LatestStats()
    body = {"rank": 0, "version": 1, "base": None, "step": 1, "applied_seq": 0, "held_seq": 0, "state": {},
            "stats": {"device": "cpu", "slots": {}}}
    with pytest.raises(ValueError, match="num_ubatches: missing"):
        latest.push(0, 0, body, 1.0)
    answer = msgpack.unpackb(latest.answer({0: [0]}, {}, 1.0, 1.0, 3.0, key=0, version=0))
    assert answer["missing"] == [{"rank": 0, "reason": "sent an invalid stats snapshot (num_ubatches: missing)"}]
    good = one_slot().to_wire()
    assert latest.push(0, 0, {**body, "stats": good}, 1.0)
    for delta, why in (({"columns": {"requests": [[5], [1]]}}, "slot index 5 out of range"),
                       ({"columns": {"ubatch": [[0], [1]]}}, "unknown 'ubatch'"),
                       ({"fields": {"slots": {}}}, "unknown 'slots'"),
                       ({"columns": {"requests": [[0], ["x"]]}}, r"slots.requests\[0\]: expected int")):
        with pytest.raises(ValueError, match=why):
            latest.push(0, 0, {**body, "version": 2, "base": 1, "stats": None, "delta": delta}, 2.0)
        assert latest.ranks[0].wire == good  # what it held is untouched
    assert not latest.push(0, 0, {**body, "version": 3, "base": 2, "stats": None, "delta": {}}, 2.0)  # a gap


# -- the core: answers from memory, ages, stale, lost ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _core(tmp_path) -> tuple[CoordinatorCore, Clock]:
    clock = Clock()
    core = CoordinatorCore(CoordinatorConfig(state_file=str(tmp_path / "state"), world_size=2, tp_size=2,
                                             heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT),
                           clock=clock, wall=clock)
    for rank in (0, 1):
        _register(core, rank)
    return core, clock


def _register(core: CoordinatorCore, rank: int) -> None:
    core.handle_agent((b"p%d" % rank,), p.encode(Op.REGISTER, {
        "rank": rank, "world_size": 2, "tp_size": 2, "tp_group": 0, "host": "h", "pid": rank,
        "device": "cpu", "applied_seq": None, "acks": [], "step": 0, "idle": True, "state": {}}))


def _ask(core: CoordinatorCore, **body: Any) -> dict[str, Any]:
    out = core.handle_client((b"c", b""), p.encode(Op.STATS, body, 7))
    (reply,) = [frame for kind, _, frame in out if kind == CLIENT]
    message = msgpack.unpackb(reply)
    assert message["ok"], message
    return message["result"]


def _push(core: CoordinatorCore, rank: int, capacity: int) -> list:
    stats = one_slot(capacity)
    return core.handle_agent((b"p%d" % rank,), p.encode(Op.STATS_PUSH, {
        "rank": rank, "version": 1, "base": None, "step": 5, "applied_seq": 0, "held_seq": 0, "state": {},
        "stats": stats.to_wire()}))


def test_a_stats_answer_comes_from_memory_with_each_ranks_age_and_asks_no_rank(tmp_path):
    core, clock = _core(tmp_path)
    answer = _ask(core)
    assert table_rows(answer["ranks"]) == [] and not answer["complete"]
    assert answer["missing"] == [{"rank": 0, "reason": NO_SNAPSHOT}, {"rank": 1, "reason": NO_SNAPSHOT}]
    (ack,) = [msgpack.unpackb(f) for _, _, f in _push(core, 0, 4096)]
    assert ack["op"] == "stats_ack" and ack["body"] == {"version": 1, "ok": True}
    clock.now += 0.5
    _push(core, 1, 1024)
    clock.now += 0.25
    out = core.handle_client((b"c", b""), p.encode(Op.STATS, {}, 7))
    assert [kind for kind, _, _ in out] == [CLIENT]  # no stats_request to any rank
    answer = msgpack.unpackb(out[0][2])["result"]
    assert answer["complete"] and not answer["fresh"] and answer["stale"] == []
    assert answer["ranks"]["rank"] == [0, 1] and ages(answer) == {0: 0.75, 1: 0.25}
    assert answer["as_of"] == clock.now and answer["ranks"]["confirmed_at"] == [clock.now - 0.75,
                                                                                          clock.now - 0.25]
    (group,) = table_rows(answer["groups"])
    assert group_columns(answer)[0]["capacity_max"] == [4096] and group["skew_bytes"] == 4096 - 1024


def test_a_silent_rank_is_stale_after_the_bound_then_lost(tmp_path):
    core, clock = _core(tmp_path)
    _push(core, 0, 64)
    _push(core, 1, 64)
    assert _ask(core)["complete"]
    clock.now += 3 * INTERVAL + 0.1  # the default bound: three intervals
    answer = _ask(core)  # nothing pushed since the last answer: only the time has moved
    assert answer["stale"] == [0, 1] and not answer["complete"]
    assert all(r["stale"] for r in stats_rows(answer)["ranks"])
    _push(core, 0, 64)  # rank 0 again; rank 1 stays silent
    clock.now += TIMEOUT - 3 * INTERVAL
    core.tick()
    answer = _ask(core)
    assert answer["ranks"]["rank"] == [0] and answer["stale"] == []
    assert answer["missing"][0]["rank"] == 1 and answer["missing"][0]["reason"].startswith("lost")
    (group,) = table_rows(answer["groups"])
    assert group["reporting"] == [0] and [row["ranks"] for row in group_slots(answer, 0)] == [[0]]


def test_an_answer_from_memory_follows_every_push_confirmation_and_loss(tmp_path):
    """Answers between two changes share what does not depend on the time; a push, a
    heartbeat confirming a snapshot, a goodbye, a registration or a rank lost each shows in
    the very next answer."""
    core, clock = _core(tmp_path)
    _push(core, 0, 64)
    _push(core, 1, 64)
    first = _ask(core)
    assert first["total_bytes"] == _ask(core)["total_bytes"]
    _push(core, 0, 4096)  # a whole snapshot again
    assert rank_columns(_ask(core))[0]["capacity_bytes"][0] == 4096
    clock.now += 0.5
    core.handle_agent((b"p1",), p.encode(Op.HEARTBEAT, {"rank": 1, "step": 6, "applied_seq": 0, "held_seq": 0,
                                                        "state": {}, "stats_version": 1}))
    assert ages(_ask(core)) == {0: 0.5, 1: 0.0}
    core.handle_agent((b"p1",), p.encode(Op.GOODBYE, {"rank": 1, "step": 6}))
    answer = _ask(core)
    assert answer["ranks"]["rank"] == [0] and answer["missing"][0]["reason"].startswith("stopped")
    _register(core, 1)
    assert [m["reason"] for m in _ask(core)["missing"]] == [NO_SNAPSHOT]  # live again, nothing pushed yet
    clock.now += TIMEOUT + 0.1
    core.tick()
    assert [m["rank"] for m in _ask(core)["missing"]] == [0, 1]


# -- real sockets ------------------------------------------------------------------------------------


def _without_ages(doc: Stats) -> dict[str, Any]:
    return {"ranks": [{k: v for k, v in r.items() if k != "confirmed_at"} for r in doc.ranks],
            "groups": doc.groups, "group_slots": doc["group_slots"], "missing": doc["missing"],
            "total_bytes": doc["total_bytes"]}


@pytest.fixture
def cluster(start_coordinator):
    coordinator = start_coordinator(world_size=4, tp_size=2, heartbeat_interval=0.2, heartbeat_timeout=2.0)
    ranks = [SimulatedRanks(coordinator.agent_endpoint, [r], world_size=4, tp_size=2, num_ubatches=8,
                            heartbeat_interval=0.2, heartbeat_timeout=2.0).start() for r in range(4)]
    client = Client(coordinator.client_endpoint, timeout=10)
    wait_until(lambda: client.stats()["complete"], 10, "every rank's snapshot pushed")
    yield coordinator, ranks, client
    client.close()
    for sim in ranks:
        sim.stop()


def test_fresh_gives_the_same_numbers_as_the_pushed_view(cluster):
    _, _, client = cluster
    fresh = client.stats(fresh=True)
    assert fresh["fresh"] and fresh["complete"] and set(fresh.ages().values()) == {0.0}
    pushed = client.stats()
    assert not pushed["fresh"] and pushed["complete"]
    assert _without_ages(pushed) == _without_ages(fresh)
    assert max(pushed.ages().values()) <= 0.2 + 0.1  # confirmed every interval


def test_aggregates_after_set_ubatches_drops_slots_and_a_rank_leaves_are_exact(cluster):
    _, ranks, client = cluster
    assert client.set_ubatches(3).complete
    wait_until(lambda: (d := client.stats()) and all(r["num_ubatches"] == 3 for r in d.ranks)
               and len(d["slots"]["ubatch"]) == 3 * 4, 5, "the pushes after set-ubatches")
    ranks[3].stop()  # gone: lost once silent for the heartbeat timeout
    doc = wait_until(lambda: (d := client.stats()) and len(d.ranks) == 3 and d, 5, "rank 3 gone from the answer")
    by_rank = {r["rank"]: r for r in doc.ranks}
    slots = rank_columns(doc)
    summaries = group_columns(doc)
    for group in doc.groups:
        members = [by_rank[r] for r in group["reporting"]]
        assert group["reporting"] == ([0, 1] if group["tp_group"] == 0 else [2])
        for number in SLOT_NUMBERS:
            per_slot = list(zip(*(slots[m["rank"]][number.name] for m in members)))
            for column in number.group:
                expected = {"min": min, "max": max, "sum": sum,
                            "spread": lambda v: max(v) - min(v)}[column.combine.value]
                assert summaries[group["tp_group"]][column.name] == [expected(v) for v in per_slot], \
                    (group["tp_group"], column)
        assert group["total_bytes"] == sum(m["total_bytes"] for m in members)
    assert [m["rank"] for m in doc["missing"]] == [3] and doc["missing"][0]["reason"].startswith("lost")
    assert doc["total_bytes"] == sum(r["total_bytes"] for r in doc.ranks)


def _wide_push(core: CoordinatorCore, version: int, base: int | None, snapshot: dict[str, Any] | None,
               delta: dict[str, Any] | None) -> bool | None:
    """Rank 0 pushes; whether its push was taken in (None: unacknowledged)."""
    out = core.handle_agent((b"p0",), p.encode(Op.STATS_PUSH, {
        "rank": 0, "version": version, "base": base, "step": version, "applied_seq": 0, "held_seq": 0,
        "state": {}, "stats": snapshot, "delta": delta}))
    acks = [msgpack.unpackb(f)["body"]["ok"] for _, _, f in out if msgpack.unpackb(f)["op"] == "stats_ack"]
    return acks[0] if acks else None


@pytest.mark.parametrize("pushes_a_second, refused", [(1_000, True), (200, True), (20, False)])
def test_pushes_cost_a_rank_by_the_snapshot_they_change_not_by_their_bytes(tmp_path, pushes_a_second, refused):
    """200-byte deltas into a 4,096-slot snapshot at 1,000 a second held the coordinator at
    100% of a core (each is merged into the whole snapshot). A rank may cost about 1% of a core
    a second in pushes: the flood is mostly refused, unacknowledged and counted, while a real
    agent's most (a push every 50 ms) is all taken in."""
    from wsd.agent.simulated import SimulatedManager

    core, clock = _core(tmp_path)
    snapshot = SimulatedManager(64, 64).snapshot()  # 4,096 slots: a manager's most
    assert _wide_push(core, 1, None, snapshot, None) is True
    base, taken = 1, 0
    for version in range(2, 2 + 5 * pushes_a_second):  # five seconds of it
        clock.now += 1.0 / pushes_a_second
        if _wide_push(core, version, base, None, {"columns": {"requests": [[version % 4096], [version]]}}):
            base, taken = version, taken + 1
    # refused for the cost of the snapshot they change, or past the connection's frame meter first
    by_cost, by_frames = core.gate.refused["stats push rate"], core.gate.refused["rate"]
    assert taken + by_cost + by_frames == 5 * pushes_a_second
    if refused:
        assert by_cost + by_frames > 0.8 * 5 * pushes_a_second, (by_cost, by_frames)
        if pushes_a_second < FRAMES_PER_SECOND:  # within the frame meter: refused for their cost alone
            assert by_frames == 0 and by_cost > 0.8 * 5 * pushes_a_second
    else:
        assert by_cost + by_frames == 0
    assert [r["rank"] for r in table_rows(_ask(core)["ranks"])] == [0]  # its last one taken still answers
