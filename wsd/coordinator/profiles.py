"""Sizing profiles: per engine profile, the largest request each slot has served or refused.

A profile is keyed by what decides how big a rank's scratch must be (``ProfileKey``):
the model the rank serves (vLLM's served model name, the registration's ``model``) or,
with none, its engine's name; its TP size; and its grid of slots (``num_ubatches``,
``num_lanes``). Ranks of any engine with the same key feed one profile, across their
restarts and the coordinator's. It learns from what ranks push already: each slot's
``peak_requested_bytes`` (refused requests included) and its ``last_violation``'s
``requested``; a slot's size only ever grows, until an operator drops the profile.

A manager with ``[workspace] presize = "profile"`` is handed its profile's sizes in
its registration's answer and reserves them before its engine warms up and locks.

What a rank pushes is its claim, and a profile is handed to every engine of its model:
so a profile learns a slot's size only up to what the same snapshot shows that slot
holds or was refused (its capacity, or its own last violation's request), and never
beyond ``max_profile_slot_bytes``; every growth says which engine and rank caused it
(``grew``: the ``profile_grew`` event); one registration creates at most
``NEW_PER_REGISTRATION`` profiles.

``Profiles`` is the store: bounded (``MAX_PROFILES``, and ``MAX_SLOTS`` slots in all,
the least recently grown dropped first; at most ``MAX_PROFILE_SLOTS`` slots each), written to its own file beside the
state file (``STATE_FILE.profiles``, docs/state-file.md) atomically, at most every
``SAVE_EVERY`` seconds while it changed, and when the coordinator stops. The data is
advisory: a damaged file is moved aside, never overwritten, and the coordinator starts
with no profiles instead of not starting. Plain methods, no sockets, no torch.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from wsd.coordinator.statefile import read_regular, rename_durably, storage_error, write_temporary
from wsd.slotstats import MAX_LANES, MAX_UBATCHES

__all__ = ["MAX_PROFILES", "MAX_PROFILE_SLOTS", "MAX_SLOTS", "NEW_PER_REGISTRATION", "PROFILES_SUFFIX", "SAVE_EVERY",
           "Growth", "Profile", "ProfileKey", "Profiles", "learned_sizes", "profiles_path"]

logger = logging.getLogger(__name__)

MAX_PROFILES = 1024
"""Profiles kept at most; one more drops the one whose sizes grew least recently."""
MAX_PROFILE_SLOTS = MAX_UBATCHES * MAX_LANES
"""Slots one profile holds at most: a manager's whole grid."""
MAX_SLOTS = 1 << 16
"""Slots of every profile together at most; beyond, the least recently grown profiles go."""
NEW_PER_REGISTRATION = 4
"""Profiles one registration of a rank may create: its grid at start and a few changes of it."""
MAX_NAMED = 256
"""Ranks (and engines) a profile names as its contributors at most; beyond, it counts no more."""
MAX_FILE_BYTES = 64 << 20
"""A profiles file larger than this is not one these bounds write: set aside unread."""

SAVE_EVERY = 5.0
"""Least seconds between two writes of the profiles file while profiles change."""
PROFILES_SUFFIX = ".profiles"
MAGIC = b"WSDPROF1"
_HEADER = struct.Struct(">8sQI")  # magic, payload length, crc32 of the payload
_MAX_NAME = 256  # a model's name (the registration's model is at most 256 characters)
_SEPARATOR = ":"


def profiles_path(state_file: str) -> str:
    """Where the coordinator keeps its sizing profiles: beside its state file."""
    return state_file + PROFILES_SUFFIX


