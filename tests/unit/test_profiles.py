"""Sizing profiles: what the coordinator learns per engine profile, keeps across restarts,
hands a registering rank that asks, and lets an operator drop (wsd.coordinator.profiles)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from corekit import WALL0, Harness, make, peer_of, to_agents

import wsd.coordinator.profiles as profiles_module
from wsd.coordinator.profiles import ProfileKey, Profiles, learned_sizes, profiles_path
from wsd.slotstats import LockViolation, ManagerStats, SlotStats
from wsd.wire import protocol as p
from wsd.wire.curve import refusal
from wsd.wire.protocol import ErrorCode, Op


def grid_snapshot(peaks: dict[tuple[int, int], int], *, ubatches: int = 2, lanes: int = 2,
                  refused: dict[tuple[int, int], int] | None = None) -> dict:
    """A rank's snapshot (wire form) whose slots asked for ``peaks``; ``refused``: each slot's
    last lock violation's ``requested``."""
    refused = refused or {}
    slots = tuple(
        SlotStats.of(u, lane, capacity_bytes=peaks.get((u, lane), 0), peak_requested_bytes=peaks.get((u, lane), 0),
                     requests=1,
                     last_violation=LockViolation("x.py:1:f", refused[u, lane], 0, WALL0) if (u, lane) in refused
                     else None)
        for u in range(ubatches) for lane in range(lanes))
    return ManagerStats("cpu", ubatches, lanes, False, slots).to_wire()


def push(h: Harness, rank: int, stats: dict, version: int = 1) -> None:
    h.agent(peer_of(rank), Op.STATS_PUSH, {"rank": rank, "version": version, "step": 1, "applied_seq": 0,
                                           "held_seq": 0, "state": {}, "stats": stats})


# -- pure logic ----------------------------------------------------------------------------


def test_a_key_reads_back_from_its_text_even_with_colons_in_the_model_name():
    key = ProfileKey("org/model:v2", 4, 2, 1)
    assert str(key) == "org/model:v2:tp4:ub2:ln1"
    assert ProfileKey.parse(str(key)) == key
    for bad in ("model", "model:tp2:ub1", "m:tp2:ub1:lnX", ":tp1:ub1:ln1", "m:tp1:ub99:ln1", "m:tp0:ub1:ln1"):
        with pytest.raises(ValueError):
            ProfileKey.parse(bad)


def test_each_slot_learns_its_own_largest_request_served_or_refused():
    """Per slot, never all slots alike: the largest peak, or a refused request's size where larger."""
    key = ProfileKey("m", 1, 2, 2)
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0)
    wire = grid_snapshot({(0, 0): 100, (1, 1): 300}, refused={(0, 1): 700})
    columns = wire["slots"]
    assert learned_sizes(key, columns, columns["last_violation"], 1 << 40) == {(0, 0): 100, (1, 1): 300, (0, 1): 700}
    assert store.learn(key, "e", 0, {(0, 0): 100, (1, 1): 300, (0, 1): 700})
    assert not store.learn(key, "e", 1, {(0, 0): 50})  # smaller: nothing grows
    assert store.learn(key, "e", 1, {(0, 0): 150}) == [profiles_module.Growth(0, 0, 100, 150)]
    assert store.sizes(key) == [[0, 0, 150], [0, 1, 700], [1, 1, 300]]
    [row] = store.public()
    assert (row["key"], row["ranks"], row["engines"], row["total_bytes"]) == ("m:tp1:ub2:ln2", 2, 1, 1150)


def test_slots_outside_the_keys_grid_are_left_out():
    key = ProfileKey("m", 1, 1, 1)
    columns = grid_snapshot({(0, 0): 10, (1, 0): 20}, ubatches=2, lanes=1)["slots"]
    assert learned_sizes(key, columns, None, 1 << 40) == {(0, 0): 10}


