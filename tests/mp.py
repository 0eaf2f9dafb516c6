"""Multi-rank tests on CPU: a small helper of our own around ``torch.multiprocessing``.

``Workers`` starts N processes. Each initialises a real gloo process group
(``file://`` rendezvous in the test's tmp_path, so no port is ever fixed),
runs ``target(rank: Rank, *args)`` and talks to the test through two queues of
its own: an inbox (test to worker) and an outbox (worker to test). Every wait
is bounded; a worker's traceback becomes the test's failure; ``close()`` asks
the workers to stop, joins them with a timeout, then terminates and kills
whatever is left, so that no process outlives its test.

Each rank has its own queues, and there is no shared ``mp.Event``: a rank
killed with SIGKILL while it holds a shared queue's or event's lock would
wedge every other rank; holding only its own, it wedges only itself.
"""

from __future__ import annotations

import datetime
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["COMMAND_METHODS", "Rank", "WorkerFailed", "Workers", "recording_manager"]

# The forkserver imports torch once; each worker is then a cheap fork of a
# process with no threads, sockets or process group yet. Forking the pytest
# process itself would copy the coordinator's threads and ZeroMQ context.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "wsd.agent.thread"])

# Rendezvous and collectives on the default group give up after this long, so
# that a rank whose peers are gone fails instead of hanging. (tp_groups's
# groups keep torch's default timeout; a peer's death fails them at once
# anyway, since gloo sees its connection drop.)
GLOO_TIMEOUT = datetime.timedelta(seconds=20)
# How often a wait looks at the queues and the processes again.
_POLL = 0.01
# The manager methods through which an agent applies commands.
# The manager methods an agent applies commands through, by the name recorded:
# an operator's lock and unlock go through operator_lock/operator_unlock.
COMMAND_METHODS = {"lock": "operator_lock", "unlock": "operator_unlock",
                   "set_num_ubatches": "set_num_ubatches", "reserve_bytes": "reserve_bytes",
                   "equalize": "equalize", "trim": "trim"}


def recording_manager(num_ubatches: int = 2) -> tuple[Any, list[list[Any]]]:
    """A cpu WorkspaceManager whose command methods append ``[name, args]`` to a list.

    The agent applies commands through these methods, so the list holds every
    real application, whatever the agent believes it did.
    """
    from wsd import WorkspaceManager

    manager = WorkspaceManager("cpu", num_ubatches)
    calls: list[list[Any]] = []

    def recording(name: str, method: Callable[..., None]) -> Callable[..., None]:
        def record(*args: Any) -> None:
            calls.append([name, list(args)])
            method(*args)
        return record

    for name, method in COMMAND_METHODS.items():
        setattr(manager, method, recording(name, getattr(manager, method)))
    return manager, calls


class WorkerFailed(AssertionError):
    """A worker raised, died or did not answer in time; the message has its traceback."""


