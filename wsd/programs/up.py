"""``wsd up``: a whole local cluster, a coordinator and ``torchrun`` workers, until Ctrl-C.

The coordinator and torchrun each run in a session of their own, so that
Ctrl-C reaches only ``wsd up``, which then stops the workers first and the
coordinator last, with bounded waits and a kill; SIGTERM and SIGHUP (a closed
terminal or ssh session) do the same. Should ``wsd up`` itself die, its
children follow it: the coordinator exits with its parent and torchrun gets a
SIGTERM from the kernel (``die_with_parent``), on which it stops its workers.
Should torchrun die, ``wsd up`` adopts its workers (``child_subreaper``) and
stops them itself. Before anything starts, the
configuration is loaded and checked against what is launched: the world
(``world_env``: the coordinator expects every rank from the start) and the
device (``check_backend``: nccl needs CUDA). The state file lies in the user's
state folder, one per cluster (``up_state_file``), unless the configuration
names one; ``--fresh`` removes it first. torchrun runs as
``wsd.programs.torchrun``, which says in one line which rank died; the
coordinator then keeps serving so that ``wsctl`` shows the rank lost.

Imports no torch, unless the workers are to use CUDA (``check_backend``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from wsd.config import WsdConfig, load_config, read_toml
from wsd.errors import ConfigError, ExitCode, StateFileError
from wsd.names import DEFAULT_ENGINE, engine_name
from wsd.programs.coordinator import (
    LAUNCHER_PARENT_ENV,
    POLL,
    CoordinatorProcess,
    child_subreaper,
    children,
    descendants,
    reap,
    stop_process_group,
    stop_signals,
)
from wsd.security import AGENT_TOKEN_ENV
from wsd.worker.config import Backend

__all__ = ["ENGINE_ENV", "STATE_FILE_ENV", "check_backend", "cluster_engine", "describe_desired", "forget_state",
           "recovery_line", "state_folder", "threads_per_worker", "up", "up_state_file", "world_env"]

logger = logging.getLogger(__name__)

STATE_FILE_ENV = "WSD_COORDINATOR_STATE_FILE"
CLIENT_ENDPOINT_ENV = "WSD_COORDINATOR_CLIENT_ENDPOINT"
_UNIX_PATH = 100  # what a Unix socket's path may hold (sun_path is 108 bytes), with room to spare
"""The variable through which ``wsd up`` hands its coordinator the state file it chose."""
ENGINE_ENV = "WSD_COORDINATOR_ENGINE"
"""The variable through which ``wsd up`` names its coordinator's default engine after its cluster."""
# torchrun gives its workers 30 s between SIGTERM and SIGKILL; wsd up waits a
# little longer, so that torchrun finishes its own shutdown before we kill it.
_TORCHRUN_GRACE = 35.0
# Workers stop at the next step boundary after SIGTERM: seconds, not more.
_WORKER_GRACE = 15.0
_KILL_WAIT = 5.0
_RESIGNAL_EVERY = 0.2  # seconds between looks for workers torchrun started after the stop


def _say(line: str) -> None:
    try:
        print(line, flush=True)  # flushed: whoever reads our stdout through a pipe sees it now
    except OSError:
        pass  # the terminal is gone (SIGHUP): stopping everything matters more than saying so


def state_folder(env: Mapping[str, str] | None = None) -> str:
    """``$XDG_STATE_HOME/wsd``, else ``~/.local/state/wsd`` (a relative XDG_STATE_HOME is
    ignored, as the XDG base directory specification says)."""
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        home = env.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".local", "state")
    return os.path.join(base, "wsd")