class ProfileKey(NamedTuple):
    """What a profile is for; written ``NAME:tpT:ubU:lnL`` (``wsctl profiles --drop KEY``)."""

    name: str
    """The model a rank serves (the registration's ``model``), else its engine's name."""
    tp_size: int
    num_ubatches: int
    num_lanes: int

    def __str__(self) -> str:
        return f"{self.name}:tp{self.tp_size}:ub{self.num_ubatches}:ln{self.num_lanes}"

    @classmethod
    def of(cls, model: str | None, engine: str, tp_size: int, num_ubatches: int, num_lanes: int) -> ProfileKey:
        """The key of a rank serving ``model`` (None: named after its ``engine``); ValueError
        for parts out of bounds."""
        return cls(model or engine, tp_size, num_ubatches, num_lanes).checked()

    @classmethod
    def parse(cls, text: str) -> ProfileKey:
        """The key ``str(key)`` wrote; ValueError saying what is wrong (a model's name may
        hold ``:``: the three numbers are read from the end)."""
        parts = text.rsplit(_SEPARATOR, 3)
        numbers: list[int] = []
        for part, prefix in zip(parts[1:], ("tp", "ub", "ln")):
            digits = part[len(prefix):]
            if not part.startswith(prefix) or not digits.isdigit() or len(digits) > 7:
                numbers = []
                break
            numbers.append(int(digits))
        if len(parts) != 4 or len(numbers) != 3 or not parts[0]:
            raise ValueError(f"{text!r} is not a profile key: NAME:tpT:ubU:lnL, as wsctl profiles shows it")
        return cls(parts[0], *numbers).checked()

    def checked(self) -> ProfileKey:
        """Itself, if within bounds; else ValueError naming the part."""
        if not isinstance(self.name, str) or not 0 < len(self.name) <= _MAX_NAME:
            raise ValueError(f"profile name must be 1 to {_MAX_NAME} characters, got {self.name!r}")
        for part, high in (("tp_size", 1 << 20), ("num_ubatches", MAX_UBATCHES), ("num_lanes", MAX_LANES)):
            value = getattr(self, part)
            if type(value) is not int or not 1 <= value <= high:
                raise ValueError(f"profile {part} must be 1 to {high}, got {value!r}")
        return self


@dataclass
class Profile:
    """One profile: per slot the largest request seen, when it last grew, and who fed it."""

    slots: dict[tuple[int, int], int] = field(default_factory=dict)
    updated: float = 0.0
    """Wall-clock time at which a slot's size last grew."""
    ranks: set[str] = field(default_factory=set)
    """``ENGINE/RANK`` of each rank whose snapshots it read (at most ``MAX_NAMED``)."""
    engines: set[str] = field(default_factory=set)

    def sizes(self) -> list[list[int]]:
        """``[[ubatch, lane, bytes], ...]`` in slot order: the ``registered`` answer's ``presize``."""
        return [[u, lane, size] for (u, lane), size in sorted(self.slots.items())]

    def public(self, key: ProfileKey) -> dict[str, Any]:
        """This profile in ``profiles``' answer."""
        sizes = self.sizes()
        return {"key": str(key), "name": key.name, "tp_size": key.tp_size, "num_ubatches": key.num_ubatches,
                "num_lanes": key.num_lanes, "slots": sizes, "total_bytes": sum(s[2] for s in sizes),
                "largest_bytes": max((s[2] for s in sizes), default=0), "updated": self.updated,
                "ranks": len(self.ranks), "engines": len(self.engines)}


def learned_sizes(key: ProfileKey, columns: dict[str, list[Any]],
                  violations: dict[str, list[Any]] | None, limit: int) -> dict[tuple[int, int], int]:
    """Per slot of ``key``'s grid, the largest request a checked snapshot shows it served or
    refused: its ``peak_requested_bytes`` (refused requests counted) or its last violation's
    ``requested``, whichever is larger, but never beyond what the snapshot shows the slot
    holds or was refused (its ``capacity_bytes``, that violation's ``requested``) nor beyond
    ``limit``. Slots outside the grid are left out."""
    ubatches, lanes = columns["ubatch"], columns["lane"]
    refused: dict[int, int] = {}
    if violations:
        for index, requested in zip(violations.get("slot", ()), violations.get("requested", ())):
            if 0 <= index < len(ubatches):
                refused[index] = max(requested, refused.get(index, 0))
    seen: dict[tuple[int, int], int] = {}
    for index, (u, lane, peak, capacity) in enumerate(zip(ubatches, lanes, columns["peak_requested_bytes"],
                                                          columns["capacity_bytes"])):
        if u < key.num_ubatches and lane < key.num_lanes:
            shown = max(capacity, refused.get(index, 0))  # what the slot holds, or was refused
            size = min(max(peak, refused.get(index, 0)), shown, limit)
            if size > 0:
                seen[u, lane] = size
    return seen


