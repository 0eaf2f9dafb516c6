"""The soak (bench/soak.py), run briefly as a real process: every fault kind, nothing lost."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import python, spawn  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package: import it from the checkout
from bench.soak_check import Incarnation, verify  # noqa: E402 (needs the sys.path entry above)


@pytest.mark.timeout(120)
def test_short_soak_loses_nothing_and_applies_nothing_twice(spawn):  # noqa: F811
    """A few seconds of faults (worker and coordinator killed and paused) under traffic,
    two torchrun workers in one TP group. Without the state file, the at-most-once check by
    seq, re-registration or the launcher's restarts, the soak would report lost or
    duplicate applications (or a cluster that never recovers) and exit non-zero."""
    soak = spawn(python("-m", "bench.soak", "--seconds", "6", "--max-faults", "4", "--fault-gap", "1",
                        "--workers", "2", "--tp-size", "2", "--seed", "11",
                        "--faults", "kill_worker,kill_coordinator,stop_worker,stop_coordinator"),
                 cwd=ROOT, name="soak")
    code = soak.wait(110)
    out = soak.output()
    summary = re.search(r"lost: (\d+)\s+applied twice: (\d+)\s+disagreements: (\d+)\s+"
                        r"processes left behind: (\d+)", out)
    assert summary, out
    assert summary.groups() == ("0", "0", "0", "0"), out
    faults = int(re.search(r"faults injected:\s+(\d+)", out).group(1))
    verified, final = map(int, re.search(r"applied exactly once on every live rank: (\d+) of (\d+)", out).groups())
    assert faults >= 1 and final >= 5 and verified == final, out
    assert code == 0, out


def _inc(rank: int, pid: int, lines: list[tuple[int, int, list[int]]], group: int = 0) -> Incarnation:
    return Incarnation(rank, pid, 0, group, [{"from": a, "to": b, "applied": [[s, 10 + s, True] for s in seqs]}
                                             for a, b, seqs in lines])


def test_the_checker_catches_a_duplicate_a_gap_and_a_rank_left_behind():
    """The soak's verdict is only as good as its checker: without these checks a duplicate,
    a skipped seq or a rank stuck short of the last seq would pass as 'nothing lost'."""
    good = verify([_inc(0, 1, [(0, 2, [1, 2]), (2, 3, [3])]), _inc(1, 2, [(0, 3, [1, 2, 3])])],
                  3, {1: "all", 3: "all"}, {1, 2}, 1)
    assert good.ok and good.commands_verified == 3 and good.applications == 6
    twice = verify([_inc(0, 1, [(0, 2, [1, 2]), (2, 3, [2, 3])])], 3, {}, {1}, 1)
    assert twice.duplicates and not twice.ok
    gap = verify([_inc(0, 1, [(0, 1, [1]), (2, 3, [3])])], 3, {}, {1}, 1)
    assert gap.lost and not gap.ok
    skipped = verify([_inc(0, 1, [(0, 3, [1, 3])])], 3, {2: "all"}, {1}, 1)
    assert any("seq 2" in p for p in skipped.lost)
    behind = verify([_inc(0, 1, [(0, 2, [1, 2])])], 3, {}, {1, 99}, 1)
    assert len(behind.lost) == 2  # pid 1 stopped at 2; pid 99 never recorded anything
    forgotten = verify([_inc(0, 1, [(0, 2, [1, 2])])], 2, {5: "all"}, set(), 1)
    assert any("seq 5" in p for p in forgotten.lost)
