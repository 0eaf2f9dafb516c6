"""What recording one command costs, by the number of commands the log keeps.

The coordinator records every command durably before sending it; this times
``CommandLog.append`` (median of interleaved calls) with the log already
holding 50, 1,000 and 4,096 commands, on tmpfs (the syncs cost almost
nothing: what is left is the log's own work) and on the temp folder's disk.
An append is two writes and two fdatasyncs: the record, then the journal
header that counts it (docs/state-file.md), so on disk it costs about two
syncs of that disk, however many commands are kept.

Run: ``python -m bench.bench_statefile [--appends N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.helpers import Row
from wsd.coordinator.commandlog import CommandLog

KEPT = (50, 1000, 4096)


def append_cost(directory: str, kept: int, appends: int) -> float:
    """Median microseconds of one append once ``kept`` commands are in the log."""
    with tempfile.TemporaryDirectory(prefix="wsd-bench-", dir=directory) as d:
        log = CommandLog(str(Path(d) / "cost.state"), kept)
        for i in range(kept):
            log.append("set_ubatches", {"n": 1 + i % 8}, None, 0.0)
        times = []
        for i in range(appends):
            t0 = time.perf_counter()
            log.append("lock" if i % 2 else "unlock", {}, None, 0.0)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


GROWTH_TARGET = 1.5


def run(appends: int = 200) -> list[Row]:
    """Measure, print the table and return, per folder, the cost with the fullest log
    over the cost with the emptiest (1.0: an append costs the same however much is kept)."""
    dirs = [d for d in ("/dev/shm", tempfile.gettempdir()) if Path(d).is_dir()]
    print(f"CommandLog.append, median of {appends} (us)")
    print(f"{'kept':>6} " + " ".join(f"{d:>12}" for d in dirs))
    costs: dict[int, list[float]] = {}
    for kept in KEPT:
        costs[kept] = [append_cost(d, kept, appends) for d in dirs]
        print(f"{kept:>6} " + " ".join(f"{us:>12.0f}" for us in costs[kept]), flush=True)
    few, many = min(KEPT), max(KEPT)
    rows = [Row(f"state file append [{many} kept]/[{few} kept] {d}", costs[many][i] / costs[few][i],
                f"the same append with {few} kept", GROWTH_TARGET)
            for i, d in enumerate(dirs)]
    for row in rows:
        print(f"{row.name}: {row.value:.2f} (target <= {GROWTH_TARGET})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--appends", type=int, default=200, help="appends timed per figure")
    args = parser.parse_args(argv)
    if args.appends < 1:
        parser.error(f"--appends must be at least 1, got {args.appends}")
    return run(args.appends)


if __name__ == "__main__":
    main()
