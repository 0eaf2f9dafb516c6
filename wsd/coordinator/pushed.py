"""The latest snapshot of every rank, as its agent pushed it, and answers built from them.

Agents push their snapshot when it changed (``Op.STATS_PUSH``): whole after
they register or lose track, else as a delta against the push the coordinator
last acknowledged. ``LatestStats`` keeps, per rank, the snapshot that makes
(checked, and encoded for answers), its version and when it was last known
current (a push, or a heartbeat saying it is unchanged). A ``stats`` answer is
then spliced from memory: no rank is asked, and each rank carries its age.
A TP group's summary is kept encoded until one of its members' snapshots, or
its membership, changes; an answer's body likewise, for its scope, but for
each rank's ``confirmed_at``, which every heartbeat changes. No sockets, no
torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import msgpack

from wsd.coordinator.aggregate import (
    AnswerBody,
    CheckedSnapshot,
    GroupPart,
    answer_body,
    group_part,
    packed_answer,
    read_changes,
    read_snapshot,
)
from wsd.coordinator.metrics import GroupFigures, RankFigures
from wsd.slotstats import apply_snapshot_delta

__all__ = ["NO_SNAPSHOT", "Latest", "LatestStats"]

_packer = msgpack.Packer(use_bin_type=True)
_ANSWERS_KEPT = 64  # answer bodies kept, each for one scope (all groups, or one) and its missing ranks

NO_SNAPSHOT = "live, no snapshot pushed yet"
"""Why a live rank is missing from an answer from memory: it has registered and not pushed yet."""


class Latest:
    """One rank's latest snapshot: the wire form, its checked reading, its version, when confirmed."""

    __slots__ = ("confirmed", "snapshot", "step", "version", "wire")

    def __init__(self, version: int, wire: dict[str, Any], snapshot: CheckedSnapshot, confirmed: float) -> None:
        self.version = version
        self.wire = wire
        self.snapshot = snapshot
        self.confirmed = confirmed
        self.step = snapshot.step  # the step at which it was last known current


class _Kept:
    """An answer's body for one scope, built at one generation (and the caller's version of
    the scope), and its ``confirmed_at`` column (encoded), built at a count of confirmations
    and a clock offset."""

    __slots__ = ("body", "column", "confirmations", "generation", "members", "offset", "oldest", "steps",
                 "version")

    def __init__(self, generation: int, version: Hashable, body: AnswerBody, members: tuple[Latest, ...]) -> None:
        self.generation = generation
        self.version = version  # the caller's, of the scope and missing ranks
        self.body = body
        self.members = members  # the ranks' Latest, in the body's order
        self.confirmations = -1  # none read yet
        self.offset = math.nan
        self.column = b""
        self.steps = b""  # each member's step at its confirmation, encoded with the column
        self.oldest = math.inf  # the oldest confirmation of a member, monotonic seconds