class Growth(NamedTuple):
    """One slot of a profile grown by one snapshot: what the ``profile_grew`` event says."""

    ubatch: int
    lane: int
    old: int
    new: int


def _touches_sizes(delta: dict[str, Any]) -> bool:
    return (bool({"peak_requested_bytes", "capacity_bytes"} & set(delta.get("columns", ())))
            or "last_violation" in delta.get("tables", ())
            or bool({"num_ubatches", "num_lanes"} & set(delta.get("fields", ()))))


class Profiles:
    """Every sizing profile of a coordinator, and its file."""

    def __init__(self, path: str | None, *, wall: Callable[[], float], clock: Callable[[], float],
                 max_slot_bytes: int = 32 << 30) -> None:
        """``path`` None: kept in memory only; ``max_slot_bytes``: the most one slot learns."""
        self.path = path
        self.wall = wall
        self.clock = clock
        self.max_slot_bytes = max_slot_bytes
        self.profiles: OrderedDict[ProfileKey, Profile] = OrderedDict()  # the least recently grown first
        self.slots = 0
        """Slots of every profile together (``MAX_SLOTS`` at most)."""
        self._created: OrderedDict[Any, int] = OrderedDict()  # profiles created, per registration
        self.dirty = False
        self._next_save = clock()
        self._failing = False  # the last write failed (said once until one succeeds)
        if path is not None:
            self._load(path)

    # -- learning and reading -------------------------------------------------

    def learn(self, key: ProfileKey, engine: str, rank: int, seen: dict[tuple[int, int], int],
              registration: Any = None) -> list[Growth]:
        """What one rank's snapshot shows its slots asked for (``learned_sizes``); the slots it
        grew. ``registration``: the rank's registration, which creates at most
        ``NEW_PER_REGISTRATION`` profiles (None: no such budget)."""
        profile = self.profiles.get(key)
        if profile is None:
            if not seen or not self._may_create(registration):
                return []
            profile = self.profiles[key] = Profile()
        grown = []
        slots = profile.slots
        for (u, lane), size in seen.items():
            size = min(size, self.max_slot_bytes)
            old = slots.get((u, lane), 0)
            if size > old:
                slots[u, lane] = size
                self.slots += old == 0
                grown.append(Growth(u, lane, old, size))
        who = f"{engine}/{rank}"
        if who not in profile.ranks and len(profile.ranks) < MAX_NAMED:
            profile.ranks.add(who)
            self.dirty = True
        if engine not in profile.engines and len(profile.engines) < MAX_NAMED:
            profile.engines.add(engine)
            self.dirty = True
        if grown:
            profile.updated = self.wall()
            self.profiles.move_to_end(key)
            self.dirty = True
            self._trim(keep=key)
        return grown

    def _may_create(self, registration: Any) -> bool:
        """Whether ``registration`` may create one more profile (counted when it may)."""
        if registration is None:
            return True
        created = self._created.pop(registration, 0)
        self._created[registration] = created + 1
        while len(self._created) > MAX_PROFILES:  # bounded: the oldest registrations forgotten
            self._created.popitem(last=False)
        return created < NEW_PER_REGISTRATION

    def _trim(self, keep: ProfileKey) -> None:
        """Drop the least recently grown profiles (never ``keep``) beyond the bounds."""
        while len(self.profiles) > MAX_PROFILES or self.slots > MAX_SLOTS:
            oldest = next(iter(self.profiles))
            if oldest == keep:
                break
            self.slots -= len(self.profiles.pop(oldest).slots)

    def learn_push(self, engine: str, rank: Any, tp_size: int | None, body: dict[str, Any], wire: dict[str, Any],
                   columns: dict[str, list[Any]]) -> tuple[ProfileKey | None, list[Growth]]:
        """A ``stats_push`` (``body``) of ``rank`` (its ``RankInfo``: number, model, registration)
        of ``engine``, whose snapshot is now ``wire`` (checked, with its slot ``columns``):
        learned from when it can change what a profile holds (a whole snapshot, or a delta
        touching the peaks, capacities, the last violations or the grid). The key learned
        into and the slots grown."""
        delta = body.get("delta") if body.get("base") is not None else None
        if tp_size is None or (delta is not None and not _touches_sizes(delta)):
            return None, []
        try:
            key = ProfileKey.of(rank.model, engine, tp_size, wire["num_ubatches"], wire["num_lanes"])
        except (KeyError, TypeError, ValueError):
            return None, []
        seen = learned_sizes(key, columns, wire["slots"].get("last_violation"), self.max_slot_bytes)
        return key, self.learn(key, engine, rank.rank, seen, (engine, rank.rank, rank.peer, rank.registered_at))

    def for_registration(self, body: dict[str, Any], engine: str) -> list[list[int]] | None:
        """The ``registered`` answer's ``presize`` for a registration ``body`` of ``engine``:
        its profile's sizes if it asked (``presize``: its grid) and one is known, else None."""
        grid = body.get("presize")
        if not (isinstance(grid, list) and len(grid) == 2):
            return None
        try:
            key = ProfileKey.of(body.get("model"), engine, body["tp_size"], *grid)
        except (TypeError, ValueError):
            return None
        return self.sizes(key)

    def sizes(self, key: ProfileKey) -> list[list[int]] | None:
        """``key``'s per-slot sizes, or None when no profile of that key is known."""
        profile = self.profiles.get(key)
        return None if profile is None or not profile.slots else profile.sizes()

    def drop(self, key: ProfileKey) -> bool:
        """Forget ``key``'s profile; whether there was one."""
        profile = self.profiles.pop(key, None)
        if profile is None:
            return False
        self.slots -= len(profile.slots)
        self.dirty = True
        return True

    def public(self, offset: int = 0, limit: int = MAX_PROFILES) -> list[dict[str, Any]]:
        """The profiles ``offset`` to ``offset + limit`` by key, for ``profiles``' answer (one
        page: bounded work on the coordinator's loop whatever the number of profiles)."""
        keys = sorted(self.profiles, key=str)[offset:offset + limit]
        return [self.profiles[key].public(key) for key in keys]

    # -- the file -------------------------------------------------------------

    def next_deadline(self) -> float:
        return self._next_save if self.dirty and self.path is not None else float("inf")

    def tick(self, now: float) -> None:
        """Write the file if profiles changed and the last write is ``SAVE_EVERY`` old."""
        if self.dirty and self.path is not None and now >= self._next_save:
            self._next_save = now + SAVE_EVERY
            self.save()

    def save(self) -> bool:
        """Write every profile now (atomically: a temporary file renamed over the old one);
        False if the storage refused, which is logged (once until a write succeeds)."""
        if self.path is None:
            return False
        data = self.encode()
        try:
            rename_durably(write_temporary(self.path, data), self.path)
        except OSError as e:
            if not self._failing:
                logger.error("%s; the sizing profiles stay in memory and are written again in %g s",
                             storage_error(self.path, "write the sizing profiles", e), SAVE_EVERY)
            self._failing = True
            return False
        if self._failing:
            logger.info("%s: sizing profiles written again", self.path)
        self._failing = False
        self.dirty = False
        return True

    def close(self) -> None:
        """The coordinator stops: what changed since the last write is written."""
        if self.dirty:
            self.save()

    def encode(self) -> bytes:
        payload = msgpack.packb({"format": 1, "profiles": [
            {"key": list(key), "updated": p.updated, "slots": p.sizes(), "ranks": sorted(p.ranks),
             "engines": sorted(p.engines)} for key, p in self.profiles.items()]}, use_bin_type=True)
        return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload

    @staticmethod
    def decode(raw: bytes) -> OrderedDict[ProfileKey, Profile]:
        """The profiles a file's bytes hold; ValueError saying what is wrong."""
        if len(raw) < _HEADER.size or not raw.startswith(MAGIC):
            raise ValueError(f"does not start with {MAGIC!r}")
        _, length, crc = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size:]
        if len(payload) != length:
            raise ValueError(f"{len(payload)} bytes of profiles where the header says {length}")
        if zlib.crc32(payload) != crc:
            raise ValueError("checksum mismatch")
        try:
            data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"not msgpack: {e}") from e
        if not isinstance(data, dict) or data.get("format") != 1 or not isinstance(data.get("profiles"), list):
            raise ValueError("not a format 1 profiles map")
        out: OrderedDict[ProfileKey, Profile] = OrderedDict()
        for entry in data["profiles"][:MAX_PROFILES]:
            key, profile = _read_profile(entry)
            out[key] = profile
        return out

    def _load(self, path: str) -> None:
        try:
            raw = read_regular(path, MAX_FILE_BYTES)
        except FileNotFoundError:
            return
        except OSError as e:
            logger.error("%s: cannot read the sizing profiles (%s): starting with none; they are learned again, "
                         "and this file is not written over", path, e.strerror or e)
            self.path = None  # never overwrite what could not be read
            return
        try:
            self.profiles = self.decode(raw)
        except ValueError as e:
            self._set_aside(path, str(e))
            return
        for profile in self.profiles.values():  # learned under a larger bound, or none: cut to this one
            profile.slots = {slot: min(size, self.max_slot_bytes) for slot, size in profile.slots.items()}
        self.slots = sum(len(profile.slots) for profile in self.profiles.values())
        if self.profiles:
            self._trim(keep=next(reversed(self.profiles)))
        logger.info("%s: %d sizing profile(s) loaded", path, len(self.profiles))

    def _set_aside(self, path: str, why: str) -> None:
        """A damaged file: moved aside, kept for whoever looks into it, never written over."""
        aside = f"{path}.damaged-{int(self.wall())}"
        try:
            os.replace(path, aside)
        except OSError as e:
            logger.error("%s: the sizing profiles file is damaged (%s) and cannot be moved aside (%s): starting "
                         "with none and writing none; move or delete it, then restart the coordinator", path, why,
                         e.strerror or e)
            self.path = None
            return
        logger.error("%s: the sizing profiles file is damaged (%s): moved aside to %s; starting with no profiles "
                     "(they are learned again as ranks report). Keep that file for a bug report, or delete it",
                     path, why, aside)


