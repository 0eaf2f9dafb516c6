"""The coordinator's state on disk (it survives a restart): snapshot + journal, recovery, damage.

Pure file I/O in tmp_path; no sockets. The coordinator's side (recorded before
sent, the restart of a whole core) is in test_coordinator_core.py, the real
process in test_faults.py. The journal's layout is spelt out here, apart from
wsd.coordinator.commandlog, as docs/state-file.md gives it: a 40-byte header (the record
count at bytes 24-32), then records of ``length (u32) | crc32 (u32) | payload``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from wsd.coordinator.commandlog import CommandLog
from wsd.errors import StateFileError

HEAD = 40  # journal header bytes
RECORD_HEAD = 8  # length and crc32 before each record's payload

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


def counted(journal: Path) -> int:
    return int.from_bytes(journal.read_bytes()[24:32], "big")


def records(journal: Path) -> list[tuple[int, int]]:
    """(offset, size) of every record of a journal, read from the record headers."""
    raw, pos, out = journal.read_bytes(), HEAD, []
    while pos < len(raw):
        size = RECORD_HEAD + int.from_bytes(raw[pos:pos + 4], "big")
        out.append((pos, size))
        pos += size
    return out


def refused(path: Path, capacity: int = 8) -> str:
    """load's refusal, checking it names a file and leaves every file as it was."""
    before = files(path.parent)
    with pytest.raises(StateFileError) as e:
        CommandLog(str(path), capacity).load()
    assert files(path.parent) == before, "a refused state file was rewritten"
    return str(e.value)


@pytest.fixture
def made(tmp_path) -> tuple[Path, Path]:
    """A log with snapshot seq 0 and three acknowledged commands in its journal."""
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
        assert counted(journal) == len(records(journal))
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


# -- what a crash can leave: recovered ---------------------------------------


def test_unacknowledged_tail_is_dropped_at_every_cut(made):
    """A crash mid-append leaves the header counting three records and any part of
    the fourth after them (none, a prefix, all of it, its length with zeros). That
    command was never acknowledged: without dropping it the coordinator could not
    start; dropping more would forget a command it had sent."""
    path, journal = made
    snapshot, three = path.read_bytes(), journal.read_bytes()
    fill(CommandLog(str(path), 8), 4)  # the same snapshot, and the same three records then a fourth
    four = journal.read_bytes()
    record = four[len(three):]
    tails = [record[:cut] for cut in range(1, len(record) + 1)]
    tails.append(record[:4] + bytes(len(record) - 4))  # length on disk, data never written
    for tail in tails:
        path.write_bytes(snapshot)
        journal.write_bytes(three + tail)
        log = reopened(path, 8)
        assert log.seq == 3 and [c.seq for c in log.entries] == [1, 2, 3], len(tail)
        assert log.repaired and str(journal) in log.repaired and f"from byte {len(three)}" in log.repaired
        assert "never sent" in log.repaired
        # compacted at once: the next command follows seq 3 and a restart finds nothing to drop
        assert log.append("lock", {}, None, 9.0).seq == 4
        again = reopened(path, 8)
        assert again.seq == 4 and again.repaired is None


def test_crash_between_snapshot_and_its_journal_loses_nothing(made):
    """Compaction writes the snapshot, then its empty journal. A crash between leaves
    the older journal, whose records the snapshot holds: refusing it would stop a
    coordinator that lost nothing; replaying it would apply commands twice."""
    path, journal = made
    older = journal.read_bytes()
    log = reopened(path, 8)  # compacts: snapshot generation 2 at seq 3
    journal.write_bytes(older)  # as if the crash came before the fresh journal
    again = reopened(path, 8)
    assert state(again) == state(log) and again.repaired is None
    assert again.append("lock", {}, None, 1.0).seq == 4


