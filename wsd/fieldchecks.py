"""Checks of configuration fields, which every section is built from: sizes, ranges, enums, endpoints.

Each section (``[workspace]`` in ``wsd.manager.config``, ``[coordinator]`` in
``wsd.coordinator.config``, ``[agent]``, ``[worker]`` and ``[workload]`` beside
theirs, ``[security]`` in ``wsd.security``) is a frozen, keyword-only dataclass
that validates itself at construction with these checks; each raises
ValueError naming the key and what is allowed, which ``wsd.config.load_config``
turns into a ``ConfigError`` naming the file or variable. No torch.
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from wsd.endpoints import check_endpoint as _check_endpoint_text

__all__ = ["check_endpoint", "check_positive", "check_range", "coerce_enum", "flag_number", "parse_size",
           "size_field"]

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"2MiB"``, ``"512 KB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"expected a size such as 4096, \"512KiB\" or \"2MiB\", got {value!r}"
        )
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def size_field(default: int | None) -> Any:
    """A field that takes a byte size: an int, or a string with a unit."""
    return field(default=default, metadata={"size": True})


def check_range(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def coerce_enum(obj: Any, name: str, kind: type[enum.Enum]) -> None:
    """Turn a frozen dataclass's string field into its enum, or raise naming what is allowed."""
    value = getattr(obj, name)
    if isinstance(value, kind):
        return
    try:
        object.__setattr__(obj, name, kind(value))
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def check_positive(name: str, value: float, high: float = 86400.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise ValueError(f"{name} must be a number of seconds in (0, {high:g}], got {value!r}")


def check_endpoint(name: str, value: str, *, bind: bool) -> None:
    try:
        _check_endpoint_text(value, bind=bind)
    except ValueError as e:
        raise ValueError(f"{name} {e}") from None


def flag_number(kind: type[int | float], low: float, high: float, *, what: str,
                unit: str = "", above_low: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` for a command-line number: a ``kind`` from ``low`` (excluded if
    ``above_low``) to ``high``; otherwise a usage error that names the range."""

    def show(bound: float) -> str:
        return f"{bound:g}" if isinstance(bound, float) else str(bound)

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        # NaN fails every comparison, so it is refused by the first test, as inf is by the last.
        if not (low < value if above_low else low <= value) or not value <= high:
            bounds = (f"more than {show(low)} and at most {show(high)}" if above_low
                      else f"between {show(low)} and {show(high)}")
            raise argparse.ArgumentTypeError(f"must be {bounds}{unit}, got {text}")
        return value

    return convert
