"""Test kit for real processes: start, wait for a line, fail on a traceback, stop.

``Proc`` runs a command in a session of its own with its stdout and stderr
merged and collected by a thread, so a test can wait for a line with a
timeout (and fail at once, with the output, if a traceback shows up instead),
read everything printed so far, list every process below it, and be sure
nothing it started outlives the test (``spawn`` fixture: each process group
and every descendant seen is killed at teardown).

Process listing here reads /proc directly and on purpose does not reuse
``wsd.programs.coordinator.descendants``: a test that checks "no process left behind" must
not share a blind spot with the code it checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TRACEBACK = "Traceback (most recent call last)"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry))
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo += children.get(p, [])
    return found


def _stat(pid: int) -> list[str] | None:
    """(state, ppid, pgrp, ...) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has exited; it only waits to be reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def wait_gone(pids: Iterable[int], timeout: float, what: str = "processes") -> None:
    """Fail unless every pid has exited within ``timeout`` seconds."""
    pids = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = {p for p in pids if alive(p)}
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what} still running after {timeout} s: {sorted(left)} "
                        f"({', '.join(cmdline(p)[:120] for p in sorted(left))})")
        time.sleep(0.05)


def cmdline(pid: int) -> str:
    """The command line of process ``pid``, or "?" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def python(*args: str) -> list[str]:
    """A command running this interpreter (the test's environment) with ``args``."""
    return [sys.executable, *args]


def torchrun(nproc: int, config: str, *extra: str) -> list[str]:
    """``torchrun --standalone`` (a rendezvous port the OS picks) running ``nproc`` workers."""
    return python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                  "-m", "wsd.worker", "--config", config, *extra)


def worker_env(**overrides: str) -> dict[str, str]:
    """This environment, one thread per worker: busy ranks must not starve a 2-core machine."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **overrides}


COORDINATOR_READY = r"wsd coordinator ready: agents (\S+) clients (\S+)"
"""The line ``wsd coordinator`` prints once bound: group 1 the agent endpoint, 2 the client's."""


def coordinator_section(tmp_path: os.PathLike[str] | str) -> dict[str, Any]:
    """A ``[coordinator]`` section on OS-chosen loopback ports with short heartbeats."""
    return {"agent_endpoint": "tcp://127.0.0.1:0", "client_endpoint": "tcp://127.0.0.1:0",
            "state_file": os.path.join(tmp_path, "state"), "heartbeat_interval": 0.2,
            "heartbeat_timeout": 1.0}


