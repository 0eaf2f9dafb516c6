"""Benchmark of ``stacks``: every thread's stack of a TP group of 8, against a fresh stats round.

A coordinator and 8 simulated ranks of one TP group (``wsd.agent.simulated``), each in
a process of its own; the simulated ranks answer a stacks request as a worker's
agent does, reading every thread of their process (``wsd.agent.stacks``), all 8 on
one thread: the worst case of one process answering for the whole group. The
client asks ``stacks --group 0`` and, interleaved with it, ``stats --fresh --group
0`` (which also asks every rank now and waits for the slowest): the issue's target
is an answer within 2 s for a TP group of 8; the ratio says what reading stacks
costs beyond a round trip to every rank.

Run: ``python -m bench.bench_stacks [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.helpers import START_TIMEOUT, Helper, Row, one_engine, run_coordinator
from wsd.agent.simulated import SimulatedRanks
from wsd_client.client import Client

RANKS = 8
TARGET_SECONDS = 2.0


def _run_group(conn: Any, endpoint: str) -> None:
    with SimulatedRanks(endpoint, range(RANKS), world_size=RANKS, tp_size=RANKS, num_ubatches=8) as sim:
        conn.send(sim.wait_registered(START_TIMEOUT))
        conn.recv()


def _seconds(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run(quick: bool) -> list[Row]:
    rounds = 10 if quick else 50
    with tempfile.TemporaryDirectory() as state_dir:
        coordinator = Helper(run_coordinator, str(Path(state_dir) / "bench-stacks.state"))
        group = None
        try:
            agents, client_endpoint = coordinator.result()
            group = Helper(_run_group, agents)
            if not group.result():
                raise SystemExit("the simulated ranks did not register")
            times: dict[str, list[float]] = {"stacks": [], "stats --fresh": []}
            threads = frames = 0
            with Client(client_endpoint, timeout=30) as client:
                for _ in range(rounds):
                    answer = one_engine(client.stacks(group=0))
                    assert len(answer.ranks) == RANKS and not answer.missing, answer
                    threads = sum(len(r["threads"]) for r in answer.ranks)
                    frames = sum(len(t["frames"]) for r in answer.ranks for t in r["threads"])
                    times["stacks"].append(_seconds(lambda: client.stacks(group=0)))
                    times["stats --fresh"].append(_seconds(lambda: client.stats(0, fresh=True)))
        finally:
            if group is not None:
                group.stop()
            coordinator.stop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    worst = max(times["stacks"])
    print(f"TP group of {RANKS}: {threads} threads, {frames} frames in one answer ({rounds} rounds, interleaved)")
    for name, values in times.items():
        print(f"  {name:<14} median {medians[name] * 1e3:7.1f} ms   max {max(values) * 1e3:7.1f} ms")
    return [
        Row(f"stacks[{RANKS}] slowest", worst, "absolute", TARGET_SECONDS, unit=" s"),
        Row(f"stacks[{RANKS}] median", medians["stacks"] / medians["stats --fresh"], "stats --fresh"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    for row in run(args.quick):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
