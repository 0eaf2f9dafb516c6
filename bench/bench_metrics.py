"""What a Prometheus scrape costs at scale, per-slot series on and off.

A real coordinator (``wsd.coordinator.loop.Coordinator`` in a spawned process
of its own, its metrics endpoint on) and simulated ranks (``wsd.agent.simulated``,
8 slots each, TP groups of 8, steady) in two further processes, at 1,024 ranks
by default: once with ``[coordinator] metrics_slots = true`` (the default) and
once with ``false``. For each, once every rank's snapshot is in the figures
(``wsd_stats_absent_ranks 0``): the median over ``--scrapes`` HTTP GETs of
the whole text, plain and gzip-compressed as Prometheus asks for it (time from
the request to the last byte, on loopback), with the sizes and sample counts.

Run: ``python -m bench.bench_metrics [--ranks 1024] [--scrapes 20]``.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.helpers import Helper, run_coordinator
from wsd.agent.simulated import SimulatedRanks

SLOTS = 8
TP_SIZE = 8
SIM_PROCESSES = 2
_REGISTER_TIMEOUT = 120.0


@dataclass(frozen=True)
class Scrape:
    slots: bool
    samples: int
    plain_kib: float
    plain_ms: float
    gzip_kib: float
    gzip_ms: float


def _run_ranks(conn: Any, endpoint: str, first: int, count: int, world: int) -> None:
    """Simulated ranks first..first+count-1 until told to stop."""
    with SimulatedRanks(endpoint, range(first, first + count), world_size=world, tp_size=TP_SIZE,
                        num_ubatches=SLOTS) as sim:
        conn.send(sim.wait_registered(_REGISTER_TIMEOUT))
        conn.recv()


def _get(url: str, *, compressed: bool) -> tuple[bytes, float]:
    """The body of one scrape, as sent, and the milliseconds it took."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if compressed else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
    elapsed = (time.perf_counter() - started) * 1e3
    return body, elapsed


def _complete(url: str) -> bool:
    text = _get(url, compressed=False)[0].decode()
    return "\nwsd_stats_absent_ranks 0\n" in text


def measure(n: int, slots: bool, scrapes: int, state_dir: str) -> Scrape:
    coordinator = Helper(run_coordinator, str(Path(state_dir) / f"metrics-{n}-{slots}.state"),
                         {"world_size": n, "tp_size": TP_SIZE, "metrics_port": 0, "metrics_slots": slots})
    helpers = [coordinator]
    try:
        agent_endpoint, _, url = coordinator.result()
        share = -(-n // SIM_PROCESSES)
        sims = [Helper(_run_ranks, agent_endpoint, first, min(share, n - first), n) for first in range(0, n, share)]
        helpers += sims
        if not all(sim.result(_REGISTER_TIMEOUT + 30) for sim in sims):
            raise SystemExit(f"not all {n} simulated ranks registered within {_REGISTER_TIMEOUT} s")
        deadline = time.monotonic() + _REGISTER_TIMEOUT
        while not _complete(url):
            if time.monotonic() > deadline:
                raise SystemExit(f"not every rank's snapshot in the metrics within {_REGISTER_TIMEOUT} s")
            time.sleep(0.2)
        plain = [_get(url, compressed=False) for _ in range(scrapes)]
        packed = [_get(url, compressed=True) for _ in range(scrapes)]
        text = plain[-1][0]
        if gzip.decompress(packed[-1][0]).count(b"\n") != text.count(b"\n"):
            raise SystemExit("the gzip-compressed scrape is not the plain one")
        samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        return Scrape(slots, samples, len(text) / 1024, statistics.median(ms for _, ms in plain),
                      len(packed[-1][0]) / 1024, statistics.median(ms for _, ms in packed))
    finally:
        for helper in reversed(helpers):
            helper.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024, help="simulated ranks (default 1024)")
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes measured per setting (default 20)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as state_dir:
        results = [measure(args.ranks, slots, args.scrapes, state_dir) for slots in (True, False)]
    print(f"{args.ranks} ranks x {SLOTS} slots, median of {args.scrapes} scrapes")
    print(f"{'metrics_slots':<14} {'samples':>8} {'plain KiB':>10} {'plain ms':>9} {'gzip KiB':>9} {'gzip ms':>8}")
    for r in results:
        print(f"{str(r.slots).lower():<14} {r.samples:>8} {r.plain_kib:>10.0f} {r.plain_ms:>9.1f} "
              f"{r.gzip_kib:>9.0f} {r.gzip_ms:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
