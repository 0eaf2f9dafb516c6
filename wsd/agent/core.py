"""One rank's side of the agent protocol: no sockets, no threads of its own, no torch.

``AgentCore`` holds what a rank has registered, received and applied, and turns
each frame from the coordinator, and the passing of time, into the frames to
send back. The real agent (``wsd.agent.thread``) drives one from its I/O thread beside
a ``WorkspaceManager``; simulated ranks (``wsd.agent.simulated``) drive many from one
loop. What the rank *is* (its manager state, snapshot and how it applies a
command) comes from a ``RankTarget`` (its manager, as the protocol sees it).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from wsd.agent.push import StatsPush
from wsd.commands import start_actions
from wsd.fmt import cut
from wsd.security import (
    challenge_proof,
    command_mac,
    new_nonce,
    registered_proof,
    registration_proof,
    same_proof,
    session_key,
)
from wsd.wire import protocol as p
from wsd.wire.protocol import Op

__all__ = ["AgentCore", "RankTarget"]

logger = logging.getLogger(__name__)

# (seq, step, ok, error) of the last commands applied, resent on re-registration
# so that acknowledgements lost with a connection still reach the coordinator.
_ACK_MEMORY = p.ACK_MEMORY
# A registration that could not be sent is retried this soon: an agent's DEALER
# (with IMMEDIATE) refuses to send before its connection is up, so the very first
# registration usually is, and waiting a whole interval for the next one delays
# every start-up. One that was sent waits an interval for its answer: retrying it
# sooner would only add registrations to a busy coordinator's start-up storm.
_UNSENT_RETRY = 0.05
_UNPROVEN_WARNING_EVERY = 60.0  # seconds between warnings of frames that do not prove the token


class RankTarget(Protocol):
    """What a rank is, as the protocol needs it."""

    device: str

    def state(self) -> dict[str, Any]:
        """``{"locked": bool, "num_ubatches": int}`` for heartbeats."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """``ManagerStats.to_wire()`` of the rank's manager, a new map each time it changed
        (never changed in place afterwards)."""
        ...

    def apply(self, action: str, args: dict[str, Any]) -> None:
        """Apply one command; an exception is reported in its acknowledgement."""
        ...

    def in_step(self) -> tuple[int, float] | None:
        """(which step, seconds inside it) while the engine is inside a step; None between
        steps (an idle engine is never stalled)."""
        ...

    def stacks(self) -> list[dict[str, Any]]:
        """Every thread's stack, the engine's first (``wsd.agent.stacks.thread_stacks``)."""
        ...


def _cut(error: str) -> str:
    """An error as an ack carries it: at most 1,000 characters (the protocol allows 4,096,
    and an ack that is refused for its size would leave the command pending)."""
    return cut(error, 1000)


class AgentCore:
    """One rank's registration, timers and command bookkeeping.

    Thread use: ``on_frame`` and ``on_time`` run on one I/O thread;
    ``apply_up_to`` and ``steps`` belong to the engine thread (to the I/O
    thread in idle mode). ``held`` is written by the I/O thread only,
    ``applied`` by the applying thread only; the received commands are shared
    under a lock.
    """

    def __init__(
        self,
        target: RankTarget,
        *,
        rank: int,
        world_size: int,
        tp_size: int = 1,
        idle: bool = False,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        extra: dict[str, Any] | None = None,
        host: str | None = None,
        pid: int | None = None,
        now: float = 0.0,
        token: bytes | None = None,
        engine: str | None = None,
        model: str | None = None,
        presize: tuple[int, int] | None = None,
    ) -> None:
        """``engine``: the engine this rank belongs to (None: the coordinator's default);
        ``model``: what it serves, as ``wsctl engines`` shows it; ``presize``: the grid
        (num_ubatches, num_lanes) whose sizing profile the registration asks for
        (``[workspace] presize = "profile"``), None: it asks for none."""
        self.target = target
        self.engine = engine
        self.model = model
        self.presize = presize
        # The profile's [[ubatch, lane, bytes], ...] the first registration was answered with
        # (None: none known, or not asked); written before ``registered`` is set.
        self.presize_sizes: list[list[int]] | None = None
        self.rank = rank
        self.world_size = world_size
        self.tp_size = tp_size
        self.tp_index = rank // tp_size
        self.idle = idle
        self.interval = heartbeat_interval
        self.timeout = heartbeat_timeout
        self.extra = extra or {}
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        # This agent process, the same across its reconnections: the coordinator
        # passes a live rank to another connection only with the same instance.
        self.instance = uuid.uuid4().hex
        # With the agent token, every registration is a handshake (wsd.security): our nonce in a
        # first REGISTER, the coordinator's CHALLENGE proving it holds the token, a second
        # REGISTER proving we do over both nonces, and REGISTERED proving it is the
        # coordinator's answer. The two nonces key the registration's commands.
        self._token = token
        self._nonce: str | None = None
        self._challenge: str | None = None
        self._key: bytes | None = None
        self.unauthenticated = 0
        """Frames dropped for not proving the coordinator holds the token (challenges,
        answers, commands): an endpoint squatted, or frames of an earlier registration."""
        self._warned_at = -math.inf
        self._lock = threading.Lock()
        self._received: dict[int, dict[str, Any]] = {}
        self.held = 0  # highest seq with every seq up to it received
        self.applied = 0  # highest seq applied or skipped
        # Highest seq received that this rank's group must apply (its baseline, or a
        # command for every group or for its own): waking the engine for one addressed
        # only to other groups would cost it a step for nothing (written by the I/O thread).
        self.mine = 0
        self._fresh = True  # never registered: the coordinator picks our baseline
        # A fresh process starts from the coordinator's baseline seq by taking on
        # its group's desired state at that seq: one action, applied at the step
        # the group agrees on the baseline, before any command after it.
        self.baseline = 0
        self._desired: dict[str, Any] | None = None
        # Frames the applying thread leaves for on_time to send (failed start actions).
        self._reports: deque[bytes] = deque(maxlen=_ACK_MEMORY)
        self.steps = 0
        self._acks: deque[list[Any]] = deque(maxlen=_ACK_MEMORY)
        self.registered = threading.Event()
        self.epoch: str | None = None
        self.rejected: str | None = None
        self.last_heard = now
        self.next_heartbeat = now
        self.next_register = now
        # Pushing the snapshot (see on_time and wsd.agent.push): ``push.urgent`` may be set
        # from any thread, to push at once (a command, a lock violation).
        self.push = StatsPush(now)
        # Stalls: after stall_after seconds inside one engine step the stacks go to the
        # coordinator on their own, once per step (None: the coordinator asks for none).
        self.stall_after: float | None = None
        self._stall_said: int | None = None
        self._handlers: dict[Op, Callable[[dict[str, Any], float], list[bytes]]] = {
            Op.REGISTERED: self._on_registered,
            Op.CHALLENGE: self._on_challenge,
            Op.PULSE: self._on_pulse,
            Op.COMMAND: self._on_command,
            Op.STATS_REQUEST: self._on_stats_request,
            Op.STATS_ACK: self._on_stats_ack,
            Op.STACKS_REQUEST: self._on_stacks_request,
            Op.REJECTED: self._on_rejected,
        }

    # -- time -------------------------------------------------------------------

    def due(self) -> float:
        """When ``on_time`` next has something to do (same clock as ``now``)."""
        if self.registered.is_set():
            return min(self.next_heartbeat, self.last_heard + self.timeout, self.push.due(self.timeout))
        return self.next_register

    def on_time(self, now: float) -> list[bytes]:
        """Registration, heartbeats and noticing a silent coordinator."""
        if self.registered.is_set() and now - self.last_heard >= self.timeout:
            logger.warning("rank %d: no word from the coordinator for %.1f s; registering again",
                           self.rank, now - self.last_heard)
            self.registered.clear()
            self.next_register = now
        if not self.registered.is_set():
            if now >= self.next_register:
                self.next_register = now + self.interval
                if self._token is not None:  # every attempt a new handshake
                    self._nonce, self._challenge = new_nonce(), None
                return [p.encode(Op.REGISTER, self.registration())]
        else:
            out = self._take_reports() + self._stalled()
            push, unchanged = self._stats_due(now)
            if push is not None:  # a push is a heartbeat too
                self.next_heartbeat = now + self.interval
                out.append(push)
            elif now >= self.next_heartbeat or unchanged:
                self.next_heartbeat = now + self.interval
                heartbeat = self._heartbeat_body()
                if unchanged:  # the acknowledged snapshot is current as of now
                    heartbeat["stats_version"] = self.push.acked_version()
                out.append(p.encode(Op.HEARTBEAT, heartbeat))
            return out
        return []

    def _heartbeat_body(self) -> dict[str, Any]:
        inside = self.target.in_step()
        return {"rank": self.rank, "step": self.steps, "applied_seq": self.applied, "held_seq": self.held,
                "state": self.target.state(), "in_step": None if inside is None else round(inside[1], 3)}

    def _stalled(self) -> list[bytes]:
        """The stacks, once per engine step, when the engine has been inside it for stall_after."""
        inside = self.target.in_step()
        if self.stall_after is None or inside is None or inside[1] < self.stall_after or inside[0] == self._stall_said:
            return []
        self._stall_said = inside[0]
        logger.warning("rank %d: the engine has been inside one step for %.0f s; its stacks go to the coordinator",
                       self.rank, inside[1])
        return [self._stacks_reply(0)]

    def _stacks_reply(self, request: int) -> bytes:
        inside = self.target.in_step()
        return p.encode(Op.STACKS_REPLY, {"rank": self.rank, "request": request, "step": self.steps,
                                          "in_step": None if inside is None else round(inside[1], 3),
                                          "threads": self.target.stacks()})

    def _stats_due(self, now: float) -> tuple[bytes | None, bool]:
        """A push if the snapshot is due to be looked at and changed; or (None, True) if
        it was looked at and is the acknowledged one still; else (None, False)."""
        push, unchanged = self.push.poll(now, self.timeout, self.target.snapshot)
        if push is None:
            return None, unchanged
        return p.encode(Op.STATS_PUSH, {**self._heartbeat_body(), **push}), False

    def unsent(self, now: float) -> None:
        """The driver could not send what ``on_time`` returned (no connection yet)."""
        if not self.registered.is_set():
            self.next_register = min(self.next_register, now + _UNSENT_RETRY)

    def last_push(self) -> bytes | None:
        """Before a clean shutdown's goodbye: the snapshot, whole, if the coordinator lacks it."""
        if not self.registered.is_set():
            return None
        push = self.push.last(self.target.snapshot)
        return None if push is None else p.encode(Op.STATS_PUSH, {**self._heartbeat_body(), **push})

    def goodbye(self) -> bytes | None:
        """The last frame of a clean shutdown, None unless registered: the coordinator
        then shows the rank ``stopped`` at once, instead of ``lost`` a timeout later."""
        if not self.registered.is_set():
            return None
        return p.encode(Op.GOODBYE, {
            "rank": self.rank, "step": self.steps, "applied_seq": self.applied,
            "held_seq": self.held, "state": self.target.state(),
        })

    def _take_reports(self) -> list[bytes]:
        out = []
        while self._reports:
            out.append(self._reports.popleft())
        return out

    def registration(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "world_size": self.world_size, "tp_size": self.tp_size,
            "tp_group": self.tp_index, "host": self.host, "pid": self.pid,
            "device": self.target.device,
            # Not fresh once registered: a process that has yet to reach its
            # baseline (its group has not agreed on it) will, so it says so, and a
            # restarted coordinator neither sends nor expects the start again.
            "applied_seq": None if self._fresh else max(self.applied, self.baseline),
            "acks": list(self._acks), "step": self.steps, "idle": self.idle,
            "state": self.target.state(), "config": self.extra,
            "instance": self.instance, "engine": self.engine, "model": self.model,
            "presize": None if self.presize is None else list(self.presize),
            "nonce": self._nonce, "challenge": self._challenge, "proof": self._proof(),
        }

    def _proof(self) -> str | None:
        """Our proof that we hold the token, once the coordinator proved it does (None before)."""
        if self._token is None or self._nonce is None or self._challenge is None:
            return None
        return registration_proof(self._token, self.rank, self.instance, self.engine, self._nonce, self._challenge)

    def _unproven(self, what: str, now: float) -> list[bytes]:
        """A frame that does not prove the coordinator holds the token: dropped, and said at
        most once a minute."""
        self.unauthenticated += 1
        if now >= self._warned_at + _UNPROVEN_WARNING_EVERY:
            self._warned_at = now
            logger.warning("rank %d: dropped %s that does not prove it comes from a coordinator holding the "
                           "agent token (%d such frames): another process on the coordinator's endpoint, or an "
                           "answer to an earlier registration", self.rank, what, self.unauthenticated)
        return []

    # -- frames from the coordinator ------------------------------------------------

    def on_frame(self, frame: bytes, now: float) -> list[bytes]:
        """Handle one frame; returns the frames to send in answer."""
        try:
            message = p.decode(frame, p.COORDINATOR_OPS)
        except p.ProtocolError as e:
            logger.warning("rank %d: bad message from the coordinator: %s", self.rank, e)
            return []
        self.last_heard = now
        return self._handlers[message.op](message.body, now)

    def _on_challenge(self, body: dict[str, Any], now: float) -> list[bytes]:
        """The coordinator's answer to a first registration: answered with our proof if it
        proved it holds the token over our nonce."""
        if self._token is None or self._nonce is None or self.registered.is_set() or not same_proof(
                body["proof"], challenge_proof(self._token, self._nonce, body["nonce"])):
            return self._unproven("a challenge", now)
        self._challenge = body["nonce"]
        return [p.encode(Op.REGISTER, self.registration())]

    def _on_registered(self, body: dict[str, Any], now: float) -> list[bytes]:
        if self._token is not None:
            if self._nonce is None or self._challenge is None or not same_proof(body["proof"], registered_proof(
                    self._token, self._nonce, self._challenge, body["epoch"], body["baseline_seq"])):
                return self._unproven("a registration's answer", now)
            self._key = session_key(self._token, self._nonce, self._challenge)
            self._nonce = self._challenge = None  # spent: a registration again is a new handshake
        rebase = body.get("rebase", False) and body["baseline_seq"] > self.applied
        if rebase:
            # The coordinator's kept log cannot bring us up to date (the commands after
            # what we applied are gone, or never existed there): start again from its
            # baseline with the group's desired state, as a fresh process does.
            logger.warning("rank %d: the coordinator's log cannot replay seq %d..%d; starting again from "
                           "seq %d with the desired state", self.rank, self.applied + 1, body["baseline_seq"],
                           body["baseline_seq"])
            with self._lock:
                self._received = {}  # the coordinator sends again every command after the baseline
        if self._fresh or rebase:
            # Held at once (the group's agreement waits for every member to hold
            # it); applied only at the step the group agrees on it (apply_up_to).
            # In this order: the engine thread reads held, then baseline and desired.
            self._desired = body["desired"]
            if self._fresh:
                self.presize_sizes = body.get("presize")
            self.baseline = body["baseline_seq"]
            self.held = self.baseline
            self.mine = self.baseline
            self._fresh = False
        self.epoch = body["epoch"]
        self.interval = body["heartbeat_interval"]
        self.timeout = body["heartbeat_timeout"]
        self.stall_after = body["stall_after"]
        self.rejected = None
        self.next_heartbeat = now
        # A registration starts the coordinator's memory of us afresh: push it whole, now.
        # A coordinator older than pushes says no interval: it asks for snapshots instead.
        self.push.restart(body["stats_interval"], now)
        self.registered.set()
        logger.info("rank %d: registered with coordinator %s at seq %d", self.rank,
                    self.epoch[:8], body["baseline_seq"])
        if self.idle:  # no engine loop: take on the desired state on receipt
            return [ack for _, ack in self.apply_up_to(self.held)] + self._take_reports()
        return []

    def _on_pulse(self, body: dict[str, Any], now: float) -> list[bytes]:
        if self.registered.is_set() and (not body["registered"] or body["epoch"] != self.epoch):
            logger.info("rank %d: coordinator restarted or forgot us; registering again", self.rank)
            self.registered.clear()
            self.next_register = now
        return []

    def _on_command(self, body: dict[str, Any], now: float) -> list[bytes]:
        if self._token is not None and (self._key is None or not same_proof(body["mac"],
                                                                            command_mac(self._key, body))):
            return self._unproven(f"command seq {body['seq']}", now)
        seq = body["seq"]
        with self._lock:
            if seq <= self.held or seq in self._received:
                return []  # a replay of something we have (or our baseline covers): at most once
            self._received[seq] = body
            held = self.held
            while held + 1 in self._received:
                held += 1
        if body["group"] is None or body["group"] == self.tp_index:
            self.mine = max(self.mine, seq)
        self.held = held
        if self.idle:  # no engine loop: apply on receipt
            return [ack for _, ack in self.apply_up_to(held)]
        return []

    def _on_stacks_request(self, body: dict[str, Any], now: float) -> list[bytes]:
        return [self._stacks_reply(body["request"])]

    def _on_stats_request(self, body: dict[str, Any], now: float) -> list[bytes]:
        reply = {"rank": self.rank, "request": body["request"], "step": self.steps}
        return [p.encode(Op.STATS_REPLY, {**reply, "stats": self.target.snapshot()})]

    def _on_stats_ack(self, body: dict[str, Any], now: float) -> list[bytes]:
        self.push.on_ack(body)
        return []

    def _on_rejected(self, body: dict[str, Any], now: float) -> list[bytes]:
        self.registered.clear()
        if body["code"] == "conflict":
            # Our rank is still live on an older connection (a restarted worker whose old
            # process the coordinator has not yet missed): it passes to us once that one
            # has been silent for the heartbeat timeout. Ask again each interval.
            if self.rejected != body["message"]:
                logger.warning("rank %d: %s; asking again every %.1f s", self.rank, body["message"],
                               self.interval)
            self.next_register = now + self.interval
        else:
            if self.rejected != body["message"]:
                logger.error("rank %d: the coordinator refused us: %s", self.rank, body["message"])
            self.next_register = now + self.timeout
        self.rejected = body["message"]
        return []

    def waiting(self) -> bool:
        """True while a received command for this rank (or its start) waits for a step.

        Conservative: a command for this rank received beyond a gap counts too.
        """
        return self.held > self.applied and self.mine > self.applied

    # -- applying ---------------------------------------------------------------------

    def apply_up_to(self, agreed: int) -> list[tuple[int, bytes]]:
        """Apply every command up to ``agreed`` not yet applied; returns ``(seq, ack frame)`` of each.

        Commands for another TP group are skipped (every rank holds every seq,
        so that agreement on one number covers them). A failing command is
        acknowledged with its error and never raised into the caller.
        """
        acks: list[tuple[int, bytes]] = []
        if self.applied < self.baseline:
            if agreed < self.baseline:
                return acks  # some member of the group has not registered yet
            self._start()
            self.applied = self.baseline
            self.push.urgent = True
        while self.applied < agreed:
            seq = self.applied + 1
            with self._lock:
                command = self._received.pop(seq)
            group = command["group"]
            if group is None or group == self.tp_index:
                error = None
                try:
                    self.target.apply(command["action"], command["args"])
                except Exception as e:  # reported to the coordinator, never raised into the engine
                    error = _cut(f"{type(e).__name__}: {e}")
                    logger.warning("rank %d: command %d (%s) failed: %s", self.rank, seq, command["action"], error)
                # Remembered for a registration to resend, shorter: 64 of them must fit in one.
                self._acks.append(p.AckRecord(seq, self.steps, error is None,
                                              None if error is None else error[:p.ACK_MEMORY_ERROR]).to_wire())
                acks.append((seq, p.encode(Op.ACK, {"rank": self.rank, "seq": seq, "step": self.steps,
                                                    "ok": error is None, "error": error})))
            self.applied = seq
        if acks:
            self.push.urgent = True  # the coordinator learns what the commands did at once
        return acks

    def _start(self) -> None:
        """Take on the group's desired state at our baseline: once, before any later command.

        A failure is logged and reported to the coordinator as an agent event,
        never raised into the engine; the other actions still apply.
        """
        desired, self._desired = self._desired or {}, None
        for action, args in start_actions(desired):  # in the command table's start order
            try:
                self.target.apply(action, args)
            except Exception as e:  # reported, never raised into the engine
                error = _cut(f"{type(e).__name__}: {e}")
                logger.warning("rank %d: taking on the desired state at seq %d: %s failed: %s",
                               self.rank, self.baseline, action, error)
                self._reports.append(p.encode(Op.EVENT, {"rank": self.rank, "kind": "start_failed", "detail": {
                    "baseline_seq": self.baseline, "action": action, "error": error, "step": self.steps}}))
