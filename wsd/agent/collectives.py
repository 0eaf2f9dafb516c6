"""Small collectives of msgpack-able values over a gloo group, without pickle or numpy.

``torch.distributed``'s ``*_object`` collectives pickle their objects and need
numpy to turn the received tensor back into bytes; a CPU install of torch does
not bring numpy, and wsd keeps pickle off every wire it owns. These send the
msgpack encoding as a ``uint8`` tensor instead: first every rank's length,
then the bytes padded to the longest. Not for the hot path: each is two
collectives and a copy.

``tp_groups`` builds the groups they run on: a TP group and its gloo twin,
together in one place (as vLLM's ``parallel_state`` builds a group's device and
CPU groups), for the built-in worker and for an engine that embeds the agent.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

__all__ = ["all_gather_values", "broadcast_value", "tp_groups"]


def _to_tensor(data: bytes, length: int) -> torch.Tensor:
    buf = torch.zeros(length, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _to_bytes(tensor: torch.Tensor, length: int) -> bytes:
    return bytes(tensor[:length].tolist())


def broadcast_value(value: Any, group: Any, src: int = 0) -> Any:
    """``value`` of global rank ``src`` on every rank of ``group`` (collective)."""
    mine = msgpack.packb(value, use_bin_type=True) if dist.get_rank() == src else b""
    length = torch.tensor([len(mine)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    buf = _to_tensor(mine, int(length.item()))
    dist.broadcast(buf, src=src, group=group)
    return msgpack.unpackb(_to_bytes(buf, int(length.item())), raw=False)


def all_gather_values(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value``, in the group's rank order (collective)."""
    mine = msgpack.packb(value, use_bin_type=True)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in lengths)
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, _to_tensor(mine, longest), group=group)
    return [msgpack.unpackb(_to_bytes(t, int(n.item())), raw=False) for t, n in zip(gathered, lengths)]


def tp_groups(rank: int, world_size: int, tp_size: int, backend: str | None) -> tuple[Any, Any]:
    """``rank``'s TP group (contiguous ranks) on ``backend``, and its gloo twin.

    The twin carries the agent's consistency collective (small, on the CPU, beside
    the engine's own collectives); it is None at tp_size 1, where there is no one
    to agree with. ``backend`` None: the twin alone, for an engine that has its TP
    group already, or a gloo world with no compute collective (tests, benchmarks). Collective: every rank must
    call it, in the same order, since ``new_group`` is.
    """
    mine: tuple[Any, Any] = (None, None)
    for first in range(0, world_size, tp_size):
        ranks = list(range(first, first + tp_size))
        group = None if backend is None else dist.new_group(ranks, backend=backend)
        twin = None if tp_size == 1 else dist.new_group(ranks, backend="gloo")
        if first <= rank < first + tp_size:
            mine = (group, twin)
    return mine
