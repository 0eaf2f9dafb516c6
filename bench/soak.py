"""A bounded soak: a local cluster under random faults, commands and queries; nothing may be lost.

It runs a real ``wsd coordinator`` (state file in a temp folder, endpoints on
ports the OS picks, read from its ready line) and real ``torchrun`` workers
(``bench.soak_worker``: ``wsd.programs.worker`` with its built-in engine loop, small
shapes, gloo, with every command application recorded), all on loopback.
``torchrun --max-restarts`` restarts the worker group when a rank dies, as an
operator's launcher would: a replacement is a fresh process that registers
by itself. Meanwhile one thread injects faults at random (SIGKILL a worker;
SIGKILL the coordinator and restart it on the same endpoints and state file;
SIGSTOP/SIGCONT a worker; SIGSTOP/SIGCONT the coordinator), waiting for the
cluster to be whole again before the next, and the main thread issues
commands (``lock``, ``unlock``, ``set_ubatches``, ``reserve``/``trim`` when
unlocked, ``equalize``; waiting or not) and queries (``stats``, ``status``,
``ranks``, ``events``) through the Python client.

At the end it lets the cluster settle, issues one last command, and checks
every worker's record (``bench/soak_check.py``): each process applied every
seq of its TP group exactly once, in order, with no gap, from the baseline it
was given; every process alive at the end reached the last seq; the members
of a TP group applied the same seqs at the same steps; no seq answered to the
client is missing from the coordinator after its restarts. A request that
went unanswered while the coordinator was deliberately down is counted as
expected-unavailable; one unanswered while it was up counts as lost. Exit
code 0 only if nothing was lost, applied twice or left running.

No simulated ranks (``wsd/agent/simulated.py``) widen this world: the coordinator
accepts only ranks that report its one world size, and torchrun's workers
report theirs, so simulated ranks could not join the same world without a
second coordinator, which would soak nothing more.

The process kit (``Proc``: output collected by a thread, a line awaited with
a timeout, every descendant killed at the end) is imported from
``tests/procs.py`` rather than copied or moved: it is a test kit (it reports
through ``pytest.fail``), and the soak is a test at heart.

Run: ``python -m bench.soak --quick`` (about 60 s) or ``--seconds N``;
``--help`` for every knob.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.helpers import one_engine
from bench.soak_check import ALL, desired_mismatches, read_records, verify
from bench.soak_worker import RECORD_ENV
from tests.procs import (
    COORDINATOR_READY,
    Proc,
    alive,
    cmdline,
    coordinator_section,
    python,
    worker_env,
    write_config,
)
from wsd.commands import COMMANDS
from wsd.wire.protocol import ErrorCode
from wsd_client.client import Client, ClientError, Unavailable

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("kill_worker", "kill_coordinator", "stop_worker", "stop_coordinator")
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0
# After the coordinator is back, a client's socket reconnects within zmq's
# reconnect interval (0.1 s); a request that still finds no one this long
# after the outage counts as lost, not as expected-unavailable.
RECONNECT_GRACE = 1.0
# A pause (SIGSTOP) outlasts the heartbeat timeout, so it is a real outage.
PAUSE = (1.5 * HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_TIMEOUT)
CLIENT_TIMEOUT = 2.0
STARTUP_TIMEOUT = 120.0  # torch imports on a busy two-core machine


class SoakError(Exception):
    """The soak could not run (a process would not start, the cluster never recovered)."""


class Ledger:
    """What happened, counted from two threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.commands: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.told: dict[int, Any] = {}  # seq -> TP group (ALL), from replies
        self.incomplete = 0  # commands answered with ranks pending/lost/missing
        self.outages: list[list[float]] = []  # [start, end or inf]
        self.lost_requests: list[str] = []
        self.lost_state: list[str] = []
        self.events: Counter[str] = Counter()

    def outage(self) -> list[float]:
        with self.lock:
            span = [time.monotonic(), float("inf")]
            self.outages.append(span)
            return span

    def during_outage(self, start: float, end: float) -> bool:
        with self.lock:
            return any(s <= end and start <= e + RECONNECT_GRACE for s, e in self.outages)

    def max_told(self) -> int:
        with self.lock:
            return max(self.told, default=0)


