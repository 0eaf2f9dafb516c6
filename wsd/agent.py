"""The agent: lives in each worker process beside its manager.

Its own I/O thread owns a DEALER socket to the coordinator: it registers,
heartbeats, re-registers when the coordinator restarted, receives commands and
answers stats requests from a snapshot, all without the engine thread. The
engine calls ``step()`` at its step boundary: the ranks of the TP group agree,
with one small ``all_reduce`` on a gloo side group, on the highest sequence
number every member holds, and all apply exactly the commands up to it, so
every rank of the group applies them at the same step. Nothing the engine
calls waits on the network: if the coordinator is gone, the worker runs on.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import zmq

from wsd import protocol as p
from wsd.config import AgentConfig
from wsd.errors import WsdError
from wsd.manager import WorkspaceManager
from wsd.protocol import Op
from wsd.stats import LockViolation, ManagerStats
from wsd.transport import connect, make_socket, send_nowait

__all__ = ["Agent", "AgentError", "tp_side_group"]

logger = logging.getLogger(__name__)

# Events held while the coordinator cannot be reached; the oldest go first.
_OUTBOX_LIMIT = 1000
# (seq, step, ok, error) of the last commands applied, resent on re-registration
# so that acknowledgements lost with a connection still reach the coordinator.
_ACK_MEMORY = 64


class AgentError(WsdError):
    """The agent could not start or stop in time; the message says which."""


def tp_side_group(rank: int, world_size: int, tp_size: int) -> Any:
    """The gloo group of ``rank``'s TP group (contiguous ranks), or None when tp_size is 1.

    Collective: every rank must call it, in the same order, since
    ``new_group`` is.
    """
    if tp_size == 1:
        return None
    mine = None
    for first in range(0, world_size, tp_size):
        group = dist.new_group(list(range(first, first + tp_size)), backend="gloo")
        if first <= rank < first + tp_size:
            mine = group
    return mine


def _apply(manager: WorkspaceManager, action: str, args: dict[str, Any]) -> None:
    if action == "lock":
        manager.lock()
    elif action == "unlock":
        manager.unlock()
    elif action == "set_ubatches":
        manager.set_num_ubatches(args["n"])
    elif action == "reserve":
        manager.reserve_bytes(args["bytes"])
    elif action == "equalize":
        manager.equalize()
    elif action == "trim":
        manager.trim()
    else:
        raise ValueError(f"unknown action {action!r}")


class Agent:
    """One rank's link to the coordinator; ``step()`` is the engine's safe point."""

    def __init__(
        self,
        manager: WorkspaceManager,
        *,
        endpoint: str,
        rank: int,
        world_size: int,
        tp_size: int = 1,
        tp_group: Any = None,
        idle: bool = False,
        config: AgentConfig | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        context: zmq.Context | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.manager = manager
        self.endpoint = endpoint
        self.rank = rank
        self.world_size = world_size
        self.tp_size = tp_size
        self.tp_index = rank // tp_size
        self._group = tp_group
        self.idle = idle
        self.config = config or AgentConfig()
        self._interval = heartbeat_interval
        self._timeout = heartbeat_timeout
        self._context = context or zmq.Context.instance()
        self._extra = extra or {}
        # Shared with the I/O thread. Commands by seq, under _lock; ints are
        # written by one side only.
        self._lock = threading.Lock()
        self._received: dict[int, dict[str, Any]] = {}
        self._held = 0  # highest seq with every seq up to it received (I/O thread)
        self._applied = 0  # highest seq applied or skipped (engine thread; I/O in idle mode)
        self._fresh = True  # never registered: the coordinator picks our baseline
        self._steps = 0
        self._acks: deque[list[Any]] = deque(maxlen=_ACK_MEMORY)
        self._outbox: queue.SimpleQueue[tuple[Op, dict[str, Any]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._seq_tensor = torch.zeros(1, dtype=torch.int64)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = threading.Event()
        self.epoch: str | None = None
        self.rejected: str | None = None
        manager.add_violation_listener(self._on_violation)

    # -- life cycle -----------------------------------------------------------

    def start(self) -> Agent:
        """Start the I/O thread (it registers by itself); returns self."""
        self._thread = threading.Thread(target=self._run, name=f"wsd-agent-{self.rank}", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.config.connect_timeout):
            raise AgentError(f"agent of rank {self.rank}: I/O thread did not start within "
                             f"{self.config.connect_timeout} s")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AgentError(f"agent of rank {self.rank}: I/O thread did not stop within {timeout} s")
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait_registered(self, timeout: float) -> bool:
        """For tests and start-up logs: True once the coordinator accepted us."""
        return self.registered.wait(timeout)

    @property
    def applied_seq(self) -> int:
        return self._applied

    @property
    def held_seq(self) -> int:
        return self._held

    @property
    def steps(self) -> int:
        return self._steps

    # -- the engine's side --------------------------------------------------------

    def step(self) -> list[int]:
        """The engine's step boundary: apply the commands the TP group agrees on.

        Returns the sequence numbers applied here. Costs one all_reduce of one
        integer on the gloo side group every ``apply_every`` steps, and never
        touches the network otherwise.
        """
        self._steps += 1
        if self.idle or self._steps % self.config.apply_every:
            return []
        agreed = self._held
        if self._group is not None:
            self._seq_tensor[0] = agreed
            dist.all_reduce(self._seq_tensor, op=dist.ReduceOp.MIN, group=self._group)
            agreed = int(self._seq_tensor[0])
        if agreed <= self._applied:
            return []
        return self._apply_up_to(agreed)

    def _apply_up_to(self, agreed: int) -> list[int]:
        done = []
        while self._applied < agreed:
            seq = self._applied + 1
            with self._lock:
                command = self._received.pop(seq)
            group = command["group"]
            if group is None or group == self.tp_index:
                error = None
                try:
                    _apply(self.manager, command["action"], command["args"])
                except Exception as e:  # reported to the coordinator, never raised into the engine
                    error = f"{type(e).__name__}: {e}"
                    logger.warning("rank %d: command %d (%s) failed: %s", self.rank, seq, command["action"], error)
                ack = [seq, self._steps, error is None, error]
                self._acks.append(ack)
                self._send_later(Op.ACK, {"rank": self.rank, "seq": seq, "step": self._steps,
                                          "ok": error is None, "error": error})
                done.append(seq)
            self._applied = seq
        return done

    def gather_tp_stats(self) -> list[ManagerStats]:
        """Every TP-group member's snapshot, by rank order; collective on the side group."""
        mine = self.manager.stats().to_dict()
        if self._group is None:
            return [ManagerStats.from_dict(mine)]
        gathered: list[Any] = [None] * self.tp_size
        dist.all_gather_object(gathered, mine, group=self._group)
        return [ManagerStats.from_dict(d) for d in gathered]

    def _on_violation(self, ubatch: int, lane: int, violation: LockViolation) -> None:
        self._send_later(Op.EVENT, {"rank": self.rank, "kind": "lock_violation", "detail": {
            "ubatch": ubatch, "lane": lane, "caller": violation.caller,
            "requested": violation.requested, "capacity": violation.capacity,
            "step": self._steps,
        }})

    def _send_later(self, op: Op, body: dict[str, Any]) -> None:
        self._outbox.put((op, body))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or stopping

    # -- the I/O thread ------------------------------------------------------------

    def _run(self) -> None:
        sock = make_socket(self._context, zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a coordinator that is not there
        try:
            connect(sock, self.endpoint)
        except WsdError:
            logger.exception("rank %d: agent cannot connect", self.rank)
            sock.close(linger=0)
            self._ready.set()
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._ready.set()
        io = _IoState(time.monotonic())
        held_back: deque[tuple[Op, dict[str, Any]]] = deque(maxlen=_OUTBOX_LIMIT)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                due = io.next_heartbeat if self.registered.is_set() else io.next_register
                ready = dict(poller.poll(max(0.0, min(due - now, 0.5)) * 1000))
                if sock in ready:
                    self._drain(sock, io)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                while True:
                    try:
                        held_back.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if self.registered.is_set():
                    while held_back and send_nowait(sock, [p.encode(*held_back[0])]):
                        held_back.popleft()
                self._timers(sock, io, time.monotonic())
        finally:
            sock.close(linger=0)

    def _timers(self, sock: zmq.Socket, io: _IoState, now: float) -> None:
        if self.registered.is_set() and now - io.last_heard > self._timeout:
            logger.warning("rank %d: no word from the coordinator for %.1f s; registering again",
                           self.rank, now - io.last_heard)
            self.registered.clear()
            io.next_register = now
        if not self.registered.is_set():
            if now >= io.next_register:
                send_nowait(sock, [p.encode(Op.REGISTER, self._registration())])
                io.next_register = now + self._interval
        elif now >= io.next_heartbeat:
            send_nowait(sock, [p.encode(Op.HEARTBEAT, {
                "rank": self.rank, "step": self._steps, "applied_seq": self._applied,
                "held_seq": self._held, "state": self._state(),
            })])
            io.next_heartbeat = now + self._interval

    def _registration(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "world_size": self.world_size, "tp_size": self.tp_size,
            "tp_group": self.tp_index, "host": socket.gethostname(), "pid": os.getpid(),
            "device": str(self.manager.device),
            "applied_seq": None if self._fresh else self._applied,
            "acks": list(self._acks), "step": self._steps, "idle": self.idle,
            "state": self._state(), "config": self._extra,
        }

    def _state(self) -> dict[str, Any]:
        return {"locked": self.manager.is_locked(), "num_ubatches": self.manager.num_ubatches}

    def _drain(self, sock: zmq.Socket, io: _IoState) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = p.decode(frame, p.COORDINATOR_OPS)
            except p.ProtocolError as e:
                logger.warning("rank %d: bad message from the coordinator: %s", self.rank, e)
                continue
            io.last_heard = time.monotonic()
            handler = self._handlers[message.op]
            handler(self, sock, io, message.body)

    def _on_registered(self, sock: zmq.Socket, io: _IoState, body: dict[str, Any]) -> None:
        if self._fresh:
            self._applied = self._held = body["baseline_seq"]
            self._fresh = False
        self.epoch = body["epoch"]
        self._interval = body["heartbeat_interval"]
        self._timeout = body["heartbeat_timeout"]
        self.rejected = None
        io.next_heartbeat = time.monotonic()
        self.registered.set()
        logger.info("rank %d: registered with coordinator %s at seq %d", self.rank,
                    self.epoch[:8], body["baseline_seq"])

    def _on_pulse(self, sock: zmq.Socket, io: _IoState, body: dict[str, Any]) -> None:
        if self.registered.is_set() and (not body["registered"] or body["epoch"] != self.epoch):
            logger.info("rank %d: coordinator restarted or forgot us; registering again", self.rank)
            self.registered.clear()
            io.next_register = time.monotonic()

    def _on_command(self, sock: zmq.Socket, io: _IoState, body: dict[str, Any]) -> None:
        seq = body["seq"]
        with self._lock:
            if seq <= self._applied or seq in self._received:
                return  # a replay of something we have: at most once
            self._received[seq] = body
            held = self._held
            while held + 1 in self._received:
                held += 1
        self._held = held
        if self.idle:  # no engine loop: apply on receipt (acks leave with the outbox)
            self._apply_up_to(held)

    def _on_stats_request(self, sock: zmq.Socket, io: _IoState, body: dict[str, Any]) -> None:
        send_nowait(sock, [p.encode(Op.STATS_REPLY, {
            "rank": self.rank, "request": body["request"],
            "stats": self.manager.stats().to_dict(), "step": self._steps,
        })])

    def _on_rejected(self, sock: zmq.Socket, io: _IoState, body: dict[str, Any]) -> None:
        if self.rejected != body["message"]:
            logger.error("rank %d: the coordinator refused us: %s", self.rank, body["message"])
        self.rejected = body["message"]
        self.registered.clear()
        io.next_register = time.monotonic() + self._timeout

    _handlers: dict[Op, Callable[..., None]] = {
        Op.REGISTERED: _on_registered,
        Op.PULSE: _on_pulse,
        Op.COMMAND: _on_command,
        Op.STATS_REQUEST: _on_stats_request,
        Op.REJECTED: _on_rejected,
    }


class _IoState:
    """Timers of the I/O thread."""

    __slots__ = ("last_heard", "next_heartbeat", "next_register")

    def __init__(self, now: float) -> None:
        self.last_heard = now
        self.next_heartbeat = now
        self.next_register = now
