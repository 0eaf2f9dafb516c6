"""Waking an idle vLLM engine so that a waiting command applies.

An idle engine core blocks on its input queue: no ``execute_model``, so no step
boundary, and a command would wait for the next request. A worker's agent that
holds a command its group has not applied sends one small message to its engine
core (``WakeSender``); the engine core's ``WakeListener`` thread puts one
``WSD_STEP`` request on the engine's input queue, and the engine core's own
thread then runs ``wsd_step`` on every worker (``collective_rpc``), where the TP
group agrees and applies. The same serves a busy engine, whose workers agree
only every ``apply_every`` steps. Nothing is sent while nothing waits, so an idle
engine is never woken for nothing: vLLM's shared-memory queue busy-spins for a
second after each message, and a blind periodic tick cost 21% of a core per
worker. (The agents' heartbeats still cost an idle worker about 1% of a core.)

The engine core binds an IPC socket named after its pid, in a folder of the
user's own (``<tmp>/wsd-<uid>``, mode 0700, checked): no other local user can
send to it, squat its name or leave a file there that stops it. Its workers,
which it spawned, find it by their parent pid. A worker that lives inside its
engine core's process (the ``uni`` executor) finds the listener in its own
process (``local_listener``) and asks it directly.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import tempfile
import threading
from typing import Any

import zmq

__all__ = ["WSD_STEP", "WakeListener", "WakeSender", "local_listener", "wake_endpoint", "wake_folder"]

logger = logging.getLogger(__name__)

WSD_STEP = "wsd_step"
"""The request type put on the engine core's input queue, and the worker method it runs."""

# The listener wakes at least this often to notice close().
_POLL_MS = 500

# The listener of the engine core that runs in this process, if one does.
_local: WakeListener | None = None


def local_listener() -> WakeListener | None:
    """The wake listener of an engine core in this very process (a worker of the
    ``uni`` executor lives there), or None."""
    return _local


def wake_folder() -> str:
    """This user's folder of wake sockets, ``<tmp>/wsd-<uid>``; made with mode 0700.

    OSError unless it is a real folder (not a link) of this user that no one else
    may enter: in a shared temp folder, another user could have made it first.
    """
    folder = os.path.join(tempfile.gettempdir(), f"wsd-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a folder of this user's that only it may enter "
                              f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): "
                              f"remove it, or point TMPDIR elsewhere")
    return folder


def wake_endpoint(engine_pid: int) -> str:
    """Where the engine core of process ``engine_pid`` listens for wake-ups."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'wsd-{os.getuid()}')}/wsd-vllm-wake-{engine_pid}"


def _remove_stale(folder: str) -> None:
    """Remove the sockets of engine cores that are gone: one killed (vLLM's default
    shutdown SIGKILLs its engine core) never removed its own."""
    prefix = "wsd-vllm-wake-"
    for name in os.listdir(folder):
        pid = name[len(prefix):]
        if not (name.startswith(prefix) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass  # gone already, or not ours to remove: binding says if it matters
        except PermissionError:
            pass  # alive, someone else's


class WakeListener:
    """In the engine core: turns workers' wake-ups into one queued ``WSD_STEP`` at a time."""

    def __init__(self, input_queue: queue.Queue[Any], context: zmq.Context | None = None) -> None:
        self._queue = input_queue
        self._context = context or zmq.Context.instance()
        self.endpoint = wake_endpoint(os.getpid())
        # Set while a WSD_STEP is queued and not yet run: wake-ups from every
        # worker of a group arrive together, and one step serves them all.
        self.queued = threading.Event()
        self._stop = threading.Event()
        self._sock = self._context.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64)  # a wake-up is one empty frame
        try:
            _remove_stale(wake_folder())
            self._sock.bind(self.endpoint)
        except (OSError, zmq.ZMQError):
            self._sock.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="wsd-vllm-wake", daemon=True)
        self._thread.start()
        global _local
        _local = self

    def request(self) -> None:
        """Queue one ``WSD_STEP`` unless one is queued already (any thread)."""
        if not self.queued.is_set():
            self.queued.set()
            self._queue.put_nowait((WSD_STEP, None))

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                while sock.poll(0):
                    sock.recv(zmq.NOBLOCK)
                self.request()
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.warning("wsd wake listener stopped: %s", e)
        finally:
            sock.close(linger=0)

    def close(self, timeout: float = 2.0) -> None:
        """Stop listening and remove the socket file (the engine core shuts down)."""
        global _local
        if _local is self:
            _local = None
        self._stop.set()
        self._thread.join(timeout)
        try:
            os.unlink(self.endpoint[len("ipc://"):])
        except FileNotFoundError:
            pass


class WakeSender:
    """In a worker: asks its engine core for one agreement step. Called from one thread only."""

    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        # Connected now, so that the connection is up long before the first
        # wake-up (a send before it is dropped). Used by one thread at a time:
        # made here, then only the agent's I/O thread sends, and close() comes
        # after that thread has ended.
        self._sock: zmq.Socket | None = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1)  # one waiting wake-up is as good as many
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # none queued for an engine not there
        self._sock.connect(endpoint)

    def listening(self) -> bool:
        """Whether an engine core has bound the endpoint (its socket file exists)."""
        return self.endpoint.startswith("ipc://") and os.path.exists(self.endpoint[len("ipc://"):])

    def __call__(self) -> None:
        if self._sock is None:
            return
        try:
            self._sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # one is already waiting (or no engine core listens: see listening())

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
