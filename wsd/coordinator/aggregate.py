"""Aggregation of per-rank manager snapshots: per rank, per slot, per TP group.

Input is what agents send (``ManagerStats.to_wire()``: each rank's slots as
equal-length columns); output is plain lists and maps, ready for msgpack or
JSON, every part of it a table of columns: the ranks, every rank's slots, the
groups and every group's per-slot summary but a group's of one rank (the ``stats`` answer;
``wsd_client.rows.stats_rows`` expands it into rows). Every column is read by
name and checked against its type (``wsd.coordinator.snapshotcheck``), and a
group's columns are derived, from the schema (``wsd.slotstats.SLOT_NUMBERS``).
No sockets, no torch.

Each snapshot is checked and read out in one pass as its reply arrives
(``read_snapshot``), and its part of the answer encoded then, while the other
ranks are still answering; so is a TP group's part once all its ranks have
answered (``StatsRound``). What is left for the end of a round is the groups
with ranks missing and the splicing of the encoded parts, so that the answer
leaves soon after the last reply.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, NamedTuple

import msgpack

from wsd.coordinator.snapshotcheck import checked_changes, checked_columns
from wsd.slotstats import (
    GROUP_COLUMNS,
    GROUP_TABLE,
    RANK_TABLE,
    SLOT_COLUMNS,
    SLOT_KEY,
    SLOT_NUMBERS,
    SPARSE,
    SPARSE_TABLES,
)

__all__ = [
    "AnswerBody",
    "CheckedSnapshot",
    "GroupPart",
    "StatsRound",
    "answer_body",
    "group_part",
    "packed_answer",
    "read_changes",
    "read_snapshot",
]

_CODED_TABLES = tuple(table for table in SPARSE_TABLES if table.coded)
# One packer for the whole process: the coordinator's core runs on one thread.
_packer = msgpack.Packer(use_bin_type=True)


class CheckedSnapshot:
    """One rank's checked snapshot, the columns aggregation reads, and its encoded parts.

    ``columns`` maps each of ``SLOT_COLUMNS`` to its column. ``entry`` is the
    rank's row of the answer's ``ranks`` table (but for ``step`` and ``confirmed_at``), and
    ``tables`` its rows of the answer's slot table and of each sparse table
    (``SPARSE_TABLES``), encoded now: an answer splices them behind headers
    (``packed_answer``), whatever the number of ranks, instead of encoding them
    again. The sparse tables' ``coded`` columns are indices into ``strings``, the
    rank's own names; ``coded`` keeps those tables' columns, for an answer whose
    table of names numbers them otherwise.
    """

    __slots__ = ("coded", "columns", "entry", "locked", "num_ubatches", "rank", "step", "strings", "tables",
                 "total_bytes", "tp_group")

    def __init__(self, rank: int, tp_group: int, step: int, stats: dict[str, Any],
                 columns: dict[str, list[Any]], *, previous: CheckedSnapshot | None = None,
                 changed: frozenset[str] = frozenset()) -> None:
        self.rank = rank
        self.tp_group = tp_group
        self.step = step  # the step it was taken at
        self.columns = columns
        self.total_bytes = stats.get("total_bytes", 0)
        self.locked = stats["locked"]
        self.num_ubatches = stats["num_ubatches"]
        row = {"rank": rank, "tp_group": tp_group, "device": stats["device"],
               "num_ubatches": self.num_ubatches, "num_lanes": stats["num_lanes"], "locked": self.locked,
               "total_bytes": self.total_bytes, "capacity_bytes": sum(columns["capacity_bytes"]),
               "lock_violations": sum(columns["lock_violations"]),
               "allocator_cap_bytes": stats.get("allocator_cap_bytes"),
               "allocator_headroom_bytes": stats.get("allocator_headroom_bytes")}
        # step and confirmed_at: per answer (packed_answer).
        self.entry: tuple[bytes, ...] = tuple(_packer.pack(row[c]) for c in RANK_TABLE[:-2])
        slots = stats["slots"]
        # Whole, or a delta on ``previous`` (same rank, same slots): only what changed is
        # encoded again.
        if previous is None:
            slot_rows = _rows(rank, [columns[c] for c in SLOT_COLUMNS])
        else:
            count, parts = previous.tables[0]
            slot_rows = (count, (parts[0], *(_items(columns[c]) if c in changed else part
                                             for c, part in zip(SLOT_COLUMNS, parts[1:]))))
        if previous is None or any(table.name in changed for table in _CODED_TABLES):
            recode = True  # one table of names for all the coded tables: each is coded again
            self.strings, self.coded = _coded(slots)
        else:
            recode = False
            self.strings, self.coded = previous.strings, previous.coded
        tables = [slot_rows]
        for i, table in enumerate(SPARSE_TABLES, 1):
            if previous is not None and table.name not in changed and not (recode and table.coded):
                tables.append(previous.tables[i])
            elif table.coded:
                tables.append(_rows(rank, self.coded[table.name]))
            else:
                entries = slots.get(table.name) or {}
                tables.append(_rows(rank, [entries.get(c, []) for c in table.columns]))
        self.tables: tuple[tuple[int, tuple[bytes, ...]], ...] = tuple(tables)


def _coded(slots: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, list[list[Any]]]]:
    """A rank's coded sparse tables (checked), each as its columns, their ``coded`` columns as
    indices into the rank's own strings, which it returns too, in order of use."""
    strings: dict[str, int] = {}
    out = {}
    for table in _CODED_TABLES:
        entries = slots.get(table.name) or {}
        out[table.name] = [[strings.setdefault(value, len(strings)) for value in entries.get(c, [])]
                           if c in table.coded else entries.get(c, []) for c in table.columns]
    return tuple(strings), out


