"""Aggregation of per-rank manager snapshots: per rank, per slot, per TP group.

Input is what agents send (``ManagerStats.to_dict()``); output is plain lists
and maps, ready for msgpack or JSON. No sockets, no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["aggregate_stats", "check_snapshot"]

_RANK_FIELDS = {"device": str, "num_ubatches": int, "num_lanes": int, "locked": bool, "slots": list}
_SLOT_FIELDS = ("ubatch", "lane", "capacity_bytes", "peak_requested_bytes", "requests", "resizes",
                "lock_violations")
_MISSING = object()


def _need(where: str, value: Any, kind: type) -> None:
    if value is _MISSING:
        raise ValueError(f"{where}: missing")
    # bool is an int in Python; it is never a count of bytes.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")


def check_snapshot(stats: dict[str, Any]) -> None:
    """Raise ValueError naming the key unless ``stats`` has what aggregation reads.

    Checked as each reply arrives, so that one agent's bad snapshot cannot break
    the aggregation of everyone else's.
    """
    for key, kind in _RANK_FIELDS.items():
        _need(key, stats.get(key, _MISSING), kind)
    if "total_bytes" in stats:
        _need("total_bytes", stats["total_bytes"], int)
    for i, slot in enumerate(stats["slots"]):
        _need(f"slots[{i}]", slot, dict)
        for key in _SLOT_FIELDS:
            _need(f"slots[{i}].{key}", slot.get(key, _MISSING), int)


def _rank_summary(rank: int, group: int, stats: dict[str, Any], step: int) -> dict[str, Any]:
    slots = stats["slots"]
    return {
        "rank": rank,
        "tp_group": group,
        "step": step,
        "device": stats["device"],
        "num_ubatches": stats["num_ubatches"],
        "num_lanes": stats["num_lanes"],
        "locked": stats["locked"],
        "total_bytes": stats.get("total_bytes", 0),
        "capacity_bytes": sum(s["capacity_bytes"] for s in slots),
        "lock_violations": sum(s["lock_violations"] for s in slots),
        "slots": slots,
    }


def _group_summary(group: int, ranks: list[dict[str, Any]], expected: list[int],
                   missing: dict[int, str]) -> dict[str, Any]:
    by_slot: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = {}
    for r in ranks:
        for s in r["slots"]:
            by_slot.setdefault((s["ubatch"], s["lane"]), []).append((r["rank"], s))
    slots = []
    for (ubatch, lane), members in sorted(by_slot.items()):
        capacities = [s["capacity_bytes"] for _, s in members]
        slots.append({
            "ubatch": ubatch,
            "lane": lane,
            "ranks": [rank for rank, _ in members],
            "capacity_min": min(capacities),
            "capacity_max": max(capacities),
            "capacity_total": sum(capacities),
            "skew_bytes": max(capacities) - min(capacities),
            "peak_requested_max": max(s["peak_requested_bytes"] for _, s in members),
            "requests": sum(s["requests"] for _, s in members),
            "resizes": sum(s["resizes"] for _, s in members),
            "lock_violations": sum(s["lock_violations"] for _, s in members),
        })
    totals = [r["total_bytes"] for r in ranks]
    return {
        "tp_group": group,
        "ranks": expected,
        "reporting": [r["rank"] for r in ranks],
        "missing": [{"rank": rank, "reason": missing[rank]} for rank in expected if rank in missing],
        "total_bytes": sum(totals),
        "rank_bytes_min": min(totals, default=0),
        "rank_bytes_max": max(totals, default=0),
        "skew_bytes": (max(totals) - min(totals)) if totals else 0,
        "locked_consistent": len({r["locked"] for r in ranks}) <= 1,
        "num_ubatches_consistent": len({r["num_ubatches"] for r in ranks}) <= 1,
        "slots": slots,
    }


def aggregate_stats(
    replies: dict[int, tuple[int, int, dict[str, Any]]],
    expected: dict[int, list[int]],
    missing: dict[int, str],
) -> dict[str, Any]:
    """Aggregate ``{rank: (tp_group, step, stats)}``.

    ``expected`` maps each TP group in scope to its ranks; ``missing`` gives the
    reason for every expected rank that did not reply.
    """
    ranks = [_rank_summary(rank, g, stats, step) for rank, (g, step, stats) in sorted(replies.items())]
    groups = [
        _group_summary(g, [r for r in ranks if r["tp_group"] == g], members, missing)
        for g, members in sorted(expected.items())
    ]
    return {
        "complete": not missing,
        "total_bytes": sum(r["total_bytes"] for r in ranks),
        "ranks": ranks,
        "groups": groups,
        "missing": [{"rank": rank, "reason": reason} for rank, reason in sorted(missing.items())],
    }
