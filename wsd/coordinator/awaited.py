"""Work that waits for a set of ranks: a command for their acknowledgements
(``wsd.coordinator.dispatch``), a fresh stats round for their snapshots
(``wsd.coordinator.snapshots``). Each is answered once every target has answered
or is gone, or at its deadline; what it waits for, and how a rank leaves it, is
the same for both. Plain logic, no I/O. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from wsd.coordinator.outbox import Out

__all__ = ["Awaited", "expired", "rank_gone"]

K = TypeVar("K")


@dataclass(kw_only=True)
class Awaited:
    """The ranks a piece of work waits for, and those it will be answered without."""

    targets: set[int]
    deadline: float
    """Monotonic time at which it is answered with whoever answered by then."""
    lost: set[int] = field(default_factory=set)
    """Targets lost (silent past the heartbeat timeout) while it waited."""
    why: dict[int, str] = field(default_factory=dict)
    """Ranks out of the answer for a reason of their own (a goodbye, an invalid snapshot,
    never registered), and that reason."""
    owed: set[int] = field(init=False)
    """Targets that have neither answered nor gone: done when empty, checked in O(1) per answer."""

    def __post_init__(self) -> None:
        self.owed = set(self.targets)


def rank_gone(waiting: Mapping[K, Awaited], rank: int, why: str | None,
              finish: Callable[[K], list[Out]]) -> list[Out]:
    """A rank is no longer live: lost (``why`` None) or stopped (``why`` says so). Everything
    in ``waiting`` that still waits for it is answered without it, through ``finish(key)``,
    once nothing else is owed."""
    out: list[Out] = []
    for key, work in list(waiting.items()):
        if rank in work.owed:
            if why is None:
                work.lost.add(rank)
            else:
                work.why[rank] = why
            work.owed.discard(rank)
            if not work.owed:
                out += finish(key)
    return out


def expired(waiting: Mapping[K, Awaited], now: float, finish: Callable[[K], list[Out]]) -> list[Out]:
    """Answer, through ``finish(key)``, everything in ``waiting`` whose deadline has passed."""
    out: list[Out] = []
    for key, work in list(waiting.items()):
        if now >= work.deadline:
            out += finish(key)
    return out
