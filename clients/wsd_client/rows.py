"""The ``stats`` answer in rows: the documented shape ``wsctl stats --json`` prints.

``Client.stats()`` returns the coordinator's compact answer, whose parts are
tables: maps of equal-length columns, one row per entry. ``ranks`` has a row
per reporting rank (its figures, and ``confirmed_at``: when its snapshot was
last known current, Unix seconds; ``as_of - confirmed_at`` is its age, as
``ages`` gives). Every rank's slots are rows of one table, ``slots``, whose
``rank`` column says whose each row is (``{"rank": [0, 0, 1, 1], "ubatch":
[0, 1, 0, 1], "capacity_bytes": [4096, 0, ...], ...}``); the last violations
persistent buffers and retained spans likewise (``last_violation``,
``persistent`` and ``retained``, whose ``slot`` is the index of the slot among
its rank's; a persistent buffer's
``key`` and ``kind`` are indices into the answer's ``strings``, a few names
that would otherwise repeat for every slot). ``groups`` has a row per
TP group, and every group's per-slot summary rows are one table too,
``group_slots``, whose ``tp_group`` column says whose each row is; but for a
group of one rank reporting, whose summary is that rank's own slots
(``group_columns`` derives it).
``table_rows`` gives a table's rows as maps; ``stats_rows`` turns the whole
answer into one map per rank and group with one map per slot under each, the
shape ``wsctl``'s JSON and tables show, with each rank's ``age`` and whether
it is ``stale``; the one place that does. Imports no torch.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

from wsd.slotstats import (
    GROUP_COLUMNS,
    SLOT_COLUMNS,
    SLOT_KEY,
    SPARSE_TABLES,
    one_rank_summary,
    slot_rows,
)

__all__ = ["ages", "group_columns", "group_slots", "rank_columns", "rank_slots", "stats_rows",
           "table_rows"]

_TABLES = ("slots", *(table.name for table in SPARSE_TABLES), "group_slots", "strings")


def table_rows(table: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A table's rows, each a map of its columns' names to the row's values."""
    names = tuple(table)
    return [dict(zip(names, values)) for values in zip(*table.values())]


def _split(table: dict[str, list[Any]], owner: str = "rank") -> dict[int, dict[str, list[Any]]]:
    """A table of every rank's (or group's) rows, split by its ``owner`` column (each one's
    rows are together)."""
    out: dict[int, dict[str, list[Any]]] = {}
    owners = table.get(owner, [])
    columns = {name: column for name, column in table.items() if name != owner}
    start = 0
    for key, rows in groupby(owners):
        end = start + sum(1 for _ in rows)
        out[key] = {name: column[start:end] for name, column in columns.items()}
        start = end
    return out


def _decoded(table: dict[str, list[Any]], coded: tuple[str, ...], strings: list[str]) -> dict[str, list[Any]]:
    """A sparse table with its ``coded`` columns as strings: the answer sends them as indices
    into its ``strings``."""
    if not coded:
        return table
    return {name: [strings[i] for i in column] if name in coded else column for name, column in table.items()}


