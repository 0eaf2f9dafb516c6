"""The coordinator's command log and desired state, kept on disk as a snapshot and a journal.

Every state-changing command gets the next sequence number and is recorded
durably before it is sent to any agent, so that a coordinator restarted from
disk knows every command it ever sent. Two files hold it:

* the snapshot, at ``state_file``: desired state, sequence number and the kept
  commands, replaced atomically (temporary file, fsync, rename, fsync the
  folder);
* the journal, at ``state_file + ".journal"``: one record per command since the
  snapshot, appended and fsynced before the command is sent.

Recording a command writes one small record however many commands are kept.
The journal is folded into a new snapshot when it holds ``2 * capacity``
records (so a snapshot's bytes are spread over at least ``capacity`` commands)
and at start-up. Both files start with a magic and hold frames of
``length (u32) | crc32 (u32) | msgpack payload``, so damage is found exactly:
see ``load``. No sockets, no torch.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from wsd.errors import StateFileError

__all__ = ["Command", "CommandLog"]

logger = logging.getLogger(__name__)

_FORMAT = 2
_SNAPSHOT_MAGIC = b"WSDSNAP2"
_JOURNAL_MAGIC = b"WSDJRNL2"
_HEADER = struct.Struct(">II")  # payload length, crc32 of the payload
# A command record is a few dozen bytes; a bound on the length tells a damaged
# length field from a record, and a torn tail from a damaged middle.
_MAX_RECORD = 1 << 20
_DECODE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, struct.error, msgpack.UnpackException)


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
    if action == "lock":
        state["locked"] = True
    elif action == "unlock":
        state["locked"] = False
    elif action == "set_ubatches":
        state["num_ubatches"] = args["n"]
    elif action == "reserve":
        state["reserve_bytes"] = max(state.get("reserve_bytes") or 0, args["bytes"])
    elif action == "trim":
        state["reserve_bytes"] = None


# The desired-state fields each action changes (see _apply_desired).
_TOUCHES = {"lock": ("locked",), "unlock": ("locked",), "set_ubatches": ("num_ubatches",),
            "reserve": ("reserve_bytes",), "trim": ("reserve_bytes",)}


def _blank() -> dict[str, Any]:
    return {"locked": None, "num_ubatches": None, "reserve_bytes": None}


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _frame_problem(raw: bytes, pos: int) -> str | None:
    """What is wrong with the frame at ``pos``; None if it is whole and its checksum holds."""
    if len(raw) - pos < _HEADER.size:
        return f"{len(raw) - pos} bytes, less than a record header"
    length, crc = _HEADER.unpack_from(raw, pos)
    if not 0 < length <= _MAX_RECORD:
        return f"impossible record length {length}"
    if pos + _HEADER.size + length > len(raw):
        return f"record of {length} bytes cut short at {len(raw) - pos - _HEADER.size}"
    if zlib.crc32(raw[pos + _HEADER.size:pos + _HEADER.size + length]) != crc:
        return "checksum mismatch"
    return None


def _is_torn_tail(raw: bytes, pos: int) -> bool:
    """Whether the bad bytes from ``pos`` on can be one append cut short by a crash.

    Such an append leaves at most one record's bytes (a prefix, or on some file
    systems the full length with part of it unwritten) and no whole record after
    them. Anything else is damage to records that were once complete.
    """
    if len(raw) - pos > _HEADER.size + _MAX_RECORD:
        return False
    return all(_frame_problem(raw, q) is not None for q in range(pos + 1, len(raw) - _HEADER.size))


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateFileError(f"{path}: cannot read the coordinator state: {e}") from e


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(path: str, data: bytes) -> None:
    """Write ``data`` as ``path`` atomically: a crash leaves the old file or the new one."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path)


