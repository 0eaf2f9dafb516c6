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
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import zmq

from wsd import commands, placement
from wsd.agent.core import AgentCore
from wsd.agent.stacks import StepClock, thread_stacks
from wsd.config import AgentConfig, LockedGrowthPolicy
from wsd.errors import AgentError, WsdError
from wsd.manager.core import WorkspaceManager
from wsd.slotstats import LockViolation
from wsd.wire import protocol as p
from wsd.wire.curve import ClientKeys
from wsd.wire.protocol import Op
from wsd.wire.transport import Waker, answer_waiting, connect, make_socket, send_nowait

__all__ = ["Agent", "AgentError"]

logger = logging.getLogger(__name__)

# Events held while the coordinator cannot be reached; the oldest go first.
_OUTBOX_LIMIT = 1000
# The I/O thread wakes at least this often to notice stop().
_MAX_POLL = 0.5
# An engine holding a command it may apply is asked (on_pending) for a round at once,
# then again after this long, the wait doubling up to _WAKE_MAX while the same command waits.
_WAKE_AFTER = 0.2
_WAKE_MAX = 2.0
# How long a refused (raised) locked request waits for its report to be sent.
_VIOLATION_FLUSH = 0.5
# How long a closed socket may go on delivering the goodbye (ms): a coordinator
# that is slow or gone must not hold the process's exit up for longer.
_GOODBYE_LINGER_MS = 500


class _ManagerTarget:
    """A WorkspaceManager as the protocol sees it (``wsd.agent.core.RankTarget``)."""

    def __init__(self, manager: WorkspaceManager, warm: threading.Event, clock: StepClock) -> None:
        self.manager = manager
        self.device = str(manager.device)
        self.warm = warm
        self.clock = clock

    def state(self) -> dict[str, Any]:
        return {"locked": self.manager.is_locked(), "num_ubatches": self.manager.num_ubatches,
                "warming": not self.warm.is_set()}

    def snapshot(self) -> dict[str, Any]:
        return self.manager.stats().to_wire()

    def apply(self, action: str, args: dict[str, Any]) -> None:
        commands.call(self.manager, action, args)  # the manager method of the command's row

    def in_step(self) -> tuple[int, float] | None:
        inside = self.clock.inside()
        return None if inside is None else (self.clock.step, inside)

    def stacks(self) -> list[dict[str, Any]]:
        # Asked on the agent's I/O thread, which is left out: its stack says only that it asked.
        return thread_stacks(self.clock.thread, skip=threading.get_ident())


