"""Human output: sizes in KiB/MiB/GiB and aligned text tables. No torch."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

__all__ = ["cut", "format_bytes", "format_time", "one_line", "printable", "table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def cut(text: str, limit: int) -> str:
    """``text`` as it is, or its first ``limit`` characters saying how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or show as something else escaped
    (``\\x1b``, ``\\u202e``), but newline and tab: control characters (ESC sequences, BEL),
    format characters (bidi overrides such as U+202E, which reorder what follows), and line
    and paragraph separators (U+2028, U+2029). What a peer put in a name or a message never
    reaches a terminal raw; a table's own line breaks stay."""
    if text.isascii():
        return _CONTROL.sub(_escape, text)
    return "".join(c if c.isprintable() or c in "\n\t" else _escape_char(c) for c in text)


def one_line(text: str) -> str:
    """``text`` as ``printable`` makes it, newlines and tabs escaped too: for one field of a
    line (a frame, a thread's or a model's name), which may not start a line of its own."""
    return printable(text).replace("\n", "\\n").replace("\t", "\\t")


def _escape(match: re.Match[str]) -> str:
    return _escape_char(match.group())


def _escape_char(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


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
