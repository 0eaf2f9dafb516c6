"""Starting and stopping wsd's processes: ``wsd coordinator`` and ``wsd up``.

``serve_coordinator`` runs a coordinator in the foreground until SIGTERM or
SIGINT and announces its bound endpoints on one line of stdout (``READY``),
which is how whoever started it learns ports chosen by the OS.
``CoordinatorProcess`` starts that as a child and waits for the line; the
embedded mode of the worker and ``wsd up`` both use it. ``up`` runs a whole
local cluster: a coordinator and ``torchrun --standalone`` workers, each in a
session of its own, so that Ctrl-C reaches only ``wsd up``, which then stops
the workers first and the coordinator last, with bounded waits and a kill.
Its state file lies in the user's state folder, one per cluster (``up_state_file``),
unless the configuration names one; ``--fresh`` removes it first.

Imports no torch: the coordinator runs where there is none.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from wsd.config import WsdConfig, load_config, read_toml
from wsd.errors import ConfigError, LaunchError, StateFileError
from wsd.security import AGENT_TOKEN_ENV, load_agent_token

__all__ = ["READY", "CoordinatorProcess", "forget_state", "recovery_line", "serve_coordinator",
           "state_folder", "stop_process_group", "up", "up_state_file"]

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
STATE_FILE_ENV = "WSD_COORDINATOR_STATE_FILE"
"""The variable through which ``wsd up`` hands its coordinator the state file it chose."""


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


def state_folder(env: Mapping[str, str] | None = None) -> str:
    """``$XDG_STATE_HOME/wsd``, else ``~/.local/state/wsd`` (a relative XDG_STATE_HOME is
    ignored, as the XDG base directory specification says)."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        home = env.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".local", "state")
    return os.path.join(base, "wsd")


def up_state_file(config: WsdConfig, env: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """The state file of ``wsd up``'s coordinator, and whether the configuration chose it.

    The configuration's ``[coordinator] state_file`` (in the file or
    ``WSD_COORDINATOR_STATE_FILE``) when it sets one. Otherwise one file per
    cluster in ``state_folder``: ``default.state`` without a configuration file,
    else named after the file and a hash of its real path, so that two clusters
    never replay each other's desired state (``./wsd-coordinator.state``, the
    coordinator's own default, was shared by whatever ran in that folder).
    """
    env = os.environ if env is None else env
    if STATE_FILE_ENV in env:
        return config.coordinator.state_file, True
    if config.source != "<defaults>":
        section = read_toml(config.source).get("coordinator", {})
        if "state_file" in section:
            return config.coordinator.state_file, True
        real = os.path.realpath(config.source)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(real))[0]) or "config"
        digest = hashlib.sha256(real.encode(errors="surrogateescape")).hexdigest()[:12]
        name = f"{stem}-{digest}.state"
    else:
        name = "default.state"
    return os.path.join(state_folder(env), name), False


def forget_state(path: str) -> list[str]:
    """Remove the state file at ``path`` and its journal; the paths removed.

    StateFileError naming the file if one exists and cannot be removed.
    """
    removed = []
    for name in (path, f"{path}.journal"):
        try:
            os.remove(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StateFileError(f"{name}: cannot remove it for --fresh: {e.strerror}") from e
        removed.append(name)
    return removed


def recovery_line(path: str, capacity: int) -> str:
    """What a coordinator starting from ``path`` will recover, in one line for ``wsd up``.

    Loads a copy of the snapshot and journal in a temporary folder: loading
    folds the journal into a new snapshot, which must not happen to the real
    files before the coordinator itself loads them. A state the copy cannot
    load is left for the coordinator to refuse, with its own message naming
    the real file.
    """
    from wsd.coordinator.commandlog import CommandLog

    shown = os.path.abspath(path)
    if not any(os.path.exists(p) for p in (path, f"{path}.journal")):
        return f"no earlier state in {shown}: starting empty"
    with tempfile.TemporaryDirectory(prefix="wsd-up-") as folder:
        copy = os.path.join(folder, "state")
        for suffix in ("", ".journal"):
            if os.path.exists(path + suffix):
                shutil.copyfile(path + suffix, copy + suffix)
        log = CommandLog(copy, capacity)
        try:
            if not log.load():
                return f"no earlier state in {shown}: starting empty"
        except StateFileError:
            return f"the state in {shown} cannot be loaded; the coordinator will say why"
    differ = sorted(g for g, d in log.groups.items() if d != log.default)
    groups = f" (TP groups {', '.join(map(str, differ))} differ)" if differ else ""
    return (f"recovered seq {log.seq}, desired: {describe_desired(log.default)}{groups} from {shown}; "
            "wsd up --fresh starts empty")


def describe_desired(desired: Mapping[str, Any]) -> str:
    """``{"locked": True, "num_ubatches": 4, ...}`` -> ``"locked, 4 ubatches"``; ``"nothing set"``."""
    from wsd.fmt import format_bytes

    parts = []
    if desired.get("locked") is not None:
        parts.append("locked" if desired["locked"] else "unlocked")
    if desired.get("num_ubatches") is not None:
        parts.append(f"{desired['num_ubatches']} ubatches")
    if desired.get("reserve_bytes") is not None:
        parts.append(f"reserve {format_bytes(int(desired['reserve_bytes']))}")
    return ", ".join(parts) or "nothing set"


def up(nproc: int, config_path: str | None, *, fresh: bool = False,
       out: Callable[[str], object] = _say) -> int:
    """A local cluster: a coordinator and ``nproc`` torchrun workers, until Ctrl-C or SIGTERM.

    ``fresh``: remove the cluster's state file and journal first, so that the
    coordinator starts with no desired state and seq 0.
    """
    config = load_config(config_path)  # fail now, with the file and key, not in every worker
    env = dict(os.environ)
    state_file, chosen = up_state_file(config, env)
    if not chosen:
        try:
            os.makedirs(os.path.dirname(state_file), mode=0o700, exist_ok=True)
        except OSError as e:
            raise StateFileError(f"{state_file}: cannot create its folder: {e.strerror}: set "
                                 f"XDG_STATE_HOME, or [coordinator] state_file") from e
        env[STATE_FILE_ENV] = state_file
    if fresh:
        removed = forget_state(state_file)
        out(f"wsd up: --fresh: removed {' and '.join(map(os.path.abspath, removed))}" if removed
            else f"wsd up: --fresh: no state to remove at {os.path.abspath(state_file)}")
    out(f"wsd up: {recovery_line(state_file, config.coordinator.log_capacity)}")
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        stop.set()

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
