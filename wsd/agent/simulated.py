"""Simulated ranks: many lightweight agents speaking the real protocol, without torch.

For scale tests and benchmarks of the coordinator. Each simulated rank is an
``AgentCore`` (the same protocol logic as the real agent) over a
``SimulatedManager`` (a torch-free stand-in for a warmed-up ``WorkspaceManager``
whose snapshot is a real ``ManagerStats``), with its own DEALER socket. All the
ranks of a ``SimulatedRanks`` run on one thread with one poller, so one process
can hold hundreds of them: they register, heartbeat, apply commands on receipt
(idle mode) and acknowledge them, answer stats requests, and register again
when the coordinator restarted or forgot them.

Run from the command line (until interrupted):
``python -m wsd.agent.simulated --endpoint tcp://127.0.0.1:7600 --ranks 32``.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from wsd import commands
from wsd.agent.core import AgentCore
from wsd.agent.stacks import thread_stacks
from wsd.config import MAX_UBATCHES
from wsd.errors import ConfigError, SimulationError, WsdError
from wsd.names import engine_name_problem
from wsd.security import SecurityConfig, load_agent_token
from wsd.slotstats import SLOT_NUMBERS, ManagerStats, PersistentStats, SlotStats
from wsd.wire.transport import Waker, answer_waiting, connect, make_socket, raise_fd_limit, send_nowait

__all__ = ["SimulatedManager", "SimulatedRanks", "SimulationError", "main"]

logger = logging.getLogger(__name__)

_MiB = 1 << 20
# The loop wakes at least this often to notice stop().
_MAX_POLL = 0.1
# Timers due within this much of each other are served in one wake-up, so that
# hundreds of ranks with slightly different heartbeat phases do not each cost
# a poll of every socket (heartbeats may leave this much early).
_TIMER_SLACK = 0.02
# File descriptors per rank: its TCP connection and its socket's mailbox, with room.
_FDS_PER_RANK = 3


class SimulatedManager:
    """A warmed-up workspace manager's numbers, without buffers (``wsd.agent.core.RankTarget``).

    Every slot starts at ``slot_bytes`` of capacity with one persistent buffer,
    as after warm-up; commands change the numbers as they would change a real
    manager's buffers (``reserve`` and ``equalize`` grow slots, ``trim``
    empties them, ``set_ubatches`` adds or drops slots, refused growth while
    locked raises as the manager does).
    """

    def __init__(self, num_ubatches: int = 8, num_lanes: int = 1, *, slot_bytes: int = 64 * _MiB,
                 device: str = "cpu", busy: bool = False) -> None:
        if not 1 <= num_ubatches <= MAX_UBATCHES:
            raise ValueError(f"num_ubatches must be between 1 and {MAX_UBATCHES}, got {num_ubatches}")
        if num_lanes < 1:
            raise ValueError(f"num_lanes must be at least 1, got {num_lanes}")
        self.device = device
        self.num_lanes = num_lanes
        self.locked = False
        self._capacity = [slot_bytes] * (num_ubatches * num_lanes)
        self._snapshot: dict[str, Any] | None = None
        # busy: every slot serves one request between two looks at the snapshot, as a
        # serving engine's do, so that every look finds a change to push.
        self.busy = busy
        self._served = 0
        # stuck_since: a simulated engine inside one step since then (time.monotonic), as a
        # rank whose TP peer froze; None: between steps.
        self.stuck_since: float | None = None

    @property
    def num_ubatches(self) -> int:
        return len(self._capacity) // self.num_lanes

    def state(self) -> dict[str, Any]:
        return {"locked": self.locked, "num_ubatches": self.num_ubatches}

    def stats(self) -> ManagerStats:
        lanes = self.num_lanes
        persistent = (PersistentStats(key="moe_topk_ids", kind="tensor", nbytes=_MiB),)
        numbers = {n.name: n.kind(0) for n in SLOT_NUMBERS}  # any number not simulated below is 0
        return ManagerStats(
            device=self.device, num_ubatches=self.num_ubatches, num_lanes=lanes, locked=self.locked,
            slots=tuple(
                SlotStats(**{**numbers, "ubatch": i // lanes, "lane": i % lanes, "capacity_bytes": capacity,
                             "peak_requested_bytes": capacity, "requests": 1000 + i + self._served,
                             "resizes": 3 if capacity else 0}, last_violation=None, persistent=persistent)
                for i, capacity in enumerate(self._capacity)
            ),
        )

    def snapshot(self) -> dict[str, Any]:
        # Built once per change: a simulated rank has no engine moving its
        # counters (unless busy), and one process plays many ranks that would
        # each build theirs in a process of their own, in parallel. The
        # coordinator's side is untouched: it decodes and checks every push.
        if self.busy:
            self._served += 1
            self._snapshot = None
        if self._snapshot is None:
            self._snapshot = self.stats().to_wire()
        return self._snapshot

    def in_step(self) -> tuple[int, float] | None:
        since = self.stuck_since
        return None if since is None else (1, max(0.0, time.monotonic() - since))

    def stacks(self) -> list[dict[str, Any]]:
        return thread_stacks(skip=threading.get_ident())

    def _refuse_if_locked(self, action: str) -> None:
        if self.locked:
            raise WsdError(f"{action}: the workspace is locked; unlock first")

    def apply(self, action: str, args: dict[str, Any]) -> None:
        self._snapshot = None
        commands.call(self, action, args)  # the manager method of the command's row, below

    # -- the manager's command methods, on simulated numbers -----------------------------------

    def operator_lock(self) -> None:
        self.locked = True

    def operator_unlock(self) -> None:
        self.locked = False

    def set_num_ubatches(self, num_ubatches: int) -> None:
        wanted = num_ubatches * self.num_lanes
        kept = self._capacity[:wanted]
        fill = max(self._capacity, default=0) if self.locked else 0  # locked: pre-sized, as the manager does
        self._capacity = kept + [fill] * (wanted - len(kept))

    def reserve_bytes(self, nbytes: int) -> None:
        self._refuse_if_locked("reserve")
        self._capacity = [max(c, nbytes) for c in self._capacity]

    def equalize(self) -> None:
        largest = max(self._capacity, default=0)
        if any(c < largest for c in self._capacity):
            self._refuse_if_locked("equalize")
        self._capacity = [largest] * len(self._capacity)

    def trim(self) -> None:
        self._refuse_if_locked("trim")
        self._capacity = [0] * len(self._capacity)


class SimulatedRanks:
    """Many simulated ranks on one thread: one DEALER per rank, one poller for all."""

    def __init__(
        self,
        endpoint: str,
        ranks: Iterable[int],
        *,
        world_size: int,
        tp_size: int = 1,
        num_ubatches: int = 8,
        num_lanes: int = 1,
        slot_bytes: int = 64 * _MiB,
        busy: bool = False,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        context: zmq.Context | None = None,
        token: bytes | None = None,
        engine: str | None = None,
        model: str | None = None,
    ) -> None:
        """``engine``: the engine every one of these ranks belongs to (None: the coordinator's
        default); ``model``: what it serves, as a vLLM worker registers it (None: not said)."""
        problem = None if engine is None else engine_name_problem(engine)
        if problem is not None:
            raise ValueError(f"engine: {problem}")
        self.endpoint = endpoint
        self.ranks = list(ranks)
        if not self.ranks:
            raise ValueError("ranks: at least one rank is needed")
        if world_size < 1 or any(not 0 <= r < world_size for r in self.ranks):
            raise ValueError(f"ranks must lie in 0..{world_size - 1} (world_size={world_size})")
        now = time.monotonic()
        self.managers = [SimulatedManager(num_ubatches, num_lanes, slot_bytes=slot_bytes, busy=busy)
                         for _ in self.ranks]
        self.links = [
            AgentCore(m, rank=r, world_size=world_size, tp_size=tp_size, idle=True,
                      heartbeat_interval=heartbeat_interval, heartbeat_timeout=heartbeat_timeout,
                      extra={"simulated": True}, now=now, token=token, engine=engine, model=model)
            for r, m in zip(self.ranks, self.managers)
        ]
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._waker = Waker()
        self.max_lag = 0.0
        """Seconds the loop served a timer (registration, heartbeat) late, at most, so far:
        a figure near the heartbeat timeout would mean that the simulation, not the
        coordinator, is to blame for a rank marked lost."""

    def __enter__(self) -> SimulatedRanks:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- life cycle ---------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SimulatedRanks:
        """Open every rank's socket on the loop thread; returns once they are connecting."""
        raise_fd_limit(len(self.ranks) * _FDS_PER_RANK + 64)
        if self._own_context:
            self._context.set(zmq.MAX_SOCKETS, max(1024, len(self.ranks) + 64))
        self._thread = threading.Thread(target=self._run, name="wsd-simulated", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self._stop.set()
            raise SimulationError(f"{len(self.ranks)} simulated ranks did not start within {timeout} s")
        if self._failed is not None:
            self.stop()
            raise SimulationError(f"simulated ranks could not start: {self._failed}") from self._failed
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every socket and stop the loop; waits at most ``timeout``."""
        self._stop.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise SimulationError(f"simulated ranks did not stop within {timeout} s")
            self._thread = None
        self._waker.close()
        if self._own_context and not self._context.closed:
            self._context.term()

    def registered(self) -> int:
        """How many of the ranks the coordinator has accepted."""
        return sum(link.registered.is_set() for link in self.links)

    def wait_registered(self, timeout: float) -> bool:
        """True once every rank is registered (False after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        return all(link.registered.wait(max(0.0, deadline - time.monotonic())) for link in self.links)

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        sockets: list[zmq.Socket] = []
        try:
            poller = zmq.Poller()
            for _ in self.links:
                sock = make_socket(self._context, zmq.DEALER)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # as the real agent: no queueing towards no one
                sockets.append(sock)
                connect(sock, self.endpoint)
                poller.register(sock, zmq.POLLIN)
            poller.register(self._waker.fd, zmq.POLLIN)
        except (WsdError, zmq.ZMQError) as e:
            for sock in sockets:
                sock.close(linger=0)
            self._failed = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(poller, sockets)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _loop(self, poller: zmq.Poller, sockets: list[zmq.Socket]) -> None:
        links = self.links
        index = {sock: i for i, sock in enumerate(sockets)}
        # Timers in a heap of (due, i); ``scheduled[i]`` is rank i's live entry,
        # any other entry for i is stale and skipped when it surfaces.
        scheduled = [link.due() for link in links]
        timers = [(due, i) for i, due in enumerate(scheduled)]
        heapq.heapify(timers)
        while not self._stop.is_set():
            now = time.monotonic()
            oldest_due = None
            while timers and timers[0][0] <= now + _TIMER_SLACK:
                due, i = heapq.heappop(timers)
                if due != scheduled[i]:
                    continue
                if oldest_due is None:
                    oldest_due = due
                link = links[i]
                for frame in link.on_time(max(now, due)):
                    if not send_nowait(sockets[i], [frame]):
                        link.unsent(now)
                scheduled[i] = link.due()
                heapq.heappush(timers, (scheduled[i], i))
            if oldest_due is not None:  # the last frame of the batch left this late
                self.max_lag = max(self.max_lag, time.monotonic() - oldest_due)
            wait = min(timers[0][0] - now, _MAX_POLL) if timers else _MAX_POLL
            # int(): what pyzmq does with a float timeout, which its stubs do not admit.
            for sock, _ in poller.poll(int(max(wait, 0.0) * 1000)):
                ready = index.get(sock)
                if ready is None:  # the wake-up pipe: stop() was called
                    self._waker.drain()
                    continue
                link = links[ready]
                answer_waiting(sock, _receiver(link))
                due = link.due()
                if due < scheduled[ready]:  # e.g. just registered: heartbeat now
                    scheduled[ready] = due
                    heapq.heappush(timers, (due, ready))


def _receiver(link: AgentCore) -> Callable[[bytes], list[bytes]]:
    """``link``'s frame handler, each frame stamped with the time it is read.

    A function rather than a lambda in the loop, so that the handler binds this
    link and not the loop's variable (which would rebind before a late call).
    """
    return lambda frame: link.on_frame(frame, time.monotonic())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wsd.agent.simulated", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="the coordinator's agent endpoint")
    parser.add_argument("--ranks", type=int, required=True, help="how many ranks to simulate")
    parser.add_argument("--first-rank", type=int, default=0, help="number of the first simulated rank")
    parser.add_argument("--world-size", type=int, help="world size (default: first-rank + ranks)")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--ubatches", type=int, default=8, help="slots per rank (num_ubatches)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--busy", action="store_true",
                        help="every slot serves requests, so each rank pushes a changed snapshot every interval")
    parser.add_argument("--engine", help="the engine these ranks belong to (default: the coordinator's default)")
    parser.add_argument("--model", help="what their engine serves, as vLLM's model_name (default: not said)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    world = args.world_size or args.first_rank + args.ranks
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s simulated %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        sim = SimulatedRanks(args.endpoint, range(args.first_rank, args.first_rank + args.ranks),
                             world_size=world, tp_size=args.tp_size, num_ubatches=args.ubatches, busy=args.busy,
                             heartbeat_interval=args.heartbeat_interval,
                             heartbeat_timeout=args.heartbeat_timeout,
                             token=load_agent_token(SecurityConfig()),  # $WSD_AGENT_TOKEN, if set
                             engine=args.engine, model=args.model)
    except (ValueError, ConfigError) as e:
        parser.error(str(e))
    with sim:
        print(f"{args.ranks} simulated ranks connecting to {args.endpoint}", flush=True)
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
