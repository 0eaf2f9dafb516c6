"""Immutable snapshots of a workspace manager's state.

Plain frozen data, importing no torch: a snapshot crosses threads (the agent's
I/O thread reads it while the engine runs) and processes (it is sent to the
coordinator as msgpack) as it is.

Two plain forms: ``to_dict``/``from_dict``, one map per slot (the documented
row shape ``wsctl --json`` prints), and ``to_wire``/``from_wire``, the compact
columnar form agents send and the coordinator passes on: the slots as a map of
equal-length columns, one per number, with the rarer last violations and
persistent buffers as tables of their own keyed by slot index. ``slot_rows``
turns the columns back into the row shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PERSISTENT_COLUMNS", "SLOT_COLUMNS", "VIOLATION_COLUMNS", "LockViolation", "ManagerStats",
           "PersistentStats", "SlotStats", "slot_rows"]

# The columns of a slot table on the wire, one entry per slot, in slot order.
SLOT_COLUMNS = ("ubatch", "lane", "capacity_bytes", "peak_requested_bytes", "requests", "resizes",
                "lock_violations")
# The sparse tables: one entry per violation or persistent buffer, ``slot``
# being the index of the slot it belongs to in the columns above.
VIOLATION_COLUMNS = ("slot", "caller", "requested", "capacity", "time")
PERSISTENT_COLUMNS = ("slot", "key", "kind", "nbytes")


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
class SlotStats:
    """One (ubatch, lane) slot."""

    ubatch: int
    lane: int
    capacity_bytes: int
    """Size of the slot's scratch buffer now."""
    peak_requested_bytes: int
    """Largest total one ``get_simultaneous`` call asked of this slot."""
    requests: int
    """Calls of ``get_simultaneous`` served by this slot."""
    resizes: int
    """Times the buffer was (re)allocated larger."""
    lock_violations: int
    """Requests refused because the manager was locked."""
    last_violation: LockViolation | None
    persistent: tuple[PersistentStats, ...]

    @property
    def persistent_bytes(self) -> int:
        return sum(p.nbytes for p in self.persistent)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A whole manager: its configuration and every slot."""

    device: str
    num_ubatches: int
    num_lanes: int
    locked: bool
    slots: tuple[SlotStats, ...]

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
        hand: the agent builds one per stats request, and ``asdict``'s
        recursive deep copy cost several times more.
        """
        slots = []
        total = 0
        for s in self.slots:
            v = s.last_violation
            persistent: tuple[dict[str, Any], ...] = tuple(
                {"key": q.key, "kind": q.kind, "nbytes": q.nbytes} for q in s.persistent)
            total += s.capacity_bytes + sum(q["nbytes"] for q in persistent)
            slots.append({
                "ubatch": s.ubatch, "lane": s.lane, "capacity_bytes": s.capacity_bytes,
                "peak_requested_bytes": s.peak_requested_bytes, "requests": s.requests,
                "resizes": s.resizes, "lock_violations": s.lock_violations,
                "last_violation": None if v is None else {
                    "caller": v.caller, "requested": v.requested, "capacity": v.capacity, "time": v.time},
                "persistent": persistent,
            })
        return {"device": self.device, "num_ubatches": self.num_ubatches, "num_lanes": self.num_lanes,
                "locked": self.locked, "slots": tuple(slots), "total_bytes": total}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManagerStats:
        """The inverse of ``to_dict`` (extra keys such as ``total_bytes`` ignored)."""
        slots = []
        for s in data["slots"]:
            violation = s.get("last_violation")
            slots.append(
                SlotStats(
                    ubatch=s["ubatch"],
                    lane=s["lane"],
                    capacity_bytes=s["capacity_bytes"],
                    peak_requested_bytes=s["peak_requested_bytes"],
                    requests=s["requests"],
                    resizes=s["resizes"],
                    lock_violations=s["lock_violations"],
                    last_violation=LockViolation(**violation) if violation else None,
                    persistent=tuple(PersistentStats(**p) for p in s["persistent"]),
                )
            )
        return cls(
            device=data["device"],
            num_ubatches=data["num_ubatches"],
            num_lanes=data["num_lanes"],
            locked=data["locked"],
            slots=tuple(slots),
        )

    def to_wire(self) -> dict[str, Any]:
        """The compact form agents send: ``slots`` as columns (see the module docstring).

        Per slot, msgpack then carries seven small integers instead of a map of
        nine named fields: about a fifth of the bytes, and a fraction of the
        coordinator's decoding, checking and encoding per rank.
        """
        slots = self.slots
        violations: dict[str, list[Any]] = {c: [] for c in VIOLATION_COLUMNS}
        persistent: dict[str, list[Any]] = {c: [] for c in PERSISTENT_COLUMNS}
        total = 0
        for i, s in enumerate(slots):
            total += s.capacity_bytes
            v = s.last_violation
            if v is not None:
                for column, value in zip(VIOLATION_COLUMNS, (i, v.caller, v.requested, v.capacity, v.time)):
                    violations[column].append(value)
            for q in s.persistent:
                total += q.nbytes
                for column, value in zip(PERSISTENT_COLUMNS, (i, q.key, q.kind, q.nbytes)):
                    persistent[column].append(value)
        columns: dict[str, Any] = {
            "ubatch": [s.ubatch for s in slots],
            "lane": [s.lane for s in slots],
            "capacity_bytes": [s.capacity_bytes for s in slots],
            "peak_requested_bytes": [s.peak_requested_bytes for s in slots],
            "requests": [s.requests for s in slots],
            "resizes": [s.resizes for s in slots],
            "lock_violations": [s.lock_violations for s in slots],
            "last_violation": violations,
            "persistent": persistent,
        }
        return {"device": self.device, "num_ubatches": self.num_ubatches, "num_lanes": self.num_lanes,
                "locked": self.locked, "slots": columns, "total_bytes": total}

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
    for row in rows:
        row["last_violation"] = None
        row["persistent"] = []
    violations = columns.get("last_violation") or {}
    for i, caller, requested, capacity, when in zip(*(violations.get(c, ()) for c in VIOLATION_COLUMNS)):
        rows[i]["last_violation"] = {"caller": caller, "requested": requested, "capacity": capacity,
                                     "time": when}
    persistent = columns.get("persistent") or {}
    for i, key, kind, nbytes in zip(*(persistent.get(c, ()) for c in PERSISTENT_COLUMNS)):
        rows[i]["persistent"].append({"key": key, "kind": kind, "nbytes": nbytes})
    return rows
