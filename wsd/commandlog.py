"""The coordinator's command log and desired state, persisted atomically.

Every state-changing command gets the next sequence number and is written to
the state file (write a temporary file, fsync, rename, fsync the directory)
before it is sent to any agent, so that a coordinator restarted from the file
knows every command it ever sent. No sockets, no torch.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from wsd.errors import StateFileError

__all__ = ["Command", "CommandLog"]

_FORMAT = 1


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


def _blank() -> dict[str, Any]:
    return {"locked": None, "num_ubatches": None, "reserve_bytes": None}


class CommandLog:
    """Sequence numbers, the last ``capacity`` commands and the desired state per group."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.seq = 0
        self.entries: deque[Command] = deque(maxlen=capacity)
        self.default = _blank()
        self.groups: dict[int, dict[str, Any]] = {}

    def desired(self, group: int) -> dict[str, Any]:
        return dict(self.groups.get(group, self.default))

    def append(self, action: str, args: dict[str, Any], group: int | None, now: float) -> Command:
        """Record the next command durably; StateFileError (and nothing recorded) if it cannot be."""
        command = Command(self.seq + 1, action, dict(args), group, now)
        # Work on copies and adopt them only once they are on disk.
        default = dict(self.default)
        groups = {g: dict(s) for g, s in self.groups.items()}
        if group is None:
            targets = [default, *groups.values()]
        else:
            targets = [groups.setdefault(group, dict(default))]
        for state in targets:
            _apply_desired(state, action, args)
        entries = deque(self.entries, maxlen=self.entries.maxlen)
        entries.append(command)
        self._write(self._document(command.seq, default, groups, entries))
        self.seq, self.default, self.groups, self.entries = command.seq, default, groups, entries
        return command

    def since(self, seq: int) -> list[Command]:
        """Commands after ``seq`` still in the log, oldest first."""
        return [c for c in self.entries if c.seq > seq]

    def oldest(self) -> int:
        return self.entries[0].seq if self.entries else self.seq + 1

    def bump_to(self, seq: int) -> None:
        """Never hand out a number an agent has already applied (a state file was lost)."""
        if seq > self.seq:
            self._write(self._document(seq, self.default, self.groups, self.entries))
            self.seq = seq

    # -- persistence -------------------------------------------------------

    @staticmethod
    def _document(
        seq: int, default: dict[str, Any], groups: dict[int, dict[str, Any]], entries: deque[Command]
    ) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "seq": seq,
            "default": default,
            "groups": {str(g): s for g, s in groups.items()},
            "log": [[c.seq, c.action, c.args, c.group, c.time] for c in entries],
        }

    def save(self) -> None:
        self._write(self._document(self.seq, self.default, self.groups, self.entries))

    def _write(self, document: dict[str, Any]) -> None:
        data = msgpack.packb(document, use_bin_type=True)
        directory = os.path.dirname(os.path.abspath(self.path))
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise StateFileError(f"{self.path}: cannot write the coordinator state: {e}") from e

    def load(self) -> bool:
        """Restore from the state file; False if there is none yet."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StateFileError(f"{self.path}: cannot read the coordinator state: {e}") from e
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError(f"unknown format {doc.get('format') if isinstance(doc, dict) else doc!r}")
            seq = doc["seq"]
            if not isinstance(seq, int) or seq < 0:
                raise ValueError(f"seq {seq!r}")
            entries = [Command(int(s), str(a), dict(args), g, float(t)) for s, a, args, g, t in doc["log"]]
            default = dict(doc["default"])
            groups = {int(g): dict(s) for g, s in doc["groups"].items()}
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
            raise StateFileError(f"{self.path}: not a valid coordinator state file ({e})") from e
        self.seq = seq
        self.entries.clear()
        self.entries.extend(entries)
        self.default = default
        self.groups = groups
        return True