class CommandLog:
    """Sequence numbers, the last ``capacity`` commands and the desired state per group."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.journal_path = f"{path}.journal"
        self.capacity = capacity
        self.seq = 0
        self.entries: deque[Command] = deque(maxlen=capacity)
        self.default = _blank()
        self.groups: dict[int, dict[str, Any]] = {}
        self.repaired: str | None = None
        """What ``load`` dropped from a journal cut short by a crash, if anything."""
        # False until the journal is known to be whole and ours: the next append
        # then writes a fresh snapshot and journal first (a fresh log, or a failed
        # append that may have left part of a record behind).
        self._journal_ready = False
        self._journal_records = 0
        self._compact_after = 2 * capacity

    def desired(self, group: int) -> dict[str, Any]:
        return dict(self.groups.get(group, self.default))

    def desired_at(self, group: int, seq: int) -> dict[str, Any] | None:
        """``group``'s desired state as it was at ``seq``; None when the kept log cannot tell.

        A field no command after ``seq`` touched is as it is now. A field one
        did is rebuilt from the kept commands up to ``seq``: lock, unlock,
        set_ubatches and trim set it outright; reserve only raises it, so it
        needs a trim before it in the log, or the log from seq 1.
        """
        if seq >= self.seq:
            return self.desired(group)
        if self.oldest() > seq + 1:
            return None  # commands after seq are gone: what they changed is unknown
        unknown = object()
        past: dict[str, Any] = _blank() if self.oldest() == 1 else dict.fromkeys(_blank(), unknown)
        for c in self.entries:
            if c.seq <= seq and c.targets(group):
                if c.action == "reserve" and past["reserve_bytes"] is unknown:
                    continue  # a raise of an unknown value stays unknown
                _apply_desired(past, c.action, c.args)
        state = self.desired(group)
        for c in self.entries:
            if c.seq > seq and c.targets(group):
                for key in _TOUCHES.get(c.action, ()):
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
        if len(payload) > _MAX_RECORD:
            raise StateFileError(f"{self.journal_path}: a command of {len(payload)} bytes is too large to record")
        self._append_record(_frame(payload))
        self._apply(command)  # only once it is on disk
        self._journal_records += 1
        if self._journal_records >= self._compact_after:
            try:
                self.compact()
            except StateFileError as e:
                # The command is recorded (and will be sent): only the folding
                # failed, which loses nothing. Retry after another capacity.
                logger.warning("cannot compact the coordinator journal, will retry: %s", e)
                self._compact_after = self._journal_records + self.capacity
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

    def compact(self) -> None:
        """Write the whole state as the snapshot, then start an empty journal.

        In that order, each step atomic: a crash between the two leaves a
        journal whose records the snapshot already holds, which ``load`` skips.
        """
        document = {
            "format": _FORMAT,
            "seq": self.seq,
            "default": self.default,
            "groups": {str(g): s for g, s in self.groups.items()},
            "log": [c.to_row() for c in self.entries],
        }
        try:
            _replace(self.path, _SNAPSHOT_MAGIC + _frame(msgpack.packb(document, use_bin_type=True)))
            _replace(self.journal_path, _JOURNAL_MAGIC)
        except OSError as e:
            raise StateFileError(f"{e.filename or self.path}: cannot write the coordinator state: {e}") from e
        self._journal_ready = True
        self._journal_records = 0
        self._compact_after = 2 * self.capacity

    def _append_record(self, record: bytes) -> None:
        try:
            # No O_CREAT: compact() made the journal; if it has gone, say so.
            fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
            try:
                _write_all(fd, record)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            # Part of the record may be on disk: appending after it would turn
            # a torn tail into damage mid-journal, so start afresh next time.
            self._journal_ready = False
            raise StateFileError(f"{self.journal_path}: cannot record the command: {e}") from e

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

        A journal whose last record was cut short is repaired by dropping that
        record (see ``_read_journal``): it was being appended when the process
        died, and a command is sent only after its record is fsynced, so no
        agent ever saw it. Any other damage raises StateFileError naming the
        file and what is wrong, and leaves both files exactly as they are.
        """
        snapshot, journal = _read(self.path), _read(self.journal_path)
        if snapshot is None:
            if journal is None:
                return False
            raise StateFileError(f"{self.path}: missing, but its journal {self.journal_path} exists "
                                 f"(restore the snapshot, or move both away to start afresh)")
        fresh = CommandLog(self.path, self.capacity)
        fresh._restore_snapshot(snapshot)
        records, torn = fresh._read_journal(journal)
        if records and records[0][1].seq > fresh.seq + 1:
            raise StateFileError(
                f"{self.journal_path}: starts at seq {records[0][1].seq} but the snapshot {self.path} "
                f"ends at seq {fresh.seq}: commands in between are missing")
        for at, command in records:
            if command.seq > fresh.seq:
                try:
                    fresh._apply(command)
                except _DECODE_ERRORS as e:
                    raise StateFileError(f"{self.journal_path}: record at byte {at} cannot be applied ({e!r})") from e
        if torn is not None:
            cut = len(journal or b"") - torn
            fresh.repaired = (f"{self.journal_path}: dropped the last record, cut short at byte {torn} ({cut} bytes):"
                              " a crash interrupted its append, so it was never sent")
            logger.warning("%s", fresh.repaired)
        self.seq, self.entries, self.default, self.groups = fresh.seq, fresh.entries, fresh.default, fresh.groups
        self.repaired = fresh.repaired
        if journal is not None:
            # Fold the journal in, so that it is short again and, if it was torn,
            # no record is ever appended after the torn bytes.
            self.compact()
        return True

    def _restore_snapshot(self, raw: bytes) -> None:
        try:
            if not raw:
                raise ValueError("empty file")
            if not raw.startswith(_SNAPSHOT_MAGIC):
                raise ValueError(f"does not start with {_SNAPSHOT_MAGIC!r}")
            problem = _frame_problem(raw, len(_SNAPSHOT_MAGIC))
            if problem is not None:
                raise ValueError(problem)
            length, _ = _HEADER.unpack_from(raw, len(_SNAPSHOT_MAGIC))
            if len(_SNAPSHOT_MAGIC) + _HEADER.size + length != len(raw):
                raise ValueError(f"{len(raw) - len(_SNAPSHOT_MAGIC) - _HEADER.size - length} bytes after the document")
            doc = msgpack.unpackb(raw[len(_SNAPSHOT_MAGIC) + _HEADER.size:], raw=False, strict_map_key=False)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError(f"unknown format {doc.get('format') if isinstance(doc, dict) else doc!r}")
            seq = doc["seq"]
            if not isinstance(seq, int) or seq < 0:
                raise ValueError(f"seq {seq!r}")
            entries = [Command.from_row(row) for row in doc["log"]]
            if any(c.seq > seq for c in entries):
                raise ValueError(f"a kept command is numbered after seq {seq}")
            self.default = dict(doc["default"])
            self.groups = {int(g): dict(s) for g, s in doc["groups"].items()}
        except _DECODE_ERRORS as e:
            raise StateFileError(f"{self.path}: not a valid coordinator state file ({e})") from e
        self.seq = seq
        self.entries.extend(entries)

    def _read_journal(self, raw: bytes | None) -> tuple[list[tuple[int, Command]], int | None]:
        """The journal's records with their byte offsets, and where a torn last record starts."""
        if raw is None:
            return [], None
        if not raw.startswith(_JOURNAL_MAGIC):
            what = "empty file" if not raw else f"does not start with {_JOURNAL_MAGIC!r}"
            raise StateFileError(f"{self.journal_path}: not a valid coordinator journal ({what})")
        records: list[tuple[int, Command]] = []
        pos = len(_JOURNAL_MAGIC)
        while pos < len(raw):
            problem = _frame_problem(raw, pos)
            if problem is not None:
                if _is_torn_tail(raw, pos):
                    return records, pos
                raise StateFileError(f"{self.journal_path}: not a valid coordinator journal "
                                     f"(record at byte {pos}: {problem}, with data after it)")
            length, _ = _HEADER.unpack_from(raw, pos)
            try:
                command = Command.from_row(msgpack.unpackb(raw[pos + _HEADER.size:pos + _HEADER.size + length],
                                                           raw=False, strict_map_key=False))
            except _DECODE_ERRORS as e:
                raise StateFileError(f"{self.journal_path}: not a valid coordinator journal "
                                     f"(record at byte {pos}: {e})") from e
            if records and command.seq != records[-1][1].seq + 1:
                raise StateFileError(f"{self.journal_path}: not a valid coordinator journal (record at byte "
                                     f"{pos} has seq {command.seq} after seq {records[-1][1].seq})")
            records.append((pos, command))
            pos += _HEADER.size + length
        return records, None
