"""A rank's pushed snapshot: when it is looked at, what is pushed, what the coordinator holds.

Every ``interval`` the rank's snapshot is looked at; if it differs from the one
the coordinator acknowledged, what changed is pushed (the whole snapshot when
the coordinator holds none of ours), else the next heartbeat confirms the one it
holds. One push is out at a time; one given no answer within the heartbeat
timeout is taken as lost, and the next push is whole. A command or a lock
violation sets ``urgent``: the next look comes at once, at most every
``URGENT_GAP`` seconds. No I/O: ``AgentCore`` frames what this returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from wsd.slotstats import snapshot_delta

__all__ = ["URGENT_GAP", "StatsPush"]

URGENT_GAP = 0.05
"""Least seconds between two pushes that a command or a lock violation brings forward,
so that a violation at every engine step costs a bounded number of frames."""


class StatsPush:
    """One rank's snapshot pushes: the version the coordinator holds and the one in flight.

    Thread use: the I/O thread drives it; ``urgent`` may be set from any thread.
    """

    def __init__(self, now: float) -> None:
        self.interval: float | None = None  # None: the coordinator takes no pushes (older than them)
        self.next_look = now
        self.urgent = False  # set from any thread: push at once (a command, a violation)
        self._version = 0
        self._acked: tuple[int, dict[str, Any]] | None = None  # (version, snapshot) the coordinator holds
        self._inflight: tuple[int, dict[str, Any], float] | None = None  # (version, snapshot, sent)
        self._last_push = now - URGENT_GAP

    def restart(self, interval: float | None, now: float) -> None:
        """A registration: the coordinator's memory of us starts afresh, so push it whole, now."""
        self.interval = interval
        self._acked = self._inflight = None
        self.urgent = True
        self._last_push = now - URGENT_GAP

    def due(self, timeout: float) -> float:
        """When ``poll`` next has something to do (``timeout``: the heartbeat timeout)."""
        if self.interval is None:
            return math.inf
        if self._inflight is not None:  # its acknowledgement, or giving up on it
            return self._inflight[2] + timeout
        if self.urgent:
            return self._last_push + URGENT_GAP
        return self.next_look

    def acked_version(self) -> int | None:
        """The version of ours the coordinator acknowledged, None if it holds none."""
        return self._acked[0] if self._acked else None

    def poll(self, now: float, timeout: float,
             snapshot: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any] | None, bool]:
        """A push's fields (``version``, ``base``, and ``stats`` or ``delta``) if the snapshot is
        due to be looked at and changed; or (None, True) if it was looked at and is the
        acknowledged one still; else (None, False)."""
        if self.interval is None:
            return None, False
        if self._inflight is not None:
            if now < self._inflight[2] + timeout:
                return None, False  # waiting for its acknowledgement
            self._inflight = None  # lost with a connection: push it whole
            self._acked = None
        urgent = self.urgent and now >= self._last_push + URGENT_GAP
        if not urgent and now < self.next_look:
            return None, False
        self.urgent = False  # before looking: a change from now on sets it again
        self.next_look = now + self.interval
        current = snapshot()
        if self._acked is not None and current == self._acked[1]:
            return None, True
        self._version += 1
        push: dict[str, Any] = {"version": self._version}
        delta = None if self._acked is None else snapshot_delta(self._acked[1], current)
        if delta is None:
            push.update(base=None, stats=current)
        else:
            push.update(base=self._acked[0] if self._acked else None, delta=delta)
        self._inflight = (self._version, current, now)
        self._last_push = now
        return push, False

    def last(self, snapshot: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """At a clean stop: a push's fields, the snapshot whole, if it differs from the last one
        pushed (acknowledged or not); None if the coordinator has it, or takes no pushes. So the
        coordinator's copy holds the worker's last steps, and its sizing profile learns them."""
        if self.interval is None:
            return None
        current = snapshot()
        sent = self._inflight[1] if self._inflight is not None else self._acked[1] if self._acked else None
        if sent is not None and current == sent:
            return None
        self._version += 1
        return {"version": self._version, "base": None, "stats": current}

    def on_ack(self, body: dict[str, Any]) -> None:
        """The coordinator's answer to a push (``version``, ``ok``)."""
        inflight = self._inflight
        if inflight is None:
            if not body["ok"] and self._acked is not None and body["version"] == self._acked[0]:
                self._acked = None  # the coordinator does not hold what we confirmed: push it whole
                self.urgent = True
            return
        if body["version"] != inflight[0]:
            return  # an answer to a push given up on
        self._inflight = None
        if body["ok"]:
            self._acked = inflight[0], inflight[1]
        else:  # a delta on a version the coordinator does not hold: push it whole, now
            self._acked = None
            self.urgent = True
