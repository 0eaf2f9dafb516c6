"""Immutable snapshots of a workspace manager's state, and the per-slot statistics schema.

Plain frozen data, importing no torch: a snapshot crosses threads (the agent's
I/O thread reads it while the engine runs) and processes (it is sent to the
coordinator as msgpack) as it is.

``SLOT_NUMBERS`` declares each number a slot reports once: its type, how it
combines over the ranks of a TP group, its Prometheus family and its ``wsctl``
column. The wire form and its checks, the TP group summaries
(``wsd.coordinator.aggregate``), the metrics (``wsd.coordinator.metrics``) and
``wsctl``'s tables (``wsd_client.render``) are derived from it, by name.

A module of the shared floor, importing nothing of wsd's: it is the contract
between the manager that fills a snapshot and the agent, the coordinator and the
clients that read one, none of which imports the manager for it. ``MAX_UBATCHES``
and ``MAX_LANES`` bound a manager's grid of slots here for the same reason (the
command table's ``set_ubatches``, the coordinator's checks of a snapshot).

Two plain forms: ``to_dict``/``from_dict``, one map per slot (the documented
row shape ``wsctl --json`` prints), and ``to_wire``/``from_wire``, the compact
columnar form agents send and the coordinator passes on: the slots as a map of
equal-length columns (``SLOT_COLUMNS``), with the rarer parts (``SPARSE_TABLES``:
the last violation, the persistent buffers, the retained span) as tables of their
own keyed by slot index. ``slot_rows`` turns the columns back into the row shape.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from operator import sub
from typing import Any, NamedTuple, get_type_hints

__all__ = [
    "GROUP_COLUMNS", "GROUP_TABLE", "MAX_LANES", "MAX_UBATCHES", "RANK_TABLE", "SLOT_COLUMNS", "SLOT_KEY",
    "SLOT_NUMBERS", "SPARSE", "SPARSE_TABLES", "Combine", "GroupColumn", "LockViolation",
    "ManagerStats", "PersistentStats", "RetainedStats", "SlotNumber", "SlotStats", "SparseTable",
    "apply_snapshot_delta", "one_rank_summary", "slot_rows", "snapshot_delta"
]

MAX_UBATCHES = 64
"""Largest ``num_ubatches`` a manager accepts."""
MAX_LANES = 64
"""Largest ``num_lanes`` a manager accepts."""

# -- the per-slot statistics schema --------------------------------------------------


class Combine(enum.Enum):
    """How one number of a slot combines over the ranks of a TP group."""

    MIN = "min"
    MAX = "max"
    SUM = "sum"
    SPREAD = "spread"
    """Largest minus smallest: how far the ranks are apart."""

    def column(self, per_slot: Sequence[Sequence[Any]]) -> list[Any]:
        """One value per slot, each from that slot's values on every rank."""
        if self is Combine.SUM:
            return list(map(sum, per_slot))
        if self is Combine.MIN:
            return list(map(min, per_slot))
        if self is Combine.MAX:
            return list(map(max, per_slot))
        return list(map(sub, map(max, per_slot), map(min, per_slot)))

    def of_one(self, values: Sequence[Any]) -> list[Any]:
        """``column`` over one rank whose slots hold ``values``: the values themselves, or
        a spread of 0 (of their type) each."""
        if self is Combine.SPREAD:
            return list(map(sub, values, values))
        return list(values)


class GroupColumn(NamedTuple):
    """One column of a TP group's per-slot summary, derived from one slot number."""

    name: str
    """Its key in the ``stats`` answer's ``groups[].slots``."""
    combine: Combine
    header: str | None
    """Its ``wsctl stats`` column; None: in the JSON only."""


@dataclass(frozen=True, kw_only=True)
class SlotNumber:
    """One number every slot reports: declared once, everything else derived.

    ``name`` is the ``SlotStats`` attribute, the wire column, the key of the
    rows ``wsctl --json`` prints and, on the manager's side, the ``Slot``
    attribute that counts it. From the declaration come the wire form and its
    checks (``kind``), the TP group's summary columns (``group``), the
    per-slot Prometheus family (``metric``) and the ``wsctl`` column (``header``).
    """

    name: str
    kind: type
    """``int`` or ``float``; a wire value of another type is refused, naming it."""
    help: str
    """What it counts; also the metric's help text."""
    header: str
    """Its column in ``wsctl stats`` and ``wsctl watch``."""
    unit: str = ""
    """``"bytes"``: shown in KiB/MiB/GiB; ``""``: a plain number."""
    metric: str
    """The Prometheus family, one sample per rank and slot."""
    counter: bool = False
    """The metric is a counter (it only grows while the rank lives), else a gauge."""
    group: tuple[GroupColumn, ...]

    def __post_init__(self) -> None:
        if self.kind not in (int, float):
            raise ValueError(f"slot number {self.name}: kind must be int or float, got {self.kind!r}")
        if self.counter != self.metric.endswith("_total"):
            raise ValueError(f"slot number {self.name}: a counter's metric, and only a counter's, ends in _total")