def test_a_slot_learns_no_more_than_its_own_snapshot_shows_nor_the_cap():
    """A push claiming a 1 TiB peak on a slot that holds 4 KiB and refused nothing teaches
    4 KiB; a refused request counts as what it asked; nothing beyond the configured cap."""
    key = ProfileKey("victim-model", 2, 1, 2)
    slots = (SlotStats.of(0, 0, capacity_bytes=4096, peak_requested_bytes=1 << 40, requests=1),
             SlotStats.of(0, 1, capacity_bytes=4096, peak_requested_bytes=1 << 40, requests=1,
                          last_violation=LockViolation("x.py:1:f", 1 << 30, 4096, WALL0)))
    columns = ManagerStats("cpu", 1, 2, True, slots).to_wire()["slots"]
    assert learned_sizes(key, columns, columns["last_violation"], 1 << 40) == {(0, 0): 4096, (0, 1): 1 << 30}
    assert learned_sizes(key, columns, columns["last_violation"], 1 << 20) == {(0, 0): 4096, (0, 1): 1 << 20}
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0, max_slot_bytes=1 << 20)
    assert store.learn(key, "attacker", 0, {(0, 0): 1 << 40}) == [profiles_module.Growth(0, 0, 0, 1 << 20)]


def test_one_registration_creates_a_few_profiles_and_all_hold_a_bounded_number_of_slots(monkeypatch):
    """A token holder claiming grid after grid from one registration creates at most
    NEW_PER_REGISTRATION profiles; every profile's slots together stay within MAX_SLOTS,
    the least recently grown going first."""
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0)
    created = [store.learn(ProfileKey("m", 1, u, 1), "e", 0, {(0, 0): 1}, registration=("e", 0, b"peer"))
               for u in range(1, 11)]
    assert sum(bool(c) for c in created) == profiles_module.NEW_PER_REGISTRATION == len(store.profiles)
    assert store.learn(ProfileKey("m", 1, 9, 1), "e", 0, {(0, 0): 1}, registration=("e", 0, b"again"))
    monkeypatch.setattr(profiles_module, "MAX_SLOTS", 10)
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0)
    for i in range(5):
        store.learn(ProfileKey(f"m{i}", 1, 4, 1), "e", 0, {(u, 0): 1 for u in range(4)})
    assert store.slots == 8 and [k.name for k in store.profiles] == ["m3", "m4"]
    assert store.drop(ProfileKey("m4", 1, 4, 1)) and store.slots == 4


def test_profiles_are_answered_a_page_at_a_time():
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0)
    for i in range(5):
        store.learn(ProfileKey(f"m{i}", 1, 1, 1), "e", 0, {(0, 0): 1})
    assert [p["name"] for p in store.public(1, 2)] == ["m1", "m2"]
    assert [p["name"] for p in store.public(4, 2)] == ["m4"] and store.public(9, 2) == []


def test_a_fifo_planted_as_the_profiles_file_never_stops_the_coordinator(tmp_path, caplog):
    """Opened without blocking and refused as not a regular file: the coordinator starts with
    no profiles and never writes over what it could not read."""
    path = tmp_path / "s.profiles"
    os.mkfifo(path)
    with caplog.at_level(logging.ERROR, logger="wsd.coordinator.profiles"):
        store = Profiles(str(path), wall=lambda: WALL0, clock=lambda: 0.0)
    assert store.profiles == {} and store.path is None
    assert "not a regular file" in caplog.text


def test_the_store_is_bounded_dropping_the_least_recently_grown(monkeypatch):
    monkeypatch.setattr(profiles_module, "MAX_PROFILES", 3)
    store = Profiles(None, wall=lambda: WALL0, clock=lambda: 0.0)
    keys = [ProfileKey(f"m{i}", 1, 1, 1) for i in range(4)]
    for key in keys[:3]:
        store.learn(key, "e", 0, {(0, 0): 1})
    store.learn(keys[0], "e", 0, {(0, 0): 2})  # grew: the most recent now
    store.learn(keys[3], "e", 0, {(0, 0): 1})
    assert list(store.profiles) == [keys[2], keys[0], keys[3]]


# -- the file --------------------------------------------------------------------------------


