"""Every thread's stack of the ranks asked (``wsctl stacks``), and those a stalled rank sends.

A stacks round asks every live rank of its targets at once and answers when
each has replied, gone, or its timeout passed (``wsd.coordinator.awaited``),
as a fresh stats round does. What an agent sends is checked here, field by
field, before anything keeps or forwards it: an agent is a peer, and its stacks
end up in the event log and in operators' terminals. Plain methods, no I/O.
Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wsd.coordinator.awaited import Awaited, expired, rank_gone
from wsd.coordinator.outbox import AGENT, Answer, Out
from wsd.coordinator.registry import RankInfo, RankState, Registry
from wsd.fmt import cut, one_line
from wsd.wire import protocol as p
from wsd.wire.protocol import Op

__all__ = ["MIN_INTERVAL", "StackRounds", "checked_threads"]

MAX_FRAMES = 64
MAX_TEXT = 256
MIN_INTERVAL = 1.0
"""Seconds before a rank's stacks are gathered again: a request sooner is answered with the
ones it sent last (``age`` says how old). Gathering interrupts the rank's agent, and 8 ranks
asked 99-148 times a second slowed their engines' steps 17-22 %."""
_KEPT_BYTES = 32 << 20  # the last replies kept for that second, in all (roughly: their text)


def checked_threads(threads: list[Any]) -> list[dict[str, Any]]:
    """An agent's threads as a stacks reply holds them, each cut to size and made printable on
    one line (a frame holding a newline or a bidi override can forge no line of its own);
    ValueError naming what is wrong (the reply is then left out)."""
    out = []
    for i, thread in enumerate(threads):
        if not isinstance(thread, dict):
            raise ValueError(f"threads[{i}]: expected a map")
        frames = thread.get("frames")
        if not isinstance(frames, list) or len(frames) > MAX_FRAMES or not all(isinstance(f, str) for f in frames):
            raise ValueError(f"threads[{i}].frames: expected at most {MAX_FRAMES} strings")
        name, dropped = thread.get("name"), thread.get("dropped", 0)
        if not isinstance(name, str) or type(dropped) is not int or dropped < 0:
            raise ValueError(f"threads[{i}]: expected a name and a count of dropped frames")
        out.append({"name": cut(one_line(name), MAX_TEXT), "engine": thread.get("engine") is True,
                    "daemon": thread.get("daemon") is True, "dropped": dropped,
                    "frames": [cut(one_line(f), MAX_TEXT) for f in frames]})
    return out


@dataclass(kw_only=True)
class _Round(Awaited):
    answer: Answer
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    joined: list[tuple[Answer, list[int]]] = field(default_factory=list)
    """Requests made while this round ran, answered with it: each answer and the ranks it asked."""


