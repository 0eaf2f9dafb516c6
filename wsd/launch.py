"""Starting and stopping wsd's processes: ``wsd coordinator`` and ``wsd up``.

``serve_coordinator`` runs a coordinator in the foreground until SIGTERM or
SIGINT and announces its bound endpoints on one line of stdout (``READY``),
which is how whoever started it learns ports chosen by the OS.
``CoordinatorProcess`` starts that as a child and waits for the line; the
embedded mode of the worker and ``wsd up`` both use it. ``up`` runs a whole
local cluster: a coordinator and ``torchrun --standalone`` workers, each in a
session of its own, so that Ctrl-C reaches only ``wsd up``, which then stops
the workers first and the coordinator last, with bounded waits and a kill.

Imports no torch: the coordinator runs where there is none.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from wsd.config import WsdConfig, load_config
from wsd.errors import ConfigError, LaunchError
from wsd.security import AGENT_TOKEN_ENV, load_agent_token

__all__ = ["READY", "CoordinatorProcess", "serve_coordinator", "stop_process_group", "up"]

logger = logging.getLogger(__name__)

READY = "wsd coordinator ready:"
"""Start of the line a foreground coordinator prints once bound: ``READY agents URL clients URL``,
followed by ``metrics URL`` when it serves metrics."""
_READY_LINE = re.compile(re.escape(READY) + r" agents (\S+) clients (\S+)(?: metrics (\S+))?")
# How often foreground loops look at their flags and children.
_POLL = 0.2
# torchrun gives its workers 30 s between SIGTERM and SIGKILL; wsd up waits a
# little longer, so that torchrun finishes its own shutdown before we kill it.
_TORCHRUN_GRACE = 35.0
# Workers stop at the next step boundary after SIGTERM: seconds, not more.
_WORKER_GRACE = 15.0
_COORDINATOR_GRACE = 10.0
_KILL_WAIT = 5.0


@contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT call ``on_signal(signum)`` instead of killing us."""
    previous = {sig: signal.signal(sig, lambda signum, frame: on_signal(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
            while not stop.wait(_POLL):
                if not coordinator.serving:
                    logger.error("coordinator loop ended unexpectedly; exiting")
                    return 1
                if exit_with_parent and os.getppid() != parent:
                    logger.warning("the process that started the coordinator is gone; exiting")
                    break
        finally:
            coordinator.stop(timeout=_COORDINATOR_GRACE)
    logger.info("coordinator stopped")
    return 0


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
        command = [sys.executable, "-m", "wsd.cli", "coordinator"]
        if self.config_path is not None:
            command += ["--config", str(self.config_path)]
        if self.exit_with_parent:
            command.append("--exit-with-parent")
        # Its log goes to our stderr; stdout carries the ready line only.
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                     env=None if self.env is None else dict(self.env),
                                     start_new_session=self.new_session)
        assert self.proc.stdout is not None
        match = _await_line(self.proc, self.proc.stdout, _READY_LINE, timeout)
        if match is None:
            code = self.stop()
            if code == 2:  # its configuration: a bad file, an endpoint it cannot bind, its state file
                raise ConfigError("the coordinator refused its configuration (exit code 2); "
                                  "its log above says why")
            raise LaunchError(f"the coordinator did not become ready within {timeout:g} s "
                              f"(exit code {code}); its log above says why")
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
        readable, _, _ = select.select([fd], [], [], min(left, _POLL))
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


def _say(line: str) -> None:
    print(line, flush=True)  # flushed: whoever reads our stdout through a pipe sees it now


def up(nproc: int, config_path: str | None, *, out: Callable[[str], object] = _say) -> int:
    """A local cluster: a coordinator and ``nproc`` torchrun workers, until Ctrl-C or SIGTERM."""
    load_config(config_path)  # fail now, with the file and key, not in every worker
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        stop.set()

    env = dict(os.environ)
    env.setdefault("WSD_COORDINATOR_WORLD_SIZE", str(nproc))
    # The coordinator admits only registrations that prove they hold this token,
    # which only the workers started here are given (see docs/security.md).
    env.setdefault(AGENT_TOKEN_ENV, secrets.token_hex(32))
    with stop_signals(on_signal):
        coordinator = CoordinatorProcess(config_path, env=env, new_session=True).start(timeout=30.0)
        torchrun = None
        try:
            worker_env = {**env, "WSD_COORDINATOR_MODE": "external",
                          "WSD_COORDINATOR_CONNECT_ENDPOINT": coordinator.agent_endpoint}
            torchrun = subprocess.Popen(_torchrun_command(nproc, config_path), env=worker_env,
                                        start_new_session=True)
            out(f"wsd up: clients on {coordinator.client_endpoint} "
                f"(agents on {coordinator.agent_endpoint}); {nproc} workers under torchrun, pid {torchrun.pid}")
            out(f"wsd up: try   WSD_ENDPOINT={coordinator.client_endpoint} wsctl status")
            if coordinator.metrics_url is not None:
                out(f"wsd up: Prometheus metrics on {coordinator.metrics_url}")
            out("wsd up: Ctrl-C stops everything")
            while not stop.wait(_POLL):
                if torchrun.poll() is not None or not coordinator.alive():
                    break
        finally:
            workers_code = _stop_workers(torchrun) if torchrun is not None else None
            coordinator_lived = coordinator.alive()
            coordinator.stop()
    if got:
        out(f"wsd up: stopped by {signal.Signals(got[0]).name}")
        return 0
    if not coordinator_lived:
        out("wsd up: the coordinator ended unexpectedly; stopped the workers")
        return 1
    out(f"wsd up: the workers ended with exit code {workers_code}")
    return 0 if workers_code == 0 else 1


def _torchrun_command(nproc: int, config_path: str | None) -> list[str]:
    # --standalone: a c10d rendezvous on a port the OS picks, never a fixed one.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "wsd.worker.process"]
    return command + (["--config", str(config_path)] if config_path is not None else [])


def _stop_workers(torchrun: subprocess.Popen) -> int | None:
    """Stop the workers, then torchrun, and every process under it, whatever its session."""
    # torchrun starts each worker in a session of its own. Signalling the
    # workers first lets them stop at one step and exit 0, so torchrun ends by
    # itself, quietly; signalling torchrun instead works too, noisily.
    workers = descendants(torchrun.pid)
    for pid in workers:
        _signal_group(pid, signal.SIGTERM)
    code: int | None
    try:
        code = torchrun.wait(_WORKER_GRACE)
    except subprocess.TimeoutExpired:
        logger.warning("the workers did not stop within %.0f s; stopping torchrun", _WORKER_GRACE)
        code = stop_process_group(torchrun, _TORCHRUN_GRACE)
    for pid in workers:  # none should be left; if torchrun had to be killed, some may be
        _signal_group(pid, signal.SIGKILL)
    return code


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # a worker leads its own group; a non-leader pid is refused
    except (ProcessLookupError, PermissionError):
        pass


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
