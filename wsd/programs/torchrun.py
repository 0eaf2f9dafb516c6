"""``python -m wsd.programs.torchrun TORCHRUN-ARGS``: torchrun as ``wsd up`` runs it.

This is torchrun: ``torch.distributed.run``'s own argument parser and ``run``,
given torchrun's arguments. What differs is what it prints when workers fail.
torchrun stops the other workers, logs each step of that, and raises
``ChildFailedError``, whose traceback and failure table fill a screen (about
190 lines for one killed worker). Here each rank that failed of its own accord
gets one line instead, the ranks that stopped because of it named after it::

    wsd up: rank 1 (pid 4242) exited with signal 9 (SIGKILL); rank 0 stopped with it

A rank stopped "because of it" is one that torchrun stopped (SIGTERM) or that
exited ``ExitCode.RANK_LOST`` (a worker's code when a collective failed because another
rank was gone). Exit codes (``exit_code``): OK when no worker failed; USAGE
when every rank that failed of its own accord refused its configuration (its
own line above says why), whatever the ranks stopped because of it reported;
RANK_LOST otherwise. Started by ``wsd up`` (``LAUNCHER_PARENT_ENV`` set), it
stops its workers when ``wsd up`` dies, as on SIGTERM, and a stop signal ends
it with one line and exit code 128 + the signal, not a traceback. Imports torch only in
``main``, as every launcher.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from wsd.errors import ExitCode
from wsd.programs.coordinator import LAUNCHER_PARENT_ENV, die_with_parent

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

__all__ = ["describe_failures", "exit_code", "main"]

# torchrun's loggers that narrate a failed group's end (the closing signals it sends,
# each failed exit code, the restarts left): the lines below say it once.
_NARRATORS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def _stopped_because_of_another(failure: ProcessFailure) -> bool:
    return failure.exitcode in (-signal.SIGTERM, ExitCode.RANK_LOST)


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"exited with signal {-failure.exitcode} ({failure.signal_name()})"
    if failure.exitcode == ExitCode.USAGE:
        return f"refused its configuration (exit code {ExitCode.USAGE:d})"
    return f"exited with code {failure.exitcode}"


def _causes(failures: Mapping[int, ProcessFailure]) -> list[int]:
    """The ranks that failed of their own accord, by rank; all of them when every rank
    stopped because of another (nothing tells which went first)."""
    return sorted(r for r, f in failures.items() if not _stopped_because_of_another(f)) or sorted(failures)


def exit_code(failures: Mapping[int, ProcessFailure]) -> ExitCode:
    """USAGE when every rank that failed of its own accord refused its configuration (a
    rank that stopped because of it, with RANK_LOST or torchrun's SIGTERM, does not make
    it a lost rank); RANK_LOST otherwise."""
    if all(failures[r].exitcode == ExitCode.USAGE for r in _causes(failures)):
        return ExitCode.USAGE
    return ExitCode.RANK_LOST


def describe_failures(failures: Mapping[int, ProcessFailure]) -> list[str]:
    """One line per rank that failed of its own accord, by rank; the ranks that stopped
    because of them named at the end of the last line. All of them one by one when
    every rank stopped because of another (nothing tells which went first)."""
    causes = _causes(failures)
    lines = [f"rank {r} (pid {failures[r].pid}) {_how(failures[r])}" for r in causes]
    followers = sorted(set(failures) - set(causes))
    if followers:
        ranks = ", ".join(map(str, followers))
        lines[-1] += f"; rank{'s' if len(followers) > 1 else ''} {ranks} stopped with it"
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    parent = os.environ.pop(LAUNCHER_PARENT_ENV, None)  # popped: the workers have no use for it
    if parent is not None:
        # SIGTERM, not SIGKILL: torchrun then stops its workers, which would outlive a killed torchrun.
        die_with_parent(int(parent), signal.SIGTERM)
    for name in _NARRATORS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        for line in describe_failures(e.failures):
            print(f"wsd up: {line}", file=sys.stderr, flush=True)
        return exit_code(e.failures)
    except SignalException as e:  # torchrun has stopped its workers
        name = signal.Signals(e.sigval).name
        print(f"wsd up: torchrun stopped the workers on {name}", file=sys.stderr, flush=True)
        return 128 + e.sigval
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