def rank_columns(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's slots as one rank's snapshot holds them (``ManagerStats.to_wire()["slots"]``:
    columns, with each sparse table's entries as a table keyed by slot index)."""
    slots = _split(doc.get("slots") or {})
    sparse = {table.name: _split(_decoded(doc.get(table.name) or {}, table.coded, doc["strings"]))
              for table in SPARSE_TABLES}
    empty: dict[str, list[Any]] = {c: [] for c in SLOT_COLUMNS}
    return {r: {**slots.get(r, empty), **{name: tables.get(r, {}) for name, tables in sparse.items()}}
            for r in doc["ranks"]["rank"]}


def rank_slots(doc: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """One rank's slots as ``[{ubatch, lane, capacity_bytes, peak_requested_bytes, requests,
    resizes, lock_violations, last_violation, persistent, retained}]``."""
    return slot_rows(rank_columns(doc)[rank])


def group_columns(doc: dict[str, Any], ranks: dict[int, dict[str, Any]] | None = None,
                  ) -> dict[int, dict[str, list[Any]]]:
    """Each TP group's per-slot summary as columns (``GROUP_COLUMNS``), by group; a group
    with no rank reporting has empty ones. A group of one rank reporting has no rows in
    ``group_slots``: its summary is that rank's slots (``one_rank_summary``), from
    ``ranks`` (``rank_columns(doc)``, built here if needed and not given)."""
    tables = _split(doc.get("group_slots") or {}, "tp_group")
    groups = doc["groups"]
    out = {}
    for group, reporting in zip(groups["tp_group"], groups["reporting"]):
        if ranks is None and _derived(group, reporting, tables):
            ranks = rank_columns(doc)
        out[group] = _summary(group, reporting, tables, ranks)
    return out


def _derived(group: int, reporting: list[int], tables: dict[int, dict[str, list[Any]]]) -> bool:
    """The group's summary is not in ``group_slots`` but is its one reporting rank's slots."""
    return group not in tables and len(reporting) == 1


def _summary(group: int, reporting: list[int], tables: dict[int, dict[str, list[Any]]],
             ranks: dict[int, dict[str, Any]] | None) -> dict[str, list[Any]]:
    """One group's summary columns, from ``group_slots`` (``tables``, split by group) or from
    its one reporting rank's own slots (``ranks``, needed then)."""
    if _derived(group, reporting, tables):
        assert ranks is not None
        return one_rank_summary(ranks[reporting[0]])
    return tables.get(group) or {c: [] for c in GROUP_COLUMNS}


def group_slots(doc: dict[str, Any], tp_group: int) -> list[dict[str, Any]]:
    """One TP group's per-slot summary as ``[{ubatch, lane, ranks, capacity_min,
    capacity_max, capacity_total, skew_bytes, peak_requested_max, requests,
    resizes, lock_violations}]``, ``ranks`` being the reporting ranks that have the slot.
    ValueError if the answer has no such group."""
    groups = doc["groups"]
    i = groups["tp_group"].index(tp_group)
    group = {name: column[i] for name, column in groups.items()}
    ranks = rank_columns(doc)
    tables = _split(doc.get("group_slots") or {}, "tp_group")
    return _group_rows(group, _summary(tp_group, group["reporting"], tables, ranks), ranks)


def _group_rows(group: dict[str, Any], columns: dict[str, list[Any]],
                ranks: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """``group``'s summary ``columns`` as rows, each with the reporting ranks whose own
    slot ``columns`` (``ranks``, by rank) hold it."""
    ubatch, lane = SLOT_KEY
    holding = {r: set(zip(ranks[r][ubatch], ranks[r][lane])) for r in group["reporting"] if r in ranks}
    rows = []
    for values in zip(*(columns[c] for c in GROUP_COLUMNS)):
        row = dict(zip(GROUP_COLUMNS, values))
        key = (row[ubatch], row[lane])
        rows.append({ubatch: key[0], lane: key[1], "ranks": [r for r, held in holding.items() if key in held],
                     **{c: row[c] for c in GROUP_COLUMNS[len(SLOT_KEY):]}})
    return rows


def ages(doc: dict[str, Any]) -> dict[int, float]:
    """Each rank's age: seconds from when its snapshot was last known current to ``as_of``,
    when the answer was sent (both the coordinator's clock), to the millisecond."""
    as_of = doc["as_of"]
    ranks = doc["ranks"]
    return {r: round(max(0.0, as_of - at), 3) for r, at in zip(ranks["rank"], ranks["confirmed_at"])}


def stats_rows(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``stats`` answer with a map per rank and group (``table_rows``), each rank's
    slots as rows under it, each group's likewise, and each rank's ``age`` and whether it is
    ``stale``."""
    columns = rank_columns(doc)
    groups = group_columns(doc, columns)
    age = ages(doc)
    stale = set(doc["stale"])
    rows = {k: v for k, v in doc.items() if k not in _TABLES}
    return {
        **rows,
        "ranks": [{**r, "age": age[r["rank"]], "stale": r["rank"] in stale, "slots": slot_rows(columns[r["rank"]])}
                  for r in table_rows(doc["ranks"])],
        "groups": [{**g, "slots": _group_rows(g, groups[g["tp_group"]], columns)} for g in table_rows(doc["groups"])],
    }