def up_state_file(config: WsdConfig, nproc: int, env: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """The state file of ``wsd up``'s coordinator for ``nproc`` workers, and whether the
    configuration chose it.

    The configuration's ``[coordinator] state_file`` (in the file or
    ``WSD_COORDINATOR_STATE_FILE``) when it sets one. Otherwise one file per
    cluster in ``state_folder``, a cluster being its configuration file and its
    world (``--nproc`` and the TP size): ``default-world2-tp2.state`` without a
    configuration file, else named after the file and a hash of its real path
    (``wsd-world2-tp2-3f2a9c1b7e04.state``), so that two clusters never replay
    each other's desired state (``./wsd-coordinator.state``, the coordinator's
    own default, was shared by whatever ran in that folder).
    """
    env = os.environ if env is None else env
    if STATE_FILE_ENV in env:
        return config.coordinator.state_file, True
    world = f"world{nproc}-tp{_tp_size(config, nproc)}"
    if config.source != "<defaults>":
        section = read_toml(config.source).get("coordinator", {})
        if "state_file" in section:
            return config.coordinator.state_file, True
        real = os.path.realpath(config.source)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(real))[0]) or "config"
        digest = hashlib.sha256(real.encode(errors="surrogateescape")).hexdigest()[:12]
        name = f"{stem}-{world}-{digest}.state"
    else:
        name = f"default-{world}.state"
    return os.path.join(state_folder(env), name), False


def _owned(info: os.stat_result) -> bool:
    return info.st_uid in (os.getuid(), 0) and not info.st_mode & 0o022


def check_state_folder(folder: str) -> None:
    """StateFileError unless ``folder`` (the state folder wsd up chose) is a real folder of this
    user's (or root's) that no one else may write: a link to another user's open folder, with
    a state planted in it ("locked, reserve 1024 TiB"), was once replayed."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or not _owned(info):
        raise StateFileError(
            f"{folder}: wsd up keeps cluster state here, and it is not a folder of this user's that only it "
            f"may write (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}"
            f"{', a link' if stat.S_ISLNK(info.st_mode) else ''}): remove it, or set XDG_STATE_HOME")


def check_state_files(path: str) -> None:
    """StateFileError unless the state file and its journal, where they exist, are regular files
    of this user's (or root's) that no one else may write: a folder, FIFO or device there once
    ended in a traceback, or a copy of /dev/zero without bound."""
    for name in (path, f"{path}.journal"):
        try:
            info = os.lstat(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise StateFileError(f"{name}: cannot read it: {e.strerror}") from e
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(f"{name}: the coordinator's state must be a regular file, and this is not one: "
                                 f"move it aside (or set [coordinator] state_file)")
        if not _owned(info):
            raise StateFileError(f"{name}: belongs to uid {info.st_uid} or may be written by others (mode "
                                 f"{stat.S_IMODE(info.st_mode):04o}): whoever can write it chooses what is "
                                 f"replayed; move it aside")


def owner_only_endpoint(state_file: str) -> str | None:
    """The client endpoint of a local cluster that only this user may steer: an ``ipc://`` socket
    in a folder beside its state file (``NAME.run/client``) that only this user may enter
    (mode 0700; connecting to a Unix socket needs both). None where that path is too long for a
    Unix socket. StateFileError if the folder is there and is not this user's alone."""
    stem = state_file[:-len(".state")] if state_file.endswith(".state") else state_file
    folder = os.path.abspath(f"{stem}.run")
    path = os.path.join(folder, "client")
    if len(path.encode(errors="surrogateescape")) > _UNIX_PATH:
        return None
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as e:
        raise StateFileError(f"{folder}: cannot create the cluster's client folder: {e.strerror}") from e
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise StateFileError(f"{folder}: wsd up keeps the cluster's client socket here, and it is not a folder "
                             f"only this user may enter (owner uid {info.st_uid}, mode "
                             f"{stat.S_IMODE(info.st_mode):04o}{', a link' if stat.S_ISLNK(info.st_mode) else ''}): "
                             f"remove it")
    return f"ipc://{path}"


