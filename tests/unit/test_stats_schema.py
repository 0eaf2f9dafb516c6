"""The per-slot statistics schema: every reader of a slot's numbers follows ``SLOT_NUMBERS``.

I/O-free: snapshots, aggregation, metric families and wsctl's text are plain
functions of plain data, checked here against the one declaration.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import fields

import msgpack
import pytest

from wsd.coordinator.aggregate import StatsRound, _group_slots, read_changes, read_snapshot
from wsd.families import FAMILIES, HELP
from wsd.slotstats import (
    GROUP_COLUMNS,
    SLOT_COLUMNS,
    SLOT_KEY,
    SLOT_NUMBERS,
    SPARSE_TABLES,
    Combine,
    GroupColumn,
    ManagerStats,
    PersistentStats,
    RetainedStats,
    SlotNumber,
    SlotStats,
    apply_snapshot_delta,
    snapshot_delta,
)
from wsd_client import render
from wsd_client.rows import group_columns, group_slots, rank_slots, stats_rows, table_rows


def _snapshot(rng: random.Random, slots: int) -> ManagerStats:
    return ManagerStats("cpu", slots, 1, False, tuple(
        SlotStats.of(i, **{n.name: rng.randrange(1 << 20) for n in SLOT_NUMBERS}) for i in range(slots)))


def _answer(snapshots: dict[int, ManagerStats], tp_group: int = 0) -> dict:
    rnd = StatsRound({tp_group: sorted(snapshots)})
    for rank, snapshot in snapshots.items():
        rnd.add(read_snapshot(rank, tp_group, 7, msgpack.unpackb(msgpack.packb(snapshot.to_wire()))))
    return msgpack.unpackb(rnd.finish({tp_group: sorted(snapshots)}, {}, as_of=1.0))


def test_slot_stats_carries_exactly_the_schemas_columns():
    assert [f.name for f in fields(SlotStats)] == [*SLOT_COLUMNS, "last_violation", "persistent", "retained"]
    assert [t.name for t in SPARSE_TABLES] == ["last_violation", "persistent", "retained"]
    assert SLOT_COLUMNS == (*SLOT_KEY, *(n.name for n in SLOT_NUMBERS))
    assert GROUP_COLUMNS == (*SLOT_KEY, *(c.name for n in SLOT_NUMBERS for c in n.group))
    assert len(set(GROUP_COLUMNS)) == len(GROUP_COLUMNS)


@pytest.mark.parametrize("ranks", [1, 3])
def test_each_group_column_is_its_numbers_combine_over_the_ranks(ranks):
    """Computed here by name from each rank's own snapshot, for every group column the
    schema declares: a column derived by position, or from the wrong number, differs."""
    rng = random.Random(ranks)
    snapshots = {r: _snapshot(rng, 4) for r in range(ranks)}
    answer = _answer(snapshots)
    (columns,) = group_columns(answer).values()
    for number in SLOT_NUMBERS:
        per_slot = [[getattr(snapshots[r].slots[i], number.name) for r in range(ranks)] for i in range(4)]
        for column in number.group:
            expected = {Combine.MIN: min, Combine.MAX: max, Combine.SUM: sum,
                        Combine.SPREAD: lambda v: max(v) - min(v)}[column.combine]
            assert columns[column.name] == [expected(v) for v in per_slot], column.name
    assert [row["ranks"] for row in group_slots(answer, 0)] == [list(range(ranks))] * 4


@pytest.mark.parametrize("combine", list(Combine))
@pytest.mark.parametrize("values", [[5, 0, 1 << 40], [0.5, -0.0, 3.0], []])
def test_a_combine_over_one_rank_is_its_column_over_one(combine, values):
    """What a client derives for a group of one rank reporting equals the aggregation's
    ``column``, value and type."""
    derived, aggregated = combine.of_one(values), combine.column(list(zip(values)))
    assert derived == aggregated and list(map(type, derived)) == list(map(type, aggregated))


def test_groups_whose_ranks_hold_different_slots_are_matched_by_key():
    rng = random.Random(5)
    short, long = _snapshot(rng, 2), _snapshot(rng, 3)
    answer = _answer({0: short, 1: long})
    columns = group_columns(answer)[0]
    assert columns["ubatch"] == [0, 1, 2]
    assert [row["ranks"] for row in group_slots(answer, 0)] == [[0, 1], [0, 1], [1]]
    for number in SLOT_NUMBERS:
        only = getattr(long.slots[2], number.name)
        for column in number.group:
            assert columns[column.name][2] == (0 if column.combine is Combine.SPREAD else only)


def test_a_group_of_one_rank_reporting_is_read_from_the_ranks_slots_not_sent_twice():
    """A group with one rank reporting (alone in it, or its peer missing) has no rows in
    ``group_slots``; its summary, read back, is what the coordinator's aggregation of that
    one rank gives, and an answer that carries its rows (an older coordinator) is read as
    it came."""
    rng = random.Random(11)
    snapshots = {r: _snapshot(rng, 3) for r in range(4)}
    expected = {0: [0], 1: [1, 2], 2: [3, 4]}  # rank 4 never answers
    rnd = StatsRound(expected)
    read = {r: read_snapshot(r, g, 7, msgpack.unpackb(msgpack.packb(snapshots[r].to_wire())))
            for g, ranks in expected.items() for r in ranks if r in snapshots}
    for snapshot in read.values():
        rnd.add(snapshot)
    answer = msgpack.unpackb(rnd.finish(expected, {4: "no reply within the stats timeout"}, as_of=1.0))
    assert set(answer["group_slots"]["tp_group"]) == {1}  # only the group of two reporting
    summaries = group_columns(answer)
    for group, rank in ((0, 0), (2, 3)):
        assert summaries[group] == _group_slots([read[rank]])
        assert [row["ranks"] for row in group_slots(answer, group)] == [[rank]] * 3
    assert summaries[1] == _group_slots([read[1], read[2]])
    # The same answer with every group's rows in group_slots reads the same.
    whole: dict[str, list] = {c: [] for c in answer["group_slots"]}
    for group in expected:
        for c, column in summaries[group].items():
            whole[c] += column
        whole["tp_group"] += [group] * len(summaries[group]["ubatch"])
    older = {**answer, "group_slots": whole}
    assert group_columns(older) == summaries and stats_rows(older) == stats_rows(answer)


def test_aggregation_reads_the_columns_by_name_not_by_position():
    rng = random.Random(9)
    snapshot = _snapshot(rng, 3).to_wire()
    reordered = {**snapshot, "slots": dict(reversed(list(snapshot["slots"].items())))}
    a = StatsRound({0: [0]})
    a.add(read_snapshot(0, 0, 1, snapshot))
    b = StatsRound({0: [0]})
    b.add(read_snapshot(0, 0, 1, reordered))
    first, second = (msgpack.unpackb(r.finish({0: [0]}, {}, as_of=1.0)) for r in (a, b))
    assert first["groups"] == second["groups"] and first["group_slots"] == second["group_slots"]
    assert table_rows(first["ranks"])[0]["capacity_bytes"] == sum(snapshot["slots"]["capacity_bytes"])


def test_persistent_names_travel_once_and_read_back_per_rank():
    """Each name is in the answer's strings once, and every rank's buffers read back as it
    sent them, also where ranks use the names in another order or names of their own."""
    def buffers(*names: str) -> tuple[PersistentStats, ...]:
        return tuple(PersistentStats(name, "tensor" if i % 2 else "resource", 64 * i) for i, name in enumerate(names))

    rng = random.Random(5)
    held = {0: [buffers("a", "b"), buffers("a")], 1: [buffers("b", "a"), buffers("c", "a", "b")], 2: [(), ()]}
    snapshots = {rank: ManagerStats("cpu", 2, 1, False, tuple(
        SlotStats.of(i, **{n.name: rng.randrange(1 << 20) for n in SLOT_NUMBERS}, persistent=slot)
        for i, slot in enumerate(slots)))
                 for rank, slots in held.items()}
    answer = _answer(snapshots)
    assert sorted(answer["strings"]) == ["a", "b", "c", "resource", "tensor"]
    assert all(isinstance(code, int) for code in answer["persistent"]["key"])
    for rank, snapshot in snapshots.items():
        assert [s["persistent"] for s in rank_slots(answer, rank)] == [
            [{"key": p.key, "kind": p.kind, "nbytes": p.nbytes} for p in slot.persistent] for slot in snapshot.slots]


def _record(table, rng: random.Random, names: list[str]):
    """A record of ``table`` with a value of its declared type in every field."""
    kinds = table.types
    make = {int: lambda: rng.randrange(1 << 30), float: lambda: rng.randrange(1 << 20) / 8,
            str: lambda: rng.choice(names)}
    return table.record(**{name: make[kinds[name]]() for name in table.fields})


def _sparse_snapshot(rng: random.Random, slots: int, names: list[str]) -> ManagerStats:
    """Random numbers, and in every sparse table a random number of records per slot (at
    most one where the table holds one per slot)."""
    def sparse(table):
        records = tuple(_record(table, rng, names) for _ in range(rng.randrange(3 if table.many else 2)))
        return records if table.many else (records[0] if records else None)

    return ManagerStats("cpu", slots, 1, False, tuple(
        SlotStats.of(i, **{n.name: rng.randrange(1 << 20) for n in SLOT_NUMBERS},
                     **{t.name: sparse(t) for t in SPARSE_TABLES}) for i in range(slots)))


def _plain(rows):
    """``to_dict``'s rows as JSON gives them back: tuples as lists."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in row.items()} for row in rows]


