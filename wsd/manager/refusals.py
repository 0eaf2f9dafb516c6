"""A locked slot's refusals: each one recorded on its slot and told to the listeners.

A request that a locked slot cannot serve is a lock violation: the slot counts
it and keeps the last one (caller, sizes, time), every listener hears of it
(the agent pushes it to the coordinator, ``ViolationLog`` logs it), and the
manager raises the ``WorkspaceLockedError`` made here, or, under the fallback
policy, serves the request from a one-off buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

from wsd.errors import WorkspaceLockedError
from wsd.manager.slots import Slot, caller_outside
from wsd.slotstats import LockViolation

__all__ = ["Refusals", "ViolationListener"]

logger = logging.getLogger(__name__)

ViolationListener = Callable[[int, int, LockViolation], None]


class Refusals:
    """The violation listeners of one manager, and the record of each refusal."""

    def __init__(self) -> None:
        self._listeners: list[ViolationListener] = []

    def add_listener(self, listener: ViolationListener) -> None:
        """Call ``listener(ubatch, lane, violation)`` whenever a locked request is refused."""
        self._listeners.append(listener)

    def refuse(self, slot: Slot, requested: int, what: str, persistent_key: Hashable = None) -> WorkspaceLockedError:
        """Count and report a request of ``requested`` bytes that locked ``slot`` refuses;
        returns the error to raise (the fallback policy serves it instead)."""
        caller = caller_outside()
        violation = LockViolation(
            caller=caller, requested=requested, capacity=slot.capacity_bytes, time=time.time()
        )
        slot.lock_violations += 1
        slot.last_violation = violation
        for listener in self._listeners:
            try:
                listener(slot.ubatch, slot.lane, violation)
            except Exception:  # a listener must not hide the refusal itself
                logger.exception("workspace lock-violation listener failed")
        return WorkspaceLockedError(
            caller=caller, ubatch=slot.ubatch, lane=slot.lane,
            requested=requested, capacity=slot.capacity_bytes, what=what,
            persistent_key=persistent_key,
        )
