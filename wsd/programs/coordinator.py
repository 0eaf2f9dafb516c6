"""Starting and stopping wsd's processes: the coordinator as a child or in the foreground.

``serve_coordinator`` runs a coordinator in the foreground until SIGTERM or
SIGINT and announces its bound endpoints on one line of stdout (``READY``),
which is how whoever started it learns ports chosen by the OS.
``CoordinatorProcess`` starts that as a child and waits for the line; the
embedded mode of the worker and ``wsd up`` (``wsd.programs.up``) both use it.
``stop_process_group`` and ``descendants`` end what was started, with bounded
waits and a kill; ``child_subreaper`` and ``die_with_parent`` (Linux) keep a
process tree together when a process in the middle of it dies.

Imports no torch: the coordinator runs where there is none.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from wsd.config import WsdConfig
from wsd.errors import ConfigError, ExitCode, LaunchError
from wsd.security import load_agent_token

__all__ = ["LAUNCHER_PARENT_ENV", "POLL", "READY", "CoordinatorProcess", "child_subreaper", "children",
           "descendants", "die_with_parent", "reap", "serve_coordinator", "stop_process_group", "stop_signals"]

logger = logging.getLogger(__name__)

READY = "wsd coordinator ready:"
"""Start of the line a foreground coordinator prints once bound: ``READY agents URL clients URL``,
followed by ``metrics URL`` when it serves metrics."""
_READY_LINE = re.compile(re.escape(READY) + r" agents (\S+) clients (\S+)(?: metrics (\S+))?")
POLL = 0.2
"""Seconds between a foreground loop's looks at its flags and children."""
LAUNCHER_PARENT_ENV = "WSD_LAUNCHER_PARENT_PID"
"""The pid whose death ends torchrun as ``wsd up`` runs it (``wsd.programs.torchrun``, ``die_with_parent``)."""
_COORDINATOR_GRACE = 10.0
_KILL_WAIT = 5.0
# prctl(2) options (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Within the block, SIGTERM, SIGINT and SIGHUP call ``on_signal(signum)`` instead of killing us.

    SIGHUP as SIGTERM: a closed terminal or ssh session sends it, and dying of it
    would leave whatever we started running.
    """
    previous = {sig: signal.signal(sig, lambda signum, frame: on_signal(signum))
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prctl(option: int, arg: int | ctypes.c_int) -> bool:
    """prctl(2) through libc; False where there is none (not Linux) or it fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.byref(arg) if isinstance(arg, ctypes.c_int) else ctypes.c_ulong(arg)
        return bool(libc.prctl(option, value, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0)
    except (OSError, AttributeError):
        return False


@contextmanager
def child_subreaper() -> Iterator[bool]:
    """Within the block, a process below us whose parent dies re-parents to us, not to
    PID 1, so that it can still be found (``children``) and stopped; yields whether
    that holds (Linux only). Those adopted must be reaped (``reap``)."""
    before = ctypes.c_int(0)
    if not _prctl(_PR_GET_CHILD_SUBREAPER, before) or not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
        yield False
        return
    try:
        yield True
    finally:
        _prctl(_PR_SET_CHILD_SUBREAPER, before.value)


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have ``sig`` sent to this process when its parent, pid ``parent``, dies (Linux; a
    no-op elsewhere); sent now if it is already gone."""
    if _prctl(_PR_SET_PDEATHSIG, sig) and os.getppid() != parent:
        os.kill(os.getpid(), sig)  # it died before the request was made


def reap(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` s for those of ``pids`` that are our children to exit, and reap
    them; those still running at the end. Others (not our children) are left alone."""
    left = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not ours, or reaped already
                done = pid
            if done:
                left.discard(pid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(min(POLL, max(0.0, deadline - time.monotonic())))


def serve_coordinator(config: WsdConfig, *, exit_with_parent: bool = False) -> int:
    """Run a coordinator in the foreground until SIGTERM/SIGINT (or our parent's end).

    ConfigError unless the world is known: from ``[coordinator] world_size``
    (``wsd up`` and the embedded mode set it), or, with an agent token, from the
    first registration that proves it holds the token. Without either, the
    first peer to reach the agent endpoint would fix the world for everyone.
    """
    from wsd.coordinator.loop import Coordinator

    token = load_agent_token(config.security)
    if config.coordinator.world_size is None and token is None:
        raise ConfigError(
            "[coordinator] world_size is not set and agents are not authenticated: set world_size "
            "(WSD_COORDINATOR_WORLD_SIZE), or an agent token (WSD_AGENT_TOKEN or [security] "
            "agent_token_file), so that no stray registration can decide the world")
    parent = os.getppid()
    stop = threading.Event()
    coordinator = Coordinator(config.coordinator, security=config.security, agent_token=token)
    if token is None:
        logger.warning("agents are not authenticated (no WSD_AGENT_TOKEN or [security] agent_token_file): "
                       "anyone who reaches %s may register as any rank that is not live",
                       coordinator.agent_endpoint)
    with stop_signals(lambda signum: stop.set()):
        coordinator.start()
        try:
            metrics = "" if coordinator.metrics_url is None else f" metrics {coordinator.metrics_url}"
            print(f"{READY} agents {coordinator.agent_endpoint} clients {coordinator.client_endpoint}{metrics}",
                  flush=True)
            while not stop.wait(POLL):
                if not coordinator.serving:
                    logger.error("coordinator loop ended unexpectedly; exiting")
                    return ExitCode.ERROR
                if exit_with_parent and os.getppid() != parent:
                    logger.warning("the process that started the coordinator is gone; exiting")
                    break
        finally:
            coordinator.stop(timeout=_COORDINATOR_GRACE)
    logger.info("coordinator stopped")
    return ExitCode.OK


def stop_process_group(proc: subprocess.Popen, grace: float, *, group: bool = True) -> int | None:
    """SIGTERM ``proc`` (its whole process group if ``group``), wait ``grace`` s, then SIGKILL.

    Returns the exit code, or None if it outlived even SIGKILL's bounded wait.
    """
    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass  # already gone

    if proc.poll() is None:
        send(signal.SIGTERM)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d did not stop within %.0f s of SIGTERM; killing it", proc.pid, grace)
    send(signal.SIGKILL)
    try:
        return proc.wait(_KILL_WAIT)
    except subprocess.TimeoutExpired:
        logger.error("pid %d survived SIGKILL for %.0f s; abandoning it", proc.pid, _KILL_WAIT)
        return None
    finally:
        if group:
            send(signal.SIGKILL)  # anything left in its group (it is the leader: ours alone)


@dataclass
class CoordinatorProcess:
    """A ``wsd coordinator`` child process, started and awaited until it is bound."""

    config_path: str | None
    env: Mapping[str, str] | None = None
    new_session: bool = False
    """Its own session: a terminal's Ctrl-C does not reach it (``wsd up`` stops it last)."""
    exit_with_parent: bool = False
    """Exit if the starting process dies without stopping it (the embedded mode's rank 0)."""

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.agent_endpoint = ""
        self.client_endpoint = ""
        self.metrics_url: str | None = None

    def start(self, timeout: float) -> CoordinatorProcess:
        """Start it and wait for its ready line; ConfigError if it refused its configuration
        (exit code 2), LaunchError otherwise, its own log saying why."""
        command = [sys.executable, "-m", "wsd.programs.cli", "coordinator"]
        if self.config_path is not None:
            command += ["--config", str(self.config_path)]
        if self.exit_with_parent:
            command.append("--exit-with-parent")
        # Its log goes to our stderr; stdout carries the ready line only.
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                     env=None if self.env is None else dict(self.env),
                                     start_new_session=self.new_session)
        assert self.proc.stdout is not None
        started = time.monotonic()
        match = _await_line(self.proc, self.proc.stdout, _READY_LINE, timeout)
        if match is None:
            ended = time.monotonic() - started < timeout  # its output ended: it did, by itself
            code = self.stop()
            if code == ExitCode.USAGE:  # its configuration: a bad file, an endpoint it cannot bind, its state file
                raise ConfigError("the coordinator refused its configuration (exit code 2); "
                                  "its log above says why")
            what = "exited before it was ready" if ended else f"was not ready within {timeout:g} s"
            raise LaunchError(f"the coordinator {what} (exit code {code}); its log above says why")
        self.agent_endpoint, self.client_endpoint, self.metrics_url = match.groups()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = _COORDINATOR_GRACE) -> int | None:
        if self.proc is None:
            return None
        code = stop_process_group(self.proc, grace, group=self.new_session)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


def _await_line(proc: subprocess.Popen, stream, pattern: re.Pattern[str], timeout: float) -> re.Match[str] | None:
    """The first line of ``stream`` matching ``pattern``, or None at EOF or timeout.

    Reads the file descriptor directly: select() on a buffered stream would
    miss lines already sitting in its buffer.
    """
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    pending = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], min(left, POLL))
        if not readable:
            if proc.poll() is not None:
                return None
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            match = pattern.search(line)
            if match:
                return match
            print(line)  # not ours: pass it on


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc, else ``ps``), exited ones not yet reaped included."""
    return [child for child, parent in _parent_pairs() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc, else ``ps``); [] if none can be listed."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pairs():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _parent_pairs() -> Sequence[tuple[int, int]]:
    pairs = []
    if os.path.isdir("/proc"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    # The command name in parentheses may contain spaces: split after it.
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pairs.append((int(name), int(fields[1])))
        return pairs
    try:
        listing = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True,
                                 text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            pairs.append((int(parts[0]), int(parts[1])))
    return pairs
