"""``wsctl profiles``: the coordinator's sizing profiles, and dropping one.

Per engine profile (``NAME:tpT:ubU:lnL``: the model, else the engine's name; TP size;
ubatches; lanes), the largest request each slot has served or refused, learned from
every rank of that profile across engines and restarts; a manager with ``[workspace]
presize = "profile"`` reserves those sizes before its warm-up (docs/manager.md). The
answer and its rendering; the requests are ``Client.profiles`` and
``Client.drop_profile``, the command ``wsd_client.queries.profiles``. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from wsd.fmt import format_bytes, format_time, table
from wsd_client.results import Answer

__all__ = ["Profiles", "render", "render_dropped"]


class Profiles(Answer):
    """``profiles``: each ``{key, name, tp_size, num_ubatches, num_lanes, slots, total_bytes,
    largest_bytes, updated, ranks, engines}``, ``slots`` as ``[[ubatch, lane, bytes], ...]``;
    ``file``: where the coordinator keeps them."""

    __slots__ = ()

    @property
    def profiles(self) -> list[dict[str, Any]]:
        return list(self.doc["profiles"])

    def sizes(self, key: str) -> dict[tuple[int, int], int]:
        """Profile ``key``'s size per (ubatch, lane); KeyError if there is none of that key."""
        for profile in self.doc["profiles"]:
            if profile["key"] == key:
                return {(u, lane): size for u, lane, size in profile["slots"]}
        raise KeyError(key)


def render(doc: dict[str, Any]) -> str:
    """One line per profile, then its slots: what a presized manager of it reserves."""
    if not doc["profiles"]:
        return f"no sizing profile yet (kept in {doc['file'] or 'memory only'})"
    rows = [[p["key"], len(p["slots"]), format_bytes(p["total_bytes"]), format_bytes(p["largest_bytes"]),
             p["ranks"], p["engines"], format_time(p["updated"], date=True)] for p in doc["profiles"]]
    lines = [table(["KEY", "SLOTS", "TOTAL", "LARGEST", "RANKS", "ENGINES", "UPDATED"], rows)]
    for p in doc["profiles"]:
        lines.append("")
        lines.append(f"{p['key']}: per slot (ubatch/lane), what presize reserves")
        lines.append("  " + "  ".join(f"{u}/{lane} {format_bytes(size)}" for u, lane, size in p["slots"]))
    return "\n".join(lines)


def render_dropped(doc: dict[str, Any]) -> str:
    saved = "" if doc["saved"] else (" (in memory only: the profiles file could not be written; "
                                     "the coordinator's log says why)")
    return f"dropped sizing profile {doc['dropped']}{saved}"
