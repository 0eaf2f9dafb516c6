"""The slots' scratch buffers: how a request is laid out in one, and how one is made.

``layout`` packs a request's views back to back from offset 0, each at a
multiple of the alignment (vLLM's layout). ``Buffers`` makes, grows and releases
the buffers of one manager's slots on its device: free before allocate, sizes
from the growth policy, the streams an operator's allocation is used on. It
knows nothing of the lock: whether a slot may grow is the manager's decision,
how it grows is this module's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from math import prod
from typing import Any

import torch

from wsd.errors import WorkspaceCaptureError, WorkspaceLimitError
from wsd.manager.allocator import AllocatorCap, Cap, growth_fits
from wsd.manager.config import GrowthPolicy, WorkspaceConfig
from wsd.manager.slots import Slot

__all__ = ["Buffers", "Layout", "ShapeAndDtype", "layout"]

ShapeAndDtype = tuple[Sequence[int], torch.dtype]
Layout = tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], list[int], list[int], int]
"""A request laid out: its normalised key, each view's bytes and offset, and the aligned total."""


def layout(shapes_and_dtypes: Sequence[ShapeAndDtype], alignment: int) -> Layout:
    """Normalised request, byte size and offset of each view, and the total."""
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
        total += -(-nbytes // alignment) * alignment
    return tuple(key), sizes, offsets, total


class Buffers:
    """Makes, grows and releases one manager's slot buffers on ``device``.

    ``config``: the growth policy (``growth``, ``granularity``, ``max_slot_bytes``),
    which ``set_num_ubatches`` never changes. ``alloc_context`` makes the context
    every buffer is allocated in (vLLM's sleep-mode memory pool).
    """

    def __init__(self, device: torch.device, alloc_context: Callable[[], AbstractContextManager[Any]],
                 config: WorkspaceConfig) -> None:
        self._device = device
        self._alloc_context = alloc_context
        self._config = config
        self.cap: Callable[[], AllocatorCap | None] = Cap(device)
        """The device allocator's cap and headroom (``wsd.manager.allocator``)."""

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        return self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def refuse_capture(self, what: str) -> None:
        """An operator's command never runs under CUDA-graph capture: whatever it moved, a
        graph captured a moment ago may point into."""
        if self.capturing():
            raise WorkspaceCaptureError(
                f"{what} refused during CUDA graph capture: buffers a graph already captured "
                f"may point into must not move; it applies once capture is over")

    def target_size(self, required: int) -> int:
        """The size a slot grows to for ``required`` bytes, by the growth policy."""
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

    def allocate(self, slot: Slot, size: int, *, operator: bool = False) -> None:
        """Give ``slot`` a new buffer of exactly ``size`` bytes (``operator``: for an operator's command)."""
        # A kernel's first growth may come during capture, before the engine's lock:
        # vLLM's V2 runner captures its speculator on a lane of its own, and a DBO
        # slot may first grow there. vLLM allocates then (from the graph's pool),
        # and so does wsd; operators' commands and fallback buffers are refused
        # during capture instead (refuse_capture, WorkspaceManager._bind).
        capturing = self.capturing()
        # Free before allocate: the old buffer goes (and the allocator's cache
        # is emptied) before the new one exists, so a resize never needs both.
        # Views that callers still hold keep the old memory alive on their own.
        # The capacity stays at the old size until the new buffer exists, so a
        # concurrent stats() never sees the slot at 0 bytes in mid-resize.
        slot.release_buffer()  # and the retained span's record with it, as vLLM
        if not capturing:  # emptying the cache synchronises, which a capture forbids
            self.empty_cache()
        try:
            with self._alloc_context():  # vLLM's sleep-mode pool, where it gives one
                slot.buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        except BaseException:
            slot.capacity_bytes = 0  # no buffer now (out of memory): the next request grows afresh
            raise
        slot.capacity_bytes = size
        slot.resizes += 1
        if operator:
            self.made_by_operator(slot)
        elif not slot.persistent:  # a kernel's own growth: on the stream that uses it
            slot.made_on = None

    def fits(self, what: str, sizes: Iterable[tuple[Slot, int]]) -> None:
        """Refuse an operator's ``what`` that would grow the slots to these sizes beyond what the
        allocator may still reserve under its cap (``wsd.manager.allocator``), before anything
        of it is allocated. Each growth counts as the new size less the old buffer, freed first."""
        growth = sum(max(size - slot.capacity_bytes, 0) for slot, size in sizes)
        if growth:
            growth_fits(what, growth, self.cap())

    def reserve(self, slots: Sequence[Slot], nbytes: int) -> None:
        """Grow every slot smaller than ``nbytes`` to the policy's size for it (an operator's)."""
        grown = [(slot, self.target_size(nbytes)) for slot in slots if slot.capacity_bytes < nbytes]
        self.fits("reserve", grown)
        for slot, size in grown:
            self.allocate(slot, size, operator=True)

    def grow_to(self, slots: Sequence[Slot], nbytes: int, what: str = "equalize") -> None:
        """Grow every slot smaller than ``nbytes`` to exactly ``nbytes`` (an operator's ``what``)."""
        grown = [(slot, nbytes) for slot in slots if slot.capacity_bytes < nbytes]
        self.fits(what, grown)
        for slot, size in grown:
            self.allocate(slot, size, operator=True)

    def drop(self, slots: Iterable[Slot]) -> None:
        """Release every slot's buffer, and the allocator's cache after them."""
        for slot in slots:
            slot.drop_buffer()
        self.empty_cache()

    def made_by_operator(self, slot: Slot) -> None:
        """An operator's command (``reserve``, ``equalize``, ``set-ubatches``) allocated for the
        slot, on the stream of the thread that applied it, between engine steps.

        The engine's kernels then use that memory on their own streams (vLLM's dual-batch
        overlap runs each ubatch on a stream of its own). The caching allocator knows only
        the stream a block was made on: once freed, it would hand the block out again on
        that stream while another stream's kernels still use it. Each request of the slot
        records the stream it comes from (``record_use``), as a kernel's own growth, made
        on the stream that uses it, never needs to.
        """
        if self._device.type == "cuda":
            slot.made_on = torch.cuda.current_stream(self._device)
            slot.used_on = set()

    def record_use(self, slot: Slot) -> None:
        """The slot's memory is used on the current stream: if that is not the stream it was
        made on, the allocator is told (``record_stream``), once per stream, so that it holds
        the memory until the work queued there is done. Not under capture: a captured graph's
        buffers never move (the lock pins them)."""
        if self.capturing():
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

    def empty_cache(self) -> None:
        """Return the allocator's cached blocks of the device to it (nothing on a CPU)."""
        kind = self._device.type
        if kind == "cpu":
            return
        backend = getattr(torch, kind, None)
        if backend is not None and hasattr(backend, "empty_cache"):
            backend.empty_cache()
