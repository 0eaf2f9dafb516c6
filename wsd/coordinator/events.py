"""The coordinator's bounded event log, with a cursor so that a client can follow it.

Bounded in count and in bytes: every event's size is measured as it is added,
and what agents report in an event is cut to size first (``bounded_detail``),
so that no peer can grow the coordinator's memory or the ``events`` answer.

An operator's trail is kept apart from what peers cause: the operator's events
(``OPERATOR``: commands, a dropped profile, a resumed or repaired log, the start)
have a quarter of the log of their own, and events peers cause (ranks joining,
stalling, reporting) only ever push out other such events. Within those, each source
(a rank, a refused registration) holds at most ``SOURCE_SHARE`` of the bytes: an
event that would take it beyond is not kept, and counted (``over_budget``).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from typing import Any

import msgpack

from wsd.errors import StrEnum
from wsd.fmt import cut, one_line

__all__ = ["OPERATOR", "SOURCE_SHARE", "EventKind", "EventLog"]


class EventKind(StrEnum):
    STARTED = "started"
    ENGINE_ADDED = "engine_added"
    """An engine the coordinator had not served since it started: its first rank registered."""
    ENGINE_FORGOTTEN = "engine_forgotten"
    """An engine that held nothing (no live rank, no command) for a while is no longer served."""
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
    PROFILE_GREW = "profile_grew"
    """A rank's snapshot grew a sizing profile: its key, the rank (and engine), and each slot
    grown as ``[ubatch, lane, old bytes, new bytes]`` (the first 16; ``slots``: how many)."""
    PROFILE_DROPPED = "profile_dropped"
    """An operator dropped a sizing profile (``wsctl profiles --drop``): its key and who asked."""
    SUPPRESSED = "suppressed"
    """Events of one source dropped for coming too fast, with their count."""


OPERATOR = frozenset({EventKind.STARTED, EventKind.STATE_REPAIRED, EventKind.RESUMED, EventKind.COMMAND,
                      EventKind.PROFILE_DROPPED})
"""The kinds an operator (or the coordinator itself) causes: kept apart from what peers cause."""
SOURCE_SHARE = 16
"""One source of peer events holds at most 1/SOURCE_SHARE of the peers' part of the log, in bytes."""

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
        key = one_line(key[:_MAX_KEY])
        if value is None or isinstance(value, (bool, int, float)):
            out[key] = value
        elif isinstance(value, str):
            out[key] = cut(one_line(value), _MAX_TEXT)
        elif isinstance(value, bytes):
            out[key] = f"<{len(value)} bytes>"
        else:
            out[key] = cut(repr(value), _MAX_NESTED_TEXT)
    return out


class _Part:
    """One part of the log: its events in id order, bounded in count and bytes."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.events: deque[tuple[dict[str, Any], int, Hashable]] = deque()
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0

    def add(self, event: dict[str, Any], size: int, source: Hashable) -> Iterator[tuple[int, Hashable]]:
        """Keep ``event``; the (size, source) of each older event it pushes out."""
        self.events.append((event, size, source))
        self.bytes += size
        while len(self.events) > self.capacity or (self.bytes > self.max_bytes and len(self.events) > 1):
            _, dropped, owner = self.events.popleft()
            self.bytes -= dropped
            yield dropped, owner


class EventLog:
    """The last ``capacity`` events, at most ``max_bytes`` of them in all, each with an id
    that only grows: a quarter of both for the operator's events (``OPERATOR``), the rest
    for what peers cause, at most ``1/SOURCE_SHARE`` of that per source."""

    def __init__(self, capacity: int, max_bytes: int = 16 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        quarter, bytes_quarter = max(capacity // 4, 1), max_bytes // 4
        self._operator = _Part(quarter, bytes_quarter)
        self._peers = _Part(max(capacity - quarter, 1), max_bytes - bytes_quarter)
        self.source_bytes = (max_bytes - bytes_quarter) // SOURCE_SHARE
        self._held: dict[Hashable, int] = {}  # bytes each peer source holds in the log
        self.last_id = 0
        # Events added since the start by kind, those the log has dropped since included
        # (wsd_events_total).
        self.counts: dict[str, int] = {str(kind): 0 for kind in EventKind}
        self.over_budget: Counter[str] = Counter()
        """Events not kept because their source held its share of the log, by kind."""

    @property
    def bytes(self) -> int:
        return self._operator.bytes + self._peers.bytes

    def add(self, kind: EventKind, time: float, *, source: Hashable = None, **detail: Any) -> dict[str, Any] | None:
        """Keep an event; None (counted in ``over_budget``) where ``source``, a peer's, already
        holds its share of the log. ``source`` None: the coordinator's own, or an operator's."""
        event = {"id": self.last_id + 1, "time": time, "kind": str(kind), **detail}
        size = len(msgpack.packb(event, use_bin_type=True, default=str))
        operator = kind in OPERATOR
        if source is not None and not operator:
            if self._held.get(source, 0) + size > self.source_bytes:
                self.over_budget[str(kind)] += 1
                return None
            self._held[source] = self._held.get(source, 0) + size
        self.last_id += 1
        self.counts[event["kind"]] += 1
        for dropped, owner in (self._operator if operator else self._peers).add(event, size, source):
            if owner is not None and owner in self._held:
                left = self._held[owner] - dropped
                if left > 0:
                    self._held[owner] = left
                else:
                    del self._held[owner]
        return event

    def take_over_budget(self) -> Counter[str]:
        """The events not kept for their source's share since the last call, by kind."""
        taken, self.over_budget = self.over_budget, Counter()
        return taken

    def _in_order(self) -> Iterator[dict[str, Any]]:
        return (event for event, _, _ in heapq.merge(self._operator.events, self._peers.events,
                                                     key=lambda entry: entry[0]["id"]))

    def since(self, cursor: int, limit: int, *, engine: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """Events with id > cursor (at most ``limit``) and the cursor to ask with next.

        ``engine``: only that engine's events and those of no engine (the coordinator's own).
        A cursor past the newest event is the tail: nothing, and the newest id as the
        cursor, so that a client can start following from now (ids are consecutive, so
        ``tail - n`` also finds the last ``n`` events without reading the whole log).
        """
        out = []
        seen = min(cursor, self.last_id)  # the last id looked at: the events another engine's skipped
        for event in self._in_order():
            if event["id"] > cursor:
                seen = event["id"]
                if engine is None or event.get("engine") in (None, engine):
                    out.append(event)
                    if len(out) >= limit:
                        break
        return out, seen

    def __len__(self) -> int:
        return len(self._operator.events) + len(self._peers.events)
