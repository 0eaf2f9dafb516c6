"""The per-rank workspace manager, a drop-in for vLLM's ``WorkspaceManager``.

One ``uint8`` scratch buffer per (ubatch, lane) slot, handed out as typed views
by ``get_simultaneous``: each request is rounded up to ``alignment`` bytes and
the views are packed back to back from offset 0, so views of different calls on
one slot alias ("like ``torch.empty``, valid until the next call on that slot").
A slot grows exactly to what is asked (or to a granularity), only the asking
slot grows, and the old buffer is dropped before the new one is allocated, with
the allocator's cache emptied in between, so a resize never holds both. Once
locked, nothing grows: a request that does not fit raises
``WorkspaceLockedError`` naming the caller, the slot and the sizes.

This is the hot path. No I/O, no locks, no logging per call. Another thread (the
agent) may call ``stats()`` at any time: it only reads.

The class keeps the hot path, the slot table it reads and the lock; the rest is
done by its parts: ``buffers`` (a request's layout, and how a buffer is made),
``refusals`` (a locked slot's refusals and their listeners), ``persistent``
(persistent buffers and resources) and ``operator_commands`` (reserve, equalize,
trim, ``set_num_ubatches``: a base class, so that they stay the manager's methods).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from math import prod
from typing import Any, cast

import torch

from wsd.config import (
    MAX_LANES,
    GrowthPolicy,
    LockedGrowthPolicy,
    WorkspaceConfig,
    WsdConfig,
    load_config,
)
from wsd.errors import (
    SlotOutOfRangeError,
    WorkspaceNotInitializedError,
)
from wsd.manager.buffers import Buffers, ShapeAndDtype, layout
from wsd.manager.operator_commands import OperatorCommands
from wsd.manager.persistent import RESOURCE, TENSOR, Persistents, by_vllm_key
from wsd.manager.refusals import Refusals, ViolationListener
from wsd.manager.slots import (
    LANE_ID,
    UBATCH_ID,
    Slot,
    current_lane,
    current_ubatch,
    use_lane,
    use_ubatch,
)
from wsd.slotstats import ManagerStats

__all__ = [
    "WorkspaceManager",
    "current_lane",
    "current_ubatch",
    "current_workspace_manager",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
    "use_lane",
    "use_ubatch",
]

logger = logging.getLogger(__name__)

# Bound views kept per slot; an engine with ever-changing shapes would otherwise
# grow this without limit. Past it the cache starts again from empty.
_VIEW_CACHE_LIMIT = 256


class WorkspaceManager(OperatorCommands):
    """Per-rank scratch buffers, one per (ubatch, lane) slot, vLLM-compatible.

    The first four parameters are vLLM's, positional as vLLM passes them:
    ``num_ubatches`` of None means 1; ``alloc_context`` makes the context every
    scratch buffer is allocated in (vLLM's sleep-mode memory pool). The current
    ubatch comes from ``use_ubatch`` or from ``ubatch_id``, a callable the
    engine passes (vLLM's ``dbo_current_ubatch_id``); the lane from ``use_lane``
    or from ``lane_id``. Nothing is allocated at construction.

    ``pin_on_lock``: the engine's own ``lock()`` pins the buffers (vLLM locks
    after CUDA-graph capture, and captured graphs point into them): an
    operator may then not unlock, trim, reserve or equalize. ``min_ubatches``:
    the fewest ubatches ``set_num_ubatches`` may leave (the engine's own count).
    """

    def __init__(
        self,
        device: torch.device | str,
        num_ubatches: int | None = None,
        num_lanes: int | None = 1,
        alloc_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        *,
        alignment: int = 256,
        growth: GrowthPolicy | str = GrowthPolicy.EXACT,
        granularity: int = 2 * 1024 * 1024,
        max_slot_bytes: int | None = None,
        on_locked_growth: LockedGrowthPolicy | str = LockedGrowthPolicy.RAISE,
        ubatch_id: Callable[[], int] | None = None,
        lane_id: Callable[[], int] | None = None,
        pin_on_lock: bool = False,
        min_ubatches: int = 1,
    ) -> None:
        if isinstance(num_lanes, int) and not isinstance(num_lanes, bool) and num_lanes < 1:
            raise ValueError(  # vLLM's words first
                f"num_lanes must be at least one, got {num_lanes} "
                f"(num_lanes must be between 1 and {MAX_LANES})"
            )
        self._config = WorkspaceConfig(
            num_ubatches=1 if num_ubatches is None else num_ubatches,
            num_lanes=1 if num_lanes is None else num_lanes,
            alignment=alignment,
            # cast: WorkspaceConfig turns a string into its enum at construction (or
            # raises naming the values allowed); its fields are typed as what they hold.
            growth=cast(GrowthPolicy, growth),
            granularity=granularity,
            max_slot_bytes=max_slot_bytes,
            on_locked_growth=cast(LockedGrowthPolicy, on_locked_growth),
        )
        self._device = torch.device(device)
        self._num_ubatches = self._config.num_ubatches
        self._num_lanes = self._config.num_lanes
        self._ubatch_id = UBATCH_ID.get if ubatch_id is None else ubatch_id
        self._lane_id = LANE_ID.get if lane_id is None else lane_id
        self._fallback = self._config.on_locked_growth is LockedGrowthPolicy.FALLBACK
        self._locked = False
        self._pin_on_lock = pin_on_lock
        self._pinned = False
        self._min_ubatches = min_ubatches
        self._slots = [
            Slot(u, lane) for u in range(self._num_ubatches) for lane in range(self._num_lanes)
        ]
        # The collaborators, each behind a narrow interface: how buffers are made
        # (never whether: the lock is this class's), how a refusal is recorded and
        # told, and how persistent keys are made and given to slots added later.
        self._buffers = Buffers(self._device, alloc_context, self._config)
        self._refusals = Refusals()
        self._persistents = Persistents(self._device)

    @classmethod
    def from_config(
        cls,
        device: torch.device | str,
        config: WorkspaceConfig | WsdConfig | str | os.PathLike[str] | None = None,
        *,
        ubatch_id: Callable[[], int] | None = None,
    ) -> WorkspaceManager:
        """A manager sized from a ``[workspace]`` section, a whole config, or a TOML file path.

        None loads ``$WSD_CONFIG`` (or defaults) with ``WSD_*`` overrides.
        """
        if config is None or isinstance(config, (str, os.PathLike)):
            config = load_config(config)
        if isinstance(config, WsdConfig):
            config = config.workspace
        return cls(
            device,
            config.num_ubatches,
            config.num_lanes,
            alignment=config.alignment,
            growth=config.growth,
            granularity=config.granularity,
            max_slot_bytes=config.max_slot_bytes,
            on_locked_growth=config.on_locked_growth,
            ubatch_id=ubatch_id,
        )

    # -- properties -------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_ubatches(self) -> int:
        return self._num_ubatches

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    @property
    def config(self) -> WorkspaceConfig:
        """The configuration in force (``num_ubatches`` follows ``set_num_ubatches``)."""
        return self._config

    @property
    def pinned(self) -> bool:
        """True while the engine's own lock holds (``pin_on_lock``): no buffer may move."""
        return self._pinned

    @property
    def _current_workspaces(self) -> list[torch.Tensor | None]:
        """Each slot's scratch buffer (None until grown), in slot order: vLLM's attribute, read-only."""
        return [slot.buffer for slot in self._slots]

    @property
    def _persistent_resources(self) -> list[dict[Hashable, Any]]:
        """Each slot's persistent objects keyed as vLLM keys them (tensors under
        ``(torch.Tensor, key)``): vLLM's attribute, as a read-only copy."""
        return by_vllm_key(self._slots)

    def __repr__(self) -> str:
        return (
            f"WorkspaceManager(device={str(self._device)!r}, num_ubatches={self._num_ubatches}, "
            f"num_lanes={self._num_lanes}, locked={self._locked})"
        )

    # -- the hot path -----------------------------------------------------

    def _current_slot(self) -> Slot:
        ubatch = self._ubatch_id()
        lane = self._lane_id()
        try:
            if 0 <= ubatch < self._num_ubatches and 0 <= lane < self._num_lanes:
                return self._slots[ubatch * self._num_lanes + lane]
        except TypeError:
            pass
        if not (isinstance(ubatch, int) and 0 <= ubatch < self._num_ubatches):
            raise SlotOutOfRangeError("ubatch", ubatch, self._num_ubatches)
        raise SlotOutOfRangeError("lane", lane, self._num_lanes)

    def get_simultaneous(self, *shapes_and_dtypes: ShapeAndDtype) -> list[torch.Tensor]:
        """Views for several tensors at once, packed in the current slot's buffer.

        Each ``(shape, dtype)`` gets a contiguous view of exactly its bytes, at
        an offset rounded up to ``alignment``, from offset 0: the layout of
        vLLM's. The views are valid until the next call on the same slot.
        """
        slot = self._current_slot()
        slot.requests += 1
        # The views of a request are laid out and bound once per buffer (in
        # _bind); a repeat request only detaches fresh tensors from them, so a
        # caller that changes a returned tensor's metadata in place
        # (unsqueeze_, resize_, set_) changes its own tensor, never the cache.
        try:
            bound = slot.views[shapes_and_dtypes]
        except (KeyError, TypeError):  # TypeError: a shape given as a list
            bound = self._bind(slot, shapes_and_dtypes)
        if slot.retained is not None:  # rare: only after a get_retained on this slot
            self._reach(slot, bound)
        if slot.made_on is not None:  # rare: an operator's allocation, on a CUDA device
            self._buffers.record_use(slot)
        return [view.detach() for view in bound]

    def _reach(self, slot: Slot, bound: tuple[torch.Tensor, ...]) -> None:
        """Forget the slot's retained span if these views, bound to its buffer, reach into it
        (vLLM 0.34). Their aligned total is where the last one ends, rounded up to the
        alignment: the views are packed from offset 0, so nothing is laid out again."""
        if not bound:
            return
        last = bound[-1]
        end = (last.storage_offset() + last.numel()) * last.element_size()
        align = self._config.alignment
        retained = slot.retained
        if retained is not None and -(-end // align) * align > retained[1]:
            slot.retained = None

    def get_retained(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """A view over the last bytes of the current slot's buffer, which requests leave alone.

        vLLM 0.34's, call for call: ``get_simultaneous`` packs its views from
        offset 0, so the span at the end of the buffer, starting at
        ``numel - nbytes`` rounded down to the alignment, outlives requests that
        do not reach it. The flag says whether the span still holds what the
        previous ``get_retained`` of this slot left there: the same key and the
        same start, no ``get_simultaneous`` since whose views reached past that
        start, and no reallocation of the buffer (growth, ``reserve``,
        ``equalize``, ``trim``). One record per slot, the latest key only. The
        buffer grows for it like for any request, and is refused the same way
        when locked.
        """
        slot = self._current_slot()
        nbytes = prod(shape) * dtype.itemsize
        if nbytes > slot.capacity_bytes:
            if self._locked:
                slot.peak_requested_bytes = max(slot.peak_requested_bytes, nbytes)
                if self._fallback and not self._buffers.capturing():
                    # As for get_simultaneous: served outside the slot, whose record
                    # stands; nothing such a buffer held can be intact next time.
                    self._refusals.refuse(slot, nbytes, "allocation")
                    return torch.empty(nbytes, dtype=torch.uint8, device=self._device).view(dtype).reshape(shape), False
            self._grow(slot, nbytes)
        slot.peak_requested_bytes = max(slot.peak_requested_bytes, nbytes)
        if slot.buffer is None:  # a zero-byte request on a slot never grown
            slot.buffer = torch.empty(0, dtype=torch.uint8, device=self._device)
        buffer = slot.buffer
        align = self._config.alignment
        start = (buffer.numel() - nbytes) // align * align
        intact = slot.retained == (key, start)
        slot.retained = (key, start)
        slot.retained_bytes = nbytes
        if slot.made_on is not None:
            self._buffers.record_use(slot)
        return buffer[start : start + nbytes].view(dtype).reshape(shape), intact

    def _bind(self, slot: Slot, shapes_and_dtypes: Sequence[ShapeAndDtype]) -> tuple[torch.Tensor, ...]:
        """The slow path: lay a request out, grow the slot if needed, bind its views."""
        key, sizes, offsets, total = layout(shapes_and_dtypes, self._config.alignment)
        bound = slot.views.get(key)
        if bound is not None:
            return bound
        if total > slot.capacity_bytes:
            if self._locked:
                # Refused (or served by the fallback): counted before the violation is
                # reported, so that the report and the snapshot it brings agree.
                slot.peak_requested_bytes = max(slot.peak_requested_bytes, total)
            if self._locked and self._fallback and not self._buffers.capturing():
                self._refusals.refuse(slot, total, "allocation")  # counted and reported
                # A one-off buffer, never cached: the slot keeps its size, and
                # the next request that does not fit is counted again. Outside
                # alloc_context: vLLM's sleep-mode allocator makes a new memory pool
                # at each entry and keeps it for ever, one per such request; and a
                # buffer that lives for one kernel has nothing to keep over a sleep.
                buffer = torch.empty(total, dtype=torch.uint8, device=self._device)
                return tuple(
                    buffer[offset : offset + nbytes].view(dtype).reshape(shape)
                    for (shape, dtype), nbytes, offset in zip(key, sizes, offsets)
                )
            try:
                self._grow(slot, total)
            finally:
                # Counted after the growth, so a concurrent stats() never sees
                # a peak above the capacity that served it; a refused request
                # still counts.
                slot.peak_requested_bytes = max(slot.peak_requested_bytes, total)
        slot.peak_requested_bytes = max(slot.peak_requested_bytes, total)
        if slot.buffer is None:  # a zero-byte request on a slot never grown
            slot.buffer = torch.empty(0, dtype=torch.uint8, device=self._device)
        buffer = slot.buffer
        bound = tuple(
            buffer[offset : offset + nbytes].view(dtype).reshape(shape)
            for (shape, dtype), nbytes, offset in zip(key, sizes, offsets)
        )
        if len(slot.views) >= _VIEW_CACHE_LIMIT:
            slot.views = {}
        slot.views[key] = bound
        try:
            slot.views[tuple(shapes_and_dtypes)] = bound
        except TypeError:
            pass  # unhashable as given: only the normalised key is cached
        return bound

    def _grow(self, slot: Slot, required: int, what: str = "allocation") -> None:
        if self._locked:
            raise self._refusals.refuse(slot, required, what)
        self._buffers.allocate(slot, self._buffers.target_size(required))

    # -- persistent buffers and resources -----------------------------------

    def get_persistent(
        self,
        key: Hashable,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        zero_init: bool = False,
    ) -> torch.Tensor:
        """A tensor kept for the life of the current slot, created on first use.

        Asking again with another shape or dtype is a ValueError; creating one
        while locked is refused. Tensor keys never collide with resource keys.
        """
        slot = self._current_slot()
        shape = tuple(int(d) for d in shape)
        entry = slot.persistent.get((TENSOR, key))
        if entry is not None:
            tensor = entry[0]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(  # vLLM's words, which its callers match on
                    f"Persistent workspace {key!r} has shape={tuple(tensor.shape)}, "
                    f"dtype={tensor.dtype}; requested shape={shape}, dtype={dtype}."
                )
            if slot.made_on is not None:
                self._buffers.record_use(slot)
            return tensor
        if self._locked:
            raise self._refusals.refuse(
                slot, prod(shape) * dtype.itemsize, f"persistent buffer {key!r}", key
            )
        return self._persistents.create(slot, TENSOR, key, (shape, dtype, zero_init))

    def get_persistent_resource(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        """An object made once per slot by ``factory()``; refused once locked."""
        slot = self._current_slot()
        entry = slot.persistent.get((RESOURCE, key))
        if entry is not None:
            return entry[0]
        if self._locked:
            raise self._refusals.refuse(slot, 0, f"persistent resource {key!r}", key)
        return self._persistents.create(slot, RESOURCE, key, factory)

    # -- the engine's lock ------------------------------------------------------

    def lock(self) -> None:
        """From now on no buffer grows and nothing new is created (the engine's call).

        With ``pin_on_lock`` it also pins the buffers until the engine unlocks.
        """
        self._locked = True
        if self._pin_on_lock:
            self._pinned = True

    def unlock(self) -> None:
        """Allow growth again (the engine's call: vLLM's elastic EP rescaling)."""
        self._locked = False
        self._pinned = False

    def is_locked(self) -> bool:
        return self._locked

    # -- observation ------------------------------------------------------

    def add_violation_listener(self, listener: ViolationListener) -> None:
        """Call ``listener(ubatch, lane, violation)`` whenever a locked request is refused."""
        self._refusals.add_listener(listener)

    def stats(self) -> ManagerStats:
        """An immutable snapshot; safe to call from another thread."""
        slots = tuple(self._slots)
        cap = self._buffers.cap()
        return ManagerStats(
            device=str(self._device),
            num_ubatches=len(slots) // self._num_lanes,
            num_lanes=self._num_lanes,
            locked=self._locked,
            slots=tuple(s.stats() for s in slots),
            allocator_cap_bytes=None if cap is None else cap.cap_bytes,
            allocator_headroom_bytes=None if cap is None else cap.headroom_bytes,
        )


# -- the process-wide manager, as vLLM's module functions ----------------------

_manager: WorkspaceManager | None = None


def init_workspace_manager(
    device: torch.device | str,
    num_ubatches: int | None = None,
    num_lanes: int | None = 1,
    alloc_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    **options: Any,
) -> WorkspaceManager:
    """Create the process-wide manager (replacing any earlier one) and return it."""
    global _manager
    if _manager is not None:
        logger.warning(
            "WorkspaceManager already initialized on device %s, reinitializing on device %s",
            _manager.device, device,
        )
    _manager = WorkspaceManager(device, num_ubatches, num_lanes, alloc_context, **options)
    return _manager


def is_workspace_manager_initialized() -> bool:
    return _manager is not None


def not_initialized() -> WorkspaceNotInitializedError:
    """The error for a missing process-wide manager, in vLLM's words."""
    return WorkspaceNotInitializedError(
        "WorkspaceManager not initialized. Call init_workspace_manager() with a "
        "device before using workspace functions."
    )


def current_workspace_manager() -> WorkspaceManager:
    """The process-wide manager; WorkspaceNotInitializedError if there is none."""
    if _manager is None:
        raise not_initialized()
    return _manager


def lock_workspace() -> None:
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    """Forget the process-wide manager; its buffers free once no view refers to them."""
    global _manager
    _manager = None
