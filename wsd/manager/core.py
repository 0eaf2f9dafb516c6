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
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
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
    WorkspaceCaptureError,
    WorkspaceLimitError,
    WorkspaceLockedError,
    WorkspaceLockHeldError,
    WorkspaceNotInitializedError,
)
from wsd.manager.slots import (
    LANE_ID,
    UBATCH_ID,
    Slot,
    caller_outside,
    current_lane,
    current_ubatch,
    key_text,
    tensor_bytes,
    use_lane,
    use_ubatch,
)
from wsd.slotstats import SLOT_COLUMNS, LockViolation, ManagerStats, PersistentStats, RetainedStats, SlotStats

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

ShapeAndDtype = tuple[Sequence[int], torch.dtype]
ViolationListener = Callable[[int, int, LockViolation], None]

# Bound views kept per slot; an engine with ever-changing shapes would otherwise
# grow this without limit. Past it the cache starts again from empty.
_VIEW_CACHE_LIMIT = 256


class WorkspaceManager:
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
        self._alloc_context = alloc_context
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
        # How each persistent key was first created, so that slots added while
        # locked can be given theirs up front: (kind, key) -> args.
        self._persistent_specs: dict[tuple[str, Hashable], Any] = {}
        self._violation_listeners: list[ViolationListener] = []

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
        return [
            {((torch.Tensor, key) if kind == "tensor" else key): obj
             for (kind, key), (obj, _) in slot.persistent.items()}
            for slot in self._slots
        ]

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
            self._record_use(slot)
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
                if self._fallback and not self._capturing():
                    # As for get_simultaneous: served outside the slot, whose record
                    # stands; nothing such a buffer held can be intact next time.
                    self._refuse_locked(slot, nbytes, "allocation")
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
            self._record_use(slot)
        return buffer[start : start + nbytes].view(dtype).reshape(shape), intact

    def _layout(
        self, shapes_and_dtypes: Sequence[ShapeAndDtype]
    ) -> tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], list[int], list[int], int]:
        """Normalised request, byte size and offset of each view, and the total."""
        align = self._config.alignment
        key = []
        sizes = []
        offsets = []
        total = 0
        for i, item in enumerate(shapes_and_dtypes):
            try:
                shape, dtype = item
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise TypeError(
                    f"request {i}: expected a (shape, dtype) pair, got {item!r}"
                ) from None
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"request {i}: dtype must be a torch.dtype, got {dtype!r}")
            if any(d < 0 for d in shape):
                raise ValueError(f"request {i}: shape {shape} has a negative dimension")
            nbytes = prod(shape) * dtype.itemsize
            key.append((shape, dtype))
            sizes.append(nbytes)
            offsets.append(total)
            total += -(-nbytes // align) * align
        return tuple(key), sizes, offsets, total

    def _bind(self, slot: Slot, shapes_and_dtypes: Sequence[ShapeAndDtype]) -> tuple[torch.Tensor, ...]:
        """The slow path: lay a request out, grow the slot if needed, bind its views."""
        key, sizes, offsets, total = self._layout(shapes_and_dtypes)
        bound = slot.views.get(key)
        if bound is not None:
            return bound
        if total > slot.capacity_bytes:
            if self._locked:
                # Refused (or served by the fallback): counted before the violation is
                # reported, so that the report and the snapshot it brings agree.
                slot.peak_requested_bytes = max(slot.peak_requested_bytes, total)
            if self._locked and self._fallback and not self._capturing():
                self._refuse_locked(slot, total, "allocation")  # counted and reported
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

    # -- growth -----------------------------------------------------------

    def _refuse_locked(
        self, slot: Slot, requested: int, what: str, persistent_key: Hashable = None
    ) -> WorkspaceLockedError:
        caller = caller_outside()
        violation = LockViolation(
            caller=caller, requested=requested, capacity=slot.capacity_bytes, time=time.time()
        )
        slot.lock_violations += 1
        slot.last_violation = violation
        for listener in self._violation_listeners:
            try:
                listener(slot.ubatch, slot.lane, violation)
            except Exception:  # a listener must not hide the refusal itself
                logger.exception("workspace lock-violation listener failed")
        return WorkspaceLockedError(
            caller=caller, ubatch=slot.ubatch, lane=slot.lane,
            requested=requested, capacity=slot.capacity_bytes, what=what,
            persistent_key=persistent_key,
        )

    def _target_size(self, required: int) -> int:
        config = self._config
        limit = config.max_slot_bytes
        if limit is not None and required > limit:
            raise WorkspaceLimitError(
                f"workspace request of {required} bytes exceeds max_slot_bytes={limit}"
            )
        if config.growth is GrowthPolicy.GRANULAR:
            rounded = -(-required // config.granularity) * config.granularity
            return rounded if limit is None else max(required, min(rounded, limit))
        return required

    def _grow(self, slot: Slot, required: int, what: str = "allocation") -> None:
        if self._locked:
            raise self._refuse_locked(slot, required, what)
        self._allocate(slot, self._target_size(required))

    def _capturing(self) -> bool:
        return self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _refuse_capture(self, what: str) -> None:
        """An operator's command never runs under CUDA-graph capture: whatever it moved, a
        graph captured a moment ago may point into."""
        if self._capturing():
            raise WorkspaceCaptureError(
                f"{what} refused during CUDA graph capture: buffers a graph already captured "
                f"may point into must not move; it applies once capture is over")

    def _allocate(self, slot: Slot, size: int, *, operator: bool = False) -> None:
        # A kernel's first growth may come during capture, before the engine's lock:
        # vLLM's V2 runner captures its speculator on a lane of its own, and a DBO
        # slot may first grow there. vLLM allocates then (from the graph's pool),
        # and so does wsd; operators' commands and fallback buffers are refused
        # during capture instead (_refuse_capture, _bind).
        capturing = self._capturing()
        # Free before allocate: the old buffer goes (and the allocator's cache
        # is emptied) before the new one exists, so a resize never needs both.
        # Views that callers still hold keep the old memory alive on their own.
        # The capacity stays at the old size until the new buffer exists, so a
        # concurrent stats() never sees the slot at 0 bytes in mid-resize.
        slot.release_buffer()  # and the retained span's record with it, as vLLM
        if not capturing:  # emptying the cache synchronises, which a capture forbids
            self._empty_cache()
        try:
            with self._alloc_context():  # vLLM's sleep-mode pool, where it gives one
                slot.buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        except BaseException:
            slot.capacity_bytes = 0  # no buffer now (out of memory): the next request grows afresh
            raise
        slot.capacity_bytes = size
        slot.resizes += 1
        if operator:
            self._made_by_operator(slot)
        elif not slot.persistent:  # a kernel's own growth: on the stream that uses it
            slot.made_on = None

    def _made_by_operator(self, slot: Slot) -> None:
        """An operator's command (``reserve``, ``equalize``, ``set-ubatches``) allocated for the
        slot, on the stream of the thread that applied it, between engine steps.

        The engine's kernels then use that memory on their own streams (vLLM's dual-batch
        overlap runs each ubatch on a stream of its own). The caching allocator knows only
        the stream a block was made on: once freed, it would hand the block out again on
        that stream while another stream's kernels still use it. Each request of the slot
        records the stream it comes from (``_record_use``), as a kernel's own growth, made
        on the stream that uses it, never needs to.
        """
        if self._device.type == "cuda":
            slot.made_on = torch.cuda.current_stream(self._device)
            slot.used_on = set()

    def _record_use(self, slot: Slot) -> None:
        """The slot's memory is used on the current stream: if that is not the stream it was
        made on, the allocator is told (``record_stream``), once per stream, so that it holds
        the memory until the work queued there is done. Not under capture: a captured graph's
        buffers never move (the lock pins them)."""
        if self._capturing():
            return
        stream = torch.cuda.current_stream(self._device)
        if stream == slot.made_on or stream in slot.used_on:
            return
        if slot.buffer is not None:
            slot.buffer.record_stream(stream)
        for obj, _ in slot.persistent.values():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
                obj.record_stream(stream)
        slot.used_on.add(stream)

    def _empty_cache(self) -> None:
        kind = self._device.type
        if kind == "cpu":
            return
        backend = getattr(torch, kind, None)
        if backend is not None and hasattr(backend, "empty_cache"):
            backend.empty_cache()

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
        entry = slot.persistent.get(("tensor", key))
        if entry is not None:
            tensor = entry[0]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(  # vLLM's words, which its callers match on
                    f"Persistent workspace {key!r} has shape={tuple(tensor.shape)}, "
                    f"dtype={tensor.dtype}; requested shape={shape}, dtype={dtype}."
                )
            if slot.made_on is not None:
                self._record_use(slot)
            return tensor
        if self._locked:
            raise self._refuse_locked(
                slot, prod(shape) * dtype.itemsize, f"persistent buffer {key!r}", key
            )
        args = (shape, dtype, zero_init)
        self._persistent_specs.setdefault(("tensor", key), args)
        return self._create_persistent(slot, "tensor", key, args)

    def get_persistent_resource(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        """An object made once per slot by ``factory()``; refused once locked."""
        slot = self._current_slot()
        entry = slot.persistent.get(("resource", key))
        if entry is not None:
            return entry[0]
        if self._locked:
            raise self._refuse_locked(slot, 0, f"persistent resource {key!r}", key)
        self._persistent_specs.setdefault(("resource", key), factory)
        return self._create_persistent(slot, "resource", key, factory)

    def _create_persistent(self, slot: Slot, kind: str, key: Hashable, args: Any) -> Any:
        if kind == "tensor":
            shape, dtype, zero_init = args
            make = torch.zeros if zero_init else torch.empty
            obj = make(shape, dtype=dtype, device=self._device)
        else:
            obj = args()
        slot.persistent[(kind, key)] = (obj, tensor_bytes(obj))
        return obj

    # -- lock and reconfiguration ---------------------------------------------

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

    def is_locked(self) -> bool:
        return self._locked

    def set_num_ubatches(self, num_ubatches: int) -> None:
        """Reconfigure the ubatch count, keeping the slots that remain.

        Removed slots are dropped (their memory frees once no view refers to
        it). Added slots are empty, or, when locked, pre-sized to the largest
        slot and given every persistent buffer and resource, so that locked
        execution on them cannot fail.
        """
        config = WorkspaceConfig(**{**self._config.__dict__, "num_ubatches": num_ubatches})
        self._refuse_capture("set_num_ubatches")
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
            for slot in added:
                if largest:
                    self._allocate(slot, largest, operator=True)
                for (kind, key), args in self._persistent_specs.items():
                    self._create_persistent(slot, kind, key, args)
                if slot.persistent:
                    self._made_by_operator(slot)
        # One assignment, so a concurrent stats() sees the old or the new list.
        self._slots = slots + added
        self._num_ubatches = num_ubatches
        self._config = config

    def reserve(self, *shapes_and_dtypes: ShapeAndDtype) -> None:
        """Size every slot so that this request fits without growth (unlocked only)."""
        self.reserve_bytes(self._layout(shapes_and_dtypes)[3])

    def reserve_bytes(self, nbytes: int) -> None:
        """Grow every slot to at least ``nbytes`` (unlocked only)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"reserve size must be a non-negative integer, got {nbytes!r}")
        self._refuse_capture("reserve")
        self._refuse_pinned("reserve")
        if self._locked:
            raise self._refuse_locked(self._current_slot(), nbytes, "reserve")
        for slot in self._slots:
            if slot.capacity_bytes < nbytes:
                self._allocate(slot, self._target_size(nbytes), operator=True)

    def equalize(self) -> None:
        """Grow every slot to the largest one, so no sibling slot is undersized."""
        self._refuse_capture("equalize")
        self._refuse_pinned("equalize")
        largest = max((s.capacity_bytes for s in self._slots), default=0)
        for slot in self._slots:
            if slot.capacity_bytes < largest:
                if self._locked:
                    raise self._refuse_locked(slot, largest, "equalize")
                self._allocate(slot, largest, operator=True)

    def trim(self) -> None:
        """Release every scratch buffer (unlocked only); the next request regrows.

        Persistent buffers and resources stay. Refused while locked: an
        operator's mistake, not a lock violation (no kernel asked for memory).
        """
        self._refuse_capture("trim")
        self._refuse_pinned("trim")
        if self._locked:
            raise WorkspaceLockHeldError("trim refused: the workspace is locked; unlock it first")
        for slot in self._slots:
            slot.drop_buffer()
        self._empty_cache()

    # -- observation ------------------------------------------------------

    def add_violation_listener(self, listener: ViolationListener) -> None:
        """Call ``listener(ubatch, lane, violation)`` whenever a locked request is refused."""
        self._violation_listeners.append(listener)

    def stats(self) -> ManagerStats:
        """An immutable snapshot; safe to call from another thread."""
        slots = tuple(self._slots)
        return ManagerStats(
            device=str(self._device),
            num_ubatches=len(slots) // self._num_lanes,
            num_lanes=self._num_lanes,
            locked=self._locked,
            slots=tuple(
                SlotStats(
                    **{c: getattr(s, c) for c in SLOT_COLUMNS},  # a Slot counts each under its column's name
                    last_violation=s.last_violation,
                    persistent=tuple(
                        PersistentStats(key=key_text(key), kind=kind, nbytes=n)
                        for (kind, key), (_, n) in list(s.persistent.items())
                    ),
                    retained=_retained_stats(s),
                )
                for s in slots
            ),
        )


def _retained_stats(slot: Slot) -> RetainedStats | None:
    retained, nbytes = slot.retained, slot.retained_bytes  # one read: the engine may clear it
    return None if retained is None else RetainedStats(key=key_text(retained[0]), nbytes=nbytes)


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
