"""The operator's commands of ``WorkspaceManager``: reserve, presize, equalize, trim, ``set_num_ubatches``.

They reach every slot at once, between engine steps, on the agent's command (or
the engine's own call): they size every slot for a request, grow every slot to
the largest, release every buffer, change the number of ubatches, lock and
unlock for an operator. None is on the hot path; each is refused under
CUDA-graph capture and while the engine's own lock pins the buffers.

``OperatorCommands`` is a base class of ``WorkspaceManager``, not a collaborator
of its own: the methods are the manager's public API (vLLM's drop-in and wsd's
commands call them on the manager), and the slot list they replace is the one
the hot path reads as a plain attribute, with no indirection in between. What
they use of the manager is declared below and nothing else: its slot list and
counts, its lock state, and its collaborators (``Buffers``, ``Refusals``,
``Persistents``) that do the work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from wsd.errors import WorkspaceLockHeldError
from wsd.manager.buffers import Buffers, ShapeAndDtype, layout
from wsd.manager.config import WorkspaceConfig
from wsd.manager.persistent import Persistents
from wsd.manager.refusals import Refusals
from wsd.manager.slots import Slot

__all__ = ["OperatorCommands"]


class OperatorCommands:
    """The commands that size, release and recount every slot of a manager at once."""

    # What the commands read and write of the manager (WorkspaceManager.__init__ sets them).
    _config: WorkspaceConfig
    _slots: list[Slot]
    _num_ubatches: int
    _num_lanes: int
    _min_ubatches: int
    _locked: bool
    _pinned: bool
    _buffers: Buffers
    _refusals: Refusals
    _persistents: Persistents

    if TYPE_CHECKING:
        def _current_slot(self) -> Slot:
            """The slot of the calling context (the manager's)."""

    def operator_lock(self) -> None:
        """Lock on an operator's command: like ``lock()``, but never pins."""
        self._locked = True

    def operator_unlock(self) -> None:
        """Unlock on an operator's command; refused while the engine's lock pins the buffers."""
        self._refuse_pinned("unlock")
        self._locked = False

    def _refuse_pinned(self, what: str) -> None:
        if self._pinned:
            raise WorkspaceLockHeldError(
                f"{what} refused: the engine locked this workspace itself (vLLM does after "
                f"CUDA-graph capture), and buffers under captured graphs must never move; "
                f"it stays as it is until the engine unlocks it"
            )

    def set_num_ubatches(self, num_ubatches: int) -> None:
        """Reconfigure the ubatch count, keeping the slots that remain.

        Removed slots are dropped (their memory frees once no view refers to
        it). Added slots are empty, or, when locked, pre-sized to the largest
        slot and given every persistent buffer and resource, so that locked
        execution on them cannot fail.
        """
        config = WorkspaceConfig(**{**self._config.__dict__, "num_ubatches": num_ubatches})
        self._buffers.refuse_capture("set_num_ubatches")
        if num_ubatches < self._min_ubatches:
            raise ValueError(
                f"set_num_ubatches({num_ubatches}) refused: the engine runs "
                f"{self._min_ubatches} ubatch(es) and would index the slots removed"
            )
        lanes = self._num_lanes
        slots = self._slots[: num_ubatches * lanes]
        added = [
            Slot(u, lane)
            for u in range(self._num_ubatches, num_ubatches)
            for lane in range(lanes)
        ]
        if added and self._locked:
            largest = max((s.capacity_bytes for s in self._slots), default=0)
            self._buffers.fits("set_num_ubatches", [(slot, largest) for slot in added])
            for slot in added:
                if largest:
                    self._buffers.allocate(slot, largest, operator=True)
                self._persistents.give_all(slot)
                if slot.persistent:
                    self._buffers.made_by_operator(slot)
        # One assignment, so a concurrent stats() sees the old or the new list.
        self._slots = slots + added
        self._num_ubatches = num_ubatches
        self._config = config

    def reserve(self, *shapes_and_dtypes: ShapeAndDtype) -> None:
        """Size every slot so that this request fits without growth (unlocked only)."""
        self.reserve_bytes(layout(shapes_and_dtypes, self._config.alignment)[3])

    def reserve_bytes(self, nbytes: int) -> None:
        """Grow every slot to at least ``nbytes`` (unlocked only)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"reserve size must be a non-negative integer, got {nbytes!r}")
        self._buffers.refuse_capture("reserve")
        self._refuse_pinned("reserve")
        if self._locked:
            raise self._refusals.refuse(self._current_slot(), nbytes, "reserve")
        self._buffers.reserve(self._slots, nbytes)

    def presize(self, sizes: Iterable[Sequence[int]]) -> int:
        """Grow each slot named to at least its size: ``[(ubatch, lane, bytes), ...]``, a sizing
        profile's (``[workspace] presize = "profile"``), before the engine's own warm-up.

        Unlike ``reserve``, per slot: each gets what it was seen to need, not the largest.
        A size beyond ``max_slot_bytes`` is cut to it. Unlocked only. Every entry is checked
        before any slot grows (ValueError naming the first that is not a slot of this
        manager's grid), and all or nothing: an allocation that fails releases what this
        call grew before it raises. Returns the bytes the named slots hold afterwards.
        """
        wanted: dict[tuple[int, int], int] = {}
        for entry in sizes:
            if not (len(entry) == 3 and all(type(v) is int for v in entry) and 0 <= entry[0] < self._num_ubatches
                    and 0 <= entry[1] < self._num_lanes and entry[2] >= 0):
                raise ValueError(f"presize: {list(entry)!r} is not [ubatch, lane, bytes] of this manager's "
                                 f"{self._num_ubatches} ubatch(es) x {self._num_lanes} lane(s)")
            wanted[entry[0], entry[1]] = max(entry[2], wanted.get((entry[0], entry[1]), 0))
        self._buffers.refuse_capture("presize")
        self._refuse_pinned("presize")
        if self._locked:
            raise WorkspaceLockHeldError("presize refused: the workspace is locked; a profile's sizes go in "
                                         "before the engine's warm-up and lock")
        limit = self._config.max_slot_bytes
        grown = []
        for slot in self._slots:
            size = wanted.get((slot.ubatch, slot.lane))
            if size is not None:
                size = size if limit is None else min(size, limit)
                if slot.capacity_bytes < size:
                    grown.append((slot, self._buffers.target_size(size)))
        self._buffers.fits("presize", grown)
        done: list[Slot] = []
        try:
            for slot, size in grown:
                self._buffers.allocate(slot, size, operator=True)
                done.append(slot)
        except BaseException:  # all or nothing: what this presize grew is released again
            self._buffers.drop(done)
            raise
        return sum(slot.capacity_bytes for slot in self._slots if (slot.ubatch, slot.lane) in wanted)

    def equalize(self) -> None:
        """Grow every slot to the largest one, so no sibling slot is undersized."""
        self._buffers.refuse_capture("equalize")
        self._refuse_pinned("equalize")
        largest = max((s.capacity_bytes for s in self._slots), default=0)
        if self._locked:
            for slot in self._slots:
                if slot.capacity_bytes < largest:
                    raise self._refusals.refuse(slot, largest, "equalize")
        self._buffers.grow_to(self._slots, largest)

    def trim(self) -> None:
        """Release every scratch buffer (unlocked only); the next request regrows.

        Persistent buffers and resources stay. Refused while locked: an
        operator's mistake, not a lock violation (no kernel asked for memory).
        """
        self._buffers.refuse_capture("trim")
        self._refuse_pinned("trim")
        if self._locked:
            raise WorkspaceLockHeldError("trim refused: the workspace is locked; unlock it first")
        self._buffers.drop(self._slots)
