"""The coordinator from 32 to 4,096 ranks: what each figure costs as ranks grow.

A real coordinator (``wsd.coordinator.loop.Coordinator`` in a spawned process of its
own, default heartbeats: 1 s interval, 5 s timeout, its metrics endpoint on) and
simulated ranks (``wsd.agent.simulated``, 8 slots each, TP groups of 8) in two
further processes, at 32, 128, 256, 512, 1,024 and 4,096 ranks. Up to 1,024
ranks they are busy (every slot serves requests, so every rank pushes a changed
snapshot every second); at 4,096 they are steady (each confirms its snapshot
with its heartbeat), unless ``--busy-all``. At each size:

* every rank registers and pushes;
* a soak window of pushes and heartbeats (at the largest size at least 60 s,
  ``--quick`` a few seconds): the coordinator's CPU time per second over the
  window (its threads' run time; utime plus stime from /proc/<pid>/stat beside
  it, coarser); the longest silence the coordinator then sees, next to the 5 s
  timeout;
* false losses: events marking a rank lost, back, or registered again while
  live, over the soak and the rounds after it (``lost``; those while the ranks
  register and the paths warm up are counted apart, ``start-up``);
* ``stats`` over all ranks, complete, answered from the pushed snapshots: p50
  and p99 of the round trip, and the oldest rank's age seen in any answer
  (freshness: at most the 1 s interval plus 100 ms);
* a Prometheus scrape of the metrics endpoint (HTTP GET, the whole text), median
  of 5, each of a view published after the one before (a scraper every 15 s
  always finds a new one, which the endpoint writes; scrapes of one view share
  its text, which would make back-to-back scrapes look cheaper than any is);
* ``lock``/``unlock`` in turn, applied and acknowledged by all, median;
* the coordinator's resident memory (VmRSS) and the simulation's lateness (how
  late its one loop sent a heartbeat at worst: near the timeout, a loss would
  be the simulation's fault, not the coordinator's).

The baseline of each growth figure is linear extrapolation from 32 ranks: the
ratio is (cost at 1,024 / 1,024) / (cost at 32 / 32). Targets at 1,024:
stats p50 at most 10 ms and p99 30 ms, a scrape at most 50 ms, CPU at most 10%
of one core; at 4,096: stats p50 at most 40 ms and no false loss over the
soak; at every size the oldest age at most interval + 100 ms.

Run: ``python -m bench.bench_scale [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import zmq

from bench.helpers import Helper, Row, one_engine, run_coordinator, timed_us
from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.config import CoordinatorConfig
from wsd_client.client import Client

SIZES = (32, 128, 256, 512, 1024, 4096)
BUSY_UP_TO = 1024  # ranks pushing a changed snapshot every interval up to this size
SLOTS = 8
TP_SIZE = 8
SIM_PROCESSES = 2
HEARTBEAT_TIMEOUT = 5.0  # the default, spelled out for the report
INTERVAL = 1.0  # the default heartbeat and stats interval
TARGETS_1024 = {"stats p50": 10.0, "stats p99": 30.0, "scrape": 50.0, "cpu": 10.0}
STATS_P50_4096_MS = 40.0
FRESHNESS_S = INTERVAL + 0.1
_REGISTER_TIMEOUT = 120.0
_CLIENT_TIMEOUT = 30.0
_METRICS_REFRESH = CoordinatorConfig().metrics_refresh  # seconds between two published views
_TICK = os.sysconf("SC_CLK_TCK")


def _run_ranks(conn: Any, endpoint: str, first: int, count: int, world: int, busy: bool) -> None:
    """Simulated ranks first..first+count-1 until told to stop; answers each request with its state."""
    with SimulatedRanks(endpoint, range(first, first + count), world_size=world, tp_size=TP_SIZE,
                        num_ubatches=SLOTS, busy=busy) as sim:
        conn.send(sim.wait_registered(_REGISTER_TIMEOUT))
        while conn.recv() is not None:
            conn.send({"max_lag": sim.max_lag, "registered": sim.registered()})


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time a process has used so far, twice: in ticks and in nanoseconds.

    First user plus system time from /proc/<pid>/stat (counted in clock ticks,
    10 ms here: at 32 idle ranks a few seconds' window holds one or two), then
    the sum of its threads' run time from /proc/<pid>/task/*/schedstat
    (nanoseconds), the figure the growth ratios use.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15
    ns = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ns += int(f.read().split()[0])
        except OSError:
            pass  # a thread that ended between listing and reading
    return ticks, ns / 1e9


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise SystemExit(f"no VmRSS for pid {pid}")


HICCUPS = ("lost", "back", "superseded")


def hiccups(client: Client, cursor: int) -> tuple[list[dict[str, Any]], int]:
    """Events after ``cursor`` that mark a rank lost, back, or registered again while
    live (every page), and the cursor to ask with next."""
    found: list[dict[str, Any]] = []
    while True:
        page = client.events(cursor, limit=5000)
        if not page["events"]:
            return found, cursor
        found += [e for e in page["events"] if e["kind"] in HICCUPS]
        cursor = page["cursor"]


@dataclass(frozen=True)
class SizeResult:
    n: int
    busy: bool
    register_s: float
    soak_s: float
    cpu: float  # CPU seconds per second while every rank pushes (threads' run time)
    cpu_ticks: float  # the same from utime + stime
    stats_ms: float
    stats_p99_ms: float
    scrape_ms: float
    scrape_kib: float
    oldest_age_s: float  # the oldest rank's age in any stats answer
    command_ms: float
    rss_mib: float
    startup_hiccups: int  # lost, back or superseded events while registering and warming up
    lost: int  # the same over the soak and the rounds after it: false losses
    detail: str  # the first few of those events, for the report
    max_silence_s: float
    sim_lag_s: float


def measure(n: int, *, soak: float, rounds: int, state_dir: str, busy: bool) -> SizeResult:
    """One coordinator and ``n`` simulated ranks: every figure of one row, checked."""
    coordinator = Helper(run_coordinator, str(Path(state_dir) / f"scale-{n}.state"),
                         {"world_size": n, "tp_size": TP_SIZE, "metrics_port": 0})
    helpers = [coordinator]
    context = zmq.Context()
    try:
        agent_endpoint, client_endpoint, metrics_url = coordinator.result()
        pid = coordinator.process.pid
        assert pid is not None  # started by Helper
        start = time.monotonic()
        share = -(-n // SIM_PROCESSES)
        sims = [Helper(_run_ranks, agent_endpoint, first, min(share, n - first), n, busy)
                for first in range(0, n, share)]
        helpers += sims
        if not all(sim.result(_REGISTER_TIMEOUT + 30) for sim in sims):
            raise SystemExit(f"not all {n} simulated ranks registered within {_REGISTER_TIMEOUT} s")
        register_s = time.monotonic() - start
        client = Client(client_endpoint, timeout=_CLIENT_TIMEOUT, context=context)

        ages: list[float] = []

        def stats() -> None:
            answer = one_engine(client.stats())
            if not answer["complete"] or len(answer.reporting) != n:
                raise SystemExit(f"stats at {n} ranks: {len(answer.reporting)} answered, "
                                 f"missing {answer['missing'][:5]}, stale {answer['stale'][:5]}...")
            ages.append(max(answer.ages().values()))

        scraped: list[int] = []

        def scrape() -> None:
            with urllib.request.urlopen(metrics_url, timeout=_CLIENT_TIMEOUT) as response:
                scraped.append(len(response.read()))

        deadline = time.monotonic() + _REGISTER_TIMEOUT
        while not client.stats()["complete"]:  # every rank's first push in
            if time.monotonic() > deadline:
                raise SystemExit(f"not all {n} ranks pushed a snapshot within {_REGISTER_TIMEOUT} s")
            time.sleep(0.1)

        actions = [client.lock, client.unlock]

        def command(i: int) -> None:
            result = one_engine(actions[i % 2]())
            if not result.complete or len(result.acked) != n:
                raise SystemExit(f"{result.action} at {n} ranks: acknowledged by {len(result.acked)}, "
                                 f"pending {result.pending[:5]}, lost {result.lost[:5]}")

        # Every path warm.
        stats()
        command(0)
        command(1)
        scrape()
        startup, cursor = hiccups(client, 0)
        # Idle: heartbeats both ways and nothing else. Waiting out the window is
        # the measurement itself, not a wait for a condition.
        (ticks0, cpu0), t0, soak_wall = cpu_seconds(pid), time.monotonic(), time.time()
        time.sleep(soak)
        (ticks1, cpu1), t1 = cpu_seconds(pid), time.monotonic()
        now = time.time()
        max_silence = max(now - r["last_seen"] for r in one_engine(client.ranks())["ranks"])
        status = one_engine(client.status())["ranks"]
        if status["live"] != n:
            raise SystemExit(f"after the soak at {n} ranks: {status}")
        ages.clear()
        stats_us = [timed_us(stats) for _ in range(rounds)]
        scrape_us = []
        for _ in range(5):
            # Pacing, not a wait for a condition: past the next publication, so that
            # each scrape writes its text as a scraper's would.
            time.sleep(_METRICS_REFRESH + 0.1)
            scrape_us.append(timed_us(scrape))
        command_us = [timed_us(partial(command, i)) for i in range(rounds)]
        lost, _ = hiccups(client, cursor)
        client.close()
        lags = [sim.ask("state") for sim in sims]
        return SizeResult(
            n=n, busy=busy, register_s=register_s, soak_s=t1 - t0, cpu=(cpu1 - cpu0) / (t1 - t0),
            cpu_ticks=(ticks1 - ticks0) / (t1 - t0),
            stats_ms=statistics.median(stats_us) / 1e3, command_ms=statistics.median(command_us) / 1e3,
            stats_p99_ms=statistics.quantiles(stats_us, n=100)[98] / 1e3,
            scrape_ms=statistics.median(scrape_us) / 1e3, scrape_kib=scraped[-1] / 1024,
            oldest_age_s=max(ages),
            rss_mib=rss_mib(pid), startup_hiccups=len(startup), lost=len(lost),
            detail="; ".join(f"{e['kind']} rank {e.get('rank')} at {e['time'] - soak_wall:+.1f} s"
                             for e in (startup + lost)[:6]),
            max_silence_s=max_silence, sim_lag_s=max(s["max_lag"] for s in lags),
        )
    finally:
        for helper in reversed(helpers):
            helper.stop()
        context.term()


def _growth(results: dict[int, SizeResult], attr: str) -> float:
    """Per-rank cost at the largest size over per-rank cost at the smallest."""
    small, large = results[min(results)], results[max(results)]
    return (getattr(large, attr) / large.n) / (getattr(small, attr) / small.n)


def run(quick: bool = False, sizes: Sequence[int] = SIZES, state_dir: str | None = None, *,
        busy_all: bool = False) -> list[Row]:
    """Measure every size, print the table and return the rows for ``python -m bench``."""
    rounds = 50 if quick else 200
    state_dir = state_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    load = os.getloadavg()[0]
    print(f"coordinator at N simulated ranks ({SLOTS} slots, TP {TP_SIZE}; N* busy: each pushing a changed "
          f"snapshot every {INTERVAL:g} s; heartbeat timeout {HEARTBEAT_TIMEOUT:.0f} s), {SIM_PROCESSES} "
          f"simulation processes, {rounds} stats rounds; load average {load:.2f} on {os.cpu_count()} cores")
    print(f"{'N':>5} {'register':>9} {'stats p50':>9} {'p99':>8} {'oldest':>6} {'scrape':>8} {'text':>8} "
          f"{'command':>9} {'CPU':>7} {'(ticks)':>7} {'RSS':>8} {'soak':>5} {'lost':>4} {'silence':>7} "
          f"{'sim lag':>7} {'start-up':>8}")
    results: dict[int, SizeResult] = {}
    with tempfile.TemporaryDirectory(prefix="wsd-bench-", dir=state_dir) as d:
        for n in sizes:
            soak = (6.0 if n == max(sizes) else 4.0) if quick else (65.0 if n == max(sizes) else 15.0)
            r = results[n] = measure(n, soak=soak, rounds=rounds, state_dir=d, busy=busy_all or n <= BUSY_UP_TO)
            print(f"{n:>5}{'*' if r.busy else ' '}{r.register_s:>7.1f}s {r.stats_ms:>7.2f}ms {r.stats_p99_ms:>6.2f}ms "
                  f"{r.oldest_age_s:>5.2f}s {r.scrape_ms:>6.1f}ms {r.scrape_kib:>5.0f}KiB {r.command_ms:>7.1f}ms "
                  f"{r.cpu:>7.2%} {r.cpu_ticks:>7.1%} {r.rss_mib:>5.0f}MiB {r.soak_s:>4.0f}s {r.lost:>4} "
                  f"{r.max_silence_s:>6.2f}s {r.sim_lag_s:>6.3f}s {r.startup_hiccups:>8}", flush=True)
            if r.detail:
                print(f"      hiccups (time from the soak's start): {r.detail}", flush=True)
    small, large = results[min(results)], results[max(results)]
    print(f"\ngrowth against rank count (per-rank cost at {large.n} / per-rank cost at {small.n}; "
          "1.0 is linear, below 1 sublinear)")
    rows: list[Row] = []
    baseline = f"linear from {small.n} ranks"
    for attr, what in (("stats_ms", "stats round trip"), ("cpu", "CPU while pushing"),
                       ("scrape_ms", "scrape"), ("command_ms", "command round trip"),
                       ("rss_mib", "resident memory")):
        ratio = _growth(results, attr)
        print(f"  {what:<20} {ratio:>6.2f}   ({getattr(small, attr):.3g} at {small.n}, "
              f"{getattr(large, attr):.3g} at {large.n})")
        rows.append(Row(f"scale {what} per rank [{large.n}]/[{small.n}]", ratio, baseline))
    at_1024 = results.get(1024)
    if at_1024 is not None:
        rows += [
            Row("scale stats p50 [1024]", at_1024.stats_ms, "absolute", TARGETS_1024["stats p50"], " ms"),
            Row("scale stats p99 [1024]", at_1024.stats_p99_ms, "absolute", TARGETS_1024["stats p99"], " ms"),
            Row("scale scrape [1024]", at_1024.scrape_ms, "absolute", TARGETS_1024["scrape"], " ms"),
            Row("scale CPU while pushing [1024]", at_1024.cpu * 100, "absolute, % of one core",
                TARGETS_1024["cpu"], " %"),
        ]
    at_4096 = results.get(4096)
    if at_4096 is not None:
        rows.append(Row(f"scale stats p50 [4096{', busy' if at_4096.busy else ''}]", at_4096.stats_ms,
                        "absolute", STATS_P50_4096_MS, " ms"))
    rows += [
        Row(f"scale false losses [{large.n}], {large.soak_s:.0f} s", large.lost, "absolute", 0, ""),
        Row("scale oldest age, any size", max(r.oldest_age_s for r in results.values()), "absolute",
            FRESHNESS_S, " s"),
    ]
    print()
    for row in rows:
        if row.target is not None:
            print(f"target: {row.name} <= {row.target:g}: {row.value:.2f} ({'met' if row.met else 'NOT met'})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short soak windows and fewer rounds")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                        help=f"rank counts to measure (default: {' '.join(map(str, SIZES))})")
    parser.add_argument("--busy-all", action="store_true",
                        help=f"every size busy (by default only up to {BUSY_UP_TO} ranks)")
    args = parser.parse_args(argv)
    if any(n < TP_SIZE or n % TP_SIZE for n in args.sizes):
        parser.error(f"--sizes: each must be a positive multiple of the TP size {TP_SIZE}, got {args.sizes}")
    return run(args.quick, sorted(set(args.sizes)), busy_all=args.busy_all)


if __name__ == "__main__":
    main()