SLOT_KEY = ("ubatch", "lane")
"""The columns that name a slot."""

SLOT_NUMBERS = (
    SlotNumber(name="capacity_bytes", kind=int, unit="bytes", header="CAPACITY",
               help="Size of the slot's scratch buffer.", metric="wsd_slot_capacity_bytes",
               group=(GroupColumn("capacity_min", Combine.MIN, "MIN CAPACITY"),
                      GroupColumn("capacity_max", Combine.MAX, "MAX CAPACITY"),
                      GroupColumn("capacity_total", Combine.SUM, None),
                      GroupColumn("skew_bytes", Combine.SPREAD, "SKEW"))),
    SlotNumber(name="peak_requested_bytes", kind=int, unit="bytes", header="PEAK",
               help="Largest total one get_simultaneous call asked of the slot (refused calls included).",
               metric="wsd_slot_peak_requested_bytes",
               group=(GroupColumn("peak_requested_max", Combine.MAX, "MAX PEAK"),)),
    SlotNumber(name="requests", kind=int, header="REQUESTS", help="get_simultaneous calls the slot served.",
               metric="wsd_slot_requests_total", counter=True,
               group=(GroupColumn("requests", Combine.SUM, None),)),
    SlotNumber(name="resizes", kind=int, header="RESIZES", help="Times the slot's buffer was reallocated larger.",
               metric="wsd_slot_resizes_total", counter=True,
               group=(GroupColumn("resizes", Combine.SUM, None),)),
    SlotNumber(name="lock_violations", kind=int, header="VIOLATIONS",
               help="Requests the slot refused because the workspace was locked.",
               metric="wsd_slot_lock_violations_total", counter=True,
               group=(GroupColumn("lock_violations", Combine.SUM, "VIOLATIONS"),)),
)
"""Every number a slot reports, in wire order. A new one is a row here, an
attribute of ``SlotStats`` and the ``Slot`` counter that counts it."""

SLOT_COLUMNS = SLOT_KEY + tuple(n.name for n in SLOT_NUMBERS)
"""The columns of a slot table on the wire, one entry per slot, in slot order."""
GROUP_COLUMNS = (*SLOT_KEY, *(c.name for n in SLOT_NUMBERS for c in n.group))
"""The columns of a TP group's per-slot summary, as the ``stats`` answer's ``group_slots`` table
carries them (which ranks have each slot is in the ranks' own ``slots`` table)."""

RANK_TABLE = ("rank", "tp_group", "device", "num_ubatches", "num_lanes", "locked", "total_bytes",
              "capacity_bytes", "lock_violations", "allocator_cap_bytes", "allocator_headroom_bytes", "step",
              "confirmed_at")
"""The columns of the answer's ``ranks`` table, one row per rank reporting (no allocator cap:
None). The last two change without a push: ``step`` and ``confirmed_at`` are the step and the
time at which the rank last said its snapshot is current (a push, or a heartbeat finding it
unchanged), the step ``ranks`` shows too."""
GROUP_TABLE = ("tp_group", "ranks", "reporting", "missing", "total_bytes", "rank_bytes_min", "rank_bytes_max",
               "skew_bytes", "locked_consistent", "num_ubatches_consistent")
"""The columns of the answer's ``groups`` table, one row per TP group in scope."""


