"""Which ranks ``wsctl stats`` and ``wsctl watch`` show: by rank, TP group and state.

At 256 ranks of 8 slots a frame is 2,048 rows: an operator wants the ranks that
matter (``--rank 0-7``, ``--group 3``, ``--state stale,absent``). A
``Selection`` applies to the rows ``Stats.rows()`` gives, the same for the JSON
and the tables; the answer's own totals (``complete``, ``total_bytes``) stay
as the coordinator gave them. Imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from wsd.wire.protocol import NEVER_REGISTERED

__all__ = ["STATES", "Selection", "complete", "number_list", "ranges", "state_list"]

STATES: dict[str, str] = {
    "missing": "never registered (the rank state missing)",
    "absent": "expected but absent from the answer: lost, stopped, missing, or live with no usable snapshot",
    "stale": "its snapshot is older than [coordinator] stats_stale_after",
    "locked": "its workspace is locked",
    "unlocked": "its workspace is not locked",
    "violations": "a slot refused a request while locked (lock violations > 0)",
}
"""The states ``--state`` selects, with what each means."""

# A reporting rank (an entry of ``ranks``) in each state; ``missing`` and ``absent`` ranks
# report nothing.
_HAS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "missing": lambda rank: False,
    "absent": lambda rank: False,
    "stale": lambda rank: bool(rank["stale"]),
    "locked": lambda rank: rank["locked"] is True,
    "unlocked": lambda rank: rank["locked"] is False,
    "violations": lambda rank: rank["lock_violations"] > 0,
}
# An absent rank (an entry of ``missing``, ``{rank, reason}``) in each state; the others are
# states of reporting ranks. The reason is the coordinator's: NEVER_REGISTERED for exactly
# the ranks that ``ranks`` and ``status`` call missing.
_ABSENT_IN: dict[str, Callable[[dict[str, Any]], bool]] = {
    "missing": lambda entry: entry["reason"] == NEVER_REGISTERED,
    "absent": lambda entry: True,
}
# More numbers than any world holds: a list such as 0-99999999 is a typo, not a request.
_MAX_LISTED = 1 << 20


def number_list(low: int, high: int, what: str) -> Callable[[str], frozenset[int]]:
    """An argparse ``type``: numbers and ranges from ``low`` to ``high`` (``0-3,8,12-15``)."""

    def parse(text: str) -> frozenset[int]:
        out: set[int] = set()
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            try:
                start, end = int(first), int(last if dash else first)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected {what}s and ranges such as 0-3,8, got {text!r}") from None
            for value in (start, end):
                if not low <= value <= high:
                    raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
            if end < start:
                raise argparse.ArgumentTypeError(f"a range must not go down, got {part.strip()!r}")
            if len(out) + end - start + 1 > _MAX_LISTED:
                raise argparse.ArgumentTypeError(f"at most {_MAX_LISTED} {what}s, got {text!r}")
            out.update(range(start, end + 1))
        return frozenset(out)

    return parse


def state_list(text: str) -> frozenset[str]:
    """An argparse ``type``: states of ``STATES``, comma-separated (``stale,absent``)."""
    states = frozenset(s.strip() for s in text.split(","))
    unknown = sorted(states - STATES.keys())
    if unknown:
        raise argparse.ArgumentTypeError(f"must be among {', '.join(STATES)}, got {', '.join(unknown)}")
    return states


def ranges(values: Iterable[int]) -> str:
    """Numbers as short text: runs of three or more as ranges (``0-3,8,9,12-15``); ``-`` for none."""
    numbers = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{numbers[i]}-{numbers[j]}")
        else:
            parts.extend(str(n) for n in numbers[i:j + 1])
        i = j + 1
    return ",".join(parts) or "-"


@dataclass(frozen=True)
class Selection:
    """Ranks to show: in ``ranks`` (None: any), of a TP group in ``groups`` (None: any), in
    one of ``states`` (empty: any). Each given condition must hold."""

    ranks: frozenset[int] | None = None
    groups: frozenset[int] | None = None
    states: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return self.ranks is not None or self.groups is not None or bool(self.states)

    def _where(self, rank: int, tp_group: int | None) -> bool:
        return ((self.ranks is None or rank in self.ranks)
                and (self.groups is None or tp_group in self.groups))

    def keeps(self, rank: dict[str, Any]) -> bool:
        """Whether a reporting rank (an entry of a stats answer's ``ranks``) is shown."""
        return (self._where(rank["rank"], rank["tp_group"])
                and (not self.states or any(_HAS[s](rank) for s in self.states)))

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A stats answer in rows (``Stats.rows()``) with only the selected ranks, their
        missing ones and their groups, and ``selection`` saying what was asked; ``doc`` itself
        when nothing is selected."""
        if not self:
            return doc
        group_of = {r: g["tp_group"] for g in doc["groups"] for r in g["ranks"]}
        ranks = [r for r in doc["ranks"] if self.keeps(r)]
        missing = [m for m in doc["missing"] if self._where(m["rank"], group_of.get(m["rank"]))
                   and (not self.states or any(s in _ABSENT_IN and _ABSENT_IN[s](m) for s in self.states))]
        shown = {r["rank"] for r in ranks} | {m["rank"] for m in missing}
        return {
            **doc,
            "ranks": ranks,
            "missing": missing,
            "stale": [r for r in doc["stale"] if r in shown],
            "groups": [g for g in doc["groups"] if shown & set(g["ranks"])],
            "selection": {"ranks": None if self.ranks is None else sorted(self.ranks),
                          "groups": None if self.groups is None else sorted(self.groups),
                          "states": sorted(self.states)},
        }


def complete(doc: dict[str, Any]) -> bool:
    """Whether a stats answer in rows lacks nothing: the coordinator's ``complete``, or for a
    selection, none of the ranks it selects missing or stale."""
    return not (doc["missing"] or doc["stale"]) if "selection" in doc else bool(doc["complete"])