# The answer's tables: every rank's rows of each, one after the other, ``rank`` first.
_TABLES = (("slots", ("rank", *SLOT_COLUMNS)), *((t.name, ("rank", *t.columns)) for t in SPARSE_TABLES))
_GROUP_SLOTS_TABLE = ("tp_group", *GROUP_COLUMNS)


def _items(values: list[Any]) -> bytes:
    """The encoded items of a msgpack array of ``values``, without its header."""
    n = len(values)
    packed = _packer.pack(values)
    return packed[1 if n < 16 else 3 if n < 1 << 16 else 5:]


def _rows(owner: int, columns: list[list[Any]]) -> tuple[int, tuple[bytes, ...]]:
    """A rank's (or group's) rows of one table: their number, and each column's items, the
    owner's column (``rank`` or ``tp_group``) first."""
    n = len(columns[0])
    return n, (_items([owner] * n), *map(_items, columns))


def _spliced_table(name: str, columns: tuple[str, ...], parts: list[tuple[int, tuple[bytes, ...]]],
                   *, of: int | None = None) -> list[bytes]:
    """One table of the answer, ``name`` and a map of ``columns``, spliced from the owners'
    rows (``_rows``) one after the other; ``of``: the map has that many columns, the rest to
    be appended by the caller."""
    pack = _packer.pack
    rows = sum(n for n, _ in parts)
    items = [p for n, p in parts if n]
    out = [pack(name), _packer.pack_map_header(len(columns) if of is None else of)]
    for c, column in enumerate(columns):
        out += [pack(column), _packer.pack_array_header(rows), *map(itemgetter(c), items)]
    return out


class GroupPart(NamedTuple):
    """A TP group's part of the ``stats`` answer, encoded: its row of the ``groups`` table and
    its rows of the ``group_slots`` table (their number, and each column's items)."""

    entry: tuple[int, tuple[bytes, ...]]
    rows: tuple[int, tuple[bytes, ...]]


def group_part(group: int, members: list[CheckedSnapshot], expected: list[int], missing: dict[int, str]) -> GroupPart:
    """A TP group's part of the ``stats`` answer: its summary and its per-slot rows, none for
    a group of one rank reporting (its summary is that rank's slots: see ``answer_body``)."""
    summary = _group_summary(group, members, expected, missing)
    entry = (1, tuple(_packer.pack(summary[c]) for c in GROUP_TABLE))
    if len(members) < 2:
        return GroupPart(entry, (0, ()))
    slots = _group_slots(members)
    return GroupPart(entry, _rows(group, [slots[c] for c in GROUP_COLUMNS]))


class AnswerBody(NamedTuple):
    """A ``stats`` answer but for what depends on when it is sent (``packed_answer``): the
    encoded parts of everything the ranks pushed, either side of the ``ranks`` table's
    ``step`` and ``confirmed_at`` columns, which change with every heartbeat that confirms a
    snapshot."""

    head: bytes
    tail: bytes
    missing: bool
    """Some expected rank is missing from it."""


_STEP_KEY, _CONFIRMED_KEY = (_packer.pack(c) for c in RANK_TABLE[-2:])
_BODY_KEYS = 2 + len(_TABLES) + 4  # the map entries of an AnswerBody: see answer_body


