"""Where a vLLM worker stands in vLLM's layout, and the names wsd gives it there.

Read from vLLM's own configuration and groups: its rank and world, its TP
group, the model it serves, the engine name it joins a coordinator under, and
the labels of its figures in vLLM's ``/metrics``. No torch; nothing of vLLM's
imported (the objects are passed in).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

from wsd import placement as where
from wsd.names import engine_name

__all__ = ["Placement", "default_engine", "identity", "placement", "served_model"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A vLLM worker's place as wsd registers it."""

    rank: int
    """vLLM's global rank in its torch world (TP innermost, then PCP, PP, DP)."""
    world_size: int
    """vLLM's world: PP x PCP x TP, times DP where the DP ranks share one world
    (MoE data parallelism, the external launcher); a dense DP replica is its own."""
    tp_size: int

    @property
    def tp_group(self) -> int:
        return self.rank // self.tp_size


def placement(parallel: Any, world_rank: int, world_size: int) -> Placement:
    """The placement of the worker at ``world_rank`` of vLLM's world group of ``world_size``.

    vLLM's world group is already the right world in every layout: its
    ``init_distributed_environment`` offsets the rank by the DP rank and widens
    the world to ``world_size_across_dp`` where DP ranks share one (MoE DP), and
    a dense DP replica is reset to DP = 1 with a world of its own. TP groups are
    contiguous ranks (``initialize_model_parallel``: TP is the innermost axis).
    """
    tp_size = parallel.tensor_parallel_size
    if tp_size < 1 or world_size % tp_size or not 0 <= world_rank < world_size:
        raise ValueError(f"vLLM's world group (rank {world_rank} of {world_size}) does not hold "
                         f"whole TP groups of {tp_size}")
    return Placement(rank=world_rank, world_size=world_size, tp_size=tp_size)


def served_model(vllm_config: Any) -> str | None:
    """The name vLLM serves its model under (the first, where it has several)."""
    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served) if served else None


def default_engine(vllm_config: Any, host: str, env: Mapping[str, str] = os.environ) -> str:
    """The engine a vLLM worker joins when ``[agent] engine`` (``WSD_ENGINE``) names none:
    ``HOST-MODEL``, stable across restarts of the same replica, every other character ``-``.

    Where one host runs several replicas of one model, each on its own GPUs, the first GPU
    of ``CUDA_VISIBLE_DEVICES`` tells them apart (``-gpu2``); a dense data-parallel replica
    other than the first adds its index (``-dp1``: vLLM resets each to a world of its own and
    keeps only ``data_parallel_index``). MoE data parallelism is one engine: its ranks share
    one world. Anything else on one host (two replicas on the same GPUs) names its engines.
    """
    parts = [host, served_model(vllm_config) or "vllm"]
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible:
        parts.append(f"gpu{visible}")
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    if parallel.data_parallel_size == 1 and isinstance(index, int) and index > 0:
        parts.append(f"dp{index}")
    return engine_name("-".join(parts))


def identity(worker: Any, place: Placement, *, engine: str, endpoint: str, device: str,
             gpu_labels: Mapping[str, str]) -> dict[str, Any]:
    """What labels this worker's figures in vLLM's /metrics (``metrics.Publisher``)."""
    parallel = worker.vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    labels = {**dict.fromkeys(where.LABELS, ""), **where.from_env(os.environ), **gpu_labels}
    return {**labels, "model_name": served_model(worker.vllm_config) or "",
            "engine": str(index if isinstance(index, int) else parallel.data_parallel_rank),
            "rank": place.rank, "tp_group": place.tp_group, "wsd_engine": engine, "coordinator": endpoint,
            "host": socket.gethostname(), "pid": os.getpid(), "device": device}
