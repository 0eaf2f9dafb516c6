"""The coordinator's state on disk (promise 6): snapshot + journal, recovery, damage.

Pure file I/O in tmp_path; no sockets. The coordinator's side (recorded before
sent, the restart of a whole core) is in test_coordinator_core.py, the real
process in test_faults.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wsd.commandlog import CommandLog
from wsd.errors import StateFileError

# A cycle of commands touching every field of the desired state, all ranks and groups.
SCRIPT = [
    ("lock", {}, None), ("set_ubatches", {"n": 4}, 1), ("unlock", {}, 0), ("reserve", {"bytes": 4096}, None),
    ("equalize", {}, 1), ("trim", {}, 0), ("set_ubatches", {"n": 2}, None), ("reserve", {"bytes": 512}, 1),
]


def fill(log: CommandLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        action, args, group = SCRIPT[i % len(SCRIPT)]
        log.append(action, args, group, float(i))


def state(log: CommandLog) -> tuple:
    return (log.seq, log.default, log.groups, [c.to_row() for c in log.entries])


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def reopened(path: Path, capacity: int) -> CommandLog:
    log = CommandLog(str(path), capacity)
    assert log.load()
    return log


def records(journal: Path) -> list[tuple[int, int]]:
    """(offset, size) of every record of a journal, read from the frame headers."""
    raw, pos, out = journal.read_bytes(), 8, []
    while pos < len(raw):
        size = 8 + int.from_bytes(raw[pos:pos + 4], "big")
        out.append((pos, size))
        pos += size
    return out


@pytest.fixture
def made(tmp_path) -> tuple[Path, Path]:
    """A log with snapshot seq 0 and three commands in its journal."""
    path = tmp_path / "state"
    fill(CommandLog(str(path), 8), 3)
    return path, tmp_path / "state.journal"


def test_round_trip_over_many_commands_and_compactions_restarting_after_each(tmp_path):
    """Without replaying the journal onto the snapshot (or with a compaction that
    drops or doubles a command), the restarted log would differ from one that ran
    throughout."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    capacity = 5
    steady = CommandLog(str(tmp_path / "a" / "state"), capacity)
    restarted = CommandLog(str(tmp_path / "b" / "state"), capacity)
    journal = tmp_path / "b" / "state.journal"
    longest = 0
    for i in range(6 * capacity):
        fill(steady, 1, i)
        fill(restarted, 1, i)
        longest = max(longest, len(records(journal)))
        restarted = reopened(tmp_path / "b" / "state", capacity)
        assert state(restarted) == state(steady), f"after command {i + 1}"
        assert restarted.repaired is None
    assert steady.seq == 6 * capacity and len(steady.entries) == capacity
    assert [c.seq for c in restarted.since(steady.seq - 2)] == [steady.seq - 1, steady.seq]
    # the log that never restarted compacted on its own and kept its journal short
    assert len(records(tmp_path / "a" / "state.journal")) < 2 * capacity
    assert longest == 1  # each restart folded the journal into the snapshot


def test_journal_is_compacted_past_twice_the_capacity(tmp_path):
    """Without compaction the journal (and the start-up replay) would grow forever."""
    path = tmp_path / "state"
    log = CommandLog(str(path), 4)
    fill(log, 40)
    assert len(records(tmp_path / "state.journal")) < 8
    assert state(reopened(path, 4)) == state(log)


def test_torn_last_record_is_dropped_at_every_cut(made):
    """A crash mid-append can leave any prefix of the last record (or its full
    length, partly unwritten); without dropping it the coordinator could not start,
    and with more than it dropped it would forget a command it had sent."""
    path, journal = made
    good_snapshot, good = path.read_bytes(), journal.read_bytes()
    offset, size = records(journal)[-1]
    tails = [good[:offset + cut] for cut in range(1, size)]
    tails.append(good[:offset] + bytes(size))  # length on disk, data never written
    tails.append(good[:-1] + bytes([good[-1] ^ 0xFF]))  # whole, last byte wrong
    for tail in tails:
        path.write_bytes(good_snapshot)
        journal.write_bytes(tail)
        log = reopened(path, 8)
        assert log.seq == 2 and [c.seq for c in log.entries] == [1, 2], len(tail)
        assert log.repaired and str(journal) in log.repaired and f"byte {offset}" in log.repaired
        # compacted at once: the next command follows seq 2 and a restart finds nothing torn
        assert log.append("lock", {}, None, 9.0).seq == 3
        again = reopened(path, 8)
        assert again.seq == 3 and again.repaired is None


