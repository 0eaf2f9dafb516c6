"""Persistent buffers and resources: made once per slot, and given to slots added later.

``get_persistent`` and ``get_persistent_resource`` make a tensor or an object
the first time a slot asks for a key and keep it for the slot's life. How each
key was first made is remembered, so that slots ``set_num_ubatches`` adds
while locked (when nothing new may be created on the hot path) get every one
of them up front.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from wsd.manager.slots import Slot, tensor_bytes

__all__ = ["Persistents", "by_vllm_key"]

TENSOR = "tensor"
RESOURCE = "resource"


class Persistents:
    """How each persistent key of one manager was first made: (kind, key) -> what makes it."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._specs: dict[tuple[str, Hashable], Any] = {}

    def create(self, slot: Slot, kind: str, key: Hashable, args: Any) -> Any:
        """Make ``key`` for ``slot``, remembering how (the first time) for slots added later.

        ``args``: ``(shape, dtype, zero_init)`` of a tensor, or a resource's factory.
        """
        self._specs.setdefault((kind, key), args)
        return self._make(slot, kind, key, args)

    def give_all(self, slot: Slot) -> None:
        """Make every key known so far for a new ``slot``."""
        for (kind, key), args in self._specs.items():
            self._make(slot, kind, key, args)

    def _make(self, slot: Slot, kind: str, key: Hashable, args: Any) -> Any:
        if kind == TENSOR:
            shape, dtype, zero_init = args
            make = torch.zeros if zero_init else torch.empty
            obj = make(shape, dtype=dtype, device=self._device)
        else:
            obj = args()
        slot.persistent[(kind, key)] = (obj, tensor_bytes(obj))
        return obj


def by_vllm_key(slots: Iterable[Slot]) -> list[dict[Hashable, Any]]:
    """Each slot's persistent objects keyed as vLLM keys them (tensors under
    ``(torch.Tensor, key)``), as new dicts."""
    return [
        {((torch.Tensor, key) if kind == TENSOR else key): obj
         for (kind, key), (obj, _) in slot.persistent.items()}
        for slot in slots
    ]
