"""Aggregation of per-rank manager snapshots: per rank, per slot, per TP group.

Input is what agents send (``ManagerStats.to_dict()``); output is plain lists
and maps, ready for msgpack or JSON. No sockets, no torch.

Each snapshot is checked and read out in one pass as its reply arrives
(``read_snapshot``), while the other ranks are still answering; what is left
for the end of a round (``aggregate_stats``) is the per-group arithmetic over
the numbers read out, so that the answer leaves soon after the last reply.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

__all__ = ["Snapshot", "aggregate_stats", "read_snapshot"]

_RANK_FIELDS = {"device": str, "num_ubatches": int, "num_lanes": int, "locked": bool, "slots": list}
# The slot's numbers aggregation reads, in the order of a ``Snapshot`` row.
_SLOT_FIELDS = ("ubatch", "lane", "capacity_bytes", "peak_requested_bytes", "requests", "resizes",
                "lock_violations")
_slot_row = itemgetter(*_SLOT_FIELDS)
_INT_ONLY = {int}
_MISSING = object()


def _need(where: str, value: Any, kind: type) -> None:
    if value is _MISSING:
        raise ValueError(f"{where}: missing")
    # bool is an int in Python; it is never a count of bytes.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")


def _checked_row(i: int, slot: Any) -> tuple[int, ...]:
    """The exact check of one slot: its row, or ValueError naming the key."""
    _need(f"slots[{i}]", slot, dict)
    for key in _SLOT_FIELDS:
        _need(f"slots[{i}].{key}", slot.get(key, _MISSING), int)
    return _slot_row(slot)


class Snapshot:
    """One rank's checked snapshot and the numbers aggregation reads from it.

    ``rows`` holds one tuple per slot in ``_SLOT_FIELDS`` order; ``summary`` is
    the rank's entry of the ``stats`` result, built once here.
    """

    __slots__ = ("rank", "tp_group", "rows", "total_bytes", "locked", "num_ubatches", "summary")

    def __init__(self, rank: int, tp_group: int, step: int, stats: dict[str, Any],
                 rows: list[tuple[int, ...]]) -> None:
        self.rank = rank
        self.tp_group = tp_group
        self.rows = rows
        self.total_bytes = stats.get("total_bytes", 0)
        self.locked = stats["locked"]
        self.num_ubatches = stats["num_ubatches"]
        self.summary = {
            "rank": rank,
            "tp_group": tp_group,
            "step": step,
            "device": stats["device"],
            "num_ubatches": self.num_ubatches,
            "num_lanes": stats["num_lanes"],
            "locked": self.locked,
            "total_bytes": self.total_bytes,
            "capacity_bytes": sum(r[2] for r in rows),
            "lock_violations": sum(r[6] for r in rows),
            "slots": stats["slots"],  # passed on as the agent sent them
        }


def read_snapshot(rank: int, tp_group: int, step: int, stats: dict[str, Any]) -> Snapshot:
    """Check that ``stats`` has what aggregation reads and read it out, in one pass.

    Raises ValueError naming the key otherwise. Checked as each reply arrives,
    so that one agent's bad snapshot cannot break the aggregation of everyone
    else's.
    """
    for key, kind in _RANK_FIELDS.items():
        _need(key, stats.get(key, _MISSING), kind)
    if "total_bytes" in stats:
        _need("total_bytes", stats["total_bytes"], int)
    rows = []
    for i, slot in enumerate(stats["slots"]):
        # The common case costs one lookup of all seven numbers and one type
        # test of them together (msgpack decodes integers as exactly ``int``);
        # anything else takes the exact check, which raises naming the key or
        # accepts what it always accepted (say an int subclass from a caller in
        # the same process).
        try:
            row = _slot_row(slot)
            plain = set(map(type, row)) == _INT_ONLY
        except (KeyError, TypeError):  # a key missing, or not a map
            plain = False
        if not plain:
            row = _checked_row(i, slot)
        rows.append(row)
    return Snapshot(rank, tp_group, step, stats, rows)


def _fold(rows: list[tuple[int, ...]]) -> tuple[int, ...]:
    """(capacity min, max, total, peak max, requests, resizes, violations) of one slot's rows.

    One pass of plain comparisons and additions: cheaper than transposing and
    calling min/max/sum per column for the few ranks a TP group has.
    """
    _, _, low, peak, requests, resizes, violations = rows[0]
    high = total = low
    for _, _, capacity, p, q, r, v in rows[1:]:
        if capacity < low:
            low = capacity
        if capacity > high:
            high = capacity
        if p > peak:
            peak = p
        total += capacity
        requests += q
        resizes += r
        violations += v
    return low, high, total, peak, requests, resizes, violations


def _group_summary(group: int, members: list[Snapshot], expected: list[int],
                   missing: dict[int, str]) -> dict[str, Any]:
    by_slot: dict[tuple[int, int], tuple[list[int], list[tuple[int, ...]]]] = {}
    for m in members:
        for row in m.rows:
            entry = by_slot.get(row[:2])
            if entry is None:
                entry = by_slot[row[:2]] = ([], [])
            entry[0].append(m.rank)
            entry[1].append(row)
    slots = []
    for (ubatch, lane), (ranks, rows) in sorted(by_slot.items()):
        low, high, total, peak, requests, resizes, violations = _fold(rows)
        slots.append({
            "ubatch": ubatch,
            "lane": lane,
            "ranks": ranks,
            "capacity_min": low,
            "capacity_max": high,
            "capacity_total": total,
            "skew_bytes": high - low,
            "peak_requested_max": peak,
            "requests": requests,
            "resizes": resizes,
            "lock_violations": violations,
        })
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
        "slots": slots,
    }


def aggregate_stats(
    replies: dict[int, Snapshot],
    expected: dict[int, list[int]],
    missing: dict[int, str],
) -> dict[str, Any]:
    """Aggregate ``{rank: Snapshot}``.

    ``expected`` maps each TP group in scope to its ranks; ``missing`` gives the
    reason for every expected rank that did not reply.
    """
    ordered = [replies[rank] for rank in sorted(replies)]
    by_group: dict[int, list[Snapshot]] = {g: [] for g in expected}
    for snapshot in ordered:
        by_group.setdefault(snapshot.tp_group, []).append(snapshot)
    return {
        "complete": not missing,
        "total_bytes": sum(s.total_bytes for s in ordered),
        "ranks": [s.summary for s in ordered],
        "groups": [_group_summary(g, by_group[g], members, missing) for g, members in sorted(expected.items())],
        "missing": [{"rank": rank, "reason": reason} for rank, reason in sorted(missing.items())],
    }