def _client_endpoint_chosen(config: WsdConfig, env: Mapping[str, str]) -> bool:
    """Whether the operator chose the client endpoint (the environment, or the file)."""
    if CLIENT_ENDPOINT_ENV in env:
        return True
    if config.source == "<defaults>":
        return False
    return "client_endpoint" in read_toml(config.source).get("coordinator", {})


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
    """A local cluster: a coordinator and ``nproc`` torchrun workers, until Ctrl-C, SIGTERM or SIGHUP.

    ``fresh``: remove the cluster's state file and journal first, so that the
    coordinator starts with no desired state and seq 0. When a worker dies,
    torchrun stops the others and says which rank died, in one line; the
    coordinator keeps serving, so that ``wsctl`` shows the rank lost, until
    Ctrl-C, SIGTERM or SIGHUP, and ``up`` then returns ``ExitCode.RANK_LOST``.
    """
    config = load_config(config_path)  # fail now, with the file and key, not in every worker
    env = dict(os.environ)
    # Every process below runs ``python -m``, which puts the working directory first on
    # sys.path: a ``wsd/`` folder there would be imported instead of wsd. Python 3.11+
    # leaves it out with this set (3.10 has no such switch).
    env["PYTHONSAFEPATH"] = "1"
    check_backend(config, env)
    env.update(world_env(config, nproc))
    state_file, chosen = up_state_file(config, nproc, env)
    if not chosen:
        try:
            os.makedirs(os.path.dirname(state_file), mode=0o700, exist_ok=True)
        except OSError as e:
            raise StateFileError(f"{state_file}: cannot create its folder: {e.strerror}: set "
                                 f"XDG_STATE_HOME, or [coordinator] state_file") from e
        env[STATE_FILE_ENV] = state_file
        check_state_folder(os.path.dirname(state_file))
    check_state_files(state_file)
    # Only this user steers it: clients on a socket only this user may reach, unless the
    # operator chose an endpoint (then, without CURVE, whoever reaches it is an admin).
    if not _client_endpoint_chosen(config, env):
        endpoint = owner_only_endpoint(state_file)
        if endpoint is not None:
            env[CLIENT_ENDPOINT_ENV] = endpoint
        else:
            out(f"wsd up: the state folder's path is too long for a Unix socket: clients on "
                f"{config.coordinator.client_endpoint}, which every user of this host may reach (set "
                f"XDG_STATE_HOME to a shorter folder)")
    # Its engine is named after the cluster, so that a coordinator serving several (a fleet's,
    # or one this one's workers are pointed at) tells them apart; its workers name none.
    if config.coordinator.engine == DEFAULT_ENGINE and ENGINE_ENV not in env:
        env[ENGINE_ENV] = cluster_engine(state_file)
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

    # Set here, torchrun prints no banner about it; a user's own value is kept.
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc)))
    # The coordinator admits only registrations that prove they hold this token,
    # which only the workers started here are given (see docs/security.md).
    env.setdefault(AGENT_TOKEN_ENV, secrets.token_hex(32))
    with stop_signals(on_signal), child_subreaper() as adopting:
        spare = set(children(os.getpid()))  # not ours to stop: whatever our caller started
        coordinator = CoordinatorProcess(config_path, env=env, new_session=True,
                                         exit_with_parent=True).start(timeout=30.0)
        if coordinator.proc is not None:
            spare.add(coordinator.proc.pid)
        torchrun = None
        try:
            # A signal while the coordinator started (up to 30 s) starts no worker.
            if not stop.is_set():
                worker_env = {**env, "WSD_COORDINATOR_MODE": "external",
                              "WSD_COORDINATOR_CONNECT_ENDPOINT": coordinator.agent_endpoint,
                              LAUNCHER_PARENT_ENV: str(os.getpid())}
                torchrun = _start_torchrun(nproc, config_path, worker_env)
                _serve(stop, coordinator, torchrun, f"{nproc} workers under torchrun, pid {torchrun.pid}, "
                       f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", out)
        finally:
            # Whether the workers had ended by themselves before the stop: only then does
            # their exit code say what became of them (a rank lost); stopped by us during
            # their start-up, one may die of the SIGTERM before it could catch it.
            ended = torchrun is not None and torchrun.poll() is not None
            workers_code = _stop_workers(torchrun, spare, adopting) if torchrun is not None else None
            coordinator_lived = coordinator.alive()
            coordinator.stop()
    return _outcome(got, coordinator_lived, workers_code if ended or not got else ExitCode.OK, out)


def _serve(stop: threading.Event, coordinator: CoordinatorProcess, torchrun: subprocess.Popen, workers: str,
           out: Callable[[str], object]) -> None:
    """Say where the cluster is; wait for a stop signal, torchrun's or the coordinator's end;
    after a rank lost, keep the coordinator serving until a stop signal."""
    out(f"wsd up: clients on {coordinator.client_endpoint} (agents on {coordinator.agent_endpoint}); {workers}")
    out(f"wsd up: try   WSD_ENDPOINT={coordinator.client_endpoint} wsctl status")
    if coordinator.metrics_url is not None:
        out(f"wsd up: Prometheus metrics on {coordinator.metrics_url}")
    out("wsd up: Ctrl-C stops everything")
    _wait_while(stop, lambda: torchrun.poll() is None and coordinator.alive())
    if torchrun.poll() == ExitCode.RANK_LOST and coordinator.alive():
        out(f"wsd up: a rank is gone; the coordinator keeps serving, so that wsctl shows what it saw "
            f"(WSD_ENDPOINT={coordinator.client_endpoint} wsctl status); Ctrl-C stops it")
        _wait_while(stop, coordinator.alive)


def _wait_while(stop: threading.Event, going: Callable[[], bool]) -> None:
    """Until a stop signal, or until ``going()`` turns false."""
    while not stop.wait(POLL) and going():
        pass


def _outcome(got: list[int], coordinator_lived: bool, workers_code: int | None,
             out: Callable[[str], object]) -> ExitCode:
    """``up``'s last line and exit code: OK when stopped by a signal or when the workers
    finished cleanly, RANK_LOST after a rank died, USAGE when the workers refused their
    configuration, ERROR otherwise."""
    if got:
        out(f"wsd up: stopped by {signal.Signals(got[0]).name}")
        return ExitCode.RANK_LOST if workers_code == ExitCode.RANK_LOST else ExitCode.OK
    if not coordinator_lived:
        out("wsd up: the coordinator ended unexpectedly; stopped the workers")
        return ExitCode.ERROR
    out(f"wsd up: the workers ended with exit code {workers_code}")
    known = (ExitCode.OK, ExitCode.USAGE, ExitCode.RANK_LOST)
    return ExitCode(workers_code) if workers_code in known else ExitCode.ERROR


def check_backend(config: WsdConfig, env: Mapping[str, str]) -> None:
    """ConfigError now, naming the setting and the fix, if the workers are to use CUDA
    (``[worker] backend = "nccl"``) on a machine without it: each worker would otherwise
    fail alone, under a screen of torchrun's. Imports torch only then."""
    if config.worker.backend is not Backend.NCCL:
        return
    from wsd.worker.distributed import resolve_backend

    where = "WSD_WORKER_BACKEND" if "WSD_WORKER_BACKEND" in env else config.source
    try:
        resolve_backend(config.worker.backend)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def cluster_engine(state_file: str) -> str:
    """The engine name of the cluster whose state is ``state_file``: its name without ``.state``
    (``wsd-world2-tp2-3f2a9c1b7e04``), the same for every ``wsd up`` of that cluster."""
    base = os.path.basename(state_file)
    return engine_name(base[: -len(".state")] if base.endswith(".state") else base)


def world_env(config: WsdConfig, nproc: int) -> dict[str, str]:
    """The world ``up`` launches, for its coordinator (``WSD_COORDINATOR_WORLD_SIZE`` and
    ``_TP_SIZE``), so that it expects every rank from the start and names those that never
    register. ConfigError if the configuration says otherwise."""
    tp = _tp_size(config, nproc)
    if nproc % tp:
        raise ConfigError(f"[worker] tp_size = {tp} does not divide --nproc {nproc}: "
                          f"pass a multiple of {tp} to --nproc, or change tp_size")
    for key, launched in (("world_size", nproc), ("tp_size", tp)):
        configured = getattr(config.coordinator, key)
        if configured is not None and configured != launched:
            raise ConfigError(f"[coordinator] {key} = {configured}, but wsd up starts a world of "
                              f"{nproc} ranks in TP groups of {tp}: leave {key} unset (wsd up sets it)")
    return {"WSD_COORDINATOR_WORLD_SIZE": str(nproc), "WSD_COORDINATOR_TP_SIZE": str(tp)}


def _tp_size(config: WsdConfig, nproc: int) -> int:
    return config.worker.tp_size or nproc  # the workers' default: one TP group per node


def threads_per_worker(nproc: int) -> int:
    """``OMP_NUM_THREADS`` for each of ``nproc`` workers: this process's CPUs shared out, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // nproc)


def _start_torchrun(nproc: int, config_path: str | None, env: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(_torchrun_command(nproc, config_path), env=dict(env), start_new_session=True)


def _torchrun_command(nproc: int, config_path: str | None) -> list[str]:
    # torchrun with one line per failed rank instead of its tracebacks (wsd.programs.torchrun).
    # --standalone: a c10d rendezvous on a port the OS picks, never a fixed one.
    command = [sys.executable, "-m", "wsd.programs.torchrun", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "wsd.programs.worker"]
    return command + (["--config", str(config_path)] if config_path is not None else [])


def _stop_workers(torchrun: subprocess.Popen, spare: Collection[int], adopting: bool) -> int | None:
    """Stop the workers, then torchrun, and every process under it, whatever its session;
    torchrun's exit code.

    ``spare``: our children that are not workers. ``adopting``: we are a child
    subreaper, so that workers whose torchrun died are our children, found
    among them, stopped and reaped here.
    """
    # torchrun starts each worker in a session of its own. Signalling the
    # workers first lets them stop at one step and exit 0, so torchrun ends by
    # itself, quietly; signalling torchrun instead works too, noisily.
    adopted = [p for c in children(os.getpid()) if c != torchrun.pid and c not in spare
               for p in (c, *descendants(c))]
    signalled: set[int] = set()
    deadline = time.monotonic() + _WORKER_GRACE
    code: int | None
    while True:
        # Again and again: torchrun may still be starting workers (a stop during start-up),
        # and one started after the first look would run on until torchrun was killed.
        for pid in [*descendants(torchrun.pid), *adopted]:
            if pid not in signalled:
                signalled.add(pid)
                _signal_group(pid, signal.SIGTERM)
        try:
            code = torchrun.wait(max(0.0, min(_RESIGNAL_EVERY, deadline - time.monotonic())))
            killed = False  # torchrun waited for its workers
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() < deadline:
                continue
        logger.warning("the workers did not stop within %.0f s; stopping torchrun", _WORKER_GRACE)
        code = stop_process_group(torchrun, _TORCHRUN_GRACE)
        killed = True
        break
    workers = list(signalled)
    if adopting:
        # Any worker left is now ours, running or not yet reaped, so its pid
        # (and group) cannot have been reused: wait for it, then kill its group.
        left = reap(workers, max(0.0, deadline - time.monotonic()))
    elif killed:
        left = set(workers)  # torchrun was killed, so workers may be left; we cannot tell which
    else:
        left = set()  # torchrun waited for them; their pids may already be unrelated processes'
    if left:
        logger.warning("%d worker processes did not stop; killing them", len(left))
    for pid in left:
        _signal_group(pid, signal.SIGKILL)
    if adopting:
        reap(left, _KILL_WAIT)
    return code


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # a worker leads its own group; a non-leader pid is refused
    except (ProcessLookupError, PermissionError):
        pass
