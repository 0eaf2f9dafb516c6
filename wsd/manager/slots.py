"""Slot selection and per-slot state of the workspace manager.

The current slot is chosen by two context variables, set by ``use_ubatch`` and
``use_lane``, so that each thread or task of an engine (vLLM's dual-batch
overlap runs one per ubatch) sees its own choice.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Hashable, Iterator
from types import FrameType
from typing import Any

import torch

from wsd.slotstats import SLOT_COLUMNS, LockViolation, PersistentStats, RetainedStats, SlotStats

__all__ = ["Slot", "caller_outside", "count_as_manager", "current_lane", "current_ubatch", "key_text",
           "use_lane", "use_ubatch"]

UBATCH_ID: contextvars.ContextVar[int] = contextvars.ContextVar("wsd_ubatch", default=0)
LANE_ID: contextvars.ContextVar[int] = contextvars.ContextVar("wsd_lane", default=0)

# Frames in these files are the manager's own; the caller is the first outside
# (for vLLM, the kernel that asked, not the drop-in module it called through).
# The manager's modules are listed here; an engine integration that stands in
# for the engine's own module adds its file with count_as_manager when it loads.
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES: set[str] = set()


def count_as_manager(path: str) -> None:
    """Count the frames of the file ``path`` as the manager's own: a lock violation's
    caller is the first frame outside them (an integration's ``count_as_manager(__file__)``)."""
    _OWN_FILES.add(os.path.normcase(os.path.normpath(os.path.abspath(path))))


for _name in ("core.py", "slots.py", "buffers.py", "operator_commands.py", "persistent.py", "refusals.py"):
    count_as_manager(os.path.join(_HERE, _name))


def _check_id(kind: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{kind} id must be a non-negative integer, got {value!r}")
    return value


@contextlib.contextmanager
def use_ubatch(ubatch: int) -> Iterator[None]:
    """Within the block, workspace requests use micro-batch slot ``ubatch``."""
    token = UBATCH_ID.set(_check_id("ubatch", ubatch))
    try:
        yield
    finally:
        UBATCH_ID.reset(token)


@contextlib.contextmanager
def use_lane(lane: int) -> Iterator[None]:
    """Within the block, workspace requests use lane ``lane`` of the current ubatch."""
    token = LANE_ID.set(_check_id("lane", lane))
    try:
        yield
    finally:
        LANE_ID.reset(token)


def current_ubatch() -> int:
    """The ubatch id ``use_ubatch`` selected (0 outside any block)."""
    return UBATCH_ID.get()


def current_lane() -> int:
    """The lane id ``use_lane`` selected (0 outside any block)."""
    return LANE_ID.get()


def caller_outside() -> str:
    """``file:line:function`` of the first frame outside the manager's own modules."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.normcase(frame.f_code.co_filename) in _OWN_FILES:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}"


# Longest text a persistent key is shown as in stats: keys come from the engine
# and travel in every snapshot, so their cost stays bounded.
_KEY_TEXT_LIMIT = 200


def key_text(key: Hashable) -> str:
    """A persistent key as stats show it: itself if text, else its repr, bounded."""
    text = key if isinstance(key, str) else repr(key)
    return text if len(text) <= _KEY_TEXT_LIMIT else text[: _KEY_TEXT_LIMIT - 3] + "..."


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj if isinstance(o, torch.Tensor))
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values() if isinstance(o, torch.Tensor))
    return 0


class Slot:
    """One (ubatch, lane) slot: its buffer, the views bound to it, its counters.

    Each number of ``wsd.slotstats.SLOT_NUMBERS`` is an attribute of the
    same name here, which ``stats`` copies into the snapshot.
    """

    __slots__ = (
        "buffer",
        "capacity_bytes",
        "lane",
        "last_violation",
        "lock_violations",
        "made_on",
        "peak_requested_bytes",
        "persistent",
        "requests",
        "resizes",
        "retained",
        "retained_bytes",
        "ubatch",
        "used_on",
        "views",
    )

    def __init__(self, ubatch: int, lane: int) -> None:
        self.ubatch = ubatch
        self.lane = lane
        self.buffer: torch.Tensor | None = None
        self.capacity_bytes = 0
        # Request -> views of the current buffer, laid out once; see get_simultaneous.
        self.views: dict[Any, tuple[torch.Tensor, ...]] = {}
        # (key, start) of the tail span get_retained last handed out (vLLM 0.34's
        # record), and its bytes: cleared when a request reaches into it or the buffer goes.
        self.retained: tuple[Any, int] | None = None
        self.retained_bytes = 0
        # The CUDA stream an operator's command allocated the slot's memory on, and the
        # other streams its requests have come from since (see Buffers.record_use);
        # None while the memory is the kernels' own (and always on a CPU).
        self.made_on: Any = None
        self.used_on: set[Any] = set()
        self.requests = 0
        self.peak_requested_bytes = 0
        self.resizes = 0
        self.lock_violations = 0
        self.last_violation: LockViolation | None = None
        # (kind, key) -> (object, bytes); kind "tensor" or "resource", so that
        # tensors and resources never share a key, as in vLLM.
        self.persistent: dict[tuple[str, Hashable], tuple[Any, int]] = {}

    def release_buffer(self) -> None:
        """Free the buffer but leave ``capacity_bytes`` as it was (a resize sets it next)."""
        # The bound views hold the storage too: forget them first, or the
        # old buffer outlives the resize.
        self.views = {}
        self.retained = None
        self.buffer = None

    def drop_buffer(self) -> None:
        self.release_buffer()
        self.capacity_bytes = 0

    def stats(self) -> SlotStats:
        """The slot's immutable snapshot; safe to take from another thread (it only reads)."""
        retained, nbytes = self.retained, self.retained_bytes  # one read: the engine may clear it
        return SlotStats(
            **{c: getattr(self, c) for c in SLOT_COLUMNS},  # a Slot counts each under its column's name
            last_violation=self.last_violation,
            persistent=tuple(
                PersistentStats(key=key_text(key), kind=kind, nbytes=n)
                for (kind, key), (_, n) in list(self.persistent.items())
            ),
            retained=None if retained is None else RetainedStats(key=key_text(retained[0]), nbytes=nbytes),
        )
