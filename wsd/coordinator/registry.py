"""The coordinator's registry of ranks: who is registered, live, lost or stopped, and since when.

Plain logic with an injected clock; no sockets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wsd.errors import RankTaken, RegistrationError, StrEnum
from wsd.rankrow import AGREED, ManagerState, RankRow, read_manager_state
from wsd.wire.protocol import NEVER_REGISTERED

__all__ = ["RankInfo", "RankState", "RankTaken", "RegistrationError", "Registry"]

"""Why an expected rank is missing when no agent ever registered as it: a rank in this
state is ``missing`` in ``ranks``, ``status`` and the metrics alike."""


MAX_CLAIMED_WORLD = 4096
"""The largest world a registration may set when the configuration names none. A worker with
a wrong WORLD_SIZE (or a peer) once set 2**20, and every ``status`` then blocked the loop for
14-17 s building a 185 MB answer. A larger world is configured: ``[coordinator] world_size``."""


class RankState(StrEnum):
    LIVE = "live"
    STALLED = "stalled"
    """Shown, never held: a live rank (its agent answers) whose engine has been inside one step
    for longer than ``[coordinator] stall_after``, as when a TP peer froze mid-collective."""
    LOST = "lost"
    """Silent for longer than the heartbeat timeout: died, hung or cut off."""
    STOPPED = "stopped"
    """Said goodbye: its worker shut down cleanly."""


def _utc(wall: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def _note(info: RankInfo, body: dict[str, Any], now: float | None = None) -> None:
    """Where a heartbeat or goodbye says the rank stands (a goodbye may omit the seqs); a
    heartbeat (``now``) says too whether the engine is inside a step, and for how long.

    An agent's sequence numbers only grow while it stays registered: a claim
    below what it said before is not believed (it would ask for resends of
    what it holds), nor one above what was issued (checked by the caller).
    """
    info.step = body["step"]
    if body.get("applied_seq") is not None:
        info.applied_seq = max(info.applied_seq, body["applied_seq"])
    if body.get("held_seq") is not None:
        info.held_seq = max(info.held_seq, body["held_seq"])
    if body["state"]:
        info.manager_state = read_manager_state(body["state"])
    if now is not None:
        inside = body.get("in_step")
        info.in_step_since = None if inside is None else now - inside


@dataclass
class RankInfo:
    rank: int
    peer: bytes
    tp_group: int
    host: str
    pid: int
    device: str
    idle: bool
    instance: str | None = None
    """The agent process's own value, the same across its reconnections (None: not given)."""
    model: str | None = None
    """What its engine serves, as the agent said (None: not said)."""
    key: bytes | None = field(default=None, repr=False)
    """The session key of its registration (``wsd.security.session_key``): its commands are
    sent authenticated under it. None: registrations are not authenticated."""
    state: RankState = RankState.LIVE
    stall_stacks: list[dict[str, Any]] | None = field(default=None, repr=False)
    """Every thread's stack its agent sent when it stalled, while it is stalled (for ``stacks``)."""
    registered_at: float = 0.0
    """Wall-clock time (``time.time()``) of the registration."""
    last_seen: float = 0.0
    """Monotonic time of the last message: for liveness, never shown as it is."""
    lost_at: float | None = None
    """Wall-clock time at which the rank was marked lost."""
    stopped_at: float | None = None
    """Wall-clock time at which the rank said goodbye."""
    step: int = 0
    applied_seq: int = 0
    held_seq: int = 0
    manager_state: ManagerState = field(default_factory=lambda: ManagerState())
    config: dict[str, Any] = field(default_factory=dict)
    in_step_since: float | None = None
    """Monotonic time at which its engine entered the step it is inside, as its last heartbeat
    said; None: between steps (or an agent that does not say)."""
    stalled: bool = False
    """Inside one step for longer than ``stall_after`` (set by the engine's ``tick``)."""

    @property
    def shown(self) -> RankState:
        """Its state as ``ranks``, ``status`` and the metrics show it: ``stalled`` for a stalled live rank."""
        return RankState.STALLED if self.stalled and self.state is RankState.LIVE else self.state

    def in_step(self, now: float) -> float | None:
        """Seconds its engine has been inside the current step (None: between steps, or not live)."""
        if self.in_step_since is None or self.state is not RankState.LIVE:
            return None
        return max(0.0, now - self.in_step_since)

    def public(self, now: float, wall_now: float, engine: str | None = None) -> dict[str, Any]:
        """This rank's ``RankRow`` in ``ranks``; every time in it is wall-clock time.

        ``now`` is the monotonic clock that ``last_seen`` was read from.
        """
        inside = self.in_step(now)
        return RankRow(
            engine=engine, rank=self.rank, state=str(self.shown), tp_group=self.tp_group, host=self.host,
            pid=self.pid, device=self.device, idle=self.idle, step=self.step, applied_seq=self.applied_seq,
            registered_at=self.registered_at, last_seen=wall_now - (now - self.last_seen),
            lost_at=self.lost_at, stopped_at=self.stopped_at, locked=self.manager_state.get("locked"),
            num_ubatches=self.manager_state.get("num_ubatches"), model=self.model,
            warming=self.manager_state.get("warming", False),
            in_step=None if inside is None else round(inside, 3),
        ).to_wire()