class StackRounds:
    """An engine's stacks rounds: one at a time (a request made meanwhile joins it), and no rank
    asked again within ``MIN_INTERVAL`` of its last reply."""

    def __init__(self, registry: Registry, *, clock: Callable[[], float]) -> None:
        self.registry = registry
        self.clock = clock
        self._rounds: dict[int, _Round] = {}
        self._ids = 0
        self._last: dict[int, tuple[float, int, dict[str, Any]]] = {}  # rank: when, size, its last reply
        self._kept = 0  # the sizes of the replies in ``_last``

    def next_deadline(self) -> float:
        return min((r.deadline for r in self._rounds.values()), default=math.inf)

    def start(self, answer: Answer, ranks: list[int], timeout: float) -> list[Out]:
        """Ask the live ones of ``ranks`` for their stacks now; answer once all did (or went).
        While a round runs, this request joins it instead; a rank that replied within
        ``MIN_INTERVAL`` is answered with that reply, not asked."""
        if self._rounds:
            next(reversed(self._rounds.values())).joined.append((answer, ranks))
            return []
        self._ids += 1
        request = self._ids
        now = self.clock()
        known = [self.registry.ranks.get(r) for r in ranks]
        live = [i for i in known if i is not None and i.state is RankState.LIVE]
        self._forget_before(now - MIN_INTERVAL)
        recent = {i.rank: self._last[i.rank] for i in live if i.rank in self._last}
        live = [i for i in live if i.rank not in recent]
        work = _Round(answer=answer, targets={i.rank for i in live} | set(recent), deadline=now + timeout)
        for rank, (when, _, reply) in recent.items():
            work.replies[rank] = {**reply, "age": round(now - when, 3)}
            work.owed.discard(rank)
        if len(live) < len(ranks):
            missing = self.registry.missing()  # once: it walks the whole world
            for rank in ranks:
                if rank not in work.targets and rank not in work.why:
                    work.why[rank] = missing.get(rank, "not registered")
        self._rounds[request] = work
        frame = p.encode(Op.STACKS_REQUEST, {"request": request})
        out: list[Out] = [(AGENT, (i.peer,), frame) for i in live]
        if not live:
            out += self._finish(request)
        return out

    def reply(self, info: RankInfo, body: dict[str, Any], threads: list[dict[str, Any]] | None,
              problem: str | None) -> list[Out]:
        """A rank's reply to round ``body["request"]``: its checked ``threads``, or the
        ``problem`` that kept them out."""
        work = self._rounds.get(body["request"])
        if work is None or info.rank not in work.owed:
            return []
        work.owed.discard(info.rank)
        if threads is None:
            work.why[info.rank] = f"sent invalid stacks ({problem})"
        else:
            work.replies[info.rank] = {"rank": info.rank, "tp_group": info.tp_group, "host": info.host,
                                       "pid": info.pid, "step": body["step"], "in_step": body["in_step"],
                                       "threads": threads, "at_stall": info.stall_stacks, "age": 0.0}
            self._remember(info.rank, work.replies[info.rank])
        return self._finish(body["request"]) if not work.owed else []

    def _remember(self, rank: int, reply: dict[str, Any]) -> None:
        """Keep ``rank``'s reply for ``MIN_INTERVAL``, within ``_KEPT_BYTES`` in all."""
        now = self.clock()
        self._forget_before(now - MIN_INTERVAL)
        size = sum(len(t["name"]) + sum(len(f) for f in t["frames"]) + 64 for t in reply["threads"])
        if self._kept + size > _KEPT_BYTES:
            return  # asked again, it will be gathered again: no worse than before
        old = self._last.pop(rank, None)
        self._kept += size - (old[1] if old else 0)
        self._last[rank] = (now, size, reply)

    def _forget_before(self, when: float) -> None:
        while self._last:
            rank, (at, size, _) = next(iter(self._last.items()))
            if at >= when:
                return
            del self._last[rank]
            self._kept -= size

    def rank_gone(self, rank: int, why: str | None) -> list[Out]:
        return rank_gone(self._rounds, rank, why, self._finish)

    def tick(self, now: float) -> list[Out]:
        return expired(self._rounds, now, self._finish)

    def _finish(self, request: int) -> list[Out]:
        work = self._rounds.pop(request)
        missing = {rank: work.why.get(rank) or ("lost while asked" if rank in work.lost else
                                                 "no reply within the timeout")
                   for rank in work.targets | set(work.why) if rank not in work.replies}
        out = work.answer({"ranks": [work.replies[r] for r in sorted(work.replies)],
                           "missing": [{"rank": r, "reason": why} for r, why in sorted(missing.items())]})
        for answer, ranks in work.joined:  # those made meanwhile: what this round gathered of theirs
            asked = set(ranks)
            out += answer({"ranks": [work.replies[r] for r in sorted(work.replies) if r in asked],
                           "missing": [{"rank": r, "reason": missing.get(r, "asked while another stacks round "
                                                                          "ran, which did not ask it: ask again")}
                                       for r in sorted(asked - set(work.replies))]})
        return out
