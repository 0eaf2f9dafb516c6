"""Stalled ranks: live (their agents answer) while their engines stay inside one step.

A TP group hung on one frozen rank looks, from outside, like every rank
stopped; the rank that froze is lost (its agent froze with it), and each of its
peers sits inside the collective that waits for it. Each heartbeat says for how
long the engine has been inside its current step (``in_step``); a rank inside
one for ``[coordinator] stall_after`` is ``stalled``, until it leaves the step.
Its ``stalled`` event names its TP peers' states and those it waits for where
that can be known (``Registry.waits_for``), and the innermost frames of the
threads its agent sends on its own at that moment (``innermost``: the engine's
thread first, a few kB); it waits two heartbeat intervals for them, and is written
without them after. The whole stacks stay with the rank (``RankInfo.stall_stacks``)
while it is stalled, for an admin's ``stacks``. The event and its WARNING line share
the rank's event budget. Plain logic, no I/O. Imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from wsd.coordinator.config import CoordinatorConfig
from wsd.coordinator.events import EventKind
from wsd.coordinator.registry import RankInfo, Registry

__all__ = ["STALL_FRAMES", "STALL_THREADS", "Stalls", "innermost"]

logger = logging.getLogger(__name__)

STALL_THREADS = 2
"""Threads a ``stalled`` event shows: the engine's first."""
STALL_FRAMES = 8
"""Innermost frames a ``stalled`` event shows of each (each at most 256 characters)."""


def innermost(threads: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """What a ``stalled`` event keeps of a rank's checked threads: ``STALL_THREADS`` of them,
    the engine's thread first, each with its ``STALL_FRAMES`` innermost frames (those left
    out counted in ``dropped``)."""
    if threads is None:
        return None
    shown = sorted(threads, key=lambda t: not t["engine"])[:STALL_THREADS]
    return [{**t, "frames": t["frames"][-STALL_FRAMES:],
             "dropped": t["dropped"] + max(len(t["frames"]) - STALL_FRAMES, 0)} for t in shown]


class Stalls:
    """One engine's stalled ranks (``RankInfo.stalled``), and their events."""

    def __init__(self, config: CoordinatorConfig, registry: Registry, *,
                 event: Callable[..., bool], engine: str) -> None:
        """``event(source, kind, **detail)``: write an event within the source's budget (whether
        it was kept)."""
        self.config = config
        self.registry = registry
        self.event = event
        self.engine = engine
        # Stalled ranks whose event waits for their stacks: rank -> when it is written without.
        self._due: dict[int, float] = {}

    def check(self, info: RankInfo, now: float, stacks: list[dict[str, Any]] | None = None) -> None:
        """A live rank's heartbeat, or the stacks its agent sent at a stall."""
        inside = info.in_step(now)
        stuck = inside is not None and inside >= self.config.stall_after
        if stuck and not info.stalled:
            info.stalled = True
            self._due[info.rank] = now + 2 * self.config.heartbeat_interval
        elif not stuck and info.stalled:
            self.end(info, "its engine left the step")
            return
        due = self._due.get(info.rank)
        if info.stalled and due is not None and (stacks is not None or now >= due):
            del self._due[info.rank]
            self._write(info, inside or 0.0, stacks)

    def end(self, info: RankInfo, why: str) -> None:
        """The rank is no longer stalled: ``why`` (its engine left the step, it was lost or stopped).
        A stall whose event was still waiting for its stacks ends with no event at all: every
        ``unstalled`` follows its ``stalled``."""
        if not info.stalled:
            return
        info.stalled = False
        info.stall_stacks = None
        if self._due.pop(info.rank, None) is not None:
            return
        self.event(("rank", info.rank), EventKind.UNSTALLED, rank=info.rank, tp_group=info.tp_group,
                   step=info.step, why=why)

    def _write(self, info: RankInfo, inside: float, stacks: list[dict[str, Any]] | None) -> None:
        peers = {str(r): str(self.registry.ranks[r].shown) if r in self.registry.ranks else "missing"
                 for r in self.registry.expected(info.tp_group) if r != info.rank}
        waits = self.registry.waits_for(info)
        info.stall_stacks = stacks
        if not self.event(("rank", info.rank), EventKind.STALLED, rank=info.rank, tp_group=info.tp_group,
                          step=info.step, in_step=round(inside, 3), peers=peers, waits_for=waits,
                          stacks=innermost(stacks)):
            return  # over the rank's budget: no line either
        logger.warning("engine %s: rank %d is stalled, inside one step for %.0f s; TP peers: %s; waits for: %s",
                       self.engine, info.rank, inside, ", ".join(f"{r} {s}" for r, s in peers.items()) or "none",
                       ", ".join(map(str, waits)) or "unknown")
