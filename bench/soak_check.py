"""The soak's verdict on what each worker recorded: pure logic, no processes.

Input: the records ``bench/soak_worker.py`` wrote (one file per worker
process, one line per ``apply_up_to`` call), the final sequence number, the
TP group of every seq whose reply the soak saw, and which processes are alive
at the end. Output: how many commands were applied exactly once on every rank
that held them, and every gap, duplicate or disagreement found.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ALL = "all"  # a command for every TP group


@dataclass
class Incarnation:
    """One worker process: its rank, group, and the lines it wrote, in order."""

    rank: int
    pid: int
    restart: int
    group: int
    lines: list[dict[str, Any]]
    torn: bool = False  # its last line was cut short (killed mid-write)

    @property
    def baseline(self) -> int:
        return self.lines[0]["from"]

    @property
    def last(self) -> int:
        return self.lines[-1]["to"]

    def applied(self) -> list[list[Any]]:
        return [a for line in self.lines for a in line["applied"]]


@dataclass
class Verdict:
    final_seq: int
    commands_verified: int = 0
    """Seqs 1..final applied exactly once by every process of their target that held them."""
    applications: int = 0
    """(process, seq) applications checked."""
    refused_by_manager: int = 0
    """Applications the manager refused (e.g. reserve while a fresh rank had locked itself)."""
    processes: int = 0
    torn_lines: int = 0
    unknown_target: int = 0
    """Seqs nobody applied and whose reply the soak never saw (no target to check against)."""
    duplicates: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.lost or self.disagreements)


def read_records(directory: str) -> list[Incarnation]:
    """Every process's record; a torn last line (SIGKILL mid-write) is dropped and counted."""
    found = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(directory, name)) as f:
            raw = f.read().split("\n")
        lines, torn = [], False
        for i, text in enumerate(raw):
            if not text:
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                if i < len(raw) - 2:  # only the last line can be cut by a kill
                    raise ValueError(f"{name}: line {i + 1} is not JSON: {text[:80]!r}") from None
                torn = True
        if lines:
            first = lines[0]
            found.append(Incarnation(first["rank"], first["pid"], first["restart"], first["group"], lines, torn))
    return found


def _targets(seq_group: Any, group: int) -> bool:
    return seq_group in (ALL, group)


def verify(incarnations: list[Incarnation], final_seq: int, told: dict[int, Any],
           alive_pids: set[int], groups: int) -> Verdict:
    """Check every record. ``told``: seq -> TP group (``ALL``) from the replies the soak saw;
    ``alive_pids``: worker processes running at the end, which must have reached ``final_seq``."""
    verdict = Verdict(final_seq=final_seq, processes=len(incarnations),
                      torn_lines=sum(i.torn for i in incarnations))
    # Which group each seq targets: from its reply, else from who applied it.
    appliers: dict[int, set[int]] = {}
    for inc in incarnations:
        for seq, _, _ in inc.applied():
            appliers.setdefault(seq, set()).add(inc.group)
    target: dict[int, Any] = {}
    for seq in range(1, final_seq + 1):
        seen = appliers.get(seq, set())
        inferred = ALL if len(seen) == groups or len(seen) > 1 else (next(iter(seen)) if seen else None)
        known = told.get(seq, inferred)
        if seq in told and inferred is not None and groups > 1 and inferred != known and not (
                known == ALL and len(seen) < groups):
            verdict.disagreements.append(f"seq {seq} is for group {known} but was applied by groups {sorted(seen)}")
        target[seq] = known
    for seq in told:
        if seq > final_seq:
            verdict.lost.append(f"seq {seq} was answered to the soak, but the coordinator ends at seq {final_seq}")

    bad_seqs: set[int] = set()
    for inc in incarnations:
        who = f"rank {inc.rank} (pid {inc.pid}, restart {inc.restart})"
        position = inc.baseline
        for line in inc.lines:
            if line["from"] != position:
                verdict.lost.append(f"{who}: went from seq {position} to {line['from']} without applying between")
                bad_seqs.update(range(min(position, line["from"]) + 1, max(position, line["from"]) + 1))
            position = line["to"]
        applied = inc.applied()
        counts = Counter(seq for seq, _, _ in applied)
        for seq, n in counts.items():
            if n > 1:
                verdict.duplicates.append(f"{who}: seq {seq} applied {n} times")
                bad_seqs.add(seq)
        seqs = [seq for seq, _, _ in applied]
        if seqs != sorted(seqs):
            verdict.disagreements.append(f"{who}: applied out of order: {seqs}")
        verdict.applications += len(applied)
        verdict.refused_by_manager += sum(1 for _, _, ok in applied if ok is False)
        for seq in range(inc.baseline + 1, inc.last + 1):
            wanted = target.get(seq)
            if wanted is None:
                continue
            if _targets(wanted, inc.group) and seq not in counts:
                verdict.lost.append(f"{who}: seq {seq} (for group {wanted}) never applied")
                bad_seqs.add(seq)
            elif not _targets(wanted, inc.group) and seq in counts:
                verdict.disagreements.append(f"{who}: applied seq {seq}, meant for group {wanted}")
                bad_seqs.add(seq)
        if inc.pid in alive_pids and inc.last != final_seq:
            verdict.lost.append(f"{who}: alive at the end but stopped at seq {inc.last} of {final_seq}")
            bad_seqs.update(range(inc.last + 1, final_seq + 1))
    for pid in sorted(alive_pids - {inc.pid for inc in incarnations}):
        verdict.lost.append(f"worker pid {pid}: alive at the end but never applied a command")
    verdict.disagreements += _same_step(incarnations)
    verdict.unknown_target = sum(1 for seq in range(1, final_seq + 1) if target[seq] is None)
    verdict.commands_verified = sum(1 for seq in range(1, final_seq + 1)
                                    if target[seq] is not None and seq not in bad_seqs)
    return verdict


def _same_step(incarnations: list[Incarnation]) -> list[str]:
    """Members of one TP group in one torchrun round applied the same seqs at the same steps
    (one may stop short of another: it died, or was killed before writing its last line)."""
    rounds: dict[tuple[int, int], list[Incarnation]] = {}
    for inc in incarnations:
        rounds.setdefault((inc.restart, inc.group), []).append(inc)
    problems = []
    for (restart, group), members in sorted(rounds.items()):
        lists = [[(seq, step) for seq, step, _ in inc.applied()] for inc in members]
        longest = max(lists, key=len)
        for inc, got in zip(members, lists):
            if got != longest[: len(got)]:
                problems.append(f"restart {restart}, group {group}: rank {inc.rank} applied {got[:8]}... "
                                f"where a peer applied {longest[:8]}...")
    return problems


def desired_mismatches(status: Mapping[str, Any], ranks: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every live rank whose manager is not in its TP group's desired state.

    ``status`` and ``ranks`` are the coordinator's answers; a desired field of
    None was never commanded, so any value meets it. A process started after a
    command (a torchrun restart) must have taken its group's desired state on.
    """
    desired = {g["tp_group"]: g["desired"] for g in status["groups"]}
    problems = []
    for r in ranks:
        if r["state"] != "live":
            continue
        want = desired[r["tp_group"]]
        for key in ("locked", "num_ubatches"):
            if want[key] is not None and r[key] != want[key]:
                problems.append(f"rank {r['rank']} (pid {r['pid']}): {key} is {r[key]}, "
                                f"its group {r['tp_group']} wants {want[key]}")
    return problems
