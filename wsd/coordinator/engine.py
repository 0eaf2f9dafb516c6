"""One engine's share of the coordinator: its ranks, commands, pushed stats and desired state.

An engine is one world of ranks (a vLLM replica, a data-parallel engine, a
``wsd up`` cluster): ranks are unique within it, and it has its own TP groups,
command log (with a state file of its own), pending commands and stats. The
coordinator (``wsd.coordinator.core.CoordinatorCore``) routes each agent frame
to the engine its connection registered with, and each client request to the
engines it names; what engines share (the agent gate, the event log, the
command counters) comes in a ``Shared``. Plain methods, no I/O: each returns
the frames to send. Imports no torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wsd.commands import COMMANDS, CommandResult
from wsd.config import CoordinatorConfig
from wsd.coordinator.admission import AgentGate
from wsd.coordinator.aggregate import StatsRound, read_snapshot
from wsd.coordinator.commandlog import Command, CommandLog
from wsd.coordinator.events import EventKind, EventLog, bounded_detail
from wsd.coordinator.latest import LatestStats
from wsd.coordinator.metrics import CommandOutcome, CommandStats, CoreView, core_view
from wsd.coordinator.registry import RankState, RankTaken, RegistrationError, Registry
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode, Op, ProtocolError

__all__ = ["AGENT", "CLIENT", "Answer", "Engine", "Out", "Shared", "state_path"]

logger = logging.getLogger(__name__)

AGENT = "agent"
CLIENT = "client"
Route = tuple[bytes, ...]
Out = tuple[str, Route, bytes]
Answer = Callable[[dict[str, Any] | bytes], list[Out]]
"""Where a client's answer goes: called once with the result (a map, or one already
encoded), it returns the frames that carry it (to the client, or to a fan-out across engines)."""

# Commands sent to a rank per registration or heartbeat that finds it behind:
# the rest follow at its next heartbeats, so no claim makes one message cost many.
RESEND_WINDOW = 64
_SCOPES_KEPT = 64  # the scopes of answers from memory kept, each for one group asked for (or all)


def state_path(state_file: str, name: str, default: str) -> str:
    """Where engine ``name`` keeps its command log: the configured state file for the
    coordinator's default engine (so a single-engine coordinator's file is as it always was),
    ``STATE_FILE@NAME`` beside it for every other (engine names hold no ``/`` or ``@``)."""
    return state_file if name == default else f"{state_file}@{name}"


@dataclass
class Shared:
    """What every engine of one coordinator shares."""

    config: CoordinatorConfig
    clock: Callable[[], float]
    wall: Callable[[], float]
    epoch: str
    gate: AgentGate
    events: EventLog
    command_stats: CommandStats


@dataclass
class _PendingCommand:
    command: Command
    answer: Answer | None  # None: the client did not wait
    targets: set[int]
    deadline: float
    missing: dict[int, str]
    numbered: float = 0.0  # monotonic time it got its seq: the start of its latency
    acks: dict[int, dict[str, Any]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    # Targets neither acknowledged nor lost: done when empty, checked in O(1) per ack.
    owed: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.owed = set(self.targets)


@dataclass
class _PendingStats:
    """A fresh stats round (``wsctl stats --fresh``): every live rank asked, the answer waiting."""

    answer: Answer
    group: int | None
    targets: set[int]
    deadline: float
    gathered: StatsRound  # the replies so far, aggregated as they arrive
    lost: set[int] = field(default_factory=set)
    # Targets that will not be in the answer for a reason of their own (an invalid
    # snapshot, a goodbye), and that reason.
    reasons: dict[int, str] = field(default_factory=dict)
    # Targets that have neither answered nor been lost: done when empty, checked
    # in O(1) per reply.
    owed: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.owed = set(self.targets)


class Engine:
    """One engine's ranks, command log, pending commands and stats, driven by its messages."""

    def __init__(self, name: str, shared: Shared, state_file: str, *, first: EventKind = EventKind.STARTED) -> None:
        """``first``: the event that says it is here (``started`` for the coordinator's default
        engine, ``engine_added`` for one that came later)."""
        config = shared.config
        self.name = name
        self.shared = shared
        self.config = config
        self.clock = shared.clock
        self.wall = shared.wall
        self.gate = shared.gate
        self.registry = Registry(config.world_size, config.tp_size, config.heartbeat_timeout, wall=shared.wall)
        self.log = CommandLog(state_file, config.log_capacity)
        self.recovered = self.log.load()
        # When each command in the log was last sent to agents (monotonic): a rank
        # still lacking one a heartbeat interval later is sent it again.
        self._sent_at: dict[int, float] = {}
        self._resent_at: dict[int, float] = {}
        started = shared.wall()
        self._add(first, seq=self.log.seq, recovered=self.recovered)
        if self.log.repaired:  # a torn last journal record was dropped: tell the operator
            self._add(EventKind.STATE_REPAIRED, detail=self.log.repaired)
        if config.resume_seq is not None and config.resume_seq > self.log.seq:
            # The operator's recovery from a lost state file: never hand out again a
            # number that agents applied. Written at once, so it holds across restarts.
            self._add(EventKind.RESUMED, seq=config.resume_seq, was=self.log.seq)
            logger.warning("engine %s: resuming numbering after seq %d ([coordinator] resume_seq; the log was "
                           "at %d)", name, config.resume_seq, self.log.seq)
            self.log.bump_to(config.resume_seq)
        self.started = started
        self._commands: dict[int, _PendingCommand] = {}
        self._stats: dict[int, _PendingStats] = {}  # fresh rounds (wsctl stats --fresh)
        # Per group asked for (None: all), the scope and missing ranks of an answer from memory,
        # as of the registry's count of changes.
        self._stats_scopes: dict[int | None, tuple[int, dict[int, list[int]], dict[int, str]]] = {}
        self._stats_ids = 0
        # Each rank's latest snapshot as its agent pushed it: what stats answers come from.
        self.latest = LatestStats()
        # The sequence number fresh processes of a TP group start from, so that
        # members registering a moment apart still see the same commands, with
        # the group's desired state at it (None: older than the log could tell).
        self._baselines: dict[int, tuple[int, dict[str, Any] | None]] = {}
        self._inconsistent: set[int] = set()
        self.dropped_bad_agent_frames = 0
        self.heartbeats = 0
        self.agent_ops: dict[Op, Callable[[bytes, dict[str, Any]], list[Out]]] = {
            Op.REGISTER: self.register,
            Op.HEARTBEAT: self._heartbeat,
            Op.ACK: self._ack,
            Op.STATS_REPLY: self._stats_reply,
            Op.STATS_PUSH: self._stats_push,
            Op.EVENT: self._agent_event,
            Op.GOODBYE: self._goodbye,
        }

    @property
    def in_use(self) -> bool:
        """Whether anything ever happened here: a rank registered, or a command was numbered."""
        return bool(self.registry.ranks) or self.log.seq > 0

    def _add(self, kind: EventKind, **detail: Any) -> None:
        self.shared.events.add(kind, self.wall(), engine=self.name, **detail)

    # -- time -----------------------------------------------------------------

    def tick(self, now: float, heard: float) -> list[Out]:
        """Lost ranks and timed-out rounds."""
        out: list[Out] = []
        for info in self.registry.expire(heard):
            self._add(EventKind.LOST, rank=info.rank, tp_group=info.tp_group,
                      last_step=info.step, silent_for=round(heard - info.last_seen, 3))
            out += self._rank_gone(info.rank, tp_group=info.tp_group)
        for seq, pending in list(self._commands.items()):
            if now >= pending.deadline:
                out += self._finish_command(seq)
        for request, waiting in list(self._stats.items()):
            if now >= waiting.deadline:
                out += self._finish_stats(request)
        return out

    def next_deadline(self) -> float:
        deadlines = [self.registry.next_expiry()]
        deadlines += [c.deadline for c in self._commands.values()]
        deadlines += [s.deadline for s in self._stats.values()]
        return min(deadlines)

    def asked(self, peer: bytes) -> bool:
        """Whether a stats round waits for this connection's rank."""
        info = self.registry.by_peer(peer)
        return info is not None and any(info.rank in s.owed for s in self._stats.values())

    # -- agents -------------------------------------------------------------

    def register(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        """A registration whose proof the coordinator has checked already."""
        now = self.clock()
        try:
            claimed = body["applied_seq"]
            if claimed is not None and claimed > self.log.seq:
                raise RegistrationError(
                    f"rank {body['rank']} reports applied_seq {claimed}, but this coordinator has issued "
                    f"only up to {self.log.seq}: its state file was lost or replaced. If so, set "
                    f"[coordinator] resume_seq = {claimed} (the highest such report) and restart it")
            info, old = self.registry.register(peer, body, now, heard=self.gate.heard(now))
        except RankTaken as e:
            return self._refuse(peer, body, ErrorCode.CONFLICT, str(e))
        except RegistrationError as e:
            return self._refuse(peer, body, ErrorCode.MISMATCH, str(e))
        group = info.tp_group
        desired: dict[str, Any] | None = None
        claimed = body["applied_seq"]
        missed = [] if claimed is None else self.log.since(claimed)
        # The kept log cannot bring it up to date: the commands after what it applied are
        # gone (older than log_capacity), or were never issued here (a resume_seq past it).
        # It would wait for them for ever; it starts again as a fresh process does instead.
        rebase = claimed is not None and claimed < self.log.seq and (not missed or missed[0].seq != claimed + 1)
        if claimed is None or rebase:  # a fresh process, or one started again
            live_peers = [i for i in self.registry.live(group) if i.rank != info.rank]
            # Started again, from now: its live peers have applied every command the log kept.
            recorded = self._baselines.get(group) if live_peers and not rebase else None
            baseline, desired = (self.log.seq, self.log.desired(group)) if recorded is None else recorded
            if desired is None:  # the kept log could not rebuild it: the process keeps its configuration
                logger.warning("rank %d starts at seq %d without its group's desired state (older than the log)",
                               info.rank, baseline)
        else:
            baseline = claimed  # checked above: never beyond what was issued
        if rebase:
            self._event(("rank", info.rank), EventKind.REBASED, rank=info.rank, tp_group=group,
                        applied_seq=claimed, baseline_seq=baseline, oldest_kept=missed[0].seq if missed else None)
            missed = []
        if group not in self._baselines:
            # The desired state goes with the baseline: a fresh process applies it
            # and then the commands after the baseline, so it must be the state
            # *at* the baseline (recorded now, when the log can still tell), not
            # the current one, or a later command would count twice or be undone.
            known = desired if desired is not None else self.log.desired_at(group, baseline)
            self._baselines[group] = (baseline, known)
        info.applied_seq = info.held_seq = baseline
        self.latest.forget(info.rank)  # the agent pushes its snapshot whole once registered
        kind: EventKind | None = EventKind.JOINED
        if old is not None and old.state in (RankState.LOST, RankState.STOPPED):
            kind = EventKind.BACK
        elif old is not None and old.peer == peer:
            kind = None  # the same connection asking again (our answer was late): nothing new
        elif old is not None:
            kind = EventKind.SUPERSEDED
        if kind is not None:  # a peer's doing, however fast it goes: within its rank's budget
            self._event(("rank", info.rank), kind, rank=info.rank, tp_group=group, host=info.host,
                        pid=info.pid, applied_seq=baseline)
        out: list[Out] = [(AGENT, (peer,), p.encode(Op.REGISTERED, {
            "epoch": self.shared.epoch,
            "baseline_seq": baseline,
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "stats_interval": self.config.pushed_interval,
            "desired": desired,  # only to a fresh process: a re-registration keeps what it applied
            "rebase": rebase,
        }))]
        if claimed is None or rebase:
            missed = self.log.since(baseline)
        out += self._resend(info.rank, peer, missed, now, registering=True)
        for ack in body["acks"]:  # acknowledgements sent while we could not hear them
            try:  # [seq, step, ok, error], checked as an ACK message would be
                if not (isinstance(ack, list) and len(ack) == 4):
                    raise ProtocolError(ErrorCode.BAD_FIELD, "register.acks: expected [seq, step, ok, error]")
                a = p.validate_body(Op.ACK, {"rank": info.rank, **dict(zip(("seq", "step", "ok", "error"), ack))})
            except ProtocolError as e:
                logger.warning("rank %d resent a bad ack %r: %s", info.rank, ack, e)
                continue
            out += self._record_ack(info.rank, a["seq"], a["step"], a["ok"], a["error"])
        return out

    def _refuse(self, peer: bytes, body: dict[str, Any], code: ErrorCode, reason: str) -> list[Out]:
        return refuse(self.shared, peer, body, code, reason, engine=self.name)

    def _event(self, source: tuple[Any, ...], kind: EventKind, **detail: Any) -> None:
        """An event from a source a peer controls: rate-limited per source (within this engine),
        the rest counted and summed up in one ``suppressed`` event a heartbeat interval later."""
        if self.gate.event_allowed((self.name, *source), str(kind)):
            self._add(kind, **detail)

    def _resend(self, rank: int, peer: bytes, missed: list[Command], now: float, *,
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
        return [(AGENT, (peer,), p.encode(Op.COMMAND, c.to_wire())) for c in due]

    def _heartbeat(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        self.heartbeats += 1
        now = self.clock()
        issued = self.log.seq
        body = self.gate.believable(body, "heartbeat", issued)
        info = self.registry.heartbeat(peer, body, now)
        if info is None:  # e.g. we restarted: ask the agent to register again
            return [(AGENT, (peer,), p.encode(Op.PULSE, {"epoch": self.shared.epoch, "registered": False}))]
        self._check_group(info.tp_group)
        out: list[Out] = []
        version = body.get("stats_version")
        if version is not None and not self.latest.confirm(info.rank, version, now):
            # Not the snapshot we hold (we lost it): the agent pushes its whole one.
            out.append((AGENT, (peer,), p.encode(Op.STATS_ACK, {"version": version, "ok": False})))
        if info.held_seq >= issued:
            return out
        return out + self._resend(info.rank, peer, self.log.since(info.held_seq), now)

    def _stats_push(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        """A changed snapshot, which is a heartbeat too; acknowledged with whether it was used."""
        out = self._heartbeat(peer, {k: body[k] for k in ("rank", "step", "applied_seq", "held_seq", "state")})
        info = self.registry.by_peer(peer)
        if info is None or info.state is not RankState.LIVE:
            return out  # the heartbeat's answer asks it to register; its snapshot waits until then
        try:
            ok = self.latest.push(info.rank, info.tp_group, body, self.clock())
        except ValueError as e:  # a buggy or newer agent: its rank shows missing, saying why
            ok = False
            self.dropped_bad_agent_frames += 1
            if self.gate.allow(("bad snapshot", info.rank)):
                logger.warning("rank %d pushed an invalid stats snapshot: %s", info.rank, e)
        return [*out, (AGENT, (peer,), p.encode(Op.STATS_ACK, {"version": body["version"], "ok": ok}))]

    def _check_group(self, group: int) -> None:
        members = self.registry.live(group)
        settled = len({i.applied_seq for i in members}) == 1
        states = {(i.manager_state.get("locked"), i.manager_state.get("num_ubatches")) for i in members}
        if settled and len(states) > 1 and group not in self._inconsistent:
            self._inconsistent.add(group)
            # Its members' reports drive the flips: within the group's budget.
            self._event(("group", group), EventKind.GROUP_INCONSISTENT, tp_group=group, ranks={
                str(i.rank): {"locked": i.manager_state.get("locked"),
                              "num_ubatches": i.manager_state.get("num_ubatches")} for i in members})
        elif len(states) <= 1 and group in self._inconsistent:
            self._inconsistent.discard(group)
            self._event(("group", group), EventKind.GROUP_CONSISTENT, tp_group=group)

    def _ack(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        if info is None or info.rank != body["rank"]:
            return []
        return self._record_ack(info.rank, body["seq"], body["step"], body["ok"], body["error"])

    def _record_ack(self, rank: int, seq: Any, step: Any, ok: Any, error: Any) -> list[Out]:
        pending = self._commands.get(seq) if isinstance(seq, int) else None
        if pending is None or rank not in pending.targets or rank in pending.acks:
            return []
        pending.acks[rank] = {"rank": rank, "step": step, "ok": bool(ok), "error": error}
        pending.owed.discard(rank)
        if not ok:
            self._add(EventKind.COMMAND_FAILED, rank=rank, seq=seq,
                            action=pending.command.action, error=error)
        if not pending.owed:
            return self._finish_command(seq)
        return []

    def _stats_reply(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        pending = self._stats.get(body["request"])
        if info is None or pending is None or info.rank not in pending.owed:
            return []
        pending.owed.discard(info.rank)
        try:
            pending.gathered.add(read_snapshot(info.rank, info.tp_group, body["step"], body["stats"]))
        except ValueError as e:  # a buggy or newer agent: the others' answer must not suffer
            self.dropped_bad_agent_frames += 1
            logger.warning("rank %d sent an invalid stats snapshot: %s", info.rank, e)
            pending.reasons[info.rank] = f"sent an invalid stats snapshot ({e})"
        if not pending.owed:
            return self._finish_stats(body["request"])
        return []

    def _agent_event(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        if info is None:
            return []
        kind = EventKind.LOCK_VIOLATION if body["kind"] == "lock_violation" else EventKind.AGENT_EVENT
        # The event's own keys come from the coordinator; a clashing detail key
        # would be a duplicate keyword argument and lose the whole event.
        own = ("id", "time", "kind", "rank", "tp_group", "agent_kind")
        detail = bounded_detail(body["detail"], reserved=own)
        self._event(("rank", info.rank), kind, rank=info.rank, tp_group=info.tp_group,
                    agent_kind=body["kind"], **detail)
        return []

    def _goodbye(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        body = self.gate.believable(body, "goodbye", self.log.seq)
        info = self.registry.stop(peer, body)
        if info is None:  # not the connection that registered that rank (an impostor, a late frame)
            return []
        self._event(("rank", info.rank), EventKind.STOPPED, rank=info.rank, tp_group=info.tp_group,
                    last_step=info.step)
        return self._rank_gone(info.rank, tp_group=info.tp_group,
                               why=self.registry.missing(info.tp_group)[info.rank])

    def _rank_gone(self, rank: int, *, tp_group: int, why: str | None = None) -> list[Out]:
        """A rank is no longer live: lost (``why`` None) or stopped (``why`` says so).

        What waits for it is answered without it: a lost rank is listed as lost, a
        stopped one as missing with ``why``.
        """
        out: list[Out] = []
        for seq, pending in list(self._commands.items()):
            if rank in pending.owed:
                if why is None:
                    pending.lost.add(rank)
                else:
                    pending.missing[rank] = why
                pending.owed.discard(rank)
                if not pending.owed:
                    out += self._finish_command(seq)
        for request, stats in list(self._stats.items()):
            if rank in stats.owed:
                if why is None:
                    stats.lost.add(rank)
                else:
                    stats.reasons[rank] = why
                stats.owed.discard(rank)
                if not stats.owed:
                    out += self._finish_stats(request)
        if not self.registry.live(tp_group):  # a fresh group starts from the log again
            self._baselines.pop(tp_group, None)
        return out

    # -- clients ----------------------------------------------------------

    def check_group(self, group: int | None) -> None:
        groups = self.registry.groups()
        if group is not None and self.registry.world_size is not None and group not in groups:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"group: no TP group {group} (groups are 0..{len(groups) - 1})")

    def check_command(self, action: str, group: int | None) -> None:
        """Refuse, before anything is numbered, what the desired state refuses."""
        self.check_group(group)
        if COMMANDS[action].refused_while_locked:
            # The manager refuses these while locked; say so before numbering one.
            scope = self.registry.groups() if group is None else [group]
            locked = [g for g in scope if self.log.desired(g)["locked"]]
            if locked or (group is None and not scope and self.log.default["locked"]):
                raise ProtocolError(ErrorCode.CONFLICT, f"{action}: TP group(s) {locked} are locked; unlock first")

    def command(self, action: str, body: dict[str, Any], answer: Answer) -> list[Out]:
        """Number a command, send it to every live rank, and answer when its targets applied it
        (``body["wait"]``) or at once with its number. ``check_command`` first."""
        group = body["group"]
        args = {k: v for k, v in body.items() if k not in ("group", "wait", "timeout", "engine")}
        now = self.clock()
        command = self.log.append(action, args, group, self.wall())
        self._sent_at[command.seq] = now
        while len(self._sent_at) > self.config.log_capacity:  # older ones left the log
            del self._sent_at[next(iter(self._sent_at))]
        self._add(EventKind.COMMAND, seq=command.seq, action=action, group=group, args=args)
        frame = p.encode(Op.COMMAND, command.to_wire())
        live = self.registry.live()
        out: list[Out] = [(AGENT, (i.peer,), frame) for i in live]  # every rank holds every seq
        targets = {i.rank for i in live if command.targets(i.tp_group)}
        pending = _PendingCommand(
            command=command, answer=answer if body["wait"] else None,
            targets=targets, deadline=now + (body["timeout"] or self.config.command_timeout),
            missing=self.registry.missing(group), numbered=now,
        )
        self._commands[command.seq] = pending
        if not body["wait"]:
            out += answer(CommandResult(command.seq, action, group, waited=False).to_dict())
        if not targets:
            out += self._finish_command(command.seq)
        return out

    def _finish_command(self, seq: int) -> list[Out]:
        pending = self._commands.pop(seq)
        command = pending.command
        acks = [pending.acks[r] for r in sorted(pending.acks)]
        steps_by_group: dict[int, set[int]] = {}
        for ack in acks:
            steps_by_group.setdefault(self.registry.ranks[ack["rank"]].tp_group, set()).add(ack["step"])
        waiting = tuple(sorted(pending.owed))
        result = CommandResult(
            seq=seq, action=command.action, group=command.group, waited=pending.answer is not None,
            complete=not waiting and not pending.lost and not pending.missing,
            acked=tuple(acks), failed=tuple(a["rank"] for a in acks if not a["ok"]),
            same_step={g: len(s) == 1 for g, s in sorted(steps_by_group.items())},
            pending=waiting, lost=tuple(sorted(pending.lost)),
            missing=tuple({"rank": r, "reason": why} for r, why in sorted(pending.missing.items())),
        )
        self._add(EventKind.COMMAND_APPLIED, seq=seq, action=command.action,
                  group=command.group, steps={str(a["rank"]): a["step"] for a in acks},
                  pending=list(waiting), complete=result.complete)
        outcome = (CommandOutcome.FAILED if result.failed else
                   CommandOutcome.COMPLETE if result.complete else CommandOutcome.PARTIAL)
        self.shared.command_stats.record(command.action, outcome, self.clock() - pending.numbered)
        if pending.answer is None:
            return []
        return pending.answer(result.to_dict())

    def remembered(self, group: int | None) -> bytes:
        """The encoded ``stats`` answer from the ranks' pushed snapshots (group None: all)."""
        scope, missing = self.scope(group)
        return self.latest.answer(scope, missing, self.clock(), self.wall(), self.config.stale_after,
                                  key=group, version=self.registry.changes)

    def scope(self, group: int | None) -> tuple[dict[int, list[int]], dict[int, str]]:
        """``_stats_scope(group)`` and the registry's missing ranks of it, kept while the registry
        counts no change; shared, never to be changed by the caller."""
        changes = self.registry.changes
        kept = self._stats_scopes.get(group)
        if kept is None or kept[0] != changes:
            if len(self._stats_scopes) >= _SCOPES_KEPT:  # groups asked for come and go: keep a few
                self._stats_scopes.clear()
            kept = self._stats_scopes[group] = (changes, self._stats_scope(group), self.registry.missing(group))
        return kept[1], kept[2]

    def start_stats(self, answer: Answer, group: int | None, timeout: float) -> list[Out]:
        """Ask every live rank of ``group`` (None: all) for a snapshot now, and answer when all did."""
        self._stats_ids += 1
        request = self._stats_ids
        live = self.registry.live(group)
        self._stats[request] = _PendingStats(
            answer=answer, group=group, targets={i.rank for i in live},
            deadline=self.clock() + timeout, gathered=StatsRound(self._stats_scope(group)),
        )
        frame = p.encode(Op.STATS_REQUEST, {"request": request})
        out: list[Out] = [(AGENT, (i.peer,), frame) for i in live]
        if not live:
            out += self._finish_stats(request)
        return out

    def _stats_scope(self, group: int | None) -> dict[int, list[int]]:
        """Each TP group a stats request covers, with its expected ranks."""
        groups = self.registry.groups() if group is None else [group]
        return {g: self.registry.expected(g) for g in groups}

    def _finish_stats(self, request: int) -> list[Out]:
        pending = self._stats.pop(request)
        missing = self.registry.missing(pending.group)
        for rank in pending.targets - set(pending.gathered.replies):
            missing[rank] = pending.reasons.get(rank) or (
                "lost while asked" if rank in pending.lost else "no reply within the stats timeout")
        # Encoded already: the parts as the replies came, spliced.
        return pending.answer(pending.gathered.finish(self._stats_scope(pending.group), missing,
                                                      round(self.wall(), 3)))

    # -- what clients and the metrics read ------------------------------------------

    def core_view(self) -> CoreView:
        """A copy of the registry and this engine's counters, for the metrics (replaced whole)."""
        return core_view(self.registry, seq=self.log.seq, inconsistent=self._inconsistent,
                         drifting={g for g in self.registry.groups() if self._drift(g)})

    def _drift(self, group: int) -> list[str]:
        """How a settled TP group's live ranks differ from its desired state (``["locked: desired
        false, ranks report true"]``); none while a command is on its way or nothing is desired.

        Consistency says the ranks agree with each other; this says they agree with what was
        asked (an engine that locks by itself after warm-up drifts from a desired unlock).
        """
        desired = self.log.desired(group)
        live = self.registry.live(group)
        if not desired or not live or any(i.applied_seq != self.log.seq for i in live):
            return []
        out = []
        for key in ("locked", "num_ubatches"):
            want = desired.get(key)
            seen = sorted({i.manager_state.get(key) for i in live}, key=str)
            if want is not None and seen != [want]:
                out.append(f"{key}: desired {want}, ranks report {', '.join(map(str, seen))}")
        return out

    def ranks(self) -> dict[str, Any]:
        result = self.registry.public(self.clock(), self.wall())
        for row in result["ranks"]:
            row["engine"] = self.name
        return result

    def status(self) -> dict[str, Any]:
        groups = [{**self.registry.group_status(g), "desired": self.log.desired(g),
                   "consistent": g not in self._inconsistent, "drift": self._drift(g)}
                  for g in self.registry.groups()]
        return {
            "engine": self.name,
            "epoch": self.shared.epoch,
            "started": self.started,
            "recovered": self.recovered,
            "seq": self.log.seq,
            "world_size": self.registry.world_size,
            "tp_size": self.registry.tp_size,
            "desired": self.log.default,
            "ranks": self.registry.counts(),
            "pending_commands": sorted(self._commands),
            "groups": groups,
            # Agent frames and registrations refused, by reason: an impostor or a
            # flood shows here (see the threat model in docs/security.md).
            "agents_refused": dict(sorted(self.gate.refused.items())),
            "agents_authenticated": self.gate.token is not None,
        }

    def summary(self) -> dict[str, Any]:
        """This engine in one row of ``wsctl engines``."""
        live = self.registry.live()
        states = {(i.manager_state.get("locked"), i.manager_state.get("num_ubatches")) for i in live}
        locked = sorted({s[0] for s in states}, key=str)
        ubatches = sorted({s[1] for s in states}, key=str)
        models = sorted({i.model for i in live if i.model})
        return {
            "engine": self.name,
            "model": models[0] if len(models) == 1 else (", ".join(models) or None),
            "live": len(live),
            "world_size": self.registry.world_size,
            "tp_size": self.registry.tp_size,
            "seq": self.log.seq,
            "locked": locked[0] if len(locked) == 1 else None,
            "num_ubatches": ubatches[0] if len(ubatches) == 1 else None,
            "workspace_bytes": self.latest.total_bytes(),
            "lock_violations": self.latest.violations(),
            "desired": self.log.default,
        }


def refuse(shared: Shared, peer: bytes, body: dict[str, Any], code: ErrorCode, reason: str, *,
           engine: str | None) -> list[Out]:
    """Answer a refused registration; counted, and an event unless they come too fast."""
    shared.gate.refused[f"registration {code}"] += 1
    if shared.gate.event_allowed(("refused",), str(EventKind.REJECTED)):
        shared.events.add(EventKind.REJECTED, shared.wall(), engine=engine, rank=body["rank"], code=str(code),
                          reason=reason, host=body["host"], pid=body["pid"])
    return [(AGENT, (peer,), p.encode(Op.REJECTED, {"code": str(code), "message": reason}))]
