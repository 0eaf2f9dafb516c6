"""The coordinator's command log and desired state, kept on disk as a snapshot and a journal.

Every state-changing command gets the next sequence number and is recorded
durably before it is sent to any agent, so that a coordinator restarted from
disk knows every command it ever sent. Two files hold it (docs/state-file.md):

* the snapshot, at ``state_file``: desired state, sequence number, kept
  commands and its generation, replaced atomically (temporary file, fsync,
  rename, fsync the folder);
* the journal, at ``state_file + ".journal"``: a 40-byte header (the
  generation and seq of the snapshot it follows, how many records it holds, a
  CRC-32 chained over them, its own CRC-32), then one record per command,
  ``length | crc32 of length and payload | msgpack payload``.

Recording a command appends its record and fdatasyncs, then rewrites the
header in place to count it and fdatasyncs again; only then is the command
acknowledged (numbered, applied, sent). The count is what no record can say
about itself: without it a journal cut exactly between records, or missing,
reads as a shorter history. So ``load`` drops only bytes after the counted
records (an append a crash interrupted, never acknowledged) and refuses
anything else: a bad header, a counted record missing or damaged, a journal of
another generation, a snapshot without its journal. The header lies in one
disk sector and is rewritten in place, as PostgreSQL rewrites ``pg_control``;
one torn anyway fails its CRC and is refused, never guessed.

The journal is folded into a new snapshot when it holds ``2 * capacity``
records (so a snapshot's bytes are spread over at least ``capacity`` commands)
and at start-up. The bytes of both files, and how they reach the disk, are
``wsd.coordinator.statefile``'s; this module decides what they hold. No
sockets, no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from wsd.commands import COMMANDS, DESIRED_FIELDS
from wsd.coordinator.statefile import (
    FORMAT,
    HEAD,
    MAX_RECORD,
    OLD_MAGICS,
    RECORD,
    SNAPSHOT_MAGIC,
    JournalHead,
    datasync,
    frame,
    frame_end,
    frame_problem,
    is_unborn,
    pwrite_all,
    read_state,
    rename_durably,
    storage_error,
    unlink_quietly,
    write_temporary,
)
from wsd.errors import StateFileError

__all__ = ["Command", "CommandLog"]

logger = logging.getLogger(__name__)

_DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, struct.error, msgpack.UnpackException)
# What the operator can do, at the end of every refusal (docs/state-file.md).
_START_AFRESH = "move {files} aside to start afresh, forgetting the desired state and command log"


@dataclass(frozen=True, slots=True)
class Command:
    seq: int
    action: str
    """The client operation (``lock``, ``set_ubatches``, ...)."""
    args: dict[str, Any]
    group: int | None
    """TP group targeted; None: every rank."""
    time: float

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "action": self.action, "args": self.args, "group": self.group}

    def targets(self, group: int) -> bool:
        return self.group is None or self.group == group

    def to_row(self) -> list[Any]:
        return [self.seq, self.action, self.args, self.group, self.time]

    @classmethod
    def from_row(cls, row: Any) -> Command:
        seq, action, args, group, time = row
        if not (isinstance(seq, int) and seq > 0 and isinstance(action, str) and isinstance(args, dict)
                and (group is None or isinstance(group, int)) and isinstance(time, (int, float))):
            raise ValueError(f"not a command: {row!r}")
        return cls(seq, action, args, group, float(time))


def _apply_desired(state: dict[str, Any], action: str, args: dict[str, Any]) -> None:
    """``action``'s change to a desired state, by its row of the command table (an action
    the table does not know, from another version, changes nothing)."""
    spec = COMMANDS.get(action)
    if spec is not None and spec.desired is not None:
        spec.desired(state, args)


def _touches(action: str) -> tuple[str, ...]:
    spec = COMMANDS.get(action)
    return () if spec is None else spec.touches


def _blank() -> dict[str, Any]:
    return dict.fromkeys(DESIRED_FIELDS)


class CommandLog:
    """Sequence numbers, the last ``capacity`` commands and the desired state per group."""

    def __init__(self, path: str, capacity: int) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise StateFileError(f"{path}: the folder {folder} does not exist: create it, "
                                 f"or set [coordinator] state_file to a file in an existing folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StateFileError(f"{path}: the folder {folder} is not writable by this user: "
                                 f"fix its permissions, or set [coordinator] state_file elsewhere")
        self.path = path
        self.journal_path = f"{path}.journal"
        self.capacity = capacity
        self.seq = 0
        self.entries: deque[Command] = deque(maxlen=capacity)
        self.default = _blank()
        self.groups: dict[int, dict[str, Any]] = {}
        self.repaired: str | None = None
        """What ``load`` dropped after the acknowledged records of the journal, if anything."""
        self.generation = 0
        """Of the snapshot on disk; 0: none written yet."""
        # False until the journal is known to be whole and ours: the next append
        # then writes a fresh snapshot and journal first (a fresh log, or a failed
        # append that may have left the journal other than its header says).
        self._journal_ready = False
        self._head = JournalHead(0, 0, 0, 0)
        self._journal_end = HEAD.size
        self._compact_after = 2 * capacity

    def desired(self, group: int) -> dict[str, Any]:
        return dict(self.groups.get(group, self.default))

    def desired_at(self, group: int, seq: int) -> dict[str, Any] | None:
        """``group``'s desired state as it was at ``seq``; None when the kept log cannot tell.

        A field no command after ``seq`` touched is as it is now. A field one
        did is rebuilt from the kept commands up to ``seq``: lock, unlock,
        set_ubatches and trim set it outright; a relative change (reserve only
        raises it) needs a command that sets it before, or the log from seq 1.
        """
        if seq >= self.seq:
            return self.desired(group)
        if self.oldest() > seq + 1:
            return None  # commands after seq are gone: what they changed is unknown
        unknown = object()
        past: dict[str, Any] = _blank() if self.oldest() == 1 else dict.fromkeys(_blank(), unknown)
        for c in self.entries:
            if c.seq <= seq and c.targets(group):
                spec = COMMANDS.get(c.action)
                if spec is not None and spec.relative and any(past[k] is unknown for k in spec.touches):
                    continue  # a change relative to an unknown value stays unknown
                _apply_desired(past, c.action, c.args)
        state = self.desired(group)
        for c in self.entries:
            if c.seq > seq and c.targets(group):
                for key in _touches(c.action):
                    if past[key] is unknown:
                        return None
                    state[key] = past[key]
        return state

    def append(self, action: str, args: dict[str, Any], group: int | None, now: float) -> Command:
        """Record the next command durably; StateFileError (and nothing recorded) if it cannot be."""
        if not self._journal_ready:
            self.compact()
        command = Command(self.seq + 1, action, dict(args), group, now)
        payload = msgpack.packb(command.to_row(), use_bin_type=True)
        if len(payload) > MAX_RECORD:
            raise StateFileError(f"{self.journal_path}: a command of {len(payload)} bytes is too large to record")
        self._append_record(frame(payload))
        self._apply(command)  # only once it is on disk and counted
        if self._head.records >= self._compact_after:
            try:
                self.compact()
            except StateFileError as e:
                # The command is recorded (and will be sent): only the folding
                # failed, which loses nothing. Retry after another capacity.
                logger.warning("cannot compact the coordinator journal, will retry: %s", e)
                self._compact_after = self._head.records + self.capacity
        return command

    def since(self, seq: int) -> list[Command]:
        """Commands after ``seq`` still in the log, oldest first."""
        return [c for c in self.entries if c.seq > seq]

    def oldest(self) -> int:
        return self.entries[0].seq if self.entries else self.seq + 1

    def bump_to(self, seq: int) -> None:
        """Never hand out a number an agent has already applied (a state file was lost)."""
        if seq > self.seq:
            old, self.seq = self.seq, seq
            try:
                self.compact()  # the journal holds commands only: a jump goes in a snapshot
            except StateFileError:
                self.seq = old
                raise

    def discard(self) -> None:
        """A log that never numbered a command, given up (its engine forgotten): its files go,
        if a start wrote any (an empty log is the same with or without them). A log with
        commands is never discarded."""
        if self.seq > 0:
            raise StateFileError(f"{self.path}: holds commands up to seq {self.seq}: never discarded")
        for path in (self.path, self.journal_path):
            unlink_quietly(path)

    def compact(self) -> None:
        """Write the whole state as a snapshot of the next generation, then its empty journal.

        In that order, each step atomic: a crash between the two leaves the
        journal of the generation before, whose records the snapshot already
        holds, which ``load`` accepts as such. The very first time, the journal
        goes first instead (there is no journal to lose yet): a crash between
        leaves an empty journal of generation 1 and no snapshot, which ``load``
        reads as no state; so a snapshot is never without its journal, and a
        missing journal is always damage.
        """
        generation = self.generation + 1
        document = {
            "format": FORMAT,
            "generation": generation,
            "seq": self.seq,
            "default": self.default,
            "groups": {str(g): s for g, s in self.groups.items()},
            "log": [c.to_row() for c in self.entries],
        }
        head = JournalHead(generation, self.seq, 0, 0)
        writes = [(self.path, SNAPSHOT_MAGIC + frame(msgpack.packb(document, use_bin_type=True))),
                  (self.journal_path, head.pack())]
        renames: list[tuple[str, str]] = []
        try:
            # A full disk fails here, with both files as they were: appends go on.
            for path, data in (writes if self.generation else reversed(writes)):
                renames.append((write_temporary(path, data), path))
            # From the first rename on, the journal on disk may not follow the
            # snapshot on disk: no record may be appended until both are in place.
            self._journal_ready = False
            for tmp, path in renames:
                rename_durably(tmp, path)
        except OSError as e:
            for tmp, _ in renames:  # those not renamed yet: none left behind
                unlink_quietly(tmp)
            raise storage_error(self.path, "write the coordinator state", e) from e
        self.generation = generation
        self._head = head
        self._journal_end = HEAD.size
        self._journal_ready = True
        self._compact_after = 2 * self.capacity

    def _append_record(self, record: bytes) -> None:
        head = JournalHead(self._head.generation, self._head.base, self._head.records + 1,
                     zlib.crc32(record, self._head.chain))
        try:
            # No O_CREAT: compact() made the journal; if it has gone, say so.
            # No O_APPEND either: Linux's pwrite would append the header too.
            fd = os.open(self.journal_path, os.O_WRONLY)
            try:
                pwrite_all(fd, record, self._journal_end)
                datasync(fd)
                # Count the record only once it is on disk: counted first, a crash
                # could leave a header promising a record that is not there, which
                # load must refuse. Not counted yet, it is a tail load may drop.
                try:
                    pwrite_all(fd, head.pack(), 0)
                    datasync(fd)
                except OSError:
                    # The new count may be on disk: put the old one back (an
                    # in-place write needs no space), so that a crash now does
                    # not bring back a command its client was told failed.
                    with contextlib.suppress(OSError):
                        pwrite_all(fd, self._head.pack(), 0)
                        datasync(fd)
                    raise
            finally:
                os.close(fd)
        except OSError as e:
            # Bytes may lie past the counted records, or the header be either
            # count: start afresh next time rather than append after them.
            self._journal_ready = False
            raise storage_error(self.journal_path, "record the command", e) from e
        self._head = head
        self._journal_end += len(record)

    def _apply(self, command: Command) -> None:
        if command.group is None:
            targets = [self.default, *self.groups.values()]
        else:
            targets = [self.groups.setdefault(command.group, dict(self.default))]
        for state in targets:
            _apply_desired(state, command.action, command.args)
        self.entries.append(command)
        self.seq = command.seq

    # -- recovery ----------------------------------------------------------

    def load(self) -> bool:
        """Restore from the snapshot and the journal; False if there is no state yet.

        Bytes after the records the journal's header counts are dropped (see
        ``_read_journal``): an append a crash cut short, never acknowledged, so
        no agent ever saw it. Anything else that is wrong raises StateFileError
        naming the file, what is wrong and what to do, and leaves both files
        exactly as they are. Once loaded, the journal is folded into a new
        snapshot, so that no record is ever appended after dropped bytes.
        """
        snapshot, journal = read_state(self.path), read_state(self.journal_path)
        if snapshot is None:
            if journal is None or is_unborn(journal):
                return False
            raise StateFileError(f"{self.path}: missing, but its journal {self.journal_path} exists: "
                                 "restore the snapshot, or " + _START_AFRESH.format(files="the journal"))
        fresh = CommandLog(self.path, self.capacity)
        fresh._restore_snapshot(snapshot)
        if journal is None:
            raise StateFileError(
                f"{self.journal_path}: missing, but the snapshot {self.path} (generation {fresh.generation}) "
                f"has one: the commands recorded since the snapshot are gone: restore the journal, or "
                + _START_AFRESH.format(files="the snapshot"))
        head = fresh._read_head(journal)
        # Generation one before the snapshot's: a crash came between writing the
        # snapshot and its journal, and the snapshot holds every record of this one.
        if head.generation != fresh.generation - 1:
            fresh._replay(journal, head)
        self.seq, self.entries, self.default, self.groups = fresh.seq, fresh.entries, fresh.default, fresh.groups
        self.generation, self.repaired = fresh.generation, fresh.repaired
        self.compact()
        return True

    def _replay(self, journal: bytes, head: JournalHead) -> None:
        if head.generation != self.generation or head.base != self.seq:
            raise self._refuse(f"follows the snapshot of generation {head.generation} at seq {head.base}, "
                               f"but {self.path} is generation {self.generation} at seq {self.seq}")
        records, tail = self._read_journal(journal, head)
        for at, command in records:
            try:
                self._apply(command)
            except _DECODE_ERRORS as e:
                raise self._refuse(f"record at byte {at} cannot be applied ({e!r})") from e
        if tail is not None:
            self.repaired = (f"{self.journal_path}: dropped {len(journal) - tail} bytes from byte {tail}, after "
                             f"the {head.records} records its header counts: a crash interrupted an append "
                             f"before it was acknowledged, so that command was never sent")
            logger.warning("%s", self.repaired)

    def _restore_snapshot(self, raw: bytes) -> None:
        try:
            if not raw:
                raise ValueError("empty file")
            if raw.startswith(OLD_MAGICS):
                raise ValueError("written by an older wsd (state file format 2), which this one does not read")
            if not raw.startswith(SNAPSHOT_MAGIC):
                raise ValueError(f"does not start with {SNAPSHOT_MAGIC!r}")
            problem = frame_problem(raw, len(SNAPSHOT_MAGIC))
            if problem is not None:
                raise ValueError(problem)
            if frame_end(raw, len(SNAPSHOT_MAGIC)) != len(raw):
                raise ValueError(f"{len(raw) - frame_end(raw, len(SNAPSHOT_MAGIC))} bytes after the document")
            doc = msgpack.unpackb(raw[len(SNAPSHOT_MAGIC) + RECORD.size:], raw=False, strict_map_key=False)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"unknown format {doc.get('format') if isinstance(doc, dict) else doc!r}")
            seq, generation = doc["seq"], doc["generation"]
            if not isinstance(seq, int) or seq < 0:
                raise ValueError(f"seq {seq!r}")
            if not isinstance(generation, int) or generation < 1:
                raise ValueError(f"generation {generation!r}")
            entries = [Command.from_row(row) for row in doc["log"]]
            if any(c.seq > seq for c in entries):
                raise ValueError(f"a kept command is numbered after seq {seq}")
            self.default = dict(doc["default"])
            self.groups = {int(g): dict(s) for g, s in doc["groups"].items()}
        except _DECODE_ERRORS as e:
            raise StateFileError(f"{self.path}: not a valid coordinator state file ({e}): restore it, or "
                                 + _START_AFRESH.format(files=f"it and {self.journal_path}")) from e
        self.seq, self.generation = seq, generation
        self.entries.extend(entries)

    def _refuse(self, problem: str) -> StateFileError:
        return StateFileError(f"{self.journal_path}: not a valid coordinator journal ({problem}): restore it, or "
                              + _START_AFRESH.format(files=f"it and {self.path}"))

    def _read_head(self, raw: bytes) -> JournalHead:
        try:
            return JournalHead.unpack(raw)
        except ValueError as e:
            raise self._refuse(str(e)) from e

    def _read_journal(self, raw: bytes, head: JournalHead) -> tuple[list[tuple[int, Command]], int | None]:
        """The records the header counts, with their byte offsets, and where bytes after them start.

        Every counted record was acknowledged, so each must be there, whole,
        with its checksum, its number in order, and the chain of them matching
        the header's. After them, an append cut short by a crash can leave one
        record or part of one, and nothing else.
        """
        records: list[tuple[int, Command]] = []
        pos, chain = HEAD.size, 0
        for i in range(head.records):
            if pos == len(raw):
                first, last = head.base + i + 1, head.base + head.records
                gone = f"command {first} is" if first == last else f"commands {first} to {last} are"
                raise self._refuse(f"ends at byte {pos} after {i} of the {head.records} records its header counts: "
                                   f"acknowledged {gone} missing")
            problem = frame_problem(raw, pos)
            if problem is not None:
                raise self._refuse(f"record {i + 1} of {head.records}, at byte {pos}: {problem}")
            end = frame_end(raw, pos)
            try:
                command = Command.from_row(msgpack.unpackb(raw[pos + RECORD.size:end], raw=False,
                                                           strict_map_key=False))
            except _DECODE_ERRORS as e:
                raise self._refuse(f"record {i + 1} of {head.records}, at byte {pos}: {e}") from e
            if command.seq != head.base + i + 1:
                raise self._refuse(f"record {i + 1} of {head.records}, at byte {pos}, has seq {command.seq}, "
                                   f"not {head.base + i + 1}")
            records.append((pos, command))
            chain = zlib.crc32(raw[pos:end], chain)
            pos = end
        if chain != head.chain:
            raise self._refuse("its records do not match the checksum in its header")
        if pos == len(raw):
            return records, None
        if len(raw) - pos > RECORD.size + MAX_RECORD or (
                frame_problem(raw, pos) is None and frame_end(raw, pos) != len(raw)):
            raise self._refuse(f"{len(raw) - pos} bytes after the {head.records} records its header counts, "
                               f"more than one interrupted append leaves")
        return records, pos
