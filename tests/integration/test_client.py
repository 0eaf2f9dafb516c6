"""The Python client, ``wsd_client.client.Client``: typed answers, one row shape, the events
tail, one error for every unavailability.

A real coordinator on random loopback ports (``start_coordinator``) and simulated ranks
(``wsd.agent.simulated.SimulatedRanks``) on one thread; ``wsctl.main`` in this process
where the client and ``wsctl`` must agree.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import zmq
from conftest import wait_until
from simkit import reporting

from wsd.coordinator.events import EventKind, EventLog
from wsd_client import wsctl
from wsd_client.client import TAIL, Client, Events, Pong, Ranks, Stats, Status, Unavailable
from wsd_client.results import GroupStatus, MissingRank, RankCounts, RankEntry, Sequenced


def test_a_cursor_past_the_newest_event_is_the_tail():
    """Fails if asking past the newest id returns that id back (a follower would skip
    the next events) instead of the newest id, or if ``tail - n`` misses the last n."""
    log = EventLog(capacity=100)
    for rank in range(5):
        log.add(EventKind.JOINED, 0.0, rank=rank)
    assert log.since(2**63 - 1, 1) == ([], 5)
    events, cursor = log.since(5 - 2, 100)
    assert [e["rank"] for e in events] == [3, 4] and cursor == 5
    log.add(EventKind.LOST, 0.0, rank=4)
    assert [e["id"] for e in log.since(5, 100)[0]] == [6]


# -- against a real coordinator -------------------------------------------------------------

RANKS = 8


@pytest.fixture
def cluster(start_coordinator):
    """A coordinator expecting 8 ranks in TP groups of 4, and 8 simulated ranks (2 slots each)
    whose first snapshots have all arrived."""
    coordinator = start_coordinator(world_size=RANKS, tp_size=4)
    with reporting(coordinator, range(RANKS), world_size=RANKS, tp_size=4, num_ubatches=2):
        yield coordinator


def test_read_calls_return_typed_answers_that_still_read_as_maps(cluster):
    """Fails if a read call returns a bare map again, a typed property disagrees with the
    answer it reads, or indexing (the old way) stops working."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        pong, status, ranks, stats = client.ping(), client.status(), client.ranks(), client.stats()
    assert isinstance(pong, Pong) and pong.epoch == cluster.core.epoch == pong["epoch"] and pong.seq == 0
    assert isinstance(status, Status) and (status.world_size, status.tp_size) == (RANKS, 4)
    assert status.counts == RankCounts(live=RANKS, lost=0, stopped=0, missing=0) and status.counts.absent == 0
    assert [g["tp_group"] for g in status.groups] == [0, 1] and status["seq"] == 0
    assert isinstance(ranks, Ranks) and [r["rank"] for r in ranks.ranks] == list(range(RANKS))
    assert ranks.missing == []
    assert isinstance(stats, Stats) and stats.complete and stats.missing == [] and stats.stale == []
    assert stats.total_bytes == sum(r["total_bytes"] for r in stats.ranks) == stats["total_bytes"]
    assert dict(stats) == stats.doc and set(stats) >= {"ranks", "slots", "groups", "group_slots"}
    assert isinstance(pong, Sequenced) and isinstance(status, Sequenced) and status.epoch == pong.epoch


