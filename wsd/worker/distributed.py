"""The worker's ``torch.distributed`` side: the torchrun environment and the groups.

``read_torchrun_env`` is the one reader of the variables torchrun sets; a
missing or malformed one is an error that names it, never a silent 0.
``init_distributed`` initialises the default process group (nccl on CUDA, gloo
on CPU) and builds, in the same order on every rank since ``new_group`` is
collective: each TP group on the main backend with its gloo twin, on which the
agent's consistency collective runs (``wsd.agent.collectives.tp_groups``: the
two built together, as vLLM's ``parallel_state`` builds a group's device and CPU
groups), and one gloo
group of the whole world for control (the stop vote, the embedded
coordinator's endpoint).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wsd.agent.collectives import broadcast_value, tp_groups
from wsd.config import Backend, WorkerConfig
from wsd.errors import ConfigError, TorchrunEnvError

__all__ = ["DistContext", "TorchrunEnv", "any_rank", "init_distributed", "read_torchrun_env"]

_INT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class TorchrunEnv:
    """What torchrun tells a worker about its place in the job."""

    rank: int
    """Global rank, 0..world_size-1."""
    world_size: int
    local_rank: int
    """Rank on this node; chooses the device."""
    local_world_size: int
    master_addr: str
    master_port: int


def read_torchrun_env(env: Mapping[str, str] | None = None) -> TorchrunEnv:
    """The torchrun variables, checked; TorchrunEnvError names the first bad one."""
    env = os.environ if env is None else env
    values: dict[str, int] = {}
    for name in _INT_VARS:
        raw = env.get(name)
        if raw is None or not raw.strip():
            raise TorchrunEnvError(
                f"environment variable {name} is not set: start the worker under torchrun "
                f"(or wsd up), which sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                f"MASTER_ADDR and MASTER_PORT"
            )
        try:
            values[name] = int(raw)
        except ValueError:
            raise TorchrunEnvError(
                f"environment variable {name} must be an integer, got {raw!r}"
            ) from None
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise TorchrunEnvError("environment variable MASTER_ADDR is not set: start the worker under torchrun")
    rank, world = values["RANK"], values["WORLD_SIZE"]
    local_rank, local_world = values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    if world < 1:
        raise TorchrunEnvError(f"environment variable WORLD_SIZE must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise TorchrunEnvError(f"environment variable RANK must be in 0..{world - 1} (WORLD_SIZE={world}), got {rank}")
    if not 1 <= local_world <= world:
        raise TorchrunEnvError(
            f"environment variable LOCAL_WORLD_SIZE must be in 1..{world} (WORLD_SIZE), got {local_world}"
        )
    if not 0 <= local_rank < local_world:
        raise TorchrunEnvError(
            f"environment variable LOCAL_RANK must be in 0..{local_world - 1} "
            f"(LOCAL_WORLD_SIZE={local_world}), got {local_rank}"
        )
    if not 1 <= values["MASTER_PORT"] <= 65535:
        raise TorchrunEnvError(f"environment variable MASTER_PORT must be in 1..65535, got {values['MASTER_PORT']}")
    return TorchrunEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       master_addr=addr, master_port=values["MASTER_PORT"])


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """One rank's view of the initialised job."""

    env: TorchrunEnv
    backend: str
    device: torch.device
    tp_size: int
    tp_group: Any
    """This rank's compute TP group, on the main backend."""
    tp_side_group: Any
    """This rank's gloo TP group for the agent's consistency collective (None at tp_size 1)."""
    control_group: Any
    """Gloo group of the whole world: stop votes and start-up broadcasts."""

    @property
    def tp_index(self) -> int:
        """Which TP group this rank belongs to."""
        return self.env.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        """This rank's position in its TP group: which shard of the weights it holds."""
        return self.env.rank % self.tp_size


def resolve_backend(backend: Backend) -> str:
    """``auto`` means nccl on CUDA and gloo otherwise; nccl without CUDA is a configuration error."""
    cuda = torch.cuda.is_available()
    if backend is Backend.AUTO:
        return "nccl" if cuda else "gloo"
    if backend is Backend.NCCL and not cuda:
        raise ConfigError(
            "[worker] backend = 'nccl' needs CUDA, which this machine does not have; use 'gloo' or 'auto'")
    return backend.value


def resolve_tp_size(env: TorchrunEnv, config: WorkerConfig) -> int:
    tp = env.local_world_size if config.tp_size is None else config.tp_size
    if env.world_size % tp:
        origin = "[worker] tp_size" if config.tp_size is not None else "LOCAL_WORLD_SIZE (the default tp_size)"
        raise ConfigError(f"WORLD_SIZE={env.world_size} is not a multiple of {origin}={tp}")
    return tp


def init_distributed(env: TorchrunEnv, config: WorkerConfig) -> DistContext:
    """Initialise the default process group and this rank's groups (collective)."""
    backend = resolve_backend(config.backend)
    tp = resolve_tp_size(env, config)
    if backend == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size,
        timeout=datetime.timedelta(seconds=config.collective_timeout),
    )
    compute, side = tp_groups(env.rank, env.world_size, tp, backend)
    control = dist.new_group(list(range(env.world_size)), backend="gloo")
    return DistContext(env=env, backend=backend, device=device, tp_size=tp, tp_group=compute,
                       tp_side_group=side, control_group=control)


def any_rank(flag: bool, group: Any) -> bool:
    """True on every rank if ``flag`` is True on any (collective on a gloo group).

    The stop vote: ranks that each got a signal at a slightly different moment
    leave the loop at the same step, so no rank is left waiting in a
    collective for one that has gone.
    """
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


def broadcast_from_rank0(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` on every rank (a msgpack-able value, on a gloo group)."""
    return broadcast_value(value, group, src=0)