class Proc:
    """One command in its own session; its merged output is collected line by line."""

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, name: str | None = None,
                 stdin: bool = False) -> None:
        self.args = list(args)
        self.name = name or os.path.basename(self.args[0])
        self.popen = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env=None if env is None else dict(env), cwd=cwd, start_new_session=True,
        )
        self.pid = self.popen.pid
        self.seen: set[int] = set()  # every descendant ever listed, for teardown
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"read-{self.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with self._changed:
                self._lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    # -- output -----------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        with self._changed:
            return list(self._lines)

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, *, start: int = 0,
                 allow_traceback: bool = False) -> re.Match[str]:
        """The first line (from line ``start``) matching ``pattern``; fails on timeout,
        on the process ending first, or on a traceback (unless ``allow_traceback``)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        index = start
        with self._changed:
            while True:
                while index < len(self._lines):
                    line = self._lines[index]
                    index += 1
                    match = regex.search(line)
                    if match:
                        return match
                    if TRACEBACK in line and not allow_traceback:
                        self._fail(f"a traceback while waiting for {pattern!r}")
                if self.popen.poll() is not None and not self._reader.is_alive():
                    self._fail(f"exited ({self.popen.returncode}) before printing {pattern!r}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"timed out after {timeout} s waiting for {pattern!r}")
                self._changed.wait(min(left, 0.2))

    def send_line(self, line: str) -> int:
        """Write one line to its stdin (started with ``stdin=True``); returns the
        number of output lines before it, for ``wait_for(..., start=)``."""
        start = len(self.lines)
        assert self.popen.stdin is not None, "started without stdin=True"
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()
        return start

    def count(self, pattern: str) -> int:
        regex = re.compile(pattern)
        return sum(1 for line in self.lines if regex.search(line))

    def _fail(self, why: str) -> None:
        tail = "\n".join(self._lines[-60:])
        pytest.fail(f"{self.name} (pid {self.pid}): {why}; its output ends:\n{tail}", pytrace=False)

    # -- processes ----------------------------------------------------------------

    def tree(self) -> set[int]:
        """This process and every process below it now (remembered for teardown)."""
        below = descendants(self.pid)
        self.seen |= below
        return {self.pid} | below

    def send(self, sig: int, *, group: bool = False) -> None:
        """Signal the process (or its whole process group, as a terminal's Ctrl-C does)."""
        try:
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """Its exit code; fails if it is still running after ``timeout`` s."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._fail(f"still running {timeout} s after it was asked to stop")
        self._reader.join(5)
        return code

    def kill_all(self) -> None:
        """Teardown: SIGKILL its group, every descendant ever seen and their groups."""
        for pid in {self.pid} | self.seen | descendants(self.pid):
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdout is not None:
            self._reader.join(5)
            self.popen.stdout.close()


@contextmanager
def processes() -> Iterator[Any]:
    """``start(args, **kw) -> Proc`` within the block; everything started is killed on leaving it.

    For a fixture of a wider scope than ``spawn`` (a cluster shared by a module's tests).
    """
    started: list[Proc] = []

    def start(args: Sequence[str], **kwargs: Any) -> Proc:
        proc = Proc(args, **kwargs)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.kill_all()


@pytest.fixture
def spawn() -> Iterator[Any]:
    """``spawn(args, **kw) -> Proc``; everything started is killed at teardown, whatever happened."""
    with processes() as start:
        yield start


def write_config(path: os.PathLike[str] | str, sections: Mapping[str, Mapping[str, Any]]) -> str:
    """Write a TOML file from ``{section: {key: value}}`` (str, int, float, bool values)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    text = "".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items()) + "\n"
                   for name, body in sections.items())
    with open(path, "w") as f:
        f.write(text)
    return str(path)


# -- the installed console scripts ------------------------------------------------


def _console_script(name: str) -> str:
    """The script installed beside this interpreter (no shim in between), else ``name`` on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else name


WSCTL = _console_script("wsctl")
WSD = _console_script("wsd")


@dataclass(frozen=True)
class Result:
    """One wsctl run: exit code, its JSON document (None when it printed none), stderr."""

    code: int
    doc: Any
    stderr: str


def wsctl(endpoint: str, *argv: str, timeout: float = 3.0) -> Result:
    """``wsctl --endpoint E --timeout T --json ARGV`` as a subprocess; fails if it hangs.

    A read-only request is tried up to 3 times of ``timeout`` each; the rest
    of the subprocess bound is interpreter start-up on a loaded machine.
    """
    command = [WSCTL, "--endpoint", endpoint, "--timeout", str(timeout), "--json", *argv]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3 * timeout + 20,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"wsctl {' '.join(argv)} hung: no exit within {3 * timeout + 20:g} s")
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 1, f"wsctl {argv[0]} printed more than one document: {done.stdout}"
    return Result(done.returncode, json.loads(lines[0]) if lines else None, done.stderr)


RUN_SH = Path(__file__).resolve().parents[1] / "deploy" / "local" / "run.sh"
"""The one-machine recipe: a coordinator and torchrun workers (or vLLM's API server)."""


def leftovers(tmp_path: Path) -> list[str]:
    """What ``deploy/local/run.sh`` left in its temporary folder (nothing, once it stopped)."""
    return [p.name for p in tmp_path.glob("wsd-local.*")]
