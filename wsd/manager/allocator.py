"""The cap on the device allocator, and what an operator's growth may still take under it.

vLLM 0.34's extensible KV cache sizes the cache after warm-up from the memory
then free, and caps torch's caching allocator (``set_per_process_memory_fraction``)
to leave about 512 MiB for everything outside it
(``vllm/v1/worker/extensible_kv_cache.py``, ``measure_kv_cache_blocks``). From
then on, what an operator's command grows (``reserve``, ``equalize``,
``set-ubatches`` while locked) competes with vLLM's own transient activations for
the slack under that cap. ``Cap`` reads the cap and the headroom; the operator's
commands refuse, before they allocate, a growth beyond the headroom.

Headroom here is what torch has not yet reserved under its cap: the blocks torch
holds cached are vLLM's for its next step's activations, not an operator's.
Both figures are host-side counters of torch's allocator: reading them calls no
CUDA API, so it is safe while vLLM has suspended CUDA (``cuda_checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wsd.errors import WorkspaceHeadroomError

__all__ = ["AllocatorCap", "Cap", "growth_fits"]


@dataclass(frozen=True)
class AllocatorCap:
    """The device allocator's cap and what is left under it, in bytes."""

    cap_bytes: int
    headroom_bytes: int


class Cap:
    """Reads the cap of one device's caching allocator: None where there is none (a CPU, a
    CUDA device whose per-process fraction is 1.0)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._total: int | None = None

    def __call__(self) -> AllocatorCap | None:
        device = self._device
        if device.type != "cuda" or not torch.cuda.is_initialized():
            return None
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        if fraction >= 1.0:
            return None
        if self._total is None:  # the device's size, read once (a property torch caches)
            self._total = torch.cuda.get_device_properties(device).total_memory
        cap = int(fraction * self._total)
        return AllocatorCap(cap, max(cap - torch.cuda.memory_reserved(device), 0))


def growth_fits(what: str, growth: int, cap: AllocatorCap | None) -> None:
    """Refuse (WorkspaceHeadroomError, naming both figures) an operator's ``growth`` in bytes
    that the allocator's headroom under its cap cannot hold."""
    if cap is None or growth <= cap.headroom_bytes:
        return
    raise WorkspaceHeadroomError(
        f"{what} refused: it would grow this rank's workspace by {growth} bytes, and torch may "
        f"reserve only {cap.headroom_bytes} more bytes under its cap of {cap.cap_bytes} "
        f"(vLLM caps torch's allocator after warm-up to fit its KV cache); nothing was allocated")