def one_rank_summary(columns: dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """The per-slot summary (``GROUP_COLUMNS``) of a TP group whose one rank reporting has
    these slot columns: each number combined over that one rank, as over several.

    The ``stats`` answer leaves such a group out of ``group_slots``; its clients
    derive it here, from the rank's own rows of ``slots``.
    """
    out: dict[str, list[Any]] = {key: list(columns[key]) for key in SLOT_KEY}
    for number in SLOT_NUMBERS:
        values = columns[number.name]
        for column in number.group:
            out[column.name] = column.combine.of_one(values)
    return out


@dataclass(frozen=True, slots=True)
class LockViolation:
    """The last request a locked slot refused."""

    caller: str
    """``file:line:function`` of the code outside the manager that asked."""
    requested: int
    """Bytes the request needed."""
    capacity: int
    """Bytes the slot held at the time."""
    time: float
    """Wall-clock time (``time.time()``) of the refusal."""


@dataclass(frozen=True, slots=True)
class PersistentStats:
    """One persistent buffer or resource of a slot."""

    key: str
    kind: str
    """``"tensor"`` (from ``get_persistent``) or ``"resource"``."""
    nbytes: int
    """Bytes of the tensors it holds (0 for a resource holding none)."""


@dataclass(frozen=True, slots=True)
class RetainedStats:
    """The span at the end of a slot's buffer that ``get_retained`` (vLLM 0.34) last handed
    out, and that requests have not reached into since: what the next ``get_retained`` of
    the same key finds intact. Inside the scratch buffer, so not counted again in totals."""

    key: str
    nbytes: int


@dataclass(frozen=True)
class SparseTable:
    """One of a slot's rarer parts, sent as a table of its own: one entry per record, its
    ``slot`` column the index of the slot it belongs to among its rank's.

    ``name`` is the ``SlotStats`` attribute, the wire key under ``slots``, the table of
    the ``stats`` answer and the key of each row ``wsctl --json`` prints; ``record``
    declares the columns and their types (its fields, in order). Every reader and
    writer of the table is derived from this: a column added to ``record`` is sent,
    checked and shown with no other edit.
    """

    name: str
    record: type
    many: bool
    """A tuple of records per slot; else at most one (None when none)."""
    coded: tuple[str, ...] = ()
    """Columns the ``stats`` answer sends as indices into its ``strings``: a few names,
    repeated for every slot of every rank."""

    # Derived from ``record`` once each (every snapshot written or read walks them).
    @cached_property
    def fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.record))

    @cached_property
    def columns(self) -> tuple[str, ...]:
        """The table's columns on the wire: ``slot``, then the record's fields."""
        return ("slot", *self.fields)

    @cached_property
    def types(self) -> dict[str, type]:
        """Each column's type: ``int``, ``str`` or ``float``."""
        hints = get_type_hints(self.record)
        return {"slot": int, **{name: hints[name] for name in self.fields}}

    def records(self, value: Any) -> tuple[Any, ...]:
        """A ``SlotStats`` attribute of this table's as a tuple of records."""
        if self.many:
            return tuple(value)
        return () if value is None else (value,)


SPARSE_TABLES = (
    SparseTable("last_violation", LockViolation, many=False),
    SparseTable("persistent", PersistentStats, many=True, coded=("key", "kind")),
    SparseTable("retained", RetainedStats, many=False),
)
"""A slot's sparse parts, in wire order: the last request it refused, its persistent
buffers and resources, and the retained span at its buffer's end."""
SPARSE = {table.name: table for table in SPARSE_TABLES}


