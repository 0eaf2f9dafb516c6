"""Immutable snapshots of a workspace manager's state.

Plain frozen data, importing no torch: a snapshot crosses threads (the agent's
I/O thread reads it while the engine runs) and processes (it is sent to the
coordinator as msgpack) as it is. ``to_dict``/``from_dict`` give the wire form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LockViolation", "ManagerStats", "PersistentStats", "SlotStats"]


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
            persistent = tuple({"key": q.key, "kind": q.kind, "nbytes": q.nbytes} for q in s.persistent)
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