def answer_body(members: list[CheckedSnapshot], groups: list[GroupPart], missing: dict[int, str]) -> AnswerBody:
    """The parts of a ``stats`` answer that stand until a snapshot or the membership changes,
    from ``members``, by rank.

    Every answer part is a table (a map of equal-length columns): each rank
    is a row of ``ranks`` (``RANK_TABLE``); every rank's slots are rows of
    ``slots`` (``rank`` first), and so are the entries of each sparse table
    (``SPARSE_TABLES``: the last violations, persistent buffers and retained
    spans; ``slot`` is the index of the slot among its rank's; a persistent
    buffer's ``key`` and ``kind`` are indices into ``strings``). Each TP
    group is a row of ``groups`` (``GROUP_TABLE``), and every group's per-slot
    summary rows of ``group_slots`` (``tp_group`` first), but for a group of
    one rank reporting (TP size 1, or all its other ranks missing): its summary
    is that rank's own slots (each number combined over one rank is itself, a
    spread 0), which ``slots`` holds already and ``wsd_client.rows`` reads
    there; at TP size 1 it would repeat every rank's slots. Tables rather than a
    map per rank, group or slot: a client decodes a few long lists much faster
    than thousands of small maps, each repeating its keys. msgpack frames a
    map or an array as a header followed by its items, so the parts encoded
    as each snapshot arrived are spliced in behind headers.
    """
    pack = _packer.pack
    # The ranks table last but for its last two columns, step and confirmed_at, which
    # packed_answer adds.
    head = [
        pack("total_bytes"), pack(sum(s.total_bytes for s in members)),
        *_spliced_table("ranks", RANK_TABLE[:-2], [(1, s.entry) for s in members], of=len(RANK_TABLE)),
    ]
    strings: dict[str, int] = {}
    recoded: list[list[int] | None] = []  # each rank's codes in the answer's strings; None: its own
    for s in members:  # one table of strings for all: each rank's codes kept where they agree
        codes = [strings.setdefault(value, len(strings)) for value in s.strings]
        recoded.append(None if codes == list(range(len(codes))) else codes)
    tail = []
    for i, (name, columns) in enumerate(_TABLES):
        table = SPARSE.get(name)  # None: the slots
        coded = () if table is None else table.coded
        parts = [s.tables[i] if not coded or codes is None else
                 _rows(s.rank, [[codes[c] for c in column] if column_name in coded else column
                                for column_name, column in zip(columns[1:], s.coded[name])])
                 for s, codes in zip(members, recoded)]
        tail += _spliced_table(name, columns, parts)
    tail += [
        pack("strings"), pack(list(strings)),
        *_spliced_table("groups", GROUP_TABLE, [g.entry for g in groups]),
        *_spliced_table("group_slots", _GROUP_SLOTS_TABLE, [g.rows for g in groups]),
        pack("missing"), pack([{"rank": rank, "reason": reason} for rank, reason in sorted(missing.items())]),
    ]
    return AnswerBody(b"".join(head), b"".join(tail), bool(missing))


def packed_answer(body: AnswerBody, *, fresh: bool, as_of: float, step: bytes, confirmed_at: bytes,
                  stale: list[int]) -> bytes:
    """The encoded ``stats`` result (a msgpack map): ``body``, with ``as_of`` (Unix seconds,
    when it is sent), each rank's ``step`` and ``confirmed_at`` (encoded: arrays of the step
    and the Unix seconds at which its snapshot was last known current; its age is
    ``as_of - confirmed_at``), the ``stale`` ranks and whether it is ``complete`` (no rank
    missing, none stale)."""
    pack = _packer.pack
    return b"".join((
        _packer.pack_map_header(_BODY_KEYS + 4),
        pack("complete"), pack(not body.missing and not stale),
        pack("fresh"), pack(fresh),
        pack("as_of"), pack(as_of),
        pack("stale"), pack(stale),
        body.head, _STEP_KEY, step, _CONFIRMED_KEY, confirmed_at, body.tail,
    ))


def read_snapshot(rank: int, tp_group: int, step: int, stats: dict[str, Any]) -> CheckedSnapshot:
    """Check ``stats`` (a ``to_wire`` snapshot) and read it out, in one pass.

    Raises ValueError naming the key otherwise (``slots.requests[3]: expected
    int, got str``). Checked as each reply arrives, so that one agent's bad
    snapshot cannot break the aggregation of everyone else's, nor a client's
    expansion of the answer into rows.
    """
    return CheckedSnapshot(rank, tp_group, step, stats, checked_columns(stats))


def read_changes(previous: CheckedSnapshot, step: int, stats: dict[str, Any],
                 changed: frozenset[str]) -> CheckedSnapshot:
    """``read_snapshot`` of a snapshot that differs from ``previous`` (the same rank's, whose
    checks it passed) only in ``changed``: its own fields, and the slot columns and tables
    named there (``wsd.slotstats.apply_snapshot_delta`` made it). Only those are checked
    and encoded again; ValueError naming the key otherwise."""
    columns = checked_changes(previous.columns, stats, changed)
    return CheckedSnapshot(previous.rank, previous.tp_group, step, stats, columns, previous=previous, changed=changed)


