"""Collectives of msgpack values over gloo (wsd.agent.collectives), used by the agent and the worker.

Real gloo groups in worker processes (tests/mp.py). ``Tensor.numpy`` is made to
fail in the workers: a CPU install of torch has no numpy, and the ``*_object``
collectives of torch.distributed need it (and pickle), which is what broke the
embedded coordinator's endpoint broadcast on such an install.
"""

from __future__ import annotations

from typing import Any

import torch
from mp import Rank, Workers

from wsd import WorkspaceManager, use_ubatch
from wsd.agent.collectives import all_gather_values, tp_groups
from wsd.slotstats import ManagerStats
from wsd.worker.distributed import broadcast_from_rank0


def _no_numpy(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("Numpy is not available")


def gather_worker(me: Rank) -> None:
    torch.Tensor.numpy = _no_numpy  # type: ignore[method-assign]  # as on a CPU install of torch without numpy
    manager = WorkspaceManager("cpu", 2)
    with use_ubatch(1):
        manager.get_simultaneous((((me.rank + 1) * 1024,), torch.uint8))
    _, group = tp_groups(me.rank, me.world_size, me.world_size, None)
    stats = [ManagerStats.from_dict(d) for d in all_gather_values(manager.stats().to_dict(), group)]
    endpoint = broadcast_from_rank0("tcp://node0:7600" if me.rank == 0 else None, group)
    mixed = all_gather_values({"rank": me.rank, "blob": bytes(range(me.rank * 3))}, group)
    me.report("done", capacities=[[s.capacity_bytes for s in m.slots] for m in stats],
              same=stats[me.rank] == manager.stats(), endpoint=endpoint, mixed=mixed)


def test_gather_snapshots_and_broadcast_without_numpy_or_pickle(tmp_path):
    """Every rank gets every TP member's snapshot in rank order, and rank 0's value."""
    with Workers(tmp_path, 3, gather_worker) as workers:
        results = [workers.expect(rank, "done", 60) for rank in range(3)]
    for rank, result in enumerate(results):
        assert result["capacities"] == [[0, 1024], [0, 2048], [0, 3072]], rank
        assert result["same"] is True
        assert result["endpoint"] == "tcp://node0:7600"
        assert result["mixed"] == [{"rank": r, "blob": bytes(range(r * 3))} for r in range(3)]


def test_a_single_rank_needs_no_group(tmp_path):
    with Workers(tmp_path, 1, single_worker) as workers:
        assert workers.expect(0, "done", 60)["values"] == [[1, "a"]]


def single_worker(me: Rank) -> None:
    me.report("done", values=all_gather_values([1, "a"], None))
