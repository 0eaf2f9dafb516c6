"""One engine's share of the coordinator: its ranks, and what they register, report and stop.

An engine is one world of ranks (a vLLM replica, a data-parallel engine, a
``wsd up`` cluster): ranks are unique within it, and it has its own TP groups,
command log (with a state file of its own), commands in flight
(``wsd.coordinator.dispatch.Dispatch``) and stats (``wsd.coordinator.snapshots.Snapshots``).
The coordinator (``wsd.coordinator.core.CoordinatorCore``) routes each agent
frame to the engine its connection registered with, and each client request to
the engines it names; what engines share (the agent gate, the event log, the
command counters) comes in a ``Shared``. Plain methods, no I/O, no torch: each
returns the frames to send.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wsd.coordinator.admission import AgentGate, Proven
from wsd.coordinator.commandlog import CommandLog
from wsd.coordinator.config import CoordinatorConfig
from wsd.coordinator.dispatch import Dispatch
from wsd.coordinator.events import EventKind, EventLog, bounded_detail
from wsd.coordinator.metrics import CommandStats, CoreView, core_view
from wsd.coordinator.outbox import AGENT, Out
from wsd.coordinator.profiles import Profiles
from wsd.coordinator.registry import RankInfo, RankState, RankTaken, RegistrationError, Registry
from wsd.coordinator.snapshots import Snapshots
from wsd.coordinator.stacks import StackRounds, checked_threads
from wsd.coordinator.stalls import Stalls
from wsd.rankrow import AGREED
from wsd.security import registered_proof
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode, Op, ProtocolError

__all__ = ["MAX_STACK_RANKS", "Engine", "Shared", "refuse", "state_path"]

MAX_STACK_RANKS = 64
"""The most ranks one stacks request asks: each answers with up to 1 MiB of stacks."""

logger = logging.getLogger(__name__)


def state_path(state_file: str, name: str, default: str) -> str:
    """Where engine ``name`` keeps its command log: the configured state file for the
    coordinator's default engine, ``STATE_FILE@NAME`` beside it for any other."""
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
    profiles: Profiles
    """The sizing profiles every engine's ranks feed and read (``wsd.coordinator.profiles``)."""


