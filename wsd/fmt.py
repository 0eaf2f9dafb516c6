"""Human output: sizes in KiB/MiB/GiB and aligned text tables. No torch."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

__all__ = ["cut", "format_bytes", "format_time", "printable", "table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def cut(text: str, limit: int) -> str:
    """``text`` as it is, or its first ``limit`` characters saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab escaped (``\\x1b``): what a
    peer put in a name or a message never reaches a terminal raw (ESC sequences, BEL)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(t: float | None, *, date: bool = False) -> str:
    """Wall-clock seconds as local ``HH:MM:SS.mmm`` (with the date if asked); ``-`` for None."""
    if t is None:
        return "-"
    clock = time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.localtime(t))
    return f"{clock}.{int(t % 1 * 1000):03d}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An aligned table: text columns to the left, numbers to the right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(row[i]) for row in cells[1:]) and len(cells) > 1
        for i in range(len(headers))
    ]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ", 1)[0]
    try:
        float(head)
    except ValueError:
        return text in ("-", "")
    return True
