"""The ``stats`` answer in rows: the documented shape ``wsctl stats --json`` prints.

``Client.stats()`` returns the coordinator's compact answer, in which each
rank's slots and each TP group's per-slot summary are maps of equal-length
columns (``{"ubatch": [0, 1], "capacity_bytes": [4096, 0], ...}``; a rank's
last violations and persistent buffers as sparse tables keyed by slot index).
``stats_rows`` turns it into one map per slot, the shape ``wsctl``'s JSON and
tables show; the one place that does. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from wsd.manager.stats import slot_rows

__all__ = ["group_slots", "rank_slots", "stats_rows"]


def rank_slots(rank: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank's slots as ``[{ubatch, lane, capacity_bytes, peak_requested_bytes,
    requests, resizes, lock_violations, last_violation, persistent}]``."""
    return slot_rows(rank["slots"])


def group_slots(group: dict[str, Any]) -> list[dict[str, Any]]:
    """One TP group's per-slot summary as ``[{ubatch, lane, ranks, capacity_min,
    capacity_max, capacity_total, skew_bytes, peak_requested_max, requests,
    resizes, lock_violations}]``."""
    columns = group["slots"]
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*columns.values())]


def stats_rows(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``stats`` answer with every rank's and group's slots as rows."""
    return {
        **doc,
        "ranks": [{**r, "slots": rank_slots(r)} for r in doc["ranks"]],
        "groups": [{**g, "slots": group_slots(g)} for g in doc["groups"]],
    }
