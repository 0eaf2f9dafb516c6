"""What an engine's ranks report of their workspaces: the snapshots they push, from which
``stats`` is answered, and fresh rounds (``wsctl stats --fresh``) that ask every rank now.

``Snapshots`` is one engine's (``wsd.coordinator.engine``); it reads the engine's
registry for who is expected and who is missing. Plain methods, no I/O. Imports no torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wsd.coordinator.aggregate import StatsRound, read_snapshot
from wsd.coordinator.awaited import Awaited, expired, rank_gone
from wsd.coordinator.config import CoordinatorConfig
from wsd.coordinator.metrics import StatsView
from wsd.coordinator.outbox import AGENT, Answer, Out
from wsd.coordinator.pushed import LatestStats
from wsd.coordinator.registry import RankInfo, Registry
from wsd.wire import protocol as p
from wsd.wire.protocol import Op

__all__ = ["Snapshots"]

logger = logging.getLogger(__name__)

_SCOPES_KEPT = 64  # the scopes of answers from memory kept, each for one group asked for (or all)


@dataclass(kw_only=True)
class _Round(Awaited):
    """A fresh stats round: every live rank asked, the answer waiting (``why``: targets out of
    it for a reason of their own, an invalid snapshot or a goodbye)."""

    answer: Answer
    group: int | None
    gathered: StatsRound  # the replies so far, aggregated as they arrive


class Snapshots:
    """An engine's ranks' pushed snapshots and its fresh stats rounds."""

    def __init__(self, config: CoordinatorConfig, registry: Registry, *, clock: Callable[[], float],
                 wall: Callable[[], float], allow: Callable[[Any], bool]) -> None:
        """``allow(source)``: whether a log line about that source may be written now (bounded)."""
        self.config = config
        self.registry = registry
        self.clock = clock
        self.wall = wall
        self.allow = allow
        # Each rank's latest snapshot as its agent pushed it: what stats answers come from.
        self.latest = LatestStats()
        self.invalid = 0
        """Pushes and replies that held an invalid snapshot."""
        self._rounds: dict[int, _Round] = {}
        self._ids = 0
        # Per group asked for (None: all), the scope and missing ranks of an answer from memory,
        # as of the registry's count of changes.
        self._scopes: dict[int | None, tuple[int, dict[int, list[int]], dict[int, str]]] = {}

    # -- pushed ------------------------------------------------------------------

    def slots(self, rank: int) -> int:
        """Slots of the snapshot held for ``rank`` (0: none): what merging a delta into it costs."""
        held = self.latest.ranks.get(rank)
        return 0 if held is None else len(held.snapshot.columns["ubatch"])

    def push(self, info: RankInfo, body: dict[str, Any]) -> bool:
        """A ``stats_push`` of a live rank: whether it is the rank's snapshot now."""
        try:
            return self.latest.push(info.rank, info.tp_group, body, self.clock())
        except ValueError as e:  # a buggy or newer agent: its rank shows missing, saying why
            self.invalid += 1
            if self.allow(("bad snapshot", info.rank)):
                logger.warning("rank %d pushed an invalid stats snapshot: %s", info.rank, e)
            return False

    def remembered(self, group: int | None) -> bytes:
        """The encoded ``stats`` answer from the ranks' pushed snapshots (group None: all)."""
        scope, missing = self.scope(group)
        return self.latest.answer(scope, missing, self.clock(), self.wall(), self.config.stale_after,
                                  key=group, version=self.registry.changes)

    def view(self) -> StatsView:
        """What the metrics show of every rank's remembered snapshot, now."""
        return StatsView(self.wall(), *self.latest.figures(*self.scope(None), self.clock(), self.config.stale_after))

    def scope(self, group: int | None) -> tuple[dict[int, list[int]], dict[int, str]]:
        """The groups an answer for ``group`` covers, with their expected ranks, and the
        registry's missing ranks of them: kept while the registry counts no change; shared,
        never to be changed by the caller."""
        changes = self.registry.changes
        kept = self._scopes.get(group)
        if kept is None or kept[0] != changes:
            if len(self._scopes) >= _SCOPES_KEPT:  # groups asked for come and go: keep a few
                self._scopes.clear()
            kept = self._scopes[group] = (changes, self._expected(group), self.registry.missing(group))
        return kept[1], kept[2]

    def _expected(self, group: int | None) -> dict[int, list[int]]:
        """Each TP group a stats request covers, with its expected ranks."""
        groups = self.registry.groups() if group is None else [group]
        return {g: self.registry.expected(g) for g in groups}

    # -- fresh rounds ------------------------------------------------------------

    def asked(self, rank: int) -> bool:
        """Whether a fresh round waits for this rank."""
        return any(rank in r.owed for r in self._rounds.values())

    def next_deadline(self) -> float:
        return min((r.deadline for r in self._rounds.values()), default=math.inf)

    def start(self, answer: Answer, group: int | None, timeout: float) -> list[Out]:
        """Ask every live rank of ``group`` (None: all) for a snapshot now, and answer when all did."""
        self._ids += 1
        request = self._ids
        live = self.registry.live(group)
        self._rounds[request] = _Round(
            answer=answer, group=group, targets={i.rank for i in live},
            deadline=self.clock() + timeout, gathered=StatsRound(self._expected(group)),
        )
        frame = p.encode(Op.STATS_REQUEST, {"request": request})
        out: list[Out] = [(AGENT, (i.peer,), frame) for i in live]
        if not live:
            out += self._finish(request)
        return out

    def reply(self, info: RankInfo, body: dict[str, Any]) -> list[Out]:
        """A rank's ``stats_reply`` to round ``body["request"]``."""
        pending = self._rounds.get(body["request"])
        if pending is None or info.rank not in pending.owed:
            return []
        pending.owed.discard(info.rank)
        try:
            pending.gathered.add(read_snapshot(info.rank, info.tp_group, body["step"], body["stats"]))
        except ValueError as e:  # a buggy or newer agent: the others' answer must not suffer
            self.invalid += 1
            logger.warning("rank %d sent an invalid stats snapshot: %s", info.rank, e)
            pending.why[info.rank] = f"sent an invalid stats snapshot ({e})"
        if not pending.owed:
            return self._finish(body["request"])
        return []

    def rank_gone(self, rank: int, why: str | None) -> list[Out]:
        """A rank is no longer live: lost (``why`` None) or stopped (``why`` says so); a round
        that waits for it is answered without it."""
        return rank_gone(self._rounds, rank, why, self._finish)

    def tick(self, now: float) -> list[Out]:
        """Answer the rounds whose timeout passed, without the ranks that did not reply."""
        return expired(self._rounds, now, self._finish)

    def _finish(self, request: int) -> list[Out]:
        pending = self._rounds.pop(request)
        missing = self.registry.missing(pending.group)
        for rank in pending.targets - set(pending.gathered.replies):
            missing[rank] = pending.why.get(rank) or (
                "lost while asked" if rank in pending.lost else "no reply within the stats timeout")
        # Encoded already: the parts as the replies came, spliced.
        return pending.answer(pending.gathered.finish(self._expected(pending.group), missing, round(self.wall(), 3)))