def test_crash_in_the_very_first_compaction_is_no_state(tmp_path):
    """The first compaction writes the empty journal before the snapshot. A crash
    between leaves only that journal, which holds nothing: it must read as no state,
    not as a snapshot gone missing."""
    path = tmp_path / "state"
    log = CommandLog(str(path), 8)
    log.compact()
    path.unlink()  # as if the crash came before the snapshot
    before = files(tmp_path)
    assert CommandLog(str(path), 8).load() is False
    assert files(tmp_path) == before
    fill(CommandLog(str(path), 8), 1)  # the restarted coordinator's first command
    assert reopened(path, 8).seq == 1


def test_failed_append_can_leave_only_a_tail_that_is_dropped(made, monkeypatch):
    """A write that fails half way must neither count the command nor leave part of a
    record that a later append would bury mid-journal."""
    path, _ = made
    log = reopened(path, 8)
    fill(log, 1, 3)
    real_pwrite = os.pwrite

    def half_then_full(fd, data, offset):
        real_pwrite(fd, bytes(data[: len(data) // 2]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", half_then_full)
    with pytest.raises(StateFileError, match=r"state.journal: storage unavailable"):
        log.append("lock", {}, None, 1.0)
    monkeypatch.undo()
    assert log.seq == 4
    crashed_now = reopened(path, 8)  # the coordinator dying right there: a dropped tail
    assert crashed_now.seq == 4 and crashed_now.repaired
    assert log.append("unlock", {}, None, 2.0).seq == 5  # starts a fresh journal first
    assert state(reopened(path, 8)) == state(log)


# -- what loses acknowledged commands: refused ---------------------------------


def test_cut_at_every_record_boundary_is_refused(made):
    """Found by attack: a journal cut exactly between records loaded as a shorter
    history, without a word, and the acknowledged commands after the cut were gone."""
    path, journal = made
    good = journal.read_bytes()
    for kept, (offset, _) in enumerate(records(journal)):
        journal.write_bytes(good[:offset])
        message = refused(path)
        assert message.startswith(f"{journal}: ") and f"after {kept} of the 3 records" in message, message
        assert ("command 3 is" if kept == 2 else f"commands {kept + 1} to 3 are") + " missing" in message
        assert "move it" in message and "aside" in message  # what the operator can do


def test_cut_inside_every_acknowledged_record_is_refused(made):
    """A counted record cut short was acknowledged and sent: dropping it as if a
    crash had torn it would lose it silently."""
    path, journal = made
    good = journal.read_bytes()
    for cut in range(HEAD + 1, len(good)):
        if cut in {offset for offset, _ in records(journal)}:
            continue  # boundaries: the test above
        journal.write_bytes(good[:cut])
        assert refused(path).startswith(f"{journal}: "), cut
    for cut in range(HEAD):
        journal.write_bytes(good[:cut])
        assert refused(path).startswith(f"{journal}: "), cut


@pytest.mark.parametrize("commands", [0, 3])
def test_deleted_journal_is_refused(tmp_path, commands):
    """Found by attack: a deleted journal loaded as the snapshot alone, and every
    command since the snapshot was gone. Refused even when the journal held none:
    the snapshot cannot tell."""
    path = tmp_path / "state"
    log = CommandLog(str(path), 8)
    log.compact()
    fill(log, commands)
    (tmp_path / "state.journal").unlink()
    message = refused(path)
    assert message.startswith(f"{tmp_path / 'state.journal'}: missing") and "restore the journal" in message


def every_bit_flipped(good: bytes) -> Iterator[tuple[int, int, bytes]]:
    """``good`` with each of its bits flipped, one at a time: (byte, bit, the bytes)."""
    for pos in range(len(good)):
        for bit in range(8):
            flipped = bytearray(good)
            flipped[pos] ^= 1 << bit
            yield pos, bit, bytes(flipped)


def test_every_bit_flipped_in_the_journal_is_refused(made):
    """Found by attack: a bit flipped in the last complete record was "repaired" by
    dropping a command that was acknowledged and sent. Every bit of the header and
    of every counted record, one at a time."""
    path, journal = made
    for pos, bit, flipped in every_bit_flipped(journal.read_bytes()):
        journal.write_bytes(flipped)
        assert refused(path).startswith(f"{journal}: not a valid coordinator journal"), (pos, bit)


def test_every_bit_flipped_in_the_snapshot_is_refused(made):
    """A damaged snapshot must never read as another state (or as none)."""
    path, _ = made
    reopened(path, 8)  # a snapshot holding commands and desired state
    for pos, bit, flipped in every_bit_flipped(path.read_bytes()):
        path.write_bytes(flipped)
        assert refused(path).startswith(f"{path}: not a valid coordinator state file"), (pos, bit)


def damage_cases(path: Path, journal: Path) -> dict[str, tuple[Path, bytes]]:
    snap, jour = path.read_bytes(), journal.read_bytes()
    (first, first_size), _, (third, third_size) = records(journal)
    return {
        "journal: a record missing": (journal, jour[:first] + jour[first + first_size:]),
        "journal: two records swapped": (journal, jour[:first] + jour[third:] + jour[first:third]),
        "journal: a record doubled after the count": (journal, jour + jour[third:third + third_size] + b"\x00"),
        "journal: empty": (journal, b""),
        "journal: garbage": (journal, b"\xc1" + os.urandom(64)),
        "snapshot: truncated": (path, snap[: len(snap) // 2]),
        "snapshot: trailing bytes": (path, snap + b"\x00"),
        "snapshot: empty": (path, b""),
        "snapshot: garbage": (path, b"\xc1" + os.urandom(64)),
    }


@pytest.mark.parametrize("case", [
    "journal: a record missing", "journal: two records swapped", "journal: a record doubled after the count",
    "journal: empty", "journal: garbage", "snapshot: truncated", "snapshot: trailing bytes", "snapshot: empty",
    "snapshot: garbage"])
def test_other_damage_is_refused_and_left_alone(made, case):
    """Silently starting afresh (or dropping good records) would reuse sequence numbers
    agents already applied; rewriting the files would destroy what the operator repairs."""
    path, journal = made
    target, damaged = damage_cases(path, journal)[case]
    target.write_bytes(damaged)
    assert refused(path).startswith(f"{target}: ")


def test_journal_of_another_generation_is_refused(made):
    """A journal from a later run beside an older snapshot (commands in between lost)
    must not be replayed as if nothing were missing."""
    path, _ = made
    old_snapshot = path.read_bytes()
    log = reopened(path, 8)  # compacts: snapshot generation 2 at seq 3, empty journal
    log.compact()  # generation 3
    fill(log, 2, 3)  # journal: seqs 4 and 5
    path.write_bytes(old_snapshot)  # snapshot back at generation 1, seq 0
    assert "follows the snapshot of generation 3 at seq 3, but" in refused(path)


def test_journal_without_its_snapshot_is_refused(made):
    """Replaying a journal onto a blank state would forget everything compacted away."""
    path, _ = made
    path.unlink()
    assert "missing, but its journal" in refused(path)


@pytest.mark.parametrize("which", ["state", "state.journal"])
def test_files_of_an_older_format_are_refused(made, which):
    """Format 2 had no journal header, so it cannot tell a cut at a record boundary
    from a shorter history: refused, naming the reason, never read as something else."""
    path, _ = made
    target = path.parent / which
    target.write_bytes((b"WSDSNAP2" if which == "state" else b"WSDJRNL2") + bytes(20))
    message = refused(path)
    assert message.startswith(f"{target}: ") and "older wsd (state file format 2)" in message


# -- storage ------------------------------------------------------------------


def test_state_file_in_a_missing_folder_is_refused_at_construction(tmp_path):
    """Found by attack: such a coordinator started, then failed at the first command."""
    path = tmp_path / "nowhere" / "state"
    with pytest.raises(StateFileError, match=f"^{path}: the folder {tmp_path / 'nowhere'} does not exist"):
        CommandLog(str(path), 8)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_state_file_in_a_read_only_folder_is_refused_at_construction(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(StateFileError, match="is not writable"):
            CommandLog(str(folder / "state"), 8)
    finally:
        folder.chmod(0o700)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
@pytest.mark.parametrize("failing", ["record write", "record sync", "header write", "header sync"])
def test_unavailable_storage_numbers_nothing_and_loses_nothing(made, monkeypatch, code, failing):
    """A full disk (or quota, read-only, permissions) at any step of an append: the
    error names the journal and says the storage is unavailable; the seq does not
    advance; after space returns the next append works and everything loads, even
    if the coordinator had died right at the failure."""
    path, journal = made
    log = reopened(path, 8)
    fill(log, 2, 3)
    calls = {"write": 0, "sync": 0}
    real = {"write": os.pwrite, "sync": os.fdatasync}
    kind, nth = failing.split()[1], 1 if failing.startswith("record") else 2

    def failing_call(which):
        def call(*args):
            calls[which] += 1
            if which == kind and calls[which] == nth:
                raise OSError(code, os.strerror(code))
            return real[which](*args)
        return call
    monkeypatch.setattr(os, "pwrite", failing_call("write"))
    monkeypatch.setattr(os, "fdatasync", failing_call("sync"))
    with pytest.raises(StateFileError) as e:
        log.append("lock", {}, None, 1.0)
    monkeypatch.undo()
    assert str(e.value).startswith(f"{journal}: storage unavailable ({os.strerror(code).lower()})"), e.value
    assert log.seq == 5
    crashed_now = reopened(path, 8)
    assert state(crashed_now) == state(log)  # the refused command did not come back
    assert log.append("unlock", {}, None, 2.0).seq == 6
    assert state(reopened(path, 8)) == state(log)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
class DevFull:
    """While on, every temporary file the state writes (``tempfile.mkstemp`` in
    ``wsd.coordinator.statefile``) is /dev/full under a name of its own: the kernel's own
    ENOSPC on its write. (A link planted at the temporary file's name no longer works:
    that name is made afresh and never followed, which is the point.)"""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        import tempfile

        from wsd.coordinator import statefile

        self.names: list[str] = []

        def mkstemp(prefix: str = "", suffix: str = "", dir: str | None = None) -> tuple[int, str]:
            self.names.append(os.path.join(dir or str(folder), f"{prefix}full{suffix}"))
            return os.open("/dev/full", os.O_WRONLY), self.names[-1]

        original = tempfile.mkstemp
        self._patch = lambda on: monkeypatch.setattr(statefile.tempfile, "mkstemp", mkstemp if on else original)

    def on(self) -> None:
        self._patch(True)

    def off(self) -> None:  # space is back
        self._patch(False)


def test_full_disk_for_real_with_dev_full(made, monkeypatch):
    """The kernel's own ENOSPC: the journal, then the snapshot's temporary file,
    pointed at /dev/full. Without the translation the coordinator would answer a
    full disk as a bug in wsd."""
    path, journal = made
    log = reopened(path, 8)
    fill(log, 1, 3)
    journal.unlink()
    journal.symlink_to("/dev/full")
    with pytest.raises(StateFileError, match=f"^{journal}: storage unavailable \\(no space left on device\\)"):
        log.append("lock", {}, None, 1.0)
    assert log.seq == 4
    full = DevFull(monkeypatch, path.parent)
    full.on()  # the next append compacts first: its snapshot cannot be written either
    tmp = path.parent / "state.full.tmp"
    with pytest.raises(StateFileError, match=f"^{tmp}: storage unavailable \\(no space left on device\\)"):
        log.append("lock", {}, None, 1.0)
    assert log.seq == 4 and full.names == [str(tmp)]
    full.off()
    assert log.append("unlock", {}, None, 2.0).seq == 5
    assert not journal.is_symlink()
    assert state(reopened(path, 8)) == state(log)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_compaction_on_a_full_disk_loses_nothing_and_appends_go_on(tmp_path, monkeypatch):
    """Folding the journal needs space for a new snapshot; the journal itself does
    not. A compaction that cannot write its snapshot must leave both files as they
    were and the command it followed recorded, and the next commands too."""
    path = tmp_path / "state"
    log = CommandLog(str(path), 2)
    fill(log, 3)
    full = DevFull(monkeypatch, tmp_path)
    full.on()
    fill(log, 2, 3)  # the 4th reaches 2 * capacity records: its compaction fails, logged
    assert log.seq == 5 and counted(tmp_path / "state.journal") == 5
    full.off()  # space is back (a start-up compacts, so needs it)
    assert state(reopened(path, 2)) == state(log)


def test_a_link_planted_where_the_state_writes_its_temporary_file_is_never_followed(tmp_path):
    """A link at the old fixed name (``STATE.tmp``) pointing at a file of someone else's:
    compaction writes its own new file beside it, and the linked file is untouched; nothing
    temporary is left behind."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    path = tmp_path / "state"
    (tmp_path / "state.tmp").symlink_to(victim)
    (tmp_path / "state.journal.tmp").symlink_to(victim)
    log = CommandLog(str(path), 2)
    fill(log, 6)  # compacts more than once
    assert victim.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state", "state.journal", "state.journal.tmp",
                                                           "state.tmp", "victim"]
    assert state(reopened(path, 2)) == state(log)


def test_a_fifo_planted_as_the_state_file_is_refused_without_blocking(tmp_path):
    """Reading the state never waits on a FIFO (or a device) planted at its path: refused at
    once, naming the file, and the coordinator does not start on it."""
    path = tmp_path / "state"
    os.mkfifo(path)
    with pytest.raises(StateFileError, match=f"^{path}: cannot read the coordinator state: not a regular file"):
        CommandLog(str(path), 2).load()


# -- numbering and cost --------------------------------------------------------


def test_bump_to_survives_restart_and_numbering_continues(made):
    """Agents ahead of a lost state file: their numbers must never be handed out again."""
    path, _ = made
    log = reopened(path, 8)
    log.bump_to(10)
    log.bump_to(7)  # never backwards
    log = reopened(path, 8)  # (the one writer of the files from now on)
    assert log.seq == 10
    assert log.append("lock", {}, None, 0.0).seq == 11
    assert reopened(path, 8).seq == 11


@pytest.mark.parametrize("capacity", [16, 2048])
def test_append_writes_the_same_bytes_however_many_commands_are_kept(tmp_path, monkeypatch, capacity):
    """Rewriting the whole state on every command made each append cost O(commands kept).
    Counted in bytes handed to os.pwrite and syncs, not time."""
    written: list[int] = []
    syncs: list[int] = []
    real_pwrite = os.pwrite
    # bytes are counted, speed is not the point
    monkeypatch.setattr(os, "fsync", lambda fd: syncs.append(fd))
    monkeypatch.setattr(os, "fdatasync", lambda fd: syncs.append(fd))

    def counting(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        written.append(n)
        return n
    log = CommandLog(str(tmp_path / "state"), capacity)
    fill(log, capacity)  # the log now keeps `capacity` commands
    monkeypatch.setattr(os, "pwrite", counting)
    syncs.clear()
    log.append("set_ubatches", {"n": 8}, 1, 1.0)
    # one small record and the header, each synced
    assert len(written) == 2 and written[1] == HEAD and written[0] <= 64 and len(syncs) == 2, (written, syncs)
    written.clear()
    syncs.clear()
    appends = 4 * capacity  # long enough to include compactions
    fill(log, appends, capacity)
    per_append = sum(written) / appends
    # one record (under 64 bytes) and the header, plus the snapshots' share: a
    # snapshot of `capacity` commands every `capacity` or more appends
    assert per_append <= 64 + HEAD + 64, per_append


def test_docs_describe_this_format():
    """docs/state-file.md is what an operator repairs by: it must match the code."""
    from wsd.coordinator import statefile

    doc = (Path(__file__).resolve().parents[2] / "docs" / "state-file.md").read_text()
    assert f"magic `{statefile.SNAPSHOT_MAGIC.decode()}`" in doc
    assert f"| 0-8 | magic `{statefile.JOURNAL_MAGIC.decode()}` |" in doc
    assert f"| `format` | {statefile.FORMAT} |" in doc
    assert f"a {statefile.HEAD.size}-byte header" in doc and statefile.HEAD.size == HEAD
    assert "| 24-32 | records acknowledged (u64) |" in doc  # where counted() reads