def test_profiles_survive_a_save_and_load_and_are_written_only_when_changed_and_due(tmp_path):
    path = str(tmp_path / "s.profiles")
    clock = [0.0]
    store = Profiles(path, wall=lambda: WALL0, clock=lambda: clock[0])
    key = ProfileKey("m", 2, 1, 1)
    store.learn(key, "e", 3, {(0, 0): 4096})
    store.tick(0.0)
    assert Profiles(path, wall=lambda: WALL0, clock=lambda: 0.0).sizes(key) == [[0, 0, 4096]]
    store.learn(key, "e", 3, {(0, 0): 8192})
    store.tick(1.0)  # within SAVE_EVERY of the last write: not yet
    assert Profiles(path, wall=lambda: WALL0, clock=lambda: 0.0).sizes(key) == [[0, 0, 4096]]
    assert store.next_deadline() == profiles_module.SAVE_EVERY
    store.tick(profiles_module.SAVE_EVERY)
    again = Profiles(path, wall=lambda: WALL0, clock=lambda: 0.0)
    assert again.sizes(key) == [[0, 0, 8192]] and again.profiles[key].ranks == {"e/3"}
    assert store.next_deadline() == float("inf")  # nothing changed since


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_profiles_file_is_moved_aside_and_the_coordinator_starts_with_none(tmp_path, caplog, damage):
    """Advisory data never stops a coordinator, and is never lost: without the check a flipped
    byte would be read as sizes (or raise at start); without the move it would be overwritten."""
    path = str(tmp_path / "s.profiles")
    store = Profiles(path, wall=lambda: WALL0, clock=lambda: 0.0)
    store.learn(ProfileKey("m", 1, 1, 1), "e", 0, {(0, 0): 1 << 20})
    assert store.save()
    raw = Path(path).read_bytes()
    bad = {"flip": raw[:-1] + bytes([raw[-1] ^ 1]), "truncate": raw[:-3], "garbage": b"not a profiles file"}[damage]
    with open(path, "wb") as f:
        f.write(bad)
    with caplog.at_level(logging.ERROR, logger="wsd.coordinator.profiles"):
        loaded = Profiles(path, wall=lambda: WALL0, clock=lambda: 0.0)
    assert loaded.profiles == {}
    aside = f"{path}.damaged-{int(WALL0)}"
    assert Path(aside).read_bytes() == bad and not os.path.exists(path)
    [record] = caplog.records
    assert path in record.getMessage() and aside in record.getMessage() and "damaged" in record.getMessage()


# -- through the coordinator ----------------------------------------------------------------


def test_a_registration_asking_for_presize_gets_its_profiles_sizes_learned_from_pushes(tmp_path):
    h = make(tmp_path, engine="cluster-a")
    h.register_all()
    again = iter(range(1, 100))

    def answered(**overrides) -> list | None:  # rank 3's agent registering again, on a new connection
        peer = peer_of(3, next(again))
        return to_agents(h.register(3, peer=peer, **overrides), Op.REGISTERED)[peer]["presize"]

    assert answered(presize=[2, 2]) is None  # nothing learned yet
    push(h, 0, grid_snapshot({(0, 0): 1000, (0, 1): 2000}))
    push(h, 1, grid_snapshot({(0, 0): 1500, (1, 1): 500}, refused={(1, 0): 9000}))
    assert answered(presize=[2, 2]) == [[0, 0, 1500], [0, 1, 2000], [1, 0, 9000], [1, 1, 500]]
    # Another grid, or a model, is another profile: nothing known for it; not asked, not sent.
    assert answered(presize=[1, 1]) is None
    assert answered(presize=[2, 2], model="org/m") is None
    assert answered() is None
    [row] = h.ok(Op.PROFILES)["profiles"]
    assert row["key"] == "cluster-a:tp2:ub2:ln2" and row["ranks"] == 2 and row["engines"] == 1


def test_profiles_survive_a_coordinator_restart_and_are_written_at_close(tmp_path):
    h = make(tmp_path, engine="c")
    h.register_all()
    push(h, 0, grid_snapshot({(0, 0): 4096}, ubatches=1, lanes=1))
    h.core.close()
    assert os.path.exists(profiles_path(h.config.state_file))
    again = make(tmp_path, engine="c")
    assert to_agents(again.register(0, presize=[1, 1]), Op.REGISTERED)[peer_of(0)]["presize"] == [[0, 0, 4096]]


