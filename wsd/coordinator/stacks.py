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
from wsd.fmt import cut, printable
from wsd.wire import protocol as p
from wsd.wire.protocol import Op

__all__ = ["StackRounds", "checked_threads"]

MAX_FRAMES = 64
MAX_TEXT = 256


def checked_threads(threads: list[Any]) -> list[dict[str, Any]]:
    """An agent's threads as a stacks reply holds them, each cut to size and made printable;
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
        out.append({"name": cut(printable(name), MAX_TEXT), "engine": thread.get("engine") is True,
                    "daemon": thread.get("daemon") is True, "dropped": dropped,
                    "frames": [cut(printable(f), MAX_TEXT) for f in frames]})
    return out


@dataclass(kw_only=True)
class _Round(Awaited):
    answer: Answer
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)


class StackRounds:
    """An engine's stacks rounds."""

    def __init__(self, registry: Registry, *, clock: Callable[[], float]) -> None:
        self.registry = registry
        self.clock = clock
        self._rounds: dict[int, _Round] = {}
        self._ids = 0

    def next_deadline(self) -> float:
        return min((r.deadline for r in self._rounds.values()), default=math.inf)

    def start(self, answer: Answer, ranks: list[int], timeout: float) -> list[Out]:
        """Ask the live ones of ``ranks`` for their stacks now; answer once all did (or went)."""
        self._ids += 1
        request = self._ids
        known = [self.registry.ranks.get(r) for r in ranks]
        live = [i for i in known if i is not None and i.state is RankState.LIVE]
        work = _Round(answer=answer, targets={i.rank for i in live}, deadline=self.clock() + timeout)
        if len(live) < len(ranks):
            missing = self.registry.missing()  # once: it walks the whole world
            for rank in ranks:
                if rank not in work.targets:
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
                                       "threads": threads, "at_stall": info.stall_stacks}
        return self._finish(body["request"]) if not work.owed else []

    def rank_gone(self, rank: int, why: str | None) -> list[Out]:
        return rank_gone(self._rounds, rank, why, self._finish)

    def tick(self, now: float) -> list[Out]:
        return expired(self._rounds, now, self._finish)

    def _finish(self, request: int) -> list[Out]:
        work = self._rounds.pop(request)
        missing = {rank: work.why.get(rank) or ("lost while asked" if rank in work.lost else
                                                 "no reply within the timeout")
                   for rank in work.targets | set(work.why) if rank not in work.replies}
        return work.answer({"ranks": [work.replies[r] for r in sorted(work.replies)],
                            "missing": [{"rank": r, "reason": why} for r, why in sorted(missing.items())]})
