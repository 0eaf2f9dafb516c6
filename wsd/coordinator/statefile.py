"""The state file's bytes: the snapshot's and the journal's formats, and their durable writes.

What ``wsd.coordinator.commandlog`` keeps is written here as bytes
(docs/state-file.md): a record is ``length | crc32 of length and payload |
payload``; the journal starts with a ``JournalHead`` of 40 bytes that counts
its acknowledged records and chains a CRC-32 over them. A snapshot replaces its
file atomically (``write_temporary``, then ``rename_durably``: fsync the file,
rename, fsync the folder). Every failure of the storage is a ``StateFileError``
naming the file (``storage_error``). No sockets, no torch, no knowledge of
commands: the command log decides what the bytes hold.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import tempfile
import zlib
from typing import NamedTuple

from wsd.errors import StateFileError

__all__ = [
    "FORMAT",
    "HEAD",
    "JOURNAL_MAGIC",
    "MAX_RECORD",
    "OLD_MAGICS",
    "RECORD",
    "SNAPSHOT_MAGIC",
    "JournalHead",
    "datasync",
    "frame",
    "frame_end",
    "frame_problem",
    "is_unborn",
    "pwrite_all",
    "read_regular",
    "read_state",
    "rename_durably",
    "storage_error",
    "unlink_quietly",
    "write_temporary",
]

FORMAT = 3
SNAPSHOT_MAGIC = b"WSDSNAP3"
JOURNAL_MAGIC = b"WSDJRNL3"
# Files written by wsd before the journal had a header: refused, not migrated
# (their journal cannot tell a cut at a record boundary from a shorter history).
OLD_MAGICS = (b"WSDSNAP2", b"WSDJRNL2")
RECORD = struct.Struct(">II")  # payload length, crc32 of the length field and the payload
HEAD = struct.Struct(">8sQQQII")  # magic, generation, base seq, records, chain crc32, crc32 of the rest
# A command record is a few dozen bytes; a bound on the length tells a damaged
# length field from a record.
MAX_RECORD = 1 << 20
# Errors that say the storage cannot take the write (not that wsd is wrong).
_UNAVAILABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def frame(payload: bytes) -> bytes:
    length = len(payload).to_bytes(4, "big")
    return length + zlib.crc32(payload, zlib.crc32(length)).to_bytes(4, "big") + payload


def frame_problem(raw: bytes, pos: int) -> str | None:
    """What is wrong with the record at ``pos``; None if it is whole and its checksum holds."""
    if len(raw) - pos < RECORD.size:
        return f"{len(raw) - pos} bytes, less than a record header"
    length, crc = RECORD.unpack_from(raw, pos)
    if not 0 < length <= MAX_RECORD:
        return f"impossible record length {length}"
    if pos + RECORD.size + length > len(raw):
        return f"record of {length} bytes cut short at {len(raw) - pos - RECORD.size}"
    if zlib.crc32(raw[pos + RECORD.size:pos + RECORD.size + length], zlib.crc32(raw[pos:pos + 4])) != crc:
        return "checksum mismatch"
    return None


def frame_end(raw: bytes, pos: int) -> int:
    return pos + RECORD.size + RECORD.unpack_from(raw, pos)[0]


class JournalHead(NamedTuple):
    generation: int
    """The snapshot generation this journal follows."""
    base: int
    """That snapshot's sequence number: the first record is ``base + 1``."""
    records: int
    """Records acknowledged: appended, fdatasynced and counted here."""
    chain: int
    """CRC-32 over those records' bytes, in order."""

    def pack(self) -> bytes:
        body = HEAD.pack(JOURNAL_MAGIC, *self, 0)[:-4]
        return body + zlib.crc32(body).to_bytes(4, "big")

    @classmethod
    def unpack(cls, raw: bytes) -> JournalHead:
        """The header of journal bytes ``raw``; ValueError saying what is wrong."""
        if raw.startswith(OLD_MAGICS):
            raise ValueError("written by an older wsd (state file format 2), which this one does not read")
        if len(raw) < HEAD.size:
            raise ValueError(f"{len(raw)} bytes, less than the {HEAD.size}-byte journal header")
        magic, generation, base, records, chain, crc = HEAD.unpack_from(raw)
        if magic != JOURNAL_MAGIC:
            raise ValueError(f"does not start with {JOURNAL_MAGIC!r}")
        if zlib.crc32(raw[:HEAD.size - 4]) != crc:
            raise ValueError("header checksum mismatch")
        return cls(generation, base, records, chain)


def read_state(path: str) -> bytes | None:
    try:
        return read_regular(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateFileError(f"{path}: cannot read the coordinator state: {e.strerror or e}") from e


def read_regular(path: str, max_bytes: int | None = None) -> bytes:
    """The whole of ``path``, a regular file: opened without blocking (a FIFO or a device
    planted there never stalls the coordinator) and refused, as an OSError naming what it
    is, if it is not a regular file or holds more than ``max_bytes``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if max_bytes is not None and info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than {max_bytes}", path)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def storage_error(path: str, doing: str, e: OSError) -> StateFileError:
    """``e`` as a StateFileError naming ``path`` (the file the OS names, if any)."""
    where = e.filename or path
    if e.errno in _UNAVAILABLE:
        return StateFileError(f"{where}: storage unavailable ({os.strerror(e.errno).lower()}): cannot {doing}; "
                              f"nothing was numbered: free space or fix the permissions, then retry")
    return StateFileError(f"{where}: cannot {doing}: {e.strerror or e}")


def datasync(fd: int) -> None:
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temporary(path: str, data: bytes) -> str:
    """``data`` in a new file beside ``path`` (``PATH.XXXXXXXX.tmp``), synced, for
    ``rename_durably`` to put in place. Created exclusively under a name no one could
    predict (``tempfile.mkstemp``: ``O_EXCL``, never through a link planted there); removed
    again if the write fails."""
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=folder)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    except OSError as e:
        e.filename = e.filename or tmp  # a failed write names no file: say which
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    return tmp


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def rename_durably(tmp: str, path: str) -> None:
    """Replace ``path`` atomically, durably before anything after it (the folder synced)."""
    os.replace(tmp, path)
    _fsync_dir(path)


def is_unborn(journal: bytes) -> bool:
    """Whether ``journal`` is the empty one the first compaction writes before any snapshot."""
    try:
        return JournalHead.unpack(journal) == JournalHead(1, 0, 0, 0) and len(journal) == HEAD.size
    except ValueError:
        return False