class Registry:
    """Ranks by number and by ZeroMQ peer identity, checked against the expected world."""

    def __init__(
        self,
        world_size: int | None,
        tp_size: int | None,
        timeout: float,
        *,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.world_size = world_size
        self.wall = wall
        self.tp_size = tp_size
        self.timeout = timeout
        self.ranks: dict[int, RankInfo] = {}
        self._by_peer: dict[bytes, int] = {}
        # Counts registrations, goodbyes and losses: what ``expected`` and ``missing`` give
        # stands from one count to the next.
        self.changes = 0
        # No live rank can expire before this (monotonic) time. Signs of life
        # only move a rank's expiry later, so a bound computed once stays true
        # until a registration adds an earlier one: ``expire`` walks the ranks
        # only when the bound is reached, instead of on every loop pass.
        self._expiry_bound = math.inf

    def check(self, body: dict[str, Any]) -> None:
        """Raise RegistrationError unless the registration fits the world."""
        world, tp, rank, group = body["world_size"], body["tp_size"], body["rank"], body["tp_group"]
        if self.world_size is None and world > MAX_CLAIMED_WORLD:
            raise RegistrationError(
                f"rank {rank} reports world_size={world}: a world over {MAX_CLAIMED_WORLD} ranks is set by "
                f"the operator ([coordinator] world_size), never by a registration"
            )
        if self.world_size is not None and world != self.world_size:
            raise RegistrationError(
                f"rank {rank} reports world_size={world}, the coordinator expects {self.world_size}"
            )
        if self.tp_size is not None and tp != self.tp_size:
            raise RegistrationError(
                f"rank {rank} reports tp_size={tp}, the coordinator expects {self.tp_size}"
            )
        if rank >= world:
            raise RegistrationError(f"rank {rank} is not below its world_size={world}")
        if world % tp:
            raise RegistrationError(f"rank {rank}: world_size={world} is not a multiple of tp_size={tp}")
        if group != rank // tp:
            raise RegistrationError(
                f"rank {rank} reports tp_group={group}, but with tp_size={tp} it belongs to "
                f"group {rank // tp}"
            )

    def register(self, peer: bytes, body: dict[str, Any], now: float, *,
                 heard: float | None = None) -> tuple[RankInfo, RankInfo | None]:
        """Record a (re-)registration; returns it and the record it superseded, if any.

        ``heard``: the time up to which every frame has been read (default ``now``):
        a live rank is judged silent only up to then, as ``expire`` judges it.
        """
        self.check(body)
        if self.world_size is None:
            self.world_size = body["world_size"]
        if self.tp_size is None:
            self.tp_size = body["tp_size"]
        held = self.by_peer(peer)
        if held is not None and held.rank != body["rank"] and held.state is RankState.LIVE:
            # One connection, one rank: the first would be left live and unheard until lost.
            raise RankTaken(f"rank {body['rank']}: this connection already holds rank {held.rank}")
        old = self.ranks.get(body["rank"])
        if old is not None and old.peer != peer:
            self._check_takeover(old, body, now if heard is None else heard)
            self._by_peer.pop(old.peer, None)
        info = RankInfo(
            rank=body["rank"], peer=peer, tp_group=body["tp_group"], host=body["host"],
            pid=body["pid"], device=body["device"], idle=body["idle"], instance=body.get("instance"),
            registered_at=self.wall(), last_seen=now, step=body["step"],
            applied_seq=body["applied_seq"] or 0, held_seq=body["applied_seq"] or 0,
            manager_state=read_manager_state(body["state"]), config=body["config"], model=body.get("model"),
        )
        self.ranks[info.rank] = info
        self._by_peer[peer] = info.rank
        self.changes += 1
        self._expiry_bound = min(self._expiry_bound, now + self.timeout)
        return info, old

    def _check_takeover(self, old: RankInfo, body: dict[str, Any], now: float) -> None:
        """A live rank passes to another connection only from the same agent process
        (it reconnected), or once the old connection has been silent past the timeout."""
        if old.state is not RankState.LIVE:
            return
        silent = now - old.last_seen
        if old.instance is not None and body.get("instance") == old.instance:
            return
        if silent > self.timeout:
            return
        raise RankTaken(
            f"rank {old.rank} is live on another connection (host {old.host}, pid {old.pid}, heard "
            f"{silent:.1f} s ago): it passes to another process only once that one has been silent "
            f"for heartbeat_timeout ({self.timeout:g} s)")

    def by_peer(self, peer: bytes) -> RankInfo | None:
        rank = self._by_peer.get(peer)
        return None if rank is None else self.ranks.get(rank)

    def heartbeat(self, peer: bytes, body: dict[str, Any], now: float) -> RankInfo | None:
        """Note a heartbeat; None if the peer is not (or no longer) registered."""
        info = self.by_peer(peer)
        if info is None or info.rank != body["rank"] or info.state is RankState.LOST:
            return None
        info.last_seen = now
        _note(info, body, now)
        return info

    def touch(self, peer: bytes, now: float) -> RankInfo | None:
        """Any message from a live registered peer counts as a sign of life."""
        info = self.by_peer(peer)
        if info is not None and info.state is RankState.LIVE:
            info.last_seen = now
            return info
        return None

    def stop(self, peer: bytes, body: dict[str, Any]) -> RankInfo | None:
        """Mark the rank stopped on its goodbye, as it last stood; None (nothing changed)
        unless ``peer`` is the live connection that registered it: no one else can stop
        a rank."""
        info = self.by_peer(peer)
        if info is None or info.rank != body["rank"] or info.state is not RankState.LIVE:
            return None
        info.state = RankState.STOPPED
        info.stopped_at = self.wall()
        self.changes += 1
        _note(info, body)
        self._by_peer.pop(peer, None)
        return info

    def expire(self, now: float) -> list[RankInfo]:
        """Mark lost every live rank silent for longer than the timeout; return them.

        Only live ranks: a stopped rank is silent because it said goodbye, never lost.
        """
        if now <= self._expiry_bound:
            return []
        lost = []
        bound = math.inf
        for info in self.ranks.values():
            if info.state is not RankState.LIVE:
                continue
            if now - info.last_seen > self.timeout:
                info.state = RankState.LOST
                info.lost_at = self.wall()
                self.changes += 1
                self._by_peer.pop(info.peer, None)
                lost.append(info)
            else:
                bound = min(bound, info.last_seen + self.timeout)
        self._expiry_bound = bound
        return lost

    def next_expiry(self) -> float:
        """No live rank expires before this monotonic time (``inf`` with none live)."""
        return self._expiry_bound

    def live(self, group: int | None = None) -> list[RankInfo]:
        if group is not None and self.world_size is not None and self.tp_size is not None:
            # Every heartbeat checks its group: look at the group's few ranks, not the world.
            members = (self.ranks.get(r) for r in self.expected(group))
            return [i for i in members if i is not None and i.state is RankState.LIVE and i.tp_group == group]
        return [
            i for i in self.ranks.values()
            if i.state is RankState.LIVE and (group is None or i.tp_group == group)
        ]

    def expected(self, group: int | None = None) -> list[int]:
        """Every rank the world should have (those known, if the world size is not yet known)."""
        world, tp = self.world_size, self.tp_size
        if group is not None and world is not None and tp is not None:
            # A group's ranks are consecutive: no walk over the whole world per group.
            return list(range(group * tp, min((group + 1) * tp, world)))
        ranks = sorted(self.ranks) if world is None else list(range(world))
        if group is None:
            return ranks
        if tp is None:
            return [r for r in ranks if r in self.ranks and self.ranks[r].tp_group == group]
        return [r for r in ranks if r // tp == group]

    def groups(self) -> list[int]:
        if self.world_size is None or self.tp_size is None:
            return sorted({i.tp_group for i in self.ranks.values()})
        return list(range(self.world_size // self.tp_size))

    def missing(self, group: int | None = None) -> dict[int, str]:
        """Expected ranks that are not live, with why: ``lost``, ``stopped`` or ``NEVER_REGISTERED``."""
        out = {}
        for rank in self.expected(group):
            info = self.ranks.get(rank)
            if info is None:
                out[rank] = NEVER_REGISTERED
            elif info.state is RankState.LOST:
                out[rank] = f"lost at {_utc(info.lost_at)} (last step {info.step})"
            elif info.state is RankState.STOPPED:
                out[rank] = f"stopped (said goodbye at {_utc(info.stopped_at)}, last step {info.step})"
        return out

    # -- what clients are shown ----------------------------------------------------

    def public(self, now: float, wall_now: float, engine: str | None = None) -> dict[str, Any]:
        """The ``ranks`` reply: every rank known, and those ``missing`` (expected, never registered)."""
        ranks = [i.public(now, wall_now, engine) for _, i in sorted(self.ranks.items())]
        never = [{"rank": r, "reason": why} for r, why in self.missing().items() if why == NEVER_REGISTERED]
        return {"ranks": ranks, "missing": never}

    def counts(self) -> dict[str, int]:
        """Expected ranks by state: live, stalled, lost, stopped, missing (never registered)."""
        states = [i.shown for i in self.ranks.values()]
        never = sum(1 for why in self.missing().values() if why == NEVER_REGISTERED)
        return {"live": states.count(RankState.LIVE), "stalled": states.count(RankState.STALLED),
                "lost": states.count(RankState.LOST), "stopped": states.count(RankState.STOPPED),
                "missing": never}

    def waits_for(self, info: RankInfo) -> list[int]:
        """The TP peers a stalled rank waits for, where that can be known: those gone (lost,
        stopped, never registered), else the live ones not inside a step. Empty: every peer
        is stuck inside the step too (a hang of the whole group), or none is known."""
        peers = [r for r in self.expected(info.tp_group) if r != info.rank]
        gone = [r for r in peers if r not in self.ranks or self.ranks[r].state is not RankState.LIVE]
        if gone:
            return gone
        return [r for r in peers if self.ranks[r].in_step_since is None]

    def group_status(self, group: int) -> dict[str, Any]:
        """A TP group as ``status`` shows it: members, live and missing ranks, and what the
        live ones report (one value each when they agree)."""
        live = [self.ranks[r] for r in self.expected(group)
                if r in self.ranks and self.ranks[r].state is RankState.LIVE]
        return {
            "tp_group": group,
            "ranks": self.expected(group),
            "live": [i.rank for i in live],
            "missing": [{"rank": r, "reason": why} for r, why in self.missing(group).items()],
            "applied_seq": sorted({i.applied_seq for i in live}),
            **{key: sorted({i.manager_state.get(key) for i in live}, key=str) for key in AGREED},
        }