@dataclass(frozen=True, slots=True)
class SlotStats:
    """One (ubatch, lane) slot: one attribute per ``SLOT_COLUMNS`` entry (what each number
    counts is said in ``SLOT_NUMBERS``), then one per ``SPARSE_TABLES`` entry: its last
    refused request, its persistent buffers and its retained span."""

    ubatch: int
    lane: int
    capacity_bytes: int
    peak_requested_bytes: int
    requests: int
    resizes: int
    lock_violations: int
    last_violation: LockViolation | None
    persistent: tuple[PersistentStats, ...]
    retained: RetainedStats | None = None

    @property
    def persistent_bytes(self) -> int:
        return sum(p.nbytes for p in self.persistent)

    @classmethod
    def of(cls, ubatch: int = 0, lane: int = 0, **given: Any) -> SlotStats:
        """A slot whose every number is 0 and every sparse part empty, but for ``given`` (by
        name): how a test or a simulation builds one, so that a number the schema gains
        needs no edit there. TypeError naming a name the schema does not have."""
        unknown = sorted(set(given) - set(SLOT_COLUMNS) - {t.name for t in SPARSE_TABLES})
        if unknown:
            raise TypeError(f"SlotStats has no {', '.join(unknown)}")
        values: dict[str, Any] = {n.name: n.kind() for n in SLOT_NUMBERS}
        values |= {t.name: () if t.many else None for t in SPARSE_TABLES}
        return cls(**{**values, "ubatch": ubatch, "lane": lane, **given})


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A whole manager: its configuration and every slot; where the device allocator is capped,
    the cap and what it may still reserve under it (``wsd.manager.allocator``)."""

    device: str
    num_ubatches: int
    num_lanes: int
    locked: bool
    slots: tuple[SlotStats, ...]
    allocator_cap_bytes: int | None = None
    allocator_headroom_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Scratch capacity plus persistent bytes over all slots."""
        return sum(s.capacity_bytes + s.persistent_bytes for s in self.slots)

    @property
    def lock_violations(self) -> int:
        return sum(s.lock_violations for s in self.slots)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars, ready for msgpack or JSON.

        The same as ``dataclasses.asdict`` plus ``total_bytes``, written out by
        hand: ``asdict``'s recursive deep copy costs several times more.
        """
        slots = []
        total = 0
        for s in self.slots:
            total += s.capacity_bytes + s.persistent_bytes
            row = {c: getattr(s, c) for c in SLOT_COLUMNS}
            for table in SPARSE_TABLES:
                value = getattr(s, table.name)
                if table.many:
                    row[table.name] = tuple(_record_dict(table, r) for r in value)
                else:
                    row[table.name] = None if value is None else _record_dict(table, value)
            slots.append(row)
        return {"device": self.device, "num_ubatches": self.num_ubatches, "num_lanes": self.num_lanes,
                "locked": self.locked, "slots": tuple(slots), "total_bytes": total, **self._allocator()}

    def _allocator(self) -> dict[str, int]:  # absent where the allocator has no cap
        cap, headroom = self.allocator_cap_bytes, self.allocator_headroom_bytes
        return {} if cap is None else {"allocator_cap_bytes": cap, "allocator_headroom_bytes": headroom or 0}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManagerStats:
        """The inverse of ``to_dict`` (extra keys such as ``total_bytes`` ignored)."""
        slots = []
        for s in data["slots"]:
            sparse: dict[str, Any] = {}
            for table in SPARSE_TABLES:
                value = s.get(table.name)
                if table.many:
                    sparse[table.name] = tuple(table.record(**r) for r in value or ())
                else:
                    sparse[table.name] = table.record(**value) if value else None
            slots.append(SlotStats(**{c: s[c] for c in SLOT_COLUMNS}, **sparse))
        return cls(
            device=data["device"],
            num_ubatches=data["num_ubatches"],
            num_lanes=data["num_lanes"],
            locked=data["locked"],
            slots=tuple(slots),
            allocator_cap_bytes=data.get("allocator_cap_bytes"), allocator_headroom_bytes=data.get(
                "allocator_headroom_bytes"))

    def to_wire(self) -> dict[str, Any]:
        """The compact form agents send: ``slots`` as columns (see the module docstring). Per
        slot, msgpack carries a few small numbers instead of a map of named fields: about a
        fifth of the bytes, and a fraction of the coordinator's work per rank.
        """
        slots = self.slots
        columns: dict[str, Any] = {c: [getattr(s, c) for s in slots] for c in SLOT_COLUMNS}
        for table in SPARSE_TABLES:
            entries: dict[str, list[Any]] = {c: [] for c in table.columns}
            attribute = table.name
            for i, s in enumerate(slots):
                value = getattr(s, attribute)
                if value:  # most slots have none: None, or an empty tuple
                    for record in table.records(value):
                        entries["slot"].append(i)
                        for name in table.fields:
                            entries[name].append(getattr(record, name))
            columns[attribute] = entries
        total = sum(s.capacity_bytes + s.persistent_bytes for s in slots)
        return {"device": self.device, "num_ubatches": self.num_ubatches, "num_lanes": self.num_lanes,
                "locked": self.locked, "slots": columns, "total_bytes": total, **self._allocator()}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ManagerStats:
        """The inverse of ``to_wire`` (extra keys such as ``total_bytes`` ignored)."""
        return cls.from_dict({**data, "slots": slot_rows(data["slots"])})


def slot_rows(columns: dict[str, Any]) -> list[dict[str, Any]]:
    """The slots of a ``to_wire`` snapshot as rows, each as ``to_dict`` gives it.

    The one place that expands the columnar form: the clients' JSON and tables
    and ``from_wire`` all read slots through it.
    """
    rows = [dict(zip(SLOT_COLUMNS, values)) for values in zip(*(columns[c] for c in SLOT_COLUMNS))]
    for table in SPARSE_TABLES:
        for row in rows:
            row[table.name] = [] if table.many else None
        entries = columns.get(table.name) or {}
        names = table.fields
        for i, *values in zip(*(entries.get(c, ()) for c in table.columns)):
            record = dict(zip(names, values))
            if table.many:
                rows[i][table.name].append(record)
            else:
                rows[i][table.name] = record
    return rows


def _record_dict(table: SparseTable, record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in table.fields}


# -- deltas of the wire form: what an agent pushes when its snapshot changed ------------------

# A snapshot's own values, besides its slots.
_SCALARS = ("device", "num_ubatches", "num_lanes", "locked", "total_bytes", "allocator_cap_bytes",
            "allocator_headroom_bytes")
_NUMBER_COLUMNS = frozenset(n.name for n in SLOT_NUMBERS)
_TABLES = tuple(table.name for table in SPARSE_TABLES)
_DELTA_KEYS = frozenset({"fields", "columns", "tables"})


def snapshot_delta(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """What changed from one ``to_wire`` snapshot to the next, or None if its slots did
    (their number or keys: after ``set-ubatches``), when the whole snapshot must go.

    ``{"fields": {name: value}, "columns": {number: [[slot index, ...], [value, ...]]},
    "tables": {name: table}}``: the snapshot's own values that changed, the entries of
    each slot number that changed, and the sparse tables that changed, whole.
    ``apply_snapshot_delta(old, delta) == new``.
    """
    olds, news = old["slots"], new["slots"]
    if any(olds[c] != news[c] for c in SLOT_KEY):
        return None
    fields = {k: new[k] for k in _SCALARS if k in new and old.get(k) != new[k]}
    columns = {}
    for name in _NUMBER_COLUMNS:
        a, b = olds[name], news[name]
        if a != b:
            changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            columns[name] = [changed, [b[i] for i in changed]]
    tables = {k: news[k] for k in _TABLES if olds.get(k) != news.get(k)}
    return {"fields": fields, "columns": columns, "tables": tables}


def apply_snapshot_delta(old: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The snapshot ``delta`` (from ``snapshot_delta``) makes of ``old``, which is left as it
    was; ValueError naming what is wrong with a delta that does not fit it.

    Checks the delta's shape and slot indices only: the values' types are the
    whole snapshot's check (``wsd.coordinator.aggregate.read_snapshot``).
    """
    if not isinstance(delta, dict) or not set(delta) <= _DELTA_KEYS:
        raise ValueError(f"delta: expected a map of {sorted(_DELTA_KEYS)}")
    fields = delta.get("fields", {})
    columns = delta.get("columns", {})
    tables = delta.get("tables", {})
    for where, value, known in (("fields", fields, _SCALARS), ("columns", columns, _NUMBER_COLUMNS),
                                ("tables", tables, _TABLES)):
        if not isinstance(value, dict):
            raise ValueError(f"delta.{where}: expected a map")
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"delta.{where}: unknown {unknown[0]!r}")
    slots = dict(old["slots"])
    count = len(slots[SLOT_KEY[0]])
    for name, change in columns.items():
        if not (isinstance(change, list) and len(change) == 2 and isinstance(change[0], list)
                and isinstance(change[1], list) and len(change[0]) == len(change[1])):
            raise ValueError(f"delta.columns.{name}: expected [[slot index, ...], [value, ...]] of equal length")
        column = list(slots[name])
        for i, value in zip(*change):
            if type(i) is not int or not 0 <= i < count:
                raise ValueError(f"delta.columns.{name}: slot index {i!r} out of range 0..{count - 1}")
            column[i] = value
        slots[name] = column
    slots.update(tables)
    return {**old, **fields, "slots": slots}


# SlotStats carries exactly the schema's columns, then the sparse parts: checked
# at import, so that a number added to one and not the other fails at once.
_SLOT_ATTRIBUTES = tuple(f.name for f in fields(SlotStats))
if _SLOT_ATTRIBUTES != (*SLOT_COLUMNS, *_TABLES):
    raise TypeError(f"SlotStats {_SLOT_ATTRIBUTES} does not match SLOT_COLUMNS {SLOT_COLUMNS}")