class LatestStats:
    """Every rank's latest pushed snapshot, and ``stats`` answers from them."""

    def __init__(self) -> None:
        self.ranks: dict[int, Latest] = {}
        # Why a rank's last push could not be used (an invalid snapshot), until one can.
        self.invalid: dict[int, str] = {}
        # Per TP group: what its encoded summary was built from, and the summary.
        self._groups: dict[int, tuple[Any, GroupPart]] = {}
        # Counts every change to what is remembered but confirmations (a push, a rank
        # forgotten or invalid): an answer's body built at one count stands until the next.
        self._generation = 0
        # Counts confirmations: an answer's confirmed_at column stands from one to the next.
        self._confirmations = 0
        # Per (scope, missing ranks): the body built at a generation, and its confirmations.
        self._answers: dict[Any, _Kept] = {}

    def push(self, rank: int, tp_group: int, body: dict[str, Any], now: float) -> bool:
        """Take one ``stats_push`` body; True if it is the rank's snapshot now, False if it
        was a delta on another version than the one held (the agent then pushes it whole).

        Raises ValueError naming what is wrong with an invalid push; the snapshot held
        stays as it was.
        """
        self._generation += 1
        try:
            return self._push(rank, tp_group, body, now)
        except ValueError as e:
            self.invalid[rank] = f"sent an invalid stats snapshot ({e})"
            raise

    def _push(self, rank: int, tp_group: int, body: dict[str, Any], now: float) -> bool:
        previous: CheckedSnapshot | None = None  # the snapshot a delta changed, when only that needs checking
        changed: frozenset[str] = frozenset()
        if body["base"] is None:
            wire = body["stats"]
            if wire is None:
                raise ValueError("stats_push: no base and no stats (a whole snapshot goes in stats)")
        else:
            held = self.ranks.get(rank)
            if held is None or held.version != body["base"]:
                return False  # a push lost, or ours forgotten: start again from a whole one
            delta = body["delta"]
            if delta is None:
                raise ValueError("stats_push: a base and no delta")
            wire = apply_snapshot_delta(held.wire, delta)
            if held.snapshot.tp_group == tp_group:
                previous = held.snapshot
                changed = frozenset((*delta.get("columns", ()), *delta.get("tables", ())))
        if previous is not None:  # only what the delta changed is checked and encoded again
            snapshot = read_changes(previous, body["step"], wire, changed)
        else:
            snapshot = read_snapshot(rank, tp_group, body["step"], wire)
        self.ranks[rank] = Latest(body["version"], wire, snapshot, now)
        self.invalid.pop(rank, None)
        return True

    def confirm(self, rank: int, version: int, now: float, step: int) -> bool:
        """A heartbeat at ``step`` said the rank's snapshot is still the one of ``version``;
        False if that is not the one held (the agent must push it whole)."""
        held = self.ranks.get(rank)
        if held is None or held.version != version:
            return False
        held.confirmed = now  # read when each answer is sent: no body to build again
        held.step = step
        self._confirmations += 1
        return True

    def total_bytes(self) -> int:
        """Scratch held by every rank with a snapshot, in bytes."""
        return sum(held.snapshot.total_bytes for held in self.ranks.values())

    def violations(self) -> int:
        """Lock violations counted by every rank's current slots."""
        return sum(sum(held.snapshot.columns["lock_violations"]) for held in self.ranks.values())

    def forget(self, rank: int) -> None:
        """A registration: what the rank's agent pushed before is not its state now."""
        self._generation += 1
        self.ranks.pop(rank, None)
        self.invalid.pop(rank, None)

    def ages(self, now: float) -> dict[int, float]:
        """Seconds since each remembered snapshot was known current."""
        return {rank: max(0.0, now - held.confirmed) for rank, held in self.ranks.items()}

    def answer(self, scope: dict[int, list[int]], missing: dict[int, str], now: float, wall: float,
               stale_after: float, *, key: Hashable, version: Hashable) -> bytes:
        """The encoded ``stats`` result for the TP groups of ``scope`` (group -> expected ranks).

        ``missing`` gives the reason for each expected rank that is not live; a live
        rank with nothing pushed yet is missing too. A snapshot last known current
        more than ``stale_after`` seconds before ``now`` is in the answer, marked
        stale, and the answer is not complete. ``wall``: the Unix time of ``now``.
        ``key`` and ``version`` stand for ``scope`` and ``missing``: the caller gives the
        same key and version only with the same scope and missing ranks (a new version
        replaces what was kept for the key).

        What depends on neither ``now`` nor confirmations is kept, for the same scope
        and missing ranks, until a push or a registration changes what is
        remembered: answers in between differ in their time, each rank's
        ``confirmed_at`` and the stale ranks only.
        """
        kept = self._answers.get(key)
        if kept is None or kept.generation != self._generation or kept.version != version:
            if len(self._answers) >= _ANSWERS_KEPT:  # scopes asked for come and go: keep a few
                self._answers.clear()
            kept = self._answers[key] = _Kept(self._generation, version, *self._body(scope, missing))
        # The Unix clock less the monotonic one, to a tenth of a millisecond: each rank's
        # confirmation on the Unix clock is its own plus this.
        offset = round(wall - now, 4)
        if kept.confirmations != self._confirmations or kept.offset != offset:
            kept.confirmations, kept.offset = self._confirmations, offset
            confirmed = [held.confirmed for held in kept.members]
            kept.column = _packer.pack([round(at + offset, 3) for at in confirmed])
            kept.steps = _packer.pack([held.step for held in kept.members])
            kept.oldest = min(confirmed, default=now)
        stale = [] if now - kept.oldest <= stale_after else [
            held.snapshot.rank for held in kept.members if now - held.confirmed > stale_after]
        return packed_answer(kept.body, fresh=False, as_of=round(wall, 3), step=kept.steps, confirmed_at=kept.column,
                             stale=stale)

    def _body(self, scope: dict[int, list[int]], missing: dict[int, str]) -> tuple[AnswerBody, tuple[Latest, ...]]:
        missing = dict(missing)
        answered: list[Latest] = []
        groups: list[GroupPart] = []
        for group, expected in sorted(scope.items()):
            members: list[Latest] = []
            for rank in expected:
                if rank in missing:
                    continue
                held = self.ranks.get(rank)
                if held is None:
                    missing[rank] = self.invalid.get(rank, NO_SNAPSHOT)
                    continue
                members.append(held)
            group_missing = {r: missing[r] for r in expected if r in missing}
            # Each push makes a new Latest: the members themselves (held here, so never
            # reused) say whether the summary built from them still stands.
            key = (tuple(expected), tuple(members), tuple(group_missing.items()))
            cached = self._groups.get(group)
            if cached is None or cached[0] != key:
                cached = (key, group_part(group, [m.snapshot for m in members], expected, group_missing))
                self._groups[group] = cached
            groups.append(cached[1])
            answered += members
        return answer_body([held.snapshot for held in answered], groups, missing), tuple(answered)

    def figures(self, scope: dict[int, list[int]], missing: dict[int, str], now: float,
                stale_after: float) -> tuple[tuple[RankFigures, ...], tuple[GroupFigures, ...]]:
        """What the metrics show of the same answer, without encoding it: per live rank with a
        snapshot, its figures and slot columns (shared, never changed); per group, totals."""
        ranks: list[RankFigures] = []
        groups: list[GroupFigures] = []
        for group, expected in sorted(scope.items()):
            totals = []
            for rank in expected:
                held = self.ranks.get(rank)
                if rank in missing or held is None:
                    continue
                age = max(0.0, now - held.confirmed)
                snapshot = held.snapshot
                ranks.append(RankFigures(rank, group, snapshot.total_bytes, round(age, 3), age > stale_after,
                                         snapshot.columns))
                totals.append(snapshot.total_bytes)
            if totals:  # a group with no rank reporting has no total to show
                groups.append(GroupFigures(group, sum(totals), max(totals) - min(totals)))
        return tuple(ranks), tuple(groups)