@pytest.mark.parametrize("seed", range(4))
def test_every_sparse_table_travels_from_a_snapshot_to_the_rows_wsctl_prints(seed):
    """Whatever a sparse table declares, each record reaches a client's rows as the manager
    made it: through the wire form, the coordinator's checks and its answer (coded columns
    as indices into strings), and back; and each of the plain forms reads back whole."""
    rng = random.Random(seed)
    names = ["kv", "moe", "tensor", "resource", "x" * 200]
    snapshots = {rank: _sparse_snapshot(rng, 5, names) for rank in range(3)}
    assert any(getattr(s, t.name) for snap in snapshots.values() for s in snap.slots for t in SPARSE_TABLES)
    answer = _answer(snapshots)
    for rank, snapshot in snapshots.items():
        assert ManagerStats.from_wire(snapshot.to_wire()) == snapshot
        assert ManagerStats.from_dict(snapshot.to_dict()) == snapshot
        assert rank_slots(answer, rank) == _plain(snapshot.to_dict()["slots"])


def test_a_change_to_one_sparse_table_alone_reaches_the_answer():
    """An agent pushes only what changed (a delta); the coordinator re-reads only that. A
    change to one table, coded or not, shows; the others keep their rows."""
    rng = random.Random(11)
    names = ["a", "b", "c"]
    before = _sparse_snapshot(rng, 4, names)
    for table in SPARSE_TABLES:
        slots = list(before.slots)
        new = _record(table, rng, ["fresh"])
        slots[2] = dataclasses.replace(slots[2], **{table.name: (new,) if table.many else new})
        after = dataclasses.replace(before, slots=tuple(slots))
        old_wire, new_wire = before.to_wire(), after.to_wire()
        delta = snapshot_delta(old_wire, new_wire)
        assert delta is not None and set(delta["tables"]) == {table.name}
        previous = read_snapshot(0, 0, 1, old_wire)
        changed = frozenset(delta["tables"])
        current = read_changes(previous, 2, apply_snapshot_delta(old_wire, delta), changed)
        rnd = StatsRound({0: [0]})
        rnd.add(current)
        answer = msgpack.unpackb(rnd.finish({0: [0]}, {}, as_of=1.0))
        assert rank_slots(answer, 0) == _plain(after.to_dict()["slots"]), table.name


