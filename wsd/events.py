"""The coordinator's bounded event log, with a cursor so that a client can follow it."""

from __future__ import annotations

from collections import deque
from typing import Any

from wsd.protocol import StrEnum

__all__ = ["EventKind", "EventLog"]


class EventKind(StrEnum):
    STARTED = "started"
    STATE_REPAIRED = "state_repaired"
    JOINED = "joined"
    LOST = "lost"
    BACK = "back"
    STOPPED = "stopped"
    SUPERSEDED = "superseded"
    REJECTED = "rejected"
    COMMAND = "command"
    COMMAND_APPLIED = "command_applied"
    COMMAND_FAILED = "command_failed"
    LOCK_VIOLATION = "lock_violation"
    GROUP_INCONSISTENT = "group_inconsistent"
    GROUP_CONSISTENT = "group_consistent"
    REPLAY_GAP = "replay_gap"
    AGENT_EVENT = "agent_event"


class EventLog:
    """The last ``capacity`` events, each with an id that only grows."""

    def __init__(self, capacity: int) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.last_id = 0

    def add(self, kind: EventKind, time: float, **detail: Any) -> dict[str, Any]:
        self.last_id += 1
        event = {"id": self.last_id, "time": time, "kind": str(kind), **detail}
        self._events.append(event)
        return event

    def since(self, cursor: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """Events with id > cursor (at most ``limit``) and the cursor to ask with next."""
        out = [e for e in self._events if e["id"] > cursor][:limit]
        return out, (out[-1]["id"] if out else cursor)