def _read_profile(entry: Any) -> tuple[ProfileKey, Profile]:
    """One profile of a decoded file; ValueError saying what is wrong."""
    if not isinstance(entry, dict):
        raise ValueError("a profile is not a map")
    key_parts, slots, updated = entry.get("key"), entry.get("slots"), entry.get("updated")
    if not isinstance(key_parts, list) or len(key_parts) != 4:
        raise ValueError("a profile's key is not [name, tp_size, num_ubatches, num_lanes]")
    key = ProfileKey(*key_parts).checked()
    if not isinstance(updated, (int, float)) or isinstance(updated, bool):
        raise ValueError(f"profile {key}: updated is not a time")
    if not isinstance(slots, list) or len(slots) > key.num_ubatches * key.num_lanes:
        raise ValueError(f"profile {key}: slots is not a list of at most its grid's slots")
    profile = Profile(updated=float(updated))
    for slot in slots:
        if not (isinstance(slot, list) and len(slot) == 3 and all(type(v) is int for v in slot)
                and 0 <= slot[0] < key.num_ubatches and 0 <= slot[1] < key.num_lanes and 0 < slot[2] < 2**63):
            raise ValueError(f"profile {key}: slot {slot!r} is not [ubatch, lane, bytes] within its grid")
        profile.slots[slot[0], slot[1]] = slot[2]
    for name in ("ranks", "engines"):
        names = entry.get(name, [])
        if not isinstance(names, list) or not all(isinstance(n, str) and len(n) <= 512 for n in names):
            raise ValueError(f"profile {key}: {name} is not a list of names")
        getattr(profile, name).update(names[:MAX_NAMED])
    return key, profile
