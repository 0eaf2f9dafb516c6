"""What the coordinator accepts as a rank's snapshot: every column by name, type and bound.

A snapshot comes from a peer (``ManagerStats.to_wire()``, or a delta on the last
one): before the coordinator aggregates it, each of its rank fields, slot columns
(``SLOT_COLUMNS``) and sparse tables (``SPARSE_TABLES``) is checked against the
schema (``wsd.slotstats``), and ValueError names the first key that is wrong
(``slots.requests[3]: expected int, got str``). The common case takes one cheap
pass (``_plain``); anything else the exact check, which names what is wrong.
No sockets, no torch.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from wsd.slotstats import MAX_LANES, MAX_UBATCHES, SLOT_COLUMNS, SLOT_KEY, SLOT_NUMBERS, SPARSE_TABLES

__all__ = ["MAX_NUMBER", "MAX_SLOTS", "checked_changes", "checked_columns"]

_RANK_FIELDS = {"device": str, "num_ubatches": int, "num_lanes": int, "locked": bool, "slots": dict}
_ALLOCATOR_FIELDS = ("allocator_cap_bytes", "allocator_headroom_bytes")
# Each sparse table's columns and the type of each.
_SPARSE_TYPES = {table.name: table.types for table in SPARSE_TABLES}
# The type of each slot column: the key's are ints, each number's its declared kind.
_SLOT_KINDS: dict[str, type] = {**dict.fromkeys(SLOT_KEY, int), **{n.name: n.kind for n in SLOT_NUMBERS}}
# The types msgpack decodes each kind of column into (a whole number is a float's too).
_DECODED: dict[type, set[type]] = {int: {int}, float: {float, int}}
_BY_KIND = {kind: [c for c in SLOT_COLUMNS if _SLOT_KINDS[c] is kind] for kind in set(_SLOT_KINDS.values())}
_MISSING = object()
_LIST = {list}
MAX_NUMBER = 1 << 40
"""The largest number a snapshot may carry in a slot (1 TiB, or a trillion requests): what no
GPU holds, and what the sums of a TP group's slots keep far inside msgpack's 64 bits. A rank
pushing 2**64 - 1 once broke every client's stats (msgpack overflowed in the aggregates)."""
MAX_SLOTS = MAX_UBATCHES * MAX_LANES
"""The most slots a manager can have: a snapshot with more is not one a manager made."""
_NAMES = {int: "int", str: "str", float: "number", bool: "bool", dict: "map", list: "list"}


def checked_columns(stats: dict[str, Any]) -> dict[str, list[Any]]:
    """The slot columns of ``stats``, a whole snapshot, checked; ValueError naming the key."""
    _check_rank_fields(stats)
    columns = _plain(stats)
    columns = _checked_columns(stats["slots"]) if columns is None else columns
    _check_grid(stats, len(columns[SLOT_KEY[0]]))
    return columns


def checked_changes(before: dict[str, list[Any]], stats: dict[str, Any],
                    changed: frozenset[str]) -> dict[str, list[Any]]:
    """The slot columns of ``stats``, which differs from a checked snapshot whose columns were
    ``before`` only in ``changed``: only those are checked again; ValueError naming the key."""
    _check_rank_fields(stats)
    slots = stats["slots"]
    columns = dict(before)
    count = len(columns[SLOT_KEY[0]])
    _check_grid(stats, count)
    for name in changed:
        if name in _SLOT_KINDS:
            columns[name] = _column(f"slots.{name}", slots.get(name, _MISSING), _SLOT_KINDS[name], count)
        elif slots.get(name) is not None:
            _table(f"slots.{name}", slots[name], _SPARSE_TYPES[name], count)
    return columns


def _check_rank_fields(stats: dict[str, Any]) -> None:
    for key, kind in _RANK_FIELDS.items():
        _need(key, stats.get(key, _MISSING), kind)
    if "total_bytes" in stats:
        _need("total_bytes", stats["total_bytes"], int)
        if not 0 <= stats["total_bytes"] <= 2 * MAX_SLOTS * MAX_NUMBER:  # scratch and persistent
            raise ValueError(f"total_bytes: {stats['total_bytes']} out of range 0..{2 * MAX_SLOTS * MAX_NUMBER}")
    for key in _ALLOCATOR_FIELDS:  # a capped device's allocator: both or neither
        if (key in stats) != (_ALLOCATOR_FIELDS[0] in stats):
            raise ValueError(f"{key}: the allocator's cap and headroom come together")
        if key in stats:
            _need(key, stats[key], int)
            if not 0 <= stats[key] <= MAX_NUMBER:
                raise ValueError(f"{key}: {stats[key]} out of range 0..{MAX_NUMBER}")


def _check_grid(stats: dict[str, Any], count: int) -> None:
    """A manager has one slot per ubatch and lane: a snapshot claiming another grid is not
    one a manager made (and would feed a sizing profile of a grid it never ran)."""
    if stats["num_ubatches"] * stats["num_lanes"] != count:
        raise ValueError(f"slots: {count} slots for a grid of {stats['num_ubatches']} ubatch(es) x "
                         f"{stats['num_lanes']} lane(s)")


