"""Simulated ranks (wsd.agent.simulated) against the real coordinator on random loopback ports."""

from __future__ import annotations

import pytest
from conftest import wait_until

from wsd.agent.simulated import SimulatedManager, SimulatedRanks
from wsd.slotstats import ManagerStats
from wsd_client.client import Client
from wsd_client.rows import group_columns, rank_columns

RANKS = 16
SLOTS = 8


@pytest.fixture
def swarm(start_coordinator):
    """16 simulated ranks (8 slots each) registered with a fresh coordinator."""
    # A generous timeout: on a shared machine a stalled second must not mark a rank lost.
    coordinator = start_coordinator(world_size=RANKS, tp_size=4, heartbeat_timeout=3.0)
    sim = SimulatedRanks(coordinator.agent_endpoint, range(RANKS), world_size=RANKS, tp_size=4,
                         num_ubatches=SLOTS, heartbeat_interval=0.2, heartbeat_timeout=3.0).start()
    try:
        assert sim.wait_registered(10), f"only {sim.registered()} of {RANKS} ranks registered"
        yield coordinator, sim
    finally:
        sim.stop(timeout=10)


def test_all_register_and_a_command_is_acked_by_all(swarm):
    """Without the shared protocol logic (registration, idle apply, ack) this times out or is partial."""
    coordinator, sim = swarm
    with Client(coordinator.client_endpoint, timeout=5) as client:
        assert client.status()["ranks"]["live"] == RANKS
        result = client.lock()
        assert result.complete and sorted(result.steps()) == list(range(RANKS)), result
        assert all(m.locked for m in sim.managers)
        result = client.set_ubatches(2, group=1)
        assert result.complete and sorted(result.steps()) == [4, 5, 6, 7], result
    assert [m.num_ubatches for m in sim.managers] == [8] * 4 + [2] * 4 + [8] * 8
    # Every rank holds every seq: the ranks outside group 1 take seq 2 as well, but
    # the reply did not wait for them, so they may still be on their way to it.
    wait_until(lambda: {link.applied for link in sim.links} == {2}, 5, "every rank to hold seq 2")


def test_stats_has_every_rank_with_its_slots(swarm):
    """Fails if a simulated snapshot is not ManagerStats-shaped or a rank does not answer."""
    coordinator, _ = swarm
    with Client(coordinator.client_endpoint, timeout=5) as client:
        stats = wait_until(lambda: (s := client.stats())["complete"] and s, 5, "every rank's pushed snapshot")
    assert stats["missing"] == []
    assert [r["rank"] for r in stats.ranks] == list(range(RANKS))
    slots = rank_columns(stats)
    assert all(len(slots[r]["capacity_bytes"]) == SLOTS for r in range(RANKS))
    assert len(stats.groups) == 4
    assert all(len(g["capacity_max"]) == SLOTS for g in group_columns(stats).values())
    # The wire form is exactly what a real manager sends (a simulated rank's counters move
    # only when it is busy).
    assert ManagerStats.from_wire({**stats.ranks[0], "slots": slots[0]}) == SimulatedManager(SLOTS).stats()
    assert stats["total_bytes"] == RANKS * SimulatedManager(SLOTS).stats().total_bytes


def test_ranks_register_again_after_coordinator_restart(swarm, start_coordinator):
    """Without re-registration on a new epoch the restarted coordinator would see no rank."""
    coordinator, sim = swarm
    endpoints = {"agent_endpoint": coordinator.agent_endpoint, "client_endpoint": coordinator.client_endpoint}
    coordinator.stop()
    again = start_coordinator(world_size=RANKS, tp_size=4, heartbeat_timeout=3.0, **endpoints)
    wait_until(lambda: all(link.registered.is_set() and link.epoch == again.core.epoch for link in sim.links),
               10, "every simulated rank to register with the new coordinator")
    with Client(again.client_endpoint, timeout=5) as client:
        assert client.unlock().complete


def test_manager_stand_in_follows_commands():
    """The stand-in must change its numbers as a manager would, or stats after commands lie."""
    m = SimulatedManager(2, slot_bytes=4096)
    m.apply("reserve", {"bytes": 8192})
    assert [s.capacity_bytes for s in m.stats().slots] == [8192, 8192]
    m.apply("lock", {})
    m.apply("set_ubatches", {"n": 3})
    assert [s.capacity_bytes for s in m.stats().slots] == [8192] * 3  # locked: added slots pre-sized
    with pytest.raises(Exception, match="locked"):
        m.apply("trim", {})
    m.apply("unlock", {})
    m.apply("trim", {})
    assert m.stats().total_bytes == 3 * (1 << 20)  # persistent buffers stay


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"ranks must lie in 0..3"):
        SimulatedRanks("tcp://127.0.0.1:1", range(5), world_size=4)
    with pytest.raises(ValueError, match="num_ubatches"):
        SimulatedManager(0)


def test_snapshot_wire_form_is_the_dataclasses():
    """ManagerStats.to_dict is written by hand for speed; it must stay asdict plus total_bytes,
    the allocator's cap and headroom left out where the device's allocator has none."""
    import dataclasses

    stats = _sample_stats()
    uncapped = {k: v for k, v in dataclasses.asdict(stats).items() if not k.startswith("allocator_")}
    assert stats.to_dict() == {**uncapped, "total_bytes": stats.total_bytes}
    assert ManagerStats.from_dict(stats.to_dict()) == stats
    capped = dataclasses.replace(stats, allocator_cap_bytes=8 << 30, allocator_headroom_bytes=1 << 30)
    assert capped.to_dict() == {**dataclasses.asdict(capped), "total_bytes": stats.total_bytes}
    assert ManagerStats.from_dict(capped.to_dict()) == capped


def test_columnar_wire_form_expands_to_the_row_form():
    """The compact form (to_wire) is what agents send and clients expand with
    slot_rows: expanded, it must give exactly the documented rows of to_dict,
    last violations and persistent buffers on the right slots, and survive
    msgpack both ways; else wsctl --json would print other numbers than the
    manager holds."""
    import msgpack

    from wsd.slotstats import slot_rows

    stats = _sample_stats()
    wire = msgpack.unpackb(msgpack.packb(stats.to_wire()))
    assert wire["total_bytes"] == stats.total_bytes and wire["slots"]["capacity_bytes"] == [4096 * i for i in range(6)]
    rows = [{**row, "persistent": tuple(row["persistent"])} for row in slot_rows(wire["slots"])]
    assert rows == list(stats.to_dict()["slots"])
    assert ManagerStats.from_wire(wire) == stats


def _sample_stats() -> ManagerStats:
    """Six slots (3 ubatches x 2 lanes) with violations and persistent buffers on some."""
    from wsd.slotstats import LockViolation, PersistentStats, SlotStats

    violation = LockViolation("model.py:12:forward", 4096, 1024, 1.5)
    slots = tuple(
        SlotStats.of(i // 2, i % 2, capacity_bytes=4096 * i, peak_requested_bytes=4000 * i, requests=i, resizes=1,
                     lock_violations=i % 3, last_violation=violation if i % 3 else None,
                     persistent=(PersistentStats("ids", "tensor", 512), PersistentStats("handle", "resource", 0))
                     if i % 2 else ())
        for i in range(6)
    )
    return ManagerStats("cuda:0", 3, 2, True, slots)
