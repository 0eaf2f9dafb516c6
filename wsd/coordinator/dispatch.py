"""An engine's commands in flight: numbered, sent to its ranks, resent to a rank that lacks
one, and answered once every target rank acknowledged, or at the timeout.

``Dispatch`` is one engine's (``wsd.coordinator.engine``): it reads the engine's
registry and command log, and says what happened in the engine's events. Plain
methods, no I/O. Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wsd.commands import COMMANDS, CommandResult
from wsd.coordinator.awaited import Awaited, expired, rank_gone
from wsd.coordinator.commandlog import Command, CommandLog
from wsd.coordinator.config import CoordinatorConfig
from wsd.coordinator.events import EventKind
from wsd.coordinator.metrics import CommandOutcome, CommandStats
from wsd.coordinator.outbox import AGENT, Answer, Out
from wsd.coordinator.registry import RankInfo, Registry
from wsd.security import command_mac
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode, Op, ProtocolError

__all__ = ["RESEND_WINDOW", "Dispatch"]

# Commands sent to a rank per registration or heartbeat that finds it behind:
# the rest follow at its next heartbeats, so no claim makes one message cost many.
RESEND_WINDOW = 64


@dataclass(kw_only=True)
class _Pending(Awaited):
    """A numbered command waiting for its targets' acknowledgements (``why``: the ranks of its
    target missing, never registered or stopped, and why)."""

    command: Command
    answer: Answer | None  # None: the client did not wait
    numbered: float = 0.0  # monotonic time it got its seq: the start of its latency
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)


class Dispatch:
    """Numbers an engine's commands, sends and resends them, and gathers their acknowledgements."""

    def __init__(self, config: CoordinatorConfig, registry: Registry, log: CommandLog, stats: CommandStats, *,
                 clock: Callable[[], float], wall: Callable[[], float], event: Callable[..., object]) -> None:
        """``event(kind, **detail)``: one of the engine's events."""
        self.config = config
        self.registry = registry
        self.log = log
        self.stats = stats
        self.clock = clock
        self.wall = wall
        self.event = event
        self._pending: dict[int, _Pending] = {}
        # When each command in the log was last sent to agents (monotonic): a rank
        # still lacking one a heartbeat interval later is sent it again.
        self._sent_at: dict[int, float] = {}
        self._resent_at: dict[int, float] = {}

    @property
    def pending(self) -> list[int]:
        """The sequence numbers still waiting for acknowledgements."""
        return sorted(self._pending)

    def next_deadline(self) -> float:
        return min((c.deadline for c in self._pending.values()), default=math.inf)

    def check(self, action: str, group: int | None) -> None:
        """Refuse, before anything is numbered, what the desired state refuses."""
        if COMMANDS[action].refused_while_locked:
            # The manager refuses these while locked; say so before numbering one.
            scope = self.registry.groups() if group is None else [group]
            locked = [g for g in scope if self.log.desired(g)["locked"]]
            if locked or (group is None and not scope and self.log.default["locked"]):
                raise ProtocolError(ErrorCode.CONFLICT, f"{action}: TP group(s) {locked} are locked; unlock first")

    def command(self, action: str, body: dict[str, Any], answer: Answer, *,
                issuer: dict[str, Any] | None = None) -> list[Out]:
        """Number a command, send it to every live rank, and answer when its targets applied it
        (``body["wait"]``) or at once with its number. ``check`` first. ``issuer``: who sent it,
        for the event (``Message.issuer``: the client's claim, and what CURVE proved, apart)."""
        group = body["group"]
        args = {k: v for k, v in body.items() if k not in ("group", "wait", "timeout", "engine", "new_engine")}
        now = self.clock()
        command = self.log.append(action, args, group, self.wall())
        self._sent_at[command.seq] = now
        while len(self._sent_at) > self.config.log_capacity:  # older ones left the log
            del self._sent_at[next(iter(self._sent_at))]
        self.event(EventKind.COMMAND, seq=command.seq, action=action, group=group, args=args,
                   **(issuer or {}))
        live = self.registry.live()
        out = [self._frame(command, i) for i in live]  # every rank holds every seq
        targets = {i.rank for i in live if command.targets(i.tp_group)}
        self._pending[command.seq] = _Pending(
            command=command, answer=answer if body["wait"] else None,
            targets=targets, deadline=now + (body["timeout"] or self.config.command_timeout),
            why=self.registry.missing(group), numbered=now,
        )
        if not body["wait"]:
            out += answer(CommandResult(command.seq, action, group, waited=False).to_dict())
        if not targets:
            out += self._finish(command.seq)
        return out

    def ack(self, rank: int, seq: Any, step: Any, ok: Any, error: Any) -> list[Out]:
        """A rank applied (``ok``) or could not apply command ``seq`` at ``step``."""
        pending = self._pending.get(seq) if isinstance(seq, int) else None
        if pending is None or rank not in pending.targets or rank in pending.acks:
            return []
        pending.acks[rank] = {"rank": rank, "step": step, "ok": bool(ok), "error": error}
        pending.owed.discard(rank)
        if not ok:
            self.event(EventKind.COMMAND_FAILED, rank=rank, seq=seq, action=pending.command.action, error=error)
        if not pending.owed:
            return self._finish(seq)
        return []

    def resend(self, rank: int, missed: list[Command], now: float, *,
               registering: bool = False) -> list[Out]:
        """Send a rank the commands it lacks: a window of them, at most once a heartbeat
        interval, and each only once it has been out for an interval (monotonic clock).

        A command frame can be lost (a full queue, a peer reconnecting) and its
        whole TP group would wait for it for ever, so a rank still lacking one is
        sent it again; agents drop the sequence numbers they already hold, so a
        resend is never applied twice. The window and the pace bound what any
        claim costs: the rest follow at the rank's next heartbeats.
        """
        interval = self.config.heartbeat_interval
        if now < self._resent_at.get(rank, -math.inf) + interval:
            return []
        # A registering rank lacks all of them; a heartbeat's rank may have the last
        # ones on their way.
        cutoff = math.inf if registering else now - interval
        due = [c for c in missed[:RESEND_WINDOW] if self._sent_at.get(c.seq, -math.inf) <= cutoff]
        if due:
            self._resent_at[rank] = now
        info = self.registry.ranks[rank]
        return [self._frame(c, info) for c in due]

    @staticmethod
    def _frame(command: Command, info: RankInfo) -> Out:
        """A command to one rank: authenticated under its registration's key, where it has one."""
        wire = command.to_wire()
        if info.key is not None:
            wire["mac"] = command_mac(info.key, wire)
        return AGENT, (info.peer,), p.encode(Op.COMMAND, wire)

    def rank_gone(self, rank: int, why: str | None) -> list[Out]:
        """A rank is no longer live: lost (``why`` None) or stopped (``why`` says so); what
        waits for it is answered without it."""
        return rank_gone(self._pending, rank, why, self._finish)

    def tick(self, now: float) -> list[Out]:
        """Answer the commands whose timeout passed, with the ranks still pending."""
        return expired(self._pending, now, self._finish)

    def _finish(self, seq: int) -> list[Out]:
        pending = self._pending.pop(seq)
        command = pending.command
        acks = [pending.acks[r] for r in sorted(pending.acks)]
        steps_by_group: dict[int, set[int]] = {}
        for ack in acks:
            steps_by_group.setdefault(self.registry.ranks[ack["rank"]].tp_group, set()).add(ack["step"])
        waiting = tuple(sorted(pending.owed))
        result = CommandResult(
            seq=seq, action=command.action, group=command.group, waited=pending.answer is not None,
            complete=not waiting and not pending.lost and not pending.why,
            acked=tuple(acks), failed=tuple(a["rank"] for a in acks if not a["ok"]),
            same_step={g: len(s) == 1 for g, s in sorted(steps_by_group.items())},
            pending=waiting, lost=tuple(sorted(pending.lost)),
            missing=tuple({"rank": r, "reason": why} for r, why in sorted(pending.why.items())),
        )
        self.event(EventKind.COMMAND_APPLIED, seq=seq, action=command.action, group=command.group,
                   steps={str(a["rank"]): a["step"] for a in acks}, pending=list(waiting),
                   complete=result.complete)
        outcome = (CommandOutcome.FAILED if result.failed else
                   CommandOutcome.COMPLETE if result.complete else CommandOutcome.PARTIAL)
        self.stats.record(command.action, outcome, self.clock() - pending.numbered)
        if pending.answer is None:
            return []
        return pending.answer(result.to_dict())
