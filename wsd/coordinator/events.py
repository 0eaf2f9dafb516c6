"""The coordinator's bounded event log, with a cursor so that a client can follow it.

Bounded in count and in bytes: every event's size is measured as it is added,
and what agents report in an event is cut to size first (``bounded_detail``),
so that no peer can grow the coordinator's memory or the ``events`` answer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgpack

from wsd.errors import StrEnum
from wsd.fmt import cut

__all__ = ["EventKind", "EventLog"]


class EventKind(StrEnum):
    STARTED = "started"
    ENGINE_ADDED = "engine_added"
    """An engine the coordinator had not served since it started: its first rank registered."""
    STATE_REPAIRED = "state_repaired"
    RESUMED = "resumed"
    """The operator's ``resume_seq`` moved numbering past a lost state file's."""
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
    """No longer made: such an agent is rebased (below). Kept, as older logs hold it."""
    REBASED = "rebased"
    """An agent the kept log could not bring up to date starts again from the log's seq."""
    STALLED = "stalled"
    """A live rank's engine has been inside one step for ``stall_after``: its step, how long,
    its TP peers' states, the peers it waits for where known, and its threads' stacks."""
    UNSTALLED = "unstalled"
    """A stalled rank's engine left the step (or the rank was lost, stopped or registered again)."""
    AGENT_EVENT = "agent_event"
    PROFILE_DROPPED = "profile_dropped"
    """An operator dropped a sizing profile (``wsctl profiles --drop``): its key and who asked."""
    SUPPRESSED = "suppressed"
    """Events of one source dropped for coming too fast, with their count."""


_MAX_KEYS = 32
_MAX_KEY = 64
_MAX_TEXT = 1024
_MAX_NESTED_TEXT = 256


def bounded_detail(detail: dict[Any, Any], *, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a peer reported, cut to size: at most 32 keys of 64 characters, strings of
    1,024 characters, lists and maps as short text; keys in ``reserved`` dropped."""
    out: dict[str, Any] = {}
    for key, value in detail.items():
        if len(out) >= _MAX_KEYS:
            out["truncated"] = f"{len(detail) - _MAX_KEYS} more keys"
            break
        if not isinstance(key, str) or key in reserved:
            continue
        key = key[:_MAX_KEY]
        if value is None or isinstance(value, (bool, int, float)):
            out[key] = value
        elif isinstance(value, str):
            out[key] = cut(value, _MAX_TEXT)
        elif isinstance(value, bytes):
            out[key] = f"<{len(value)} bytes>"
        else:
            out[key] = cut(repr(value), _MAX_NESTED_TEXT)
    return out


class EventLog:
    """The last ``capacity`` events, at most ``max_bytes`` of them in all, each with an id
    that only grows."""

    def __init__(self, capacity: int, max_bytes: int = 16 << 20) -> None:
        self._events: deque[tuple[dict[str, Any], int]] = deque()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self.last_id = 0
        # Events added since the start by kind, those the log has dropped since included
        # (wsd_events_total).
        self.counts: dict[str, int] = {str(kind): 0 for kind in EventKind}

    def add(self, kind: EventKind, time: float, **detail: Any) -> dict[str, Any]:
        self.last_id += 1
        event = {"id": self.last_id, "time": time, "kind": str(kind), **detail}
        self.counts[event["kind"]] += 1
        size = len(msgpack.packb(event, use_bin_type=True, default=str))
        self._events.append((event, size))
        self.bytes += size
        while len(self._events) > self.capacity or (self.bytes > self.max_bytes and len(self._events) > 1):
            _, dropped = self._events.popleft()
            self.bytes -= dropped
        return event

    def since(self, cursor: int, limit: int, *, engine: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """Events with id > cursor (at most ``limit``) and the cursor to ask with next.

        ``engine``: only that engine's events and those of no engine (the coordinator's own).
        A cursor past the newest event is the tail: nothing, and the newest id as the
        cursor, so that a client can start following from now (ids are consecutive, so
        ``tail - n`` also finds the last ``n`` events without reading the whole log).
        """
        out = []
        seen = min(cursor, self.last_id)  # the last id looked at: the events another engine's skipped
        for event, _ in self._events:
            if event["id"] > cursor:
                seen = event["id"]
                if engine is None or event.get("engine") in (None, engine):
                    out.append(event)
                    if len(out) >= limit:
                        break
        return out, seen

    def __len__(self) -> int:
        return len(self._events)