class Rank:
    """The worker's side: who it is and its two queues."""

    def __init__(self, rank: int, world_size: int, inbox: Any, outbox: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self._inbox = inbox
        self._outbox = outbox

    def report(self, kind: str, **data: Any) -> None:
        """Send ``(kind, data)`` to the test (plain picklable data only)."""
        self._outbox.put((kind, data))

    def poll(self) -> tuple[Any, ...] | None:
        """The next message from the test, or None at once if there is none."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None


def _bootstrap(rank: int, world_size: int, init_method: str, target: Callable[..., None],
               args: tuple[Any, ...], inbox: Any, outbox: Any) -> None:
    me = Rank(rank, world_size, inbox, outbox)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=GLOO_TIMEOUT)
        try:
            target(me, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        me.report("error", traceback=traceback.format_exc())
        sys.exit(1)
    me.report("exited")


class Workers:
    """N worker processes in one gloo world, driven by the test; a context manager."""

    def __init__(self, tmp_path: Any, world_size: int, target: Callable[..., None], *args: Any) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        init_file = tmp_path / f"gloo-init-{time.monotonic_ns()}"
        self._inboxes = [_CONTEXT.Queue() for _ in range(world_size)]
        self._outboxes = [_CONTEXT.Queue() for _ in range(world_size)]
        self._received: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in range(world_size)]
        self._killed: set[int] = set()
        self._errors: dict[int, str] = {}
        self.processes = [
            _CONTEXT.Process(
                target=_bootstrap, name=f"wsd-test-rank-{rank}", daemon=True,
                args=(rank, world_size, f"file://{init_file}", target, args,
                      self._inboxes[rank], self._outboxes[rank]),
            )
            for rank in range(world_size)
        ]
        self._closed = False

    def start(self) -> Workers:
        for process in self.processes:
            process.start()
        return self

    def __enter__(self) -> Workers:
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # With a test failure already on its way, worker errors are printed
        # (pytest shows them with the failure) rather than raised over it.
        self.close(raise_errors=exc_type is None)

    # -- talking to the workers ------------------------------------------------

    def send(self, rank: int, *message: Any) -> None:
        self._inboxes[rank].put(message)

    def expect(self, rank: int, kind: str, timeout: float) -> dict[str, Any]:
        """The next ``kind`` message from ``rank``; WorkerFailed on error, death or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect()
            for i, (got, data) in enumerate(self._received[rank]):
                if got == kind:
                    del self._received[rank][i]
                    return data
            process = self.processes[rank]
            if process.exitcode is not None and not self._pending(rank):
                raise WorkerFailed(f"rank {rank} exited with code {process.exitcode} "
                                   f"before sending {kind!r}")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"rank {rank} sent no {kind!r} within {timeout} s")
            time.sleep(_POLL)

    def ask(self, rank: int, kind: str, *args: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Send ``(kind, *args)`` to ``rank`` and return its ``kind`` reply."""
        self.send(rank, kind, *args)
        return self.expect(rank, kind, timeout)

    def _pending(self, rank: int) -> bool:
        """True if ``rank``'s outbox may still hold something (after a drain)."""
        self._collect()
        return not self._outboxes[rank].empty()

    def _collect(self) -> None:
        """Move everything queued into ``_received``; raise on a worker's error."""
        for rank, outbox in enumerate(self._outboxes):
            if rank in self._killed:
                continue  # it may have died mid-write: never read its queue again
            while True:
                try:
                    kind, data = outbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "error":
                    self._errors[rank] = data["traceback"]
                    raise WorkerFailed(f"rank {rank} failed:\n{data['traceback']}")
                self._received[rank].append((kind, data))

    # -- ending them ---------------------------------------------------------------

    def kill(self, rank: int, timeout: float = 5.0) -> None:
        """SIGKILL one rank and wait (bounded) until it is gone."""
        self._killed.add(rank)
        process = self.processes[rank]
        process.kill()
        process.join(timeout)
        if process.is_alive():
            raise WorkerFailed(f"rank {rank} still alive {timeout} s after SIGKILL")

    def close(self, timeout: float = 15.0, *, raise_errors: bool = True) -> None:
        """Ask every rank to stop, join with ``timeout``, then terminate and kill leftovers.

        Raises WorkerFailed if a worker failed, or did not stop by itself in time.
        """
        if self._closed:
            return
        self._closed = True
        problems: list[str] = []
        try:
            for rank, process in enumerate(self.processes):
                if process.is_alive() and rank not in self._killed:
                    self.send(rank, "stop")
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
                try:
                    self._collect()  # a worker blocks at exit until its outbox is read
                except WorkerFailed:
                    pass  # recorded in _errors, reported below
                time.sleep(_POLL)
            try:
                self._collect()
            except WorkerFailed:
                pass
            for rank, process in enumerate(self.processes):
                if process.is_alive():
                    problems.append(f"rank {rank} did not stop within {timeout} s")
        finally:
            for process in self.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(2.0)
                if process.is_alive():
                    process.kill()
                    process.join(2.0)
            for q in self._inboxes + self._outboxes:
                q.cancel_join_thread()  # never block our own exit on a dead reader
                q.close()
        problems += [f"rank {rank} failed:\n{tb}" for rank, tb in sorted(self._errors.items())]
        problems += [f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(self.processes)
                     if p.exitcode not in (0, None) and rank not in self._killed | set(self._errors)]
        problems += [f"rank {rank} is still alive after SIGKILL"
                     for rank, p in enumerate(self.processes) if p.is_alive()]
        if problems:
            message = "\n".join(problems)
            if raise_errors:
                raise WorkerFailed(message)
            print(f"worker problems during teardown:\n{message}", file=sys.stderr)
