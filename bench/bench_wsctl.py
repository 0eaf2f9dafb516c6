"""How long a fresh ``wsctl`` takes, as whole processes, against a bare ``python -c pass``.

An operator runs ``wsctl`` by hand and in scripts, often on a node whose cores a
generating engine holds: what counts is the whole process, interpreter start
included. Measured side by side in one run, interleaved (this machine is shared
and noisy), each figure the median of its runs over the median of the bare
interpreter's:

- ``wsctl --version``: the entry point alone (target at most 2x);
- ``wsctl status`` against a live coordinator (spawned, idle, on loopback
  ports): argument parsing, ZeroMQ, msgpack, one round trip and the table
  (target at most 3x);
- ``python -c "import zmq, msgpack"``, for reference: the libraries alone.

Every process may write and read compiled bytecode (in a cache folder of the
run's own, ``PYTHONPYCACHEPREFIX``), as an installed wsd has it: with
``PYTHONDONTWRITEBYTECODE`` set, as on this project's machine, each ``wsctl``
would compile wsd's sources again at every start.

Run: ``python -m bench.bench_wsctl [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.helpers import Helper, Row, run_coordinator

__all__ = ["run"]


def _wsctl() -> list[str]:
    """The installed ``wsctl`` script, as an operator runs it; else its entry point through
    this interpreter (the same code, one ``-c`` away)."""
    script = shutil.which("wsctl")
    if script is not None:
        return [script]
    return [sys.executable, "-c", "import sys; from wsd_client.cli import main; sys.exit(main())"]


def _seconds(command: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=60)
    took = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return took


def run(quick: bool) -> list[Row]:
    rounds = 10 if quick else 30
    with tempfile.TemporaryDirectory() as state_dir:
        coordinator = Helper(run_coordinator, str(Path(state_dir) / "bench-wsctl.state"))
        try:
            _, client_endpoint = coordinator.result()
            commands = {
                "python -c pass": [sys.executable, "-c", "pass"],
                "wsctl --version": [*_wsctl(), "--version"],
                "wsctl status": [*_wsctl(), "--endpoint", client_endpoint, "status"],
                "import zmq, msgpack": [sys.executable, "-c", "import zmq, msgpack"],
            }
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = str(Path(state_dir) / "pycache")
            for command in commands.values():  # compiles the bytecode, warms the file cache
                _seconds(command, env)
            times: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(rounds):  # interleaved: a burst of load hits every command alike
                for name, command in commands.items():
                    times[name].append(_seconds(command, env))
        finally:
            coordinator.stop()
    medians = {name: statistics.median(values) for name, values in times.items()}
    bare = medians["python -c pass"]
    print(f"{'command':<22}{'median':>10}{'min':>10}{'x bare':>9}   ({rounds} runs each, interleaved)")
    for name, values in times.items():
        print(f"{name:<22}{medians[name] * 1e3:>8.0f}ms{min(values) * 1e3:>8.0f}ms{medians[name] / bare:>8.2f}x")
    return [
        Row("wsctl --version process", medians["wsctl --version"] / bare, "python -c pass", 2.0),
        Row("wsctl status process", medians["wsctl status"] / bare, "python -c pass", 3.0),
        Row("import zmq, msgpack process", medians["import zmq, msgpack"] / bare, "python -c pass"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_wsctl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 runs of each command instead of 30")
    run(parser.parse_args().quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