class Engine:
    """One engine's ranks, command log, commands in flight and stats, driven by its messages."""

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
        # The configured world (``[coordinator] world_size``, ``tp_size``) is the default engine's;
        # any other engine (a vLLM replica beside it) has the world its own ranks register with.
        own = name == config.engine
        self.registry = Registry(config.world_size if own else None, config.tp_size if own else None,
                                 config.heartbeat_timeout, wall=shared.wall)
        self.log = CommandLog(state_file, config.log_capacity)
        self.recovered = self.log.load()
        self.started = shared.wall()
        self.held_at = shared.clock()  # when it last held a live rank (``CoordinatorCore._forget_engines``)
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
        self.dispatch = Dispatch(config, self.registry, self.log, shared.command_stats,
                                 clock=shared.clock, wall=shared.wall, event=self._add)
        self.snapshots = Snapshots(config, self.registry, clock=shared.clock, wall=shared.wall,
                                   allow=shared.gate.allow)
        self.stacks = StackRounds(self.registry, clock=shared.clock)
        self.stalls = Stalls(config, self.registry, event=self._event, engine=name)
        # The sequence number fresh processes of a TP group start from, so that
        # members registering a moment apart still see the same commands, with
        # the group's desired state at it (None: older than the log could tell).
        self._baselines: dict[int, tuple[int, dict[str, Any] | None]] = {}
        self._inconsistent: set[int] = set()
        # When a group's live ranks began to disagree (or, flagged, to agree again): a flip is
        # flagged only once it has held for a heartbeat interval, so that a rank flipping its
        # report at every heartbeat flips nothing (debounced per group).
        self._flip_since: dict[int, float] = {}
        self.heartbeats = 0
        self.agent_ops: dict[Op, Callable[[bytes, dict[str, Any]], list[Out]]] = {
            Op.REGISTER: self.register,  # the core's, after its challenge: never a first registration
            Op.HEARTBEAT: self._heartbeat,
            Op.ACK: self._ack,
            Op.STATS_REPLY: self._stats_reply,
            Op.STATS_PUSH: self._stats_push,
            Op.STACKS_REPLY: self._stacks_reply,
            Op.EVENT: self._agent_event,
            Op.GOODBYE: self._goodbye,
        }

    @property
    def in_use(self) -> bool:
        """Whether anything ever happened here: a rank registered, or a command was numbered."""
        return bool(self.registry.ranks) or self.log.seq > 0

    @property
    def dropped_bad_agent_frames(self) -> int:
        return self.snapshots.invalid

    def _add(self, kind: EventKind, source: Any = None, **detail: Any) -> bool:
        return self.shared.events.add(kind, self.wall(), source=source, engine=self.name, **detail) is not None

    def _event(self, source: tuple[Any, ...], kind: EventKind, **detail: Any) -> bool:
        """An event from a source a peer controls, rate-limited per source and held to its share
        of the log's bytes (the rest summed up in one ``suppressed`` event); whether it was kept."""
        source = (self.name, *source)
        return self.gate.event_allowed(source, str(kind)) and self._add(kind, source, **detail)

    # -- time -----------------------------------------------------------------

    def tick(self, now: float, heard: float) -> list[Out]:
        """Lost ranks and timed-out rounds."""
        out: list[Out] = []
        for info in self.registry.expire(heard):
            self._add(EventKind.LOST, rank=info.rank, tp_group=info.tp_group,
                      last_step=info.step, silent_for=round(heard - info.last_seen, 3))
            out += self._rank_gone(info, None)
        return out + self.dispatch.tick(now) + self.snapshots.tick(now) + self.stacks.tick(now)

    def next_deadline(self) -> float:
        return min(self.registry.next_expiry(), self.dispatch.next_deadline(), self.snapshots.next_deadline(),
                   self.stacks.next_deadline())

    def push_affordable(self, peer: bytes, size: int) -> bool:
        """Whether a ``stats_push`` frame of ``size`` bytes from this registered connection may be
        taken in now: each costs its rank by the slots of the snapshot it changes (the one held,
        or for a whole one about a slot per 32 bytes), not by its bytes. One refused is dropped
        before any of that, its connection's liveness noted: a rank pushing faster than any
        agent does."""
        info = self.registry.touch(peer, self.clock())
        if info is None:
            return True  # not ours to meter: read, and answered as any stray frame
        slots = max(self.snapshots.slots(info.rank), size // 32)
        return self.gate.push_allowed((self.name, info.rank), slots)

    def asked(self, peer: bytes) -> bool:
        """Whether a stats round waits for this connection's rank."""
        info = self.registry.by_peer(peer)
        return info is not None and self.snapshots.asked(info.rank)

    # -- registration ---------------------------------------------------------

    def register(self, peer: bytes, body: dict[str, Any], proven: Proven | None = None) -> list[Out]:
        """A registration whose proof the coordinator has checked already (``proven``; None:
        registrations are not authenticated)."""
        now = self.clock()
        claimed = body["applied_seq"]
        try:
            if claimed is not None and claimed > self.log.seq:
                raise RegistrationError(
                    f"rank {body['rank']} reports applied_seq {claimed}, but this coordinator has issued "
                    f"only up to {self.log.seq}: its state file was lost or replaced. If so, set "
                    f"[coordinator] resume_seq = {claimed} (the highest such report) and restart it")
            info, old = self.registry.register(peer, body, now, heard=self.gate.heard(now))
        except RankTaken as e:
            return refuse(self.shared, peer, body, ErrorCode.CONFLICT, str(e), engine=self.name)
        except RegistrationError as e:
            return refuse(self.shared, peer, body, ErrorCode.MISMATCH, str(e), engine=self.name)
        baseline, desired, rebase, missed = self._start_point(info, claimed)
        info.applied_seq = info.held_seq = baseline
        info.key = None if proven is None else proven.key
        self.snapshots.latest.forget(info.rank)  # the agent pushes its snapshot whole once registered
        kind: EventKind | None = EventKind.JOINED
        if old is not None and old.state in (RankState.LOST, RankState.STOPPED):
            kind = EventKind.BACK
        elif old is not None and old.peer == peer:
            kind = None  # the same connection asking again (our answer was late): nothing new
        elif old is not None:
            kind = EventKind.SUPERSEDED
        if kind is not None:  # a peer's doing, however fast it goes: within its rank's budget
            self._event(("rank", info.rank), kind, rank=info.rank, tp_group=info.tp_group, host=info.host,
                        pid=info.pid, applied_seq=baseline)
        out: list[Out] = [(AGENT, (peer,), p.encode(Op.REGISTERED, {
            "epoch": self.shared.epoch,
            "baseline_seq": baseline,
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "stats_interval": self.config.pushed_interval,
            "stall_after": float(self.config.stall_after),
            "desired": desired,  # only to a fresh process: a re-registration keeps what it applied
            "rebase": rebase,
            "presize": self.shared.profiles.for_registration(body, self.name),
            "proof": None if proven is None or self.gate.token is None else registered_proof(
                self.gate.token, proven.nonce, proven.challenge, self.shared.epoch, baseline),
        }))]
        out += self.dispatch.resend(info.rank, missed, now, registering=True)
        return out + self._replay_acks(info, body["acks"])

    def _start_point(self, info: RankInfo, claimed: int | None) -> tuple[
            int, dict[str, Any] | None, bool, list[Any]]:
        """Where a registering rank starts: its baseline seq, the desired state it takes on
        (a fresh process only), whether it is rebased, and the commands it lacks."""
        group = info.tp_group
        desired: dict[str, Any] | None = None
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
            baseline = claimed  # checked by the caller: never beyond what was issued
        if rebase:
            self._event(("rank", info.rank), EventKind.REBASED, rank=info.rank, tp_group=group,
                        applied_seq=claimed, baseline_seq=baseline, oldest_kept=missed[0].seq if missed else None)
        if group not in self._baselines:
            # The desired state goes with the baseline: a fresh process applies it
            # and then the commands after the baseline, so it must be the state
            # *at* the baseline (recorded now, when the log can still tell), not
            # the current one, or a later command would count twice or be undone.
            known = desired if desired is not None else self.log.desired_at(group, baseline)
            self._baselines[group] = (baseline, known)
        if claimed is None or rebase:
            missed = self.log.since(baseline)
        return baseline, desired, rebase, missed

    def _replay_acks(self, info: RankInfo, acks: list[Any]) -> list[Out]:
        """Acknowledgements a registering agent resends: sent while we could not hear them."""
        out: list[Out] = []
        for ack in acks:
            try:
                a = p.AckRecord.from_wire(ack, info.rank)
            except ProtocolError as e:
                logger.warning("rank %d resent a bad ack %r: %s", info.rank, ack, e)
                continue
            out += self.dispatch.ack(info.rank, a.seq, a.step, a.ok, a.error)
        return out

    # -- what registered ranks send -------------------------------------------------

    def _heartbeat(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        self.heartbeats += 1
        now = self.clock()
        issued = self.log.seq
        body = self.gate.believable(body, "heartbeat", issued)
        info = self.registry.heartbeat(peer, body, now)
        if info is None:  # e.g. we restarted: ask the agent to register again
            return [(AGENT, (peer,), p.encode(Op.PULSE, {"epoch": self.shared.epoch, "registered": False}))]
        self._check_group(info.tp_group, now)
        self.stalls.check(info, now)
        out: list[Out] = []
        version = body.get("stats_version")
        if version is not None and not self.snapshots.latest.confirm(info.rank, version, now, info.step):
            # Not the snapshot we hold (we lost it): the agent pushes its whole one.
            out.append((AGENT, (peer,), p.encode(Op.STATS_ACK, {"version": version, "ok": False})))
        if info.held_seq >= issued:
            return out
        return out + self.dispatch.resend(info.rank, self.log.since(info.held_seq), now)

    def _stats_push(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        """A changed snapshot, which is a heartbeat too; acknowledged with whether it was used."""
        out = self._heartbeat(peer, {k: body[k] for k in ("rank", "step", "applied_seq", "held_seq", "state",
                                                          "in_step")})
        info = self.registry.by_peer(peer)
        if info is None or info.state is not RankState.LIVE:
            return out  # the heartbeat's answer asks it to register; its snapshot waits until then
        ok = self.snapshots.push(info, body)
        if ok:  # what its slots asked for feeds its sizing profile, and whoever grew one is named
            held = self.snapshots.latest.ranks[info.rank]
            key, grown = self.shared.profiles.learn_push(self.name, info, self.registry.tp_size, body, held.wire,
                                                         held.snapshot.columns)
            if grown:
                self._event(("profile", info.rank), EventKind.PROFILE_GREW, rank=info.rank, key=str(key),
                            grew=[list(g) for g in grown[:16]], slots=len(grown))
        return [*out, (AGENT, (peer,), p.encode(Op.STATS_ACK, {"version": body["version"], "ok": ok}))]

    def _check_group(self, group: int, now: float) -> None:
        """Flag a TP group whose settled live ranks disagree on lock state or slot count (and
        clear the flag once they agree), each flip once it has held a heartbeat interval."""
        members = self.registry.live(group)
        settled = len({i.applied_seq for i in members}) == 1
        states = {tuple(i.manager_state.get(key) for key in AGREED) for i in members}
        flagged = group in self._inconsistent
        flips = (settled and len(states) > 1) if not flagged else len(states) <= 1
        if not flips:
            self._flip_since.pop(group, None)
            return
        since = self._flip_since.setdefault(group, now)
        if now - since < self.config.heartbeat_interval:
            return  # not for long enough yet: a report flipping at every heartbeat never gets here
        del self._flip_since[group]
        # Its members' reports drive the flips: within the group's budget too.
        if not flagged:
            self._inconsistent.add(group)
            self._event(("group", group), EventKind.GROUP_INCONSISTENT, tp_group=group, ranks={
                str(i.rank): {key: i.manager_state.get(key) for key in AGREED} for i in members})
        else:
            self._inconsistent.discard(group)
            self._event(("group", group), EventKind.GROUP_CONSISTENT, tp_group=group)

    def _ack(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        if info is None or info.rank != body["rank"]:
            return []
        return self.dispatch.ack(info.rank, body["seq"], body["step"], body["ok"], body["error"])

    def _stats_reply(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        return [] if info is None else self.snapshots.reply(info, body)

    # -- stalls and stacks -----------------------------------------------------------

    def _stacks_reply(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        now = self.clock()
        info = self.registry.touch(peer, now)
        if info is None:
            return []
        try:
            threads: list[dict[str, Any]] | None = checked_threads(body["threads"])
            problem = None
        except ValueError as e:  # a buggy or hostile agent: its stacks are left out, saying why
            threads, problem = None, str(e)
            if self.gate.allow(("bad stacks", info.rank)):
                logger.warning("rank %d sent invalid stacks: %s", info.rank, e)
        if body["request"] == 0:  # on its own: its engine has been inside one step for stall_after
            if threads is not None and body["in_step"] is not None:
                info.in_step_since = now - body["in_step"]
                self.stalls.check(info, now, threads)
            return []
        return self.stacks.reply(info, body, threads, problem)

    def stack_targets(self, group: int | None, rank: int | None) -> list[int]:
        """The ranks a stacks request names: ``rank``, else ``group``'s, else every expected one;
        at most ``MAX_STACK_RANKS`` (each answer may hold up to 1 MiB of stacks)."""
        if rank is not None:
            world = self.registry.world_size
            if world is not None and rank >= world:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"rank: no rank {rank} (ranks are 0..{world - 1})")
            return [rank]
        self.check_group(group)
        ranks = self.registry.expected(group)
        if len(ranks) > MAX_STACK_RANKS:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"stacks of {len(ranks)} ranks asked, at most {MAX_STACK_RANKS} "
                                                     f"in one request: name a TP group (group) or a rank (rank)")
        return ranks

    def _agent_event(self, peer: bytes, body: dict[str, Any]) -> list[Out]:
        info = self.registry.touch(peer, self.clock())
        if info is None:
            return []
        kind = EventKind.LOCK_VIOLATION if body["kind"] == "lock_violation" else EventKind.AGENT_EVENT
        # The event's own keys come from the coordinator; a clashing detail key
        # would be a duplicate keyword argument and lose the whole event.
        own = ("id", "time", "kind", "engine", "rank", "tp_group", "agent_kind")
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
        return self._rank_gone(info, self.registry.missing(info.tp_group)[info.rank])

    def _rank_gone(self, info: RankInfo, why: str | None) -> list[Out]:
        """A rank is no longer live: lost (``why`` None) or stopped (``why`` says so). What
        waits for it is answered without it: a lost rank is listed as lost, a stopped one as
        missing with ``why``."""
        self.stalls.end(info, "lost" if why is None else "stopped")
        out = (self.dispatch.rank_gone(info.rank, why) + self.snapshots.rank_gone(info.rank, why)
               + self.stacks.rank_gone(info.rank, why))
        if not self.registry.live(info.tp_group):  # a fresh group starts from the log again
            self._baselines.pop(info.tp_group, None)
        return out

    # -- what clients and the metrics read ------------------------------------------

    def check_group(self, group: int | None) -> None:
        groups = self.registry.groups()
        if group is not None and self.registry.world_size is not None and group not in groups:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"group: no TP group {group} (groups are 0..{len(groups) - 1})")

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
        for key in AGREED:
            want = desired.get(key)
            seen = sorted({i.manager_state.get(key) for i in live}, key=str)
            if want is not None and seen != [want]:
                out.append(f"{key}: desired {want}, ranks report {', '.join(map(str, seen))}")
        return out

    def ranks(self) -> dict[str, Any]:
        return self.registry.public(self.clock(), self.wall(), self.name)

    def status(self, offset: int = 0, limit: int = 512) -> dict[str, Any]:
        """The world, the desired state, and the TP groups ``offset`` to ``offset + limit``."""
        every = self.registry.groups()
        groups = [{**self.registry.group_status(g), "desired": self.log.desired(g),
                   "consistent": g not in self._inconsistent, "drift": self._drift(g)}
                  for g in every[offset:offset + limit]]
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
            "pending_commands": self.dispatch.pending,
            "groups": groups,
            "groups_total": len(every),
            "offset": offset,
            # Agent frames and registrations refused, by reason: an impostor or a
            # flood shows here (see the threat model in docs/security.md).
            "agents_refused": dict(sorted(self.gate.refused.items())),
            "agents_authenticated": self.gate.token is not None,
        }

    def summary(self) -> dict[str, Any]:
        """This engine in one row of ``wsctl engines``."""
        live = self.registry.live()
        # Each of AGREED, where the live ranks agree on it: null where they differ.
        agreed = {key: sorted({i.manager_state.get(key) for i in live}, key=str) for key in AGREED}
        models = sorted({i.model for i in live if i.model})
        latest = self.snapshots.latest
        return {
            "engine": self.name,
            "model": ", ".join(models) or None,
            "live": len(live),
            "world_size": self.registry.world_size,
            "tp_size": self.registry.tp_size,
            "seq": self.log.seq,
            **{key: seen[0] if len(seen) == 1 else None for key, seen in agreed.items()},
            "workspace_bytes": latest.total_bytes(),
            "lock_violations": latest.violations(),
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