def _need(where: str, value: Any, kind: type) -> None:
    if value is _MISSING:
        raise ValueError(f"{where}: missing")
    # bool is an int in Python; it is never a count of bytes.
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{where}: expected {_NAMES[kind]}, got bool")
    if kind is float and isinstance(value, int):
        return  # a whole number of seconds
    if not isinstance(value, kind):
        raise ValueError(f"{where}: expected {_NAMES[kind]}, got {type(value).__name__}")


def _column(where: str, value: Any, kind: type, length: int | None) -> list[Any]:
    """One column: a list of ``length`` values of ``kind``, or ValueError naming it.

    The common case is one type test of the whole column (msgpack decodes
    integers as exactly ``int``); anything else takes the exact check, which
    raises naming the entry or accepts what it always accepted (say an int
    subclass from a caller in the same process). Integers are numbers of a
    slot: 0 to ``MAX_NUMBER``.
    """
    _need(where, value, list)
    if length is not None and len(value) != length:
        raise ValueError(f"{where}: {len(value)} entries, expected {length} (one per slot)")
    if len(value) > MAX_SLOTS:
        raise ValueError(f"{where}: {len(value)} entries, more than a manager's {MAX_SLOTS} slots")
    if not set(map(type, value)) <= {kind}:
        for i, item in enumerate(value):
            _need(f"{where}[{i}]", item, kind)
    if kind is int and value and not (0 <= min(value) and max(value) <= MAX_NUMBER):
        i, bad = next((i, v) for i, v in enumerate(value) if not 0 <= v <= MAX_NUMBER)
        raise ValueError(f"{where}[{i}]: {bad} out of range 0..{MAX_NUMBER}")
    return value


def _table(where: str, value: Any, types: dict[str, type], slots: int) -> None:
    """A sparse table of a snapshot: equal-length columns, ``slot`` indexing a slot."""
    _need(where, value, dict)
    length = None
    for name, kind in types.items():
        column = _column(f"{where}.{name}", value.get(name, _MISSING), kind, length)
        length = len(column)
    for i, slot in enumerate(value["slot"]):
        if not 0 <= slot < slots:
            raise ValueError(f"{where}.slot[{i}]: slot index {slot} out of range 0..{slots - 1}")


def _plain_table(table: Any, kinds: dict[str, type], slots: int) -> bool:
    """A sparse table in the form agents send (see ``_plain``)."""
    parts = list(map(table.__getitem__, kinds))
    if set(map(type, parts)) != _LIST or len(set(map(len, parts))) != 1:
        return False
    if not parts[0]:
        return True
    for column, kind in zip(parts, kinds.values()):
        if set(map(type, column)) != {kind} or (kind is int and not (0 <= min(column) and max(column) <= MAX_NUMBER)):
            return False
    return 0 <= min(parts[0]) and max(parts[0]) < slots


def _plain(stats: dict[str, Any]) -> dict[str, list[Any]] | None:
    """The slot columns of a snapshot in the form agents send, or None to check exactly.

    One cheap pass over the common case: every column a list of the same
    length, one type test over all the numbers of each kind at once (msgpack
    decodes integers as exactly ``int``), the sparse tables likewise. Anything
    it does not recognise goes to the exact check, which names what is wrong.
    """
    try:
        slots = stats["slots"]
        columns = {c: slots[c] for c in SLOT_COLUMNS}
        lists = columns.values()
        if set(map(type, lists)) != _LIST or len(set(map(len, lists))) != 1:
            return None
        n = len(columns[SLOT_COLUMNS[0]])
        if n > MAX_SLOTS:
            return None
        if n:
            for kind, names in _BY_KIND.items():
                if not set(map(type, chain.from_iterable(columns[c] for c in names))) <= _DECODED[kind]:
                    return None
            ints = _BY_KIND[int]
            if not (0 <= min(map(min, (columns[c] for c in ints)))
                    and max(map(max, (columns[c] for c in ints))) <= MAX_NUMBER):
                return None
        for name, kinds in _SPARSE_TYPES.items():
            table = slots.get(name)
            if table is not None and not _plain_table(table, kinds, n):
                return None
    except (KeyError, TypeError):  # a key missing, or not a map or list
        return None
    return columns


def _checked_columns(slots: dict[str, Any]) -> dict[str, list[Any]]:
    """The exact check of a snapshot's slots: its columns, or ValueError naming the key."""
    length = None
    columns = {}
    for name in SLOT_COLUMNS:
        column = _column(f"slots.{name}", slots.get(name, _MISSING), _SLOT_KINDS[name], length)
        length = len(column)
        columns[name] = column
    for name, types in _SPARSE_TYPES.items():
        if name in slots:
            _table(f"slots.{name}", slots[name], types, length or 0)
    return columns