class Cluster:
    """The coordinator and the torchrun workers, their restarts, and their cleanup."""

    def __init__(self, tmp: Path, workers: int, tp_size: int, max_restarts: int) -> None:
        self.tmp, self.workers, self.tp_size = tmp, workers, tp_size
        self.records = tmp / "records"
        self.records.mkdir()
        section = {**coordinator_section(tmp), "world_size": workers, "tp_size": tp_size,
                   "heartbeat_interval": HEARTBEAT_INTERVAL, "heartbeat_timeout": HEARTBEAT_TIMEOUT,
                   "command_timeout": 5.0}
        self.config = write_config(tmp / "wsd.toml", {
            "coordinator": section,
            "worker": {"backend": "gloo", "tp_size": tp_size, "collective_timeout": 60.0},
            "workload": {"hidden_size": 32, "ffn_size": 64, "layers": 1, "max_tokens": 16,
                         "warmup_steps": 4, "pace": 0.02},
        })
        self.section = section
        self.started: list[Proc] = []
        self.coordinator = self._start_coordinator(self.config)
        self.agents, self.clients = self.coordinator.wait_for(COORDINATOR_READY, 30).groups()
        # A restart binds the very endpoints the agents and clients know.
        self.restart_config = write_config(tmp / "restart.toml", {"coordinator": {
            **section, "agent_endpoint": self.agents, "client_endpoint": self.clients}})
        # Each restart round gets a store of its own: with the launcher's shared store, a
        # restarted rank can read a peer address left by the previous round and fail to connect.
        env = worker_env(WSD_COORDINATOR_MODE="external", WSD_COORDINATOR_CONNECT_ENDPOINT=self.agents,
                         TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                         **{RECORD_ENV: str(self.records)})
        self.torchrun = self._start(python(
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "-m", "bench.soak_worker", "--config", self.config), env=env, cwd=str(ROOT), name="torchrun")

    def _start(self, args: list[str], **kwargs: Any) -> Proc:
        proc = Proc(args, **kwargs)
        self.started.append(proc)
        return proc

    def _start_coordinator(self, config: str) -> Proc:
        return self._start(python("-m", "wsd.programs.cli", "coordinator", "--config", config),
                           cwd=str(ROOT), name="wsd coordinator")

    def worker_pids(self) -> list[int]:
        """The worker processes under torchrun now (not torchrun's own helpers)."""
        return sorted(pid for pid in self.torchrun.tree() if "bench.soak_worker" in cmdline(pid)
                      and pid != self.torchrun.pid)

    def restart_coordinator(self) -> None:
        self.coordinator = self._start_coordinator(self.restart_config)
        try:
            self.coordinator.wait_for(COORDINATOR_READY, 30)
        except pytest.fail.Exception as e:
            raise SoakError(f"the coordinator did not restart on its endpoints: {e}") from None

    def close(self) -> list[int]:
        """Stop everything (workers first, then torchrun, then the coordinator); the pids left."""
        for pid in self.worker_pids():
            _signal(pid, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
            _signal(pid, signal.SIGTERM)
        self.coordinator.send(signal.SIGCONT)
        deadline = time.monotonic() + 15
        while self.torchrun.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        seen: set[int] = set()
        for proc in self.started:
            seen |= proc.tree() | proc.seen
            proc.kill_all()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        return sorted(p for p in seen if alive(p))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_whole(client: Client, cluster: Cluster, timeout: float) -> bool:
    """True once the coordinator answers and every rank is live (False after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.torchrun.popen.poll() is not None:
            raise SoakError(f"torchrun ended (exit code {cluster.torchrun.popen.returncode}); "
                            f"its output ends:\n" + "\n".join(cluster.torchrun.lines[-30:]))
        try:
            if client.status()["ranks"]["live"] == cluster.workers:
                return True
        except ClientError:
            pass
        time.sleep(0.1)
    return False


class Faults(threading.Thread):
    """Injects one random fault at a time, each once the cluster is whole again."""

    def __init__(self, cluster: Cluster, ledger: Ledger, rng: random.Random, kinds: Sequence[str],
                 max_faults: int, gap: float, deadline: float) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.cluster, self.ledger, self.rng = cluster, ledger, rng
        self.kinds, self.max_faults, self.gap, self.deadline = list(kinds), max_faults, gap, deadline
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Client(self.cluster.clients, timeout=CLIENT_TIMEOUT, retries=0) as client:
                while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.gap):
                    if sum(self.ledger.faults.values()) >= self.max_faults or time.monotonic() > self.deadline:
                        return
                    if not wait_whole(client, self.cluster, STARTUP_TIMEOUT):
                        raise SoakError(f"the cluster was not whole again within {STARTUP_TIMEOUT} s")
                    kind = self.rng.choice(self.kinds)
                    if getattr(self, kind)() is False:
                        continue  # nothing to signal just now (a group between restarts)
                    with self.ledger.lock:
                        self.ledger.faults[kind] += 1
        except (SoakError, ClientError, OSError, pytest.fail.Exception) as e:  # the main thread reports it
            self.error = e

    def kill_worker(self) -> bool:
        pids = self.cluster.worker_pids()
        if not pids:
            return False
        pid = self.rng.choice(pids)
        _signal(pid, signal.SIGKILL)  # torchrun restarts the group: fresh processes register
        return True

    def stop_worker(self) -> bool:
        pids = self.cluster.worker_pids()
        if not pids:
            return False
        pid = self.rng.choice(pids)
        _signal(pid, signal.SIGSTOP)
        try:
            self.stop.wait(self.rng.uniform(*PAUSE))
        finally:
            _signal(pid, signal.SIGCONT)
        return True

    def kill_coordinator(self) -> None:
        told = self.ledger.max_told()
        span = self.ledger.outage()
        self.cluster.coordinator.send(signal.SIGKILL)
        self.cluster.coordinator.wait(10)
        try:
            self.cluster.restart_coordinator()
        finally:
            span[1] = time.monotonic()
        with Client(self.cluster.clients, timeout=CLIENT_TIMEOUT) as client:
            status = one_engine(client.status())
        if status["seq"] < told:
            with self.ledger.lock:
                self.ledger.lost_state.append(f"restarted coordinator at seq {status['seq']}, "
                                              f"but seq {told} had been answered before the kill")

    def stop_coordinator(self) -> None:
        span = self.ledger.outage()
        self.cluster.coordinator.send(signal.SIGSTOP)
        try:
            self.stop.wait(self.rng.uniform(*PAUSE))
        finally:
            self.cluster.coordinator.send(signal.SIGCONT)
            span[1] = time.monotonic()


_ARGUMENTS: dict[str, Callable[[random.Random], dict[str, int]]] = {
    "set_ubatches": lambda rng: {"n": rng.randint(1, 3)},
    "reserve": lambda rng: {"bytes": rng.randint(1, 64) << 10},
}


class Traffic:
    """Commands and queries at random (every command of the table), each counted by outcome."""

    def __init__(self, client: Client, ledger: Ledger, rng: random.Random, groups: int) -> None:
        self.client, self.ledger, self.rng, self.groups = client, ledger, rng, groups
        self.locked = True  # the workload locks after warm-up; replies keep this belief current
        self.cursor, self.epoch = 0, None

    def one(self) -> None:
        op = self.rng.choice((*COMMANDS, "stats", "status", "ranks", "events", "status", "stats"))
        if op in COMMANDS and COMMANDS[op].refused_while_locked and self.locked:
            op = "unlock"
        started = time.monotonic()
        key = op
        try:
            result = self._call(op)
            key = "answered"
        except Unavailable:
            key = "unavailable"
        except ClientError as e:
            key = "refused" if e.code in (ErrorCode.CONFLICT,) else "error"
            with self.ledger.lock:
                self.ledger.refused[f"{op}: {e.code}"] += 1
        ended = time.monotonic()
        with self.ledger.lock:
            self.ledger.requests[op] += 1
        if key == "unavailable":
            if self.ledger.during_outage(started, ended):
                key = "expected_unavailable"
            else:
                with self.ledger.lock:
                    self.ledger.lost_requests.append(
                        f"{op} unanswered (sent at monotonic {started:.1f} s) with the coordinator up")
        with self.ledger.lock:
            self.ledger.outcomes[key] += 1
        if key == "answered" and op in COMMAND_OPS:
            self._note(op, result)

    def _call(self, op: str) -> Any:
        c, rng = self.client, self.rng
        if op == "stats":
            return c.stats(timeout=CLIENT_TIMEOUT)
        if op in ("status", "ranks"):
            return getattr(c, op)()
        if op == "events":
            answer = c.events(self.cursor, 200)
            if answer["epoch"] != self.epoch:  # a restarted coordinator numbers events afresh
                self.epoch, self.cursor = answer["epoch"], 0
                answer = c.events(0, 200)
            self.cursor = answer["cursor"]
            with self.ledger.lock:
                self.ledger.events.update(e["kind"] for e in answer["events"])
            return answer
        group = rng.choice([None, None, *range(self.groups)])
        kw = {"group": group, "wait": rng.random() < 0.7, "timeout": CLIENT_TIMEOUT}
        with self.ledger.lock:
            self.ledger.commands[op] += 1
        # Arguments in the ranges a soak wants (a few slots, small reservations); a
        # command the table grows takes its arguments' lowest values.
        chosen = _ARGUMENTS.get(op, lambda rng: {a.name: a.low for a in COMMANDS[op].args})(rng)
        return c.command(op, **kw, **chosen)

    def _note(self, op: str, result: Any) -> None:
        if op in ("lock", "unlock") and result.group is None:
            self.locked = op == "lock"
        elif op == "lock":
            self.locked = True
        with self.ledger.lock:
            self.ledger.told[result.seq] = ALL if result.group is None else result.group
            if result.waited and not result.complete:
                self.ledger.incomplete += 1


COMMAND_OPS = ("lock", "unlock", "set_ubatches", "reserve", "trim", "equalize")


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    ledger = Ledger()
    groups = args.workers // args.tp_size
    with tempfile.TemporaryDirectory(prefix="wsd-soak-") as tmp:
        cluster = Cluster(Path(tmp), args.workers, args.tp_size, args.max_faults + 2)
        faults: Faults | None = None
        left: list[int] = []
        try:
            with Client(cluster.clients, timeout=CLIENT_TIMEOUT, retries=1) as client:
                if not wait_whole(client, cluster, STARTUP_TIMEOUT):
                    raise SoakError(f"the {args.workers} workers did not all register within {STARTUP_TIMEOUT} s")
                begun = time.monotonic()
                deadline = begun + args.seconds
                faults = Faults(cluster, ledger, rng, args.faults, args.max_faults, args.fault_gap, deadline)
                faults.start()
                traffic = Traffic(client, ledger, random.Random(rng.random()), groups)
                issued = 0
                while time.monotonic() < deadline and issued < args.max_requests and faults.error is None:
                    traffic.one()
                    issued += 1
                    time.sleep(args.request_gap)
                faults.stop.set()
                faults.join(30 + PAUSE[1])
                if faults.error is not None:
                    raise SoakError(f"fault injection failed: {faults.error!r}") from faults.error
                # Settle: the cluster whole again, then one last command every rank must apply.
                if not wait_whole(client, cluster, STARTUP_TIMEOUT):
                    raise SoakError(f"the cluster was not whole again within {STARTUP_TIMEOUT} s of the end")
                last = one_engine(client.lock(timeout=10))
                ledger.told[last.seq] = ALL
                final_seq = one_engine(client.status())["seq"]
                soaked = time.monotonic() - begun
                pids = set(cluster.worker_pids())
                verdict = _await_records(cluster, final_seq, ledger, pids, groups)
                coordinator_view = _await_heartbeats(client, final_seq)
                off_desired = _await_desired(client)
        finally:
            if faults is not None:
                faults.stop.set()
                faults.join(PAUSE[1] + 35)
            left = cluster.close()
            if args.verbose:
                for proc in cluster.started:
                    tail = "\n".join(proc.lines[-args.verbose_lines:])
                    print(f"--- {proc.name} (pid {proc.pid}) output ends:\n{tail}")
    behind = [r for r, seq in coordinator_view.items() if seq != final_seq]
    lost = (len(verdict.lost) + len(ledger.lost_requests) + len(ledger.lost_state) + len(behind))
    print(f"wsd soak: {soaked:.0f} s, {args.workers} torchrun workers (TP size {args.tp_size}, "
          f"{groups} groups), seed {args.seed}")
    print(f"  faults injected:    {sum(ledger.faults.values())} ("
          + ", ".join(f"{k} {ledger.faults[k]}" for k in FAULTS) + ")")
    print(f"  worker processes:   {verdict.processes} (restarts included)")
    print(f"  commands issued:    {sum(ledger.commands.values())} ("
          + ", ".join(f"{k} {v}" for k, v in sorted(ledger.commands.items())) + f"); final seq {final_seq}")
    print(f"  applied exactly once on every live rank: {verdict.commands_verified} of {final_seq} seqs "
          f"({verdict.applications} applications checked, {verdict.refused_by_manager} refused by the manager, "
          f"{verdict.unknown_target} with no known target)")
    print(f"  answered with ranks pending, lost or missing: {ledger.incomplete}")
    total = sum(ledger.requests.values())
    print(f"  requests issued:    {total}; answered {ledger.outcomes['answered']}, refused "
          f"{ledger.outcomes['refused']} (" + ", ".join(f"{k} {v}" for k, v in sorted(ledger.refused.items()))
          + f"), errors {ledger.outcomes['error']}, expected-unavailable (coordinator down) "
          f"{ledger.outcomes['expected_unavailable']}")
    print("  events seen:        " + ", ".join(f"{k} {v}" for k, v in sorted(ledger.events.items())))
    print(f"  coordinator's view: {len(coordinator_view)} live ranks, all at seq {final_seq}"
          if not behind else f"  coordinator's view: ranks {behind} behind seq {final_seq}")
    print(f"  every live rank in its group's desired state: {'yes' if not off_desired else 'NO'}")
    for problem in (off_desired + verdict.lost + ledger.lost_requests + ledger.lost_state + verdict.duplicates
                    + verdict.disagreements)[:20]:
        print(f"  PROBLEM: {problem}")
    print(f"  lost: {lost}   applied twice: {len(verdict.duplicates)}   "
          f"disagreements: {len(verdict.disagreements)}   processes left behind: {len(left)}")
    bad = lost or off_desired or verdict.duplicates or verdict.disagreements or left or ledger.outcomes["error"]
    return 1 if bad else 0


def _await_records(cluster: Cluster, final_seq: int, ledger: Ledger, pids: set[int], groups: int) -> Any:
    """The verdict once every live worker recorded the last seq (or after a bounded wait)."""
    deadline = time.monotonic() + 20
    while True:
        verdict = verify(read_records(str(cluster.records)), final_seq, dict(ledger.told), pids, groups)
        if verdict.ok or time.monotonic() > deadline:
            return verdict
        time.sleep(0.2)


def _await_heartbeats(client: Client, final_seq: int) -> dict[int, int]:
    """Each live rank's applied seq as the coordinator knows it (from heartbeats), once all
    reach ``final_seq`` or after a bounded wait."""
    deadline = time.monotonic() + 10 * HEARTBEAT_INTERVAL + 5
    while True:
        view = {r["rank"]: r["applied_seq"] for r in one_engine(client.ranks())["ranks"] if r["state"] == "live"}
        if all(seq == final_seq for seq in view.values()) or time.monotonic() > deadline:
            return view
        time.sleep(HEARTBEAT_INTERVAL / 2)


def _await_desired(client: Client) -> list[str]:
    """Live ranks not in their group's desired state (``status`` desired against
    ``ranks`` from heartbeats), once there are none or after a bounded wait."""
    deadline = time.monotonic() + 10 * HEARTBEAT_INTERVAL + 5
    while True:
        problems = desired_mismatches(one_engine(client.status()), one_engine(client.ranks())["ranks"])
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(HEARTBEAT_INTERVAL / 2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about 60 s: --seconds 45 --max-faults 12")
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to issue traffic (default 300)")
    parser.add_argument("--max-faults", type=int, default=50, help="faults to inject at most (default 50)")
    parser.add_argument("--max-requests", type=int, default=100_000, help="requests to issue at most")
    parser.add_argument("--fault-gap", type=float, default=3.0, help="mean seconds between faults (default 3)")
    parser.add_argument("--request-gap", type=float, default=0.01, help="seconds between requests")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"kinds to inject (default {','.join(FAULTS)})")
    parser.add_argument("--workers", type=int, default=4, help="torchrun workers (default 4)")
    parser.add_argument("--tp-size", type=int, default=2, help="ranks per TP group (default 2)")
    parser.add_argument("--verbose", action="store_true", help="print the processes' output at the end")
    parser.add_argument("--verbose-lines", type=int, default=40, help="lines of each process's output")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.max_faults = 45.0, 12
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in args.faults if k not in FAULTS]
    if unknown or not args.faults:
        parser.error(f"--faults: unknown kind(s) {unknown}; choose from {','.join(FAULTS)}")
    if args.seconds <= 0 or args.max_faults < 0 or args.max_requests < 1 or args.fault_gap <= 0:
        parser.error("--seconds and --fault-gap must be positive, --max-faults at least 0, "
                     "--max-requests at least 1")
    if args.workers < 1 or args.tp_size < 1 or args.workers % args.tp_size:
        parser.error(f"--workers ({args.workers}) must be a positive multiple of --tp-size ({args.tp_size})")
    if args.seed is None:
        args.seed = random.randrange(1 << 32)
    try:
        return run(args)
    except SoakError as e:
        print(f"wsd soak: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