def test_dropping_a_profile_forgets_it_durably_and_logs_who(tmp_path):
    h = make(tmp_path, engine="c")
    h.register_all()
    push(h, 0, grid_snapshot({(0, 0): 4096}, ubatches=1, lanes=1))
    result = h.ok(Op.DROP_PROFILE, {"key": "c:tp2:ub1:ln1"})
    assert result == {"dropped": "c:tp2:ub1:ln1", "saved": True}
    assert h.ok(Op.PROFILES)["profiles"] == []
    assert [e["key"] for e in h.events("profile_dropped")] == ["c:tp2:ub1:ln1"]
    assert make(tmp_path, engine="c").core.profiles.profiles == {}
    reply = h.call(Op.DROP_PROFILE, {"key": "c:tp2:ub1:ln1"})
    assert reply.code == ErrorCode.BAD_FIELD and "no sizing profile" in reply.message
    reply = h.call(Op.DROP_PROFILE, {"key": "not-a-key"})
    assert reply.code == ErrorCode.BAD_FIELD and "NAME:tpT:ubU:lnL" in reply.message


def test_under_curve_a_viewer_may_read_profiles_and_may_not_drop_one():
    read = p.encode(Op.PROFILES, {}, 1)
    drop = p.encode(Op.DROP_PROFILE, {"key": "m:tp1:ub1:ln1"}, 2)
    assert refusal("viewer", read) is None
    refused = p.decode_reply(refusal("viewer", drop))
    assert refused.code == ErrorCode.FORBIDDEN and "admin" in refused.message
    assert refusal("admin", drop) is None


# -- the manager ----------------------------------------------------------------------------


def test_presize_gives_each_slot_its_own_size_and_a_warm_up_that_fits_grows_nothing():
    torch = pytest.importorskip("torch", reason="the manager's own test: the unit tier also runs without torch")

    from wsd.errors import WorkspaceLockHeldError
    from wsd.manager.core import WorkspaceManager, use_lane, use_ubatch

    manager = WorkspaceManager("cpu", 2, 2, max_slot_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"\[2, 0, 10\] is not \[ubatch, lane, bytes\]"):
        manager.presize([[0, 0, 4096], [2, 0, 10]])
    assert manager.stats().total_bytes == 0  # checked before any slot grew
    held = manager.presize([[0, 0, 4096], [1, 1, 1024], [0, 1, 4 << 20]])
    sizes = {(s.ubatch, s.lane): s.capacity_bytes for s in manager.stats().slots}
    assert sizes == {(0, 0): 4096, (0, 1): 1 << 20, (1, 0): 0, (1, 1): 1024}  # cut to max_slot_bytes
    assert held == 4096 + 1024 + (1 << 20)
    with use_ubatch(0), use_lane(0):
        manager.get_simultaneous(((1000,), torch.uint8), ((2000,), torch.uint8))
    after = {(s.ubatch, s.lane): (s.capacity_bytes, s.resizes) for s in manager.stats().slots}
    assert after[0, 0] == (4096, 1)  # the presize's allocation only: the request fit
    manager.lock()
    with pytest.raises(WorkspaceLockHeldError, match="presize refused"):
        manager.presize([[1, 0, 10]])


def test_a_presize_that_fails_part_way_releases_what_it_grew(monkeypatch):
    """All or nothing: the second allocation running out of memory leaves no slot holding
    what the first took (a poisoned profile once left a manager holding 8 GiB)."""
    torch = pytest.importorskip("torch", reason="the manager's own test: the unit tier also runs without torch")

    from wsd.manager.core import WorkspaceManager

    manager = WorkspaceManager("cpu", 2, 1)
    real = torch.empty
    made = []

    def empty(*args, **kwargs):
        if made:
            raise torch.OutOfMemoryError("out of memory (a stand-in for the device's)")
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.OutOfMemoryError):
        manager.presize([[0, 0, 4096], [1, 0, 8192]])
    assert made and [s.capacity_bytes for s in manager.stats().slots] == [0, 0]


def test_a_clean_stop_pushes_the_last_snapshot_the_coordinator_lacks():
    """A violation in a worker's last step would otherwise never reach the coordinator (its
    agent stops before the next push), and its profile would miss that request."""
    from wsd.agent.push import StatsPush

    push = StatsPush(0.0)
    push.restart(1.0, 0.0)
    first, _ = push.poll(0.0, 5.0, lambda: {"peak": 1})
    assert first is not None
    assert push.last(lambda: {"peak": 1}) is None  # in flight: the coordinator has it
    push.on_ack({"version": first["version"], "ok": True})
    assert push.last(lambda: {"peak": 1}) is None
    assert push.last(lambda: {"peak": 2}) == {"version": first["version"] + 1, "base": None, "stats": {"peak": 2}}
