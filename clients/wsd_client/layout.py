"""Tables that fit the terminal: low-priority columns are abbreviated, then dropped, never wrapped.

A wrapped table is unreadable (a 12-column row over two lines at 80 columns).
Each column says when it gives way (``drop``: higher gives way first, 0 never)
and how narrow it may be cut first (``cut_to``: text cut in the middle, behind
``…``, so that a caller's file name, line and function survive its folders). The table then names what it
left out, so that nothing disappears silently. Only human output is fitted;
``--json`` is never cut. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wsd.fmt import table

__all__ = ["Column", "fit"]

_GAP = 2  # spaces between columns, as ``wsd.fmt.table`` puts them
_ELLIPSIS = "…"


@dataclass(frozen=True)
class Column:
    header: str
    drop: int = 0
    """When the column gives way to fit the width: higher first; 0, never."""
    cut_to: int | None = None
    """At its turn, the column is first cut down to this many characters, then dropped."""


def _cut(text: str, width: int) -> str:
    """``text`` in ``width`` characters, cut in the middle: a caller's file name, line and
    function (after its last ``/``) kept whole where they fit, else its two ends."""
    if len(text) <= width:
        return text
    tail = text[text.rfind("/") + 1:]
    if "/" in text and len(tail) + 2 <= width:
        return text[: width - len(tail) - 1] + _ELLIPSIS + tail
    head = (width - 1) // 2
    return text[:head] + _ELLIPSIS + text[len(text) - (width - 1 - head):]


def fit(columns: Sequence[Column], rows: Sequence[Sequence[object]], width: int | None) -> str:
    """An aligned table of ``rows`` at most ``width`` characters wide where the columns'
    priorities allow (``None``: as wide as it comes), with a last line naming the columns
    left out, if any."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(col.header), *(len(row[i]) for row in cells)]) for i, col in enumerate(columns)]
    kept = list(range(len(columns)))
    cut: dict[int, int] = {}

    def total() -> int:
        return sum(cut.get(i, widths[i]) for i in kept) + _GAP * (len(kept) - 1)

    if width is not None:
        for turn in [*sorted({c.drop for c in columns if c.drop}, reverse=True), 0]:
            for i in [i for i in reversed(kept) if columns[i].drop == turn]:
                if total() <= width:
                    break
                floor = columns[i].cut_to
                if floor is not None and widths[i] > floor:
                    cut[i] = max(floor, len(columns[i].header), widths[i] - (total() - width))
                if total() > width and turn:
                    kept.remove(i)
                    cut.pop(i, None)
    text = table([columns[i].header for i in kept],
                 [[_cut(row[i], cut[i]) if i in cut else row[i] for i in kept] for row in cells])
    left_out = [columns[i].header for i in range(len(columns)) if i not in kept]
    if left_out:
        note = f"({', '.join(left_out)}: left out to fit {width} columns)"
        if width is not None and len(note) > width:
            note = f"({len(left_out)} column{'s' if len(left_out) > 1 else ''} left out to fit {width})"
        text += "\n" + note
    return text