def test_groups_and_ranks_are_typed_too_and_still_read_as_maps(cluster):
    """Fails if ``Status.groups`` or ``Ranks.ranks`` hand out bare maps again (the
    typed results once stopped at the top level), if a typed field disagrees with the
    map it reads, or if indexing an entry (the old way) stops working."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        assert client.lock(group=1).complete
        # What ranks report reaches the coordinator with their next heartbeat.
        status = wait_until(lambda: (s := client.status()).groups[1].locked == [True] and s, 5, "group 1 locked")
        ranks = client.ranks()
    groups = status.groups
    assert all(isinstance(g, GroupStatus) for g in groups) and groups == status.doc["groups"]
    one = groups[1]
    assert (one.tp_group, one.ranks, one.live, one.missing) == (1, [4, 5, 6, 7], [4, 5, 6, 7], [])
    assert one.locked == [True] and one.num_ubatches == [2] and one.applied_seq == [1]
    assert one.consistent is True and one.drift == [] and one.desired["locked"] is True
    assert one["tp_group"] == 1 and groups[0].locked == [False] == groups[0]["locked"]
    entries = ranks.ranks
    assert all(isinstance(r, RankEntry) for r in entries) and entries == ranks.doc["ranks"]
    five = entries[5]
    assert (five.rank, five.state, five.tp_group, five.step >= 0, five.locked, five.num_ubatches) == (
        5, "live", 1, True, True, 2)
    assert five.pid == five["pid"] and five.host == five["host"] and five.device == five["device"]
    assert five.lost_at is None and five.stopped_at is None and five.last_seen >= five.registered_at > 0
    assert five.idle is True and five.applied_seq == 1  # simulated ranks apply on receipt, as --idle


def test_a_rank_entrys_properties_are_derived_from_the_declared_row():
    """Fails if ``RankEntry`` keeps a hand-written copy of the row (a property written by hand
    beside ``wsd.rankrow.RankRow``), or lacks a property for one of its fields."""
    from wsd.rankrow import RankRow, row_fields
    from wsd_client import results

    names = [name for name, _, _ in row_fields()]
    assert all(isinstance(getattr(RankEntry, name), property) for name in names)
    assert {name for name, value in vars(RankEntry).items() if isinstance(value, property)} == set(names)
    row = RankRow(engine=None, rank=3, state="lost", tp_group=1, host="h", pid=7, device="cpu", idle=False,
                  step=9, applied_seq=2, registered_at=1.0, last_seen=2.0, lost_at=3.0, stopped_at=None,
                  locked=None, num_ubatches=4, model=None, warming=False, in_step=12.5).to_wire()
    entry = RankEntry(row)
    assert {name: getattr(entry, name) for name in names} == row
    with pytest.raises(TypeError, match="derived from RankRow"):
        @results._rank_row_properties
        class Copy(results.Answer):
            @property
            def rank(self) -> int:
                return 0


def test_missing_ranks_are_typed_and_named_missing_only(start_coordinator):
    """Fails if a rank that never registered is not a typed ``MissingRank`` in ``ranks``,
    ``status`` and ``stats``, or if the client still falls back to the old key name
    ``never_registered`` (wsd is unreleased: one name, ``missing``)."""
    coordinator = start_coordinator(world_size=2, tp_size=2)
    with reporting(coordinator, [0], world_size=2, tp_size=2, num_ubatches=1), \
            Client(coordinator.client_endpoint, timeout=5) as client:
        status, ranks, stats = client.status(), client.ranks(), client.stats()
    for missing in (ranks.missing, status.groups[0].missing, stats.missing):
        assert [(type(m), m.rank, m.reason) for m in missing] == [(MissingRank, 1, "never registered")]
        assert missing == [{"rank": 1, "reason": "never registered"}]
    assert status.counts == RankCounts(live=1, lost=0, stopped=0, missing=1)
    renamed = {**status.doc["ranks"]}
    renamed["never_registered"] = renamed.pop("missing")
    with pytest.raises(KeyError):
        RankCounts.from_wire(renamed)
    with pytest.raises(KeyError):
        _ = Ranks({"ranks": [], "never_registered": [{"rank": 1, "reason": "never registered"}]}).missing


def test_stats_is_not_expanded_until_rows_are_asked_for(cluster):
    """Fails if ``Client.stats()`` builds rows eagerly (it is benchmarked: the answer must be
    what the coordinator sent, slots as columns), or ``rows()`` does not expand them."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        stats = client.stats()
    assert "slots" not in stats.ranks[0] and stats["slots"]["rank"] == [r for r in range(RANKS) for _ in (0, 1)]
    rows = stats.rows()
    assert [len(r["slots"]) for r in rows["ranks"]] == [2] * RANKS and "slots" not in rows
    assert rows["ranks"][3]["slots"] == stats.rank_slots(3)
    assert [s["ranks"] for s in rows["groups"][1]["slots"]] == [[4, 5, 6, 7]] * 2 == \
        [s["ranks"] for s in stats.group_slots(1)]


def test_rows_are_exactly_what_wsctl_stats_json_prints(cluster, capsys):
    """Fails if the client's rows and ``wsctl stats --json`` differ in shape or content
    (the client once returned columns, wsctl rows)."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        rows = client.stats(fresh=True).rows()  # fresh: every age 0, so two answers compare equal
    assert wsctl.main(["stats", "--fresh", "--json", "--endpoint", cluster.client_endpoint]) == 0
    printed = json.loads(capsys.readouterr().out)

    def timeless(doc: dict[str, Any]) -> dict[str, Any]:  # but for when each was sent
        return {**{k: v for k, v in doc.items() if k != "as_of"},
                "ranks": [{k: v for k, v in r.items() if k != "confirmed_at"} for r in doc["ranks"]]}

    assert "as_of" in printed and all("confirmed_at" in r for r in printed["ranks"])
    assert timeless(printed) == timeless(json.loads(json.dumps(rows)))


def test_same_step_is_keyed_by_group_number_as_steps_by_rank(cluster):
    """Fails if ``same_step`` is keyed by strings again while ``steps()`` is keyed by ints."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        result = client.lock()
    assert result.complete and sorted(result.steps()) == list(range(RANKS))
    assert result.same_step == {0: True, 1: True}


def test_reserve_is_reserve_bytes_and_the_old_name_still_works_with_a_warning(cluster):
    """Fails if ``reserve_bytes`` does not reserve, or ``reserve`` is gone or silent."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        assert client.reserve_bytes(1 << 20, group=0).complete
        with pytest.warns(DeprecationWarning, match="reserve_bytes"):
            assert client.reserve(2 << 20, group=1).complete
        assert [r["reserve_bytes"] for r in (client.status().groups[g]["desired"] for g in (0, 1))] == [
            1 << 20, 2 << 20]


def test_events_from_the_tail_give_only_what_happens_next(cluster):
    """Fails if ``events(TAIL)`` returns old events, or its cursor misses the next ones
    (``events(cursor=0)`` was once the only start, the oldest events)."""
    with Client(cluster.client_endpoint, timeout=5) as client:
        everything = client.events(0, 1000)
        tail = client.events(TAIL)
        assert isinstance(tail, Events) and tail.events == [] and tail.epoch == cluster.core.epoch
        assert tail.cursor == everything.cursor == everything.events[-1]["id"]  # nothing new meanwhile
        client.unlock()
        after = wait_until(lambda: client.events(tail.cursor).events, 5, "the unlock's events")
    assert after[0]["id"] == tail.cursor + 1 and after[0]["kind"] == "command"


def test_every_unavailability_is_unavailable():
    """Fails if a socket that cannot be made (its context gone) leaks a raw ZMQError instead
    of ``Unavailable``, the one error a caller catches to say the coordinator is out of reach."""
    with socket.socket() as s:  # something listens, so the probe passes and the send is tried
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        context = zmq.Context()
        client = Client(f"tcp://127.0.0.1:{s.getsockname()[1]}", timeout=1, context=context)
        context.term()
        with pytest.raises(Unavailable, match="cannot open a socket"):
            client.ping()