def test_every_slot_number_has_its_metric_family_and_help():
    for number in SLOT_NUMBERS:
        assert FAMILIES[number.metric] == ("counter" if number.counter else "gauge",
                                           ("engine", "rank", "tp_group", "ubatch", "lane"))
        assert HELP[number.metric] == number.help


def test_wsctl_shows_every_slot_number_and_every_headed_group_column():
    rng = random.Random(3)
    snapshots = {0: _snapshot(rng, 2), 1: _snapshot(rng, 2)}
    text = render.stats(stats_rows(_answer(snapshots)))
    frame = render.watch(stats_rows(_answer(snapshots)), None, "header")
    for number in SLOT_NUMBERS:
        assert number.header in text and number.header in frame
    for column in (c for n in SLOT_NUMBERS for c in n.group if c.header is not None):
        assert column.header in text
    # A byte-counting number is shown as a size; a count as the number it is.
    requests = snapshots[0].slots[1].requests
    capacity = snapshots[0].slots[1].capacity_bytes
    row = next(line for line in text.splitlines() if line.split()[:3] == ["0", "1", "0"])
    assert str(requests) in row.split() and str(capacity) not in row.split()


def test_wsctl_shows_each_slots_retained_span_by_size_and_key():
    rng = random.Random(4)
    snapshot = _snapshot(rng, 2)
    slots = (dataclasses.replace(snapshot.slots[0], retained=RetainedStats("kv_chunk", 3 << 20)), snapshot.slots[1])
    text = render.stats(stats_rows(_answer({0: dataclasses.replace(snapshot, slots=slots)})), width=200)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "RETAINED" in line)
    rows = {tuple(line.split()[:3]): line for line in lines[header + 1:header + 3]}
    assert "3.0 MiB kv_chunk" in rows[("0", "0", "0")] and "kv_chunk" not in rows[("0", "1", "0")]


def test_a_slot_number_is_refused_when_its_declaration_contradicts_itself():
    with pytest.raises(ValueError, match="kind must be int or float"):
        SlotNumber(name="x", kind=str, help="h", header="X", metric="wsd_slot_x", group=())
    with pytest.raises(ValueError, match="_total"):
        SlotNumber(name="x", kind=int, help="h", header="X", metric="wsd_slot_x", counter=True, group=())
    assert GroupColumn("x_max", Combine.MAX, None).header is None


def test_a_slot_is_built_by_name_with_every_other_figure_zero():
    """What tests and simulations build slots with: a number the schema gains needs no edit
    at any of them, and a name the schema does not have is an error, not a silent zero."""
    slot = SlotStats.of(1, 2, requests=3)
    assert (slot.ubatch, slot.lane, slot.requests) == (1, 2, 3)
    assert all(getattr(slot, n.name) == n.kind() for n in SLOT_NUMBERS if n.name != "requests")
    assert all(getattr(slot, t.name) == (() if t.many else None) for t in SPARSE_TABLES)
    with pytest.raises(TypeError, match="SlotStats has no requets"):
        SlotStats.of(requets=3)