def damage_cases(path: Path, journal: Path) -> dict[str, tuple[Path, bytes]]:
    snap, jour = path.read_bytes(), journal.read_bytes()
    (first, first_size), (second, _), _ = records(journal)
    flip = bytearray(jour)
    flip[first + 10] ^= 0x01  # payload of the first record
    length = bytearray(jour)
    length[second + 1] ^= 0x40  # length field of the middle record
    return {
        "journal: bad checksum mid-journal": (journal, bytes(flip)),
        "journal: bad length mid-journal": (journal, bytes(length)),
        "journal: a record missing": (journal, jour[:first] + jour[first + first_size:]),
        "journal: empty": (journal, b""),
        "journal: garbage": (journal, b"\xc1" + os.urandom(64)),
        "snapshot: truncated": (path, snap[: len(snap) // 2]),
        "snapshot: a byte flipped": (path, snap[:-2] + bytes([snap[-2] ^ 0x10]) + snap[-1:]),
        "snapshot: trailing bytes": (path, snap + b"\x00"),
        "snapshot: empty": (path, b""),
        "snapshot: garbage": (path, b"\xc1" + os.urandom(64)),
    }


@pytest.mark.parametrize("case", [
    "journal: bad checksum mid-journal", "journal: bad length mid-journal", "journal: a record missing",
    "journal: empty", "journal: garbage", "snapshot: truncated", "snapshot: a byte flipped",
    "snapshot: trailing bytes", "snapshot: empty", "snapshot: garbage"])
def test_damage_other_than_a_torn_tail_is_refused_and_left_alone(made, case):
    """Silently starting afresh (or dropping good records) would reuse sequence numbers
    agents already applied; rewriting the files would destroy what the operator repairs."""
    path, journal = made
    target, damaged = damage_cases(path, journal)[case]
    target.write_bytes(damaged)
    before = files(path.parent)
    with pytest.raises(StateFileError) as refused:
        CommandLog(str(path), 8).load()
    assert str(refused.value).startswith(f"{target}: "), refused.value
    assert files(path.parent) == before


def test_journal_not_following_the_snapshot_is_refused(made):
    """A journal from a later run beside an older snapshot (commands in between lost)
    must not be replayed as if nothing were missing."""
    path, journal = made
    old_snapshot = path.read_bytes()
    log = reopened(path, 8)  # compacts: snapshot at seq 3, empty journal
    fill(log, 2, 3)  # journal: seqs 4 and 5
    path.write_bytes(old_snapshot)  # snapshot back at seq 0
    before = files(path.parent)
    with pytest.raises(StateFileError, match=r"starts at seq 4 .* ends at seq 0"):
        CommandLog(str(path), 8).load()
    assert files(path.parent) == before


def test_journal_without_its_snapshot_is_refused(made):
    """Replaying a journal onto a blank state would forget everything compacted away."""
    path, journal = made
    path.unlink()
    with pytest.raises(StateFileError, match="missing, but its journal"):
        CommandLog(str(path), 8).load()
    assert journal.exists()


def test_records_already_in_the_snapshot_are_skipped(made):
    """A crash between writing the snapshot and emptying the journal leaves records the
    snapshot holds: replaying them again would apply commands twice."""
    path, journal = made
    stale = journal.read_bytes()
    log = reopened(path, 8)
    journal.write_bytes(stale)  # as if the crash came before the fresh journal
    assert state(reopened(path, 8)) == state(log)


def test_failed_append_records_nothing_and_leaves_no_damage(made, monkeypatch):
    """A write that fails half way must neither count the command nor leave part of a
    record that a later append would bury mid-journal."""
    path, journal = made
    log = reopened(path, 8)
    fill(log, 1, 3)
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(StateFileError, match="state.journal: cannot record"):
        log.append("lock", {}, None, 1.0)
    monkeypatch.undo()
    assert log.seq == 4
    crashed_now = reopened(path, 8)  # the coordinator dying right there: a torn tail
    assert crashed_now.seq == 4 and crashed_now.repaired
    assert log.append("unlock", {}, None, 2.0).seq == 5  # starts a fresh journal first
    assert state(reopened(path, 8)) == state(log)


def test_bump_to_survives_restart_and_numbering_continues(made):
    """Agents ahead of a lost state file: their numbers must never be handed out again."""
    path, _ = made
    log = reopened(path, 8)
    log.bump_to(10)
    log.bump_to(7)  # never backwards
    assert reopened(path, 8).seq == 10
    assert log.append("lock", {}, None, 0.0).seq == 11
    assert reopened(path, 8).seq == 11


@pytest.mark.parametrize("capacity", [16, 2048])
def test_append_writes_the_same_bytes_however_many_commands_are_kept(tmp_path, monkeypatch, capacity):
    """Rewriting the whole state on every command made each append cost O(commands kept).
    Counted in bytes handed to os.write and fsyncs, not time."""
    written: list[int] = []
    syncs: list[int] = []
    real_write = os.write
    monkeypatch.setattr(os, "fsync", lambda fd: syncs.append(fd))  # bytes are counted, speed is not the point

    def counting(fd, data):
        n = real_write(fd, data)
        written.append(n)
        return n
    log = CommandLog(str(tmp_path / "state"), capacity)
    fill(log, capacity)  # the log now keeps `capacity` commands
    monkeypatch.setattr(os, "write", counting)
    syncs.clear()
    log.append("set_ubatches", {"n": 8}, 1, 1.0)
    assert sum(written) <= 64 and len(syncs) == 1, (written, syncs)  # one small record, one fsync
    written.clear()
    syncs.clear()
    appends = 4 * capacity  # long enough to include compactions
    fill(log, appends, capacity)
    per_append = sum(written) / appends
    # one record (under 64 bytes) plus the snapshots' share: a snapshot of `capacity`
    # commands every `capacity` or more appends
    assert per_append <= 64 + 64, per_append