def gpu_uuid(device: torch.device) -> dict[str, str]:
    """``{"UUID": "GPU-..."}`` for a CUDA device, as DCGM's exporter and ``nvidia-smi -L`` name
    it (what joins wsd's series with DCGM's); nothing elsewhere, or where torch cannot say."""
    if device.type != "cuda":
        return {}
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except (RuntimeError, AttributeError, AssertionError):  # no such device, an older torch
        return {}
    return {"UUID": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"}


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
        curve: ClientKeys | None = None,
        on_pending: Callable[[], None] | None = None,
        token: bytes | None = None,
        warm: bool = True,
        model: str | None = None,
        presize: bool = False,
    ) -> None:
        """``presize``: the registration asks for the sizing profile of this manager's grid
        (``[workspace] presize = "profile"``), for ``presize_from_profile``."""
        self.manager = manager
        self.endpoint = endpoint
        self._curve = curve  # CURVE keys when [security] curve_agents is on
        self.rank = rank
        self.world_size = world_size
        self.tp_size = tp_size
        self.tp_index = rank // tp_size
        self._group = tp_group
        self.idle = idle
        self.config = config or AgentConfig()
        self._apply_every = self.config.apply_every or 1
        self._context = context or zmq.Context.instance()
        # Whether the engine's warm-up is over: until then no command applies (a lock
        # replayed before the engine's own warm-up would refuse that warm-up's growth,
        # and on a GPU land before its CUDA-graph capture). An idle worker has none.
        self.warm = threading.Event()
        if warm or idle:
            self.warm.set()
        # Whether the engine's thread is inside a step, and since when: a rank inside one
        # step for [coordinator] stall_after is stalled (its stacks go to the coordinator).
        self.clock = StepClock(time.monotonic)
        # The protocol state, shared with the I/O thread (see AgentCore on who writes what).
        # Where the rank runs, as DCGM, vLLM and Kubernetes name it (wsd.placement), under
        # what the caller registers with.
        where = {**placement.from_env(os.environ), **gpu_uuid(manager.device), **(extra or {})}
        self._link = AgentCore(
            _ManagerTarget(manager, self.warm, self.clock), rank=rank, world_size=world_size, tp_size=tp_size,
            idle=idle, heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout, extra=where,
            now=time.monotonic(), token=token, engine=self.config.engine, model=model,
            presize=(manager.num_ubatches, manager.num_lanes) if presize else None,
        )
        self.registered = self._link.registered
        # Frames from the engine thread (acks, violation events) for the I/O thread to send.
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._waker = Waker()
        self._seq_tensor = torch.zeros(1, dtype=torch.int64)
        self._stop = threading.Event()
        self._say_goodbye = False  # set by stop(), read by the I/O thread as it closes
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        # An engine that may sit idle or agree seldom (vLLM's) passes on_pending:
        # the I/O thread calls it when a command may apply (_maybe_wake).
        self._on_pending = on_pending
        # What the last wake-up was for ((held, applied)), when to ask again and after how long.
        self._woken_for: tuple[int, int] | None = None
        self._next_wake = 0.0
        self._backoff = _WAKE_AFTER
        # The engine sleeps (pause()): nothing applies and nothing wakes it.
        self.paused = False
        # Frames put in the outbox by the engine thread and sent by the I/O
        # thread, counted so that a lock violation can wait for its own report.
        self._queued = 0
        self._sent = 0
        self._sent_cond = threading.Condition()
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

    def stop(self, timeout: float = 10.0, *, goodbye: bool = True) -> None:
        """Stop the I/O thread; raises AgentError if it does not end within ``timeout``.

        With ``goodbye`` (a clean shutdown) a registered agent tells the coordinator
        first, which shows the rank ``stopped`` instead of ``lost``. A worker dying
        of an error passes False: its rank is then lost, as a crash would be. The
        goodbye is sent without waiting and delivered for at most half a second,
        so a coordinator that is gone neither blocks nor fails the stop.
        """
        self._say_goodbye = goodbye
        self._stop.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AgentError(f"agent of rank {self.rank}: I/O thread did not stop within {timeout} s")
            self._thread = None
        self._waker.close()

    def wait_registered(self, timeout: float) -> bool:
        """For tests and start-up logs: True once the coordinator accepted us."""
        return self.registered.wait(timeout)

    def presize_from_profile(self, timeout: float) -> int:
        """``[workspace] presize = "profile"``, on the engine's thread before its warm-up: wait
        at most ``timeout`` for the registration, then reserve each slot at the size its sizing
        profile gives. Returns the bytes reserved (0: no profile known, no registration in
        time, or reserving failed, each logged). Advisory: never raises for any of them."""
        if self._link.presize is None:
            return 0
        if not self.registered.wait(timeout):
            logger.warning("rank %d: presize: no registration within %g s ([agent] connect_timeout): warm-up "
                           "sizes the workspace", self.rank, timeout)
            return 0
        sizes = self._link.presize_sizes
        if not sizes:
            logger.info("rank %d: presize: the coordinator knows no sizing profile of this rank yet: warm-up "
                        "sizes the workspace, and the coordinator learns from it", self.rank)
            return 0
        try:
            held = self.manager.presize(sizes)
        except Exception as e:  # out of memory, a locked manager, a bad entry: the engine runs on
            logger.warning("rank %d: presize from the sizing profile failed: %s: warm-up sizes the workspace",
                           self.rank, e)
            return 0
        logger.info("rank %d: presized %d slot(s) from the sizing profile: %d bytes", self.rank, len(sizes), held)
        self._link.push.urgent = True
        return held

    @property
    def applied_seq(self) -> int:
        return self._link.applied

    @property
    def held_seq(self) -> int:
        return self._link.held

    @property
    def steps(self) -> int:
        return self._link.steps

    @property
    def epoch(self) -> str | None:
        return self._link.epoch

    @property
    def rejected(self) -> str | None:
        return self._link.rejected

    # -- the engine's side --------------------------------------------------------

    def mark_warm(self) -> None:
        """The engine's warm-up is over: commands (and the desired state) may apply from the
        next agreement on. Any thread; once is enough."""
        if not self.warm.is_set():
            self.warm.set()
            self._link.push.urgent = True  # the coordinator learns it at once
            self._waker.wake()  # a command that waited for this may ask for a step now

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Around each of the engine's steps (its collectives included, not the time it idles
        between steps): how long it has been inside one is what tells a stalled rank."""
        self.clock.enter()
        try:
            yield
        finally:
            self.clock.leave()

    def step(self, *, agree: bool = False) -> list[int]:
        """The engine's step boundary: apply the commands the TP group agrees on.

        Returns the sequence numbers applied here. Costs one all_reduce of one
        integer on the gloo side group every ``apply_every`` steps, and never
        touches the network otherwise. ``agree``: agree at this step whatever
        the count (every rank of the group must pass the same; vLLM's woken
        engine runs such a step on every worker at once).
        """
        link = self._link
        link.steps += 1
        if self.idle or (not agree and link.steps % self._apply_every):
            return []
        agreed = self.offer()
        if self._group is not None:
            # fill_/item rather than [0] indexing: a few microseconds less per step.
            self._seq_tensor.fill_(agreed)
            self.clock.enter()  # the agreement waits for every peer: a frozen one stalls this rank
            try:
                dist.all_reduce(self._seq_tensor, op=dist.ReduceOp.MIN, group=self._group)
            finally:
                self.clock.leave()
            agreed = int(self._seq_tensor.item())  # an int64 tensor: item() is an int already
        return self.settle(agreed)

    def count_step(self) -> None:
        """One engine step that agrees on nothing: an engine whose own ordered stream brings
        the agreed number (``settle``) counts its steps here, so that acks name them."""
        self._link.steps += 1

    def offer(self) -> int:
        """The highest command this rank may apply now, for its group's agreement (the group
        applies the lowest offer of its members). Warming up, a rank holds nothing back from
        its group but applies nothing new: the group's minimum then waits for every member's
        warm-up."""
        link = self._link
        return link.held if self.warm.is_set() else link.applied

    def settle(self, agreed: int) -> list[int]:
        """Apply every command up to ``agreed``, the number the TP group agreed on (on the
        engine's thread, between its steps); returns the sequence numbers applied here."""
        link = self._link
        if agreed <= link.applied:
            return []
        done = link.apply_up_to(agreed)
        for _, ack in done:
            self._put(ack)
        self._waker.wake()
        return [seq for seq, _ in done]

    def pause(self, paused: bool) -> None:
        """The engine sleeps (True: its memory is gone, so nothing may apply, and it is not
        woken for a waiting command) or is awake again (False: a waiting command asks for a
        round at once). Any thread."""
        self.paused = paused
        if not paused:
            self._waker.wake()

    def _put(self, frame: bytes) -> int:
        """Queue a frame for the I/O thread (engine thread); returns its ticket."""
        self._queued += 1
        self._outbox.put(frame)
        return self._queued

    def _on_violation(self, ubatch: int, lane: int, violation: LockViolation) -> None:
        policy = self.manager.config.on_locked_growth
        ticket = self._put(p.encode(Op.EVENT, {"rank": self.rank, "kind": "lock_violation", "detail": {
            "ubatch": ubatch, "lane": lane, "caller": violation.caller,
            "requested": violation.requested, "capacity": violation.capacity,
            "step": self._link.steps, "policy": policy.value,
        }}))
        self._link.push.urgent = True  # the coordinator's copy of our counters is behind now
        self._waker.wake()
        if policy is LockedGrowthPolicy.RAISE:
            # The refusal is about to propagate and may end the process (vLLM's
            # worker dies of it): give the I/O thread a bounded moment to send
            # the report first. Never on the fallback path, which keeps serving.
            with self._sent_cond:
                self._sent_cond.wait_for(lambda: self._sent >= ticket, _VIOLATION_FLUSH)

    # -- the I/O thread ------------------------------------------------------------

    def _wake_due(self) -> float:
        """When the I/O thread must next look at whether to wake the engine."""
        if self._on_pending is None or self.paused or not self.warm.is_set() or not self._link.waiting():
            return float("inf")
        if self._woken_for != (self._link.held, self._link.applied):
            return time.monotonic()  # something new to agree on: now
        return self._next_wake

    def _maybe_wake(self, now: float) -> None:
        """Ask the engine for a round when this rank holds a command it may apply.

        At once when there is something new (a command received, one applied with more
        behind it, the warm-up over, the engine awake again); then again after 0.2 s,
        doubling up to ``_WAKE_MAX`` while the same command waits (a peer not there yet, a
        wake-up sent before the engine core listened). Never while the engine sleeps: each
        round costs every worker of the engine a spin of vLLM's queue readers.
        """
        if self._on_pending is None:
            return
        link = self._link
        if self.paused or not self.warm.is_set() or not link.waiting():
            self._woken_for = None  # nothing to wake it for (yet)
            return
        progress = (link.held, link.applied)
        if progress != self._woken_for:
            self._woken_for = progress
            self._backoff = _WAKE_AFTER
        elif now < self._next_wake:
            return
        else:
            self._backoff = min(2 * self._backoff, _WAKE_MAX)
        self._next_wake = now + self._backoff
        try:
            self._on_pending()
        except Exception:  # waking is best effort: the next step applies it anyway
            logger.exception("rank %d: waking the engine failed", self.rank)

    def _run(self) -> None:
        sock = make_socket(self._context, zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a coordinator that is not there
        if self._curve is not None:
            self._curve.apply(sock)
        try:
            connect(sock, self.endpoint)
        except WsdError:
            logger.exception("rank %d: agent cannot connect", self.rank)
            sock.close(linger=0)
            self._ready.set()
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        self._ready.set()
        link = self._link
        held_back: deque[bytes] = deque(maxlen=_OUTBOX_LIMIT)
        try:
            while not self._stop.is_set():
                wait = max(0.0, min(link.due(), self._wake_due()) - time.monotonic())
                wait = min(wait, _MAX_POLL)
                ready = dict(poller.poll(int(wait * 1000)))  # int(): as pyzmq does with a float
                if sock in ready:
                    answer_waiting(sock, lambda frame: link.on_frame(frame, time.monotonic()))
                if self._waker.fd in ready:
                    self._waker.drain()
                while True:
                    try:
                        held_back.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if link.registered.is_set() and held_back:
                    sent = 0
                    while held_back and send_nowait(sock, [held_back[0]]):
                        held_back.popleft()
                        sent += 1
                    if sent:
                        with self._sent_cond:
                            self._sent += sent
                            self._sent_cond.notify_all()
                now = time.monotonic()
                self._maybe_wake(now)
                for frame in link.on_time(now):
                    if not send_nowait(sock, [frame]):
                        link.unsent(now)
        finally:
            self._close(sock)

    def _close(self, sock: zmq.Socket) -> None:
        """Close the socket, after the goodbye if stop() asked for one (bounded linger)."""
        linger = 0
        # The last snapshot first, if the coordinator lacks it (a violation in the last step), then
        # the goodbye: one connection delivers them in order.
        frames = [self._link.last_push(), self._link.goodbye()] if self._say_goodbye and self._stop.is_set() else []
        for frame in frames:
            if frame is None:
                continue
            try:
                if send_nowait(sock, [frame]):  # False: no connection, nobody to tell
                    linger = _GOODBYE_LINGER_MS
            except zmq.ZMQError as e:
                logger.warning("rank %d: could not say goodbye: %s", self.rank, e)
        sock.close(linger=linger)
