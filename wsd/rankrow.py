"""A rank as the coordinator shows it, declared once: the state its manager reports, and its row.

``ManagerState`` is what an agent reports of its manager in every registration,
heartbeat and goodbye (``state``); ``read_manager_state`` is the coordinator's
type-checked reading of it, and ``AGREED`` the keys that every rank of a TP group
must agree on (the consistency check, ``drift``, ``status`` and ``engines``).

``RankRow`` is one entry of the ``ranks`` answer: its fields are the keys of the
row the coordinator builds (``wsd.coordinator.registry``), the typed properties
the client reads it through (``wsd_client.results.RankEntry``, derived from the
fields) and the table of docs/wsctl.md (``tests/unit/test_docs.py``).

A module of the shared floor, importing nothing of wsd's: the coordinator builds
the row and the torch-free client reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict, get_type_hints

__all__ = ["AGREED", "ManagerState", "RankRow", "read_manager_state", "row_fields"]


class ManagerState(TypedDict, total=False):
    """What an agent reports of its rank's manager; a key absent is not known (yet)."""

    locked: bool
    num_ubatches: int
    warming: bool
    """Its engine is still warming up: no command applies to it before that ends."""


AGREED: tuple[Literal["locked", "num_ubatches"], ...] = ("locked", "num_ubatches")
"""The keys of ``ManagerState`` that every live rank of a TP group must agree on."""

_STATE_TYPES: dict[str, type] = get_type_hints(ManagerState)


def read_manager_state(state: Mapping[str, Any]) -> ManagerState:
    """The keys of ``ManagerState`` in ``state`` whose value has the declared type.

    Status and the group consistency check compare and sort these values; one of
    another type (a list, or a bool for a count) would break them for every client,
    so it reads as unknown instead.
    """
    out: dict[str, Any] = {}
    for key, kind in _STATE_TYPES.items():
        value = state.get(key)
        if type(value) is kind:
            out[key] = value
    return out  # type: ignore[return-value]  # every key and type checked against ManagerState's


def _doc(text: str) -> Any:
    return field(metadata={"doc": text})


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """One rank of the ``ranks`` answer, as it goes on the wire (``to_wire``)."""

    engine: str | None = _doc("the engine the rank serves")
    rank: int = _doc("its global rank")
    state: str = _doc("`live`, `stalled` (live, its engine inside one step past `stall_after`), `lost` or "
                      "`stopped`")
    tp_group: int = _doc("its TP group")
    host: str = _doc("the host its worker runs on")
    pid: int = _doc("its worker's process id")
    device: str = _doc("its device (`cuda:0`, `cpu`)")
    idle: bool = _doc("a rank with no engine loop (the built-in worker's `--idle`): commands apply on receipt")
    step: int = _doc("the engine step it last reported")
    applied_seq: int = _doc("the last command it applied")
    registered_at: float = _doc("when it registered, wall-clock Unix seconds")
    last_seen: float = _doc("when it was last heard, wall-clock Unix seconds")
    lost_at: float | None = _doc("when it was marked lost; null unless it is (or was) lost")
    stopped_at: float | None = _doc("when it said goodbye; null unless it did")
    locked: bool | None = _doc("whether its workspace is locked, as it last reported; null before its first report")
    num_ubatches: int | None = _doc("its slot count's ubatches, as it last reported; null before its first report")
    model: str | None = _doc("what its engine serves, as the agent said; null: not said")
    warming: bool = _doc("its engine is still warming up: no command, and no replayed desired state, applies "
                         "to it before its warm-up ends")
    in_step: float | None = _doc("seconds its engine has been inside its current step; null between steps")

    def to_wire(self) -> dict[str, Any]:
        """The row as a map, one key per field, in the declared order."""
        return dict(vars(self))


def row_fields() -> list[tuple[str, Any, str]]:
    """``(name, type, what it says)`` per field of ``RankRow``, in order."""
    hints = get_type_hints(RankRow)
    return [(f.name, hints[f.name], f.metadata["doc"]) for f in fields(RankRow)]
