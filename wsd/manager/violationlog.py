"""Lock violations in the process's own log, with the caller, at a bounded rate.

A manager calls its violation listeners at every request a locked slot refuses
(``WorkspaceManager.add_violation_listener``). With ``on_locked_growth =
"fallback"`` that may be every engine step; ``ViolationLog`` says the first
refusal of each slot at once, in full, and after that at most one line per
``every`` seconds for the whole manager, counting what it did not say. No torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from wsd.fmt import format_bytes
from wsd.manager.config import LockedGrowthPolicy
from wsd.slotstats import LockViolation

__all__ = ["ViolationLog"]

_OUTCOME = {
    LockedGrowthPolicy.RAISE: "refused (on_locked_growth = raise: the caller fails)",
    LockedGrowthPolicy.FALLBACK: "served from a one-off buffer (on_locked_growth = fallback)",
}


class ViolationLog:
    """A violation listener that logs at WARNING: ``manager.add_violation_listener(ViolationLog(...))``."""

    def __init__(self, logger: logging.Logger, *, rank: int, policy: LockedGrowthPolicy, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.rank = rank
        self.policy = policy
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[tuple[int, int]] = set()
        self._last_line: float | None = None
        self._unsaid = 0

    def __call__(self, ubatch: int, lane: int, violation: LockViolation) -> None:
        now = self._clock()
        with self._lock:
            first = (ubatch, lane) not in self._seen
            due = self._last_line is None or now - self._last_line >= self.every
            if not first and not due:
                self._unsaid += 1
                return
            self._seen.add((ubatch, lane))
            self._last_line = now
            unsaid, self._unsaid = self._unsaid, 0
        since = f"; {unsaid} more since the last line" if unsaid else ""
        self.logger.warning(
            "wsd: rank %d's workspace is locked: slot (ubatch %d, lane %d) holds %s, a request for %s from %s "
            "was %s%s. Lock later, or reserve more before the lock",
            self.rank, ubatch, lane, format_bytes(violation.capacity), format_bytes(violation.requested),
            violation.caller, _OUTCOME[self.policy], since)