def _group_slots(members: list[CheckedSnapshot]) -> dict[str, list[Any]]:
    """Per (ubatch, lane) of a TP group: each ``GROUP_COLUMNS`` entry, by its number's ``Combine``.

    The usual case (every member has the same slots in the same order) is a
    column-wise pass over the members' columns; otherwise slots are matched by
    (ubatch, lane), over the members that have each.
    """
    if not members:
        return {c: [] for c in GROUP_COLUMNS}
    first = members[0].columns
    ubatch, lane = SLOT_KEY
    if all(m.columns[ubatch] == first[ubatch] and m.columns[lane] == first[lane] for m in members):
        out: dict[str, list[Any]] = {ubatch: first[ubatch], lane: first[lane]}
        for number in SLOT_NUMBERS:
            per_slot = list(zip(*(m.columns[number.name] for m in members)))
            for column in number.group:
                out[column.name] = column.combine.column(per_slot)
        return out
    by_slot: dict[tuple[int, int], dict[str, list[Any]]] = {}
    for m in members:
        for i, key in enumerate(zip(m.columns[ubatch], m.columns[lane])):
            values = by_slot.setdefault(key, {n.name: [] for n in SLOT_NUMBERS})
            for name, held in values.items():
                held.append(m.columns[name][i])
    keys = sorted(by_slot)
    out = {ubatch: [k[0] for k in keys], lane: [k[1] for k in keys]}
    for number in SLOT_NUMBERS:
        matched = [by_slot[k][number.name] for k in keys]
        for column in number.group:
            out[column.name] = column.combine.column(matched)
    return out


def _group_summary(group: int, members: list[CheckedSnapshot], expected: list[int],
                   missing: dict[int, str]) -> dict[str, Any]:
    totals = [m.total_bytes for m in members]
    return {
        "tp_group": group,
        "ranks": expected,
        "reporting": [m.rank for m in members],
        "missing": [{"rank": rank, "reason": missing[rank]} for rank in expected if rank in missing],
        "total_bytes": sum(totals),
        "rank_bytes_min": min(totals, default=0),
        "rank_bytes_max": max(totals, default=0),
        "skew_bytes": (max(totals) - min(totals)) if totals else 0,
        "locked_consistent": len({m.locked for m in members}) <= 1,
        "num_ubatches_consistent": len({m.num_ubatches for m in members}) <= 1,
    }


class StatsRound:
    """One ``stats`` request's replies, aggregated as they arrive.

    ``expected`` maps each TP group in scope to its ranks, as the round
    starts. Once every rank of a group has answered, that group's part of the
    answer is final (its members are all in) and is built and encoded then,
    while other ranks are still answering; ``finish`` builds the rest (groups
    with ranks missing) and splices the encoded parts.
    """

    def __init__(self, expected: dict[int, list[int]]) -> None:
        self.expected = expected
        self.replies: dict[int, CheckedSnapshot] = {}
        self._owed = {g: set(ranks) for g, ranks in expected.items()}
        self._packed: dict[int, GroupPart] = {}

    def add(self, snapshot: CheckedSnapshot) -> None:
        self.replies[snapshot.rank] = snapshot
        group = snapshot.tp_group
        owed = self._owed.get(group)
        if owed is None or snapshot.rank not in owed:
            return
        owed.discard(snapshot.rank)
        if not owed:
            members = [self.replies[r] for r in self.expected[group]]
            if all(m.tp_group == group for m in members):
                self._packed[group] = group_part(group, members, self.expected[group], {})

    def finish(self, expected: dict[int, list[int]], missing: dict[int, str], as_of: float) -> bytes:
        """The encoded ``stats`` result (a msgpack map), every snapshot current ``as_of`` (Unix
        seconds, now).

        ``expected`` maps each TP group in scope to its ranks now; ``missing``
        gives the reason for every expected rank that did not reply.
        """
        replies = self.replies
        ordered = [replies[rank] for rank in sorted(replies)]
        by_group: dict[int, list[CheckedSnapshot]] = {g: [] for g in expected}
        for snapshot in ordered:
            by_group.setdefault(snapshot.tp_group, []).append(snapshot)
        groups = []
        for g, members in sorted(expected.items()):
            packed = self._packed.get(g)
            # Built early only if nothing changed since: same ranks, none of them missing now.
            if packed is None or members != self.expected.get(g) or any(r in missing for r in members):
                packed = group_part(g, by_group[g], members, missing)
            groups.append(packed)
        body = answer_body(ordered, groups, missing)
        return packed_answer(body, fresh=True, as_of=as_of, step=_packer.pack([s.step for s in ordered]),
                             confirmed_at=_packer.pack([as_of] * len(ordered)), stale=[])
