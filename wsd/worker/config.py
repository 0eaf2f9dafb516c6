"""``[worker]`` and ``[workload]``: the built-in worker process and its engine loop. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wsd.fieldchecks import check_positive, check_range, coerce_enum

__all__ = ["Backend", "WorkerConfig", "WorkloadConfig", "WorkloadDtype"]


class Backend(enum.Enum):
    """The ``torch.distributed`` backend of the workers' compute collectives."""

    AUTO = "auto"
    """nccl when CUDA is available, else gloo."""
    NCCL = "nccl"
    GLOO = "gloo"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """``[worker]``: the worker process ``python -m wsd.worker`` run by torchrun."""

    tp_size: int | None = None
    """Ranks per tensor-parallel group, contiguous global ranks (0..tp_size-1 is group 0).
    None: LOCAL_WORLD_SIZE, one TP group per node. WORLD_SIZE must be a multiple of it."""
    backend: Backend = Backend.AUTO
    """``"auto"``, ``"nccl"`` (device cuda:LOCAL_RANK) or ``"gloo"`` (device cpu)."""
    collective_timeout: float = 300.0
    """Seconds a collective may wait for the other ranks before it fails."""
    coordinator_start_timeout: float = 30.0
    """Seconds rank 0 waits for an embedded coordinator to be ready."""

    def __post_init__(self) -> None:
        if self.tp_size is not None:
            check_range("tp_size", self.tp_size, 1, 1 << 20)
        coerce_enum(self, "backend", Backend)
        check_positive("collective_timeout", self.collective_timeout)
        check_positive("coordinator_start_timeout", self.coordinator_start_timeout, 3600.0)


class WorkloadDtype(enum.Enum):
    """Element type of the built-in workload's weights and activations."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """``[workload]``: the built-in engine loop, a tensor-parallel MLP stack.

    Each step runs every ubatch slot in turn through ``layers`` column- then
    row-parallel MLP layers, with every intermediate buffer from the workspace.
    """

    hidden_size: int = 256
    """Model width: the replicated activations are ``tokens x hidden_size``."""
    ffn_size: int = 1024
    """MLP inner width, split across the TP group: a multiple of the TP size."""
    layers: int = 2
    """MLP layers per ubatch per step (one all_reduce over the TP group each)."""
    dtype: WorkloadDtype = WorkloadDtype.FLOAT32
    """``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    max_tokens: int = 256
    """Largest token count of warm-up and steady steps."""
    warmup_steps: int = 8
    """Warm-up steps over rising token counts, the last at ``max_tokens``."""
    lock: bool = True
    """Lock the workspace after warm-up, as an engine does before CUDA-graph capture."""
    steps: int = 0
    """Steady steps after warm-up; 0: run until stopped."""
    pace: float = 0.05
    """Least seconds per step (a sleep fills the rest); 0: as fast as the machine goes."""
    oversize_chance: float = 0.0
    """Chance (0 to 1) that a steady step, while locked, asks for more tokens than
    warm-up reached, so that lock violations show in operation."""
    seed: int = 0
    """Seed of the token counts; every rank draws the same, as the TP collectives need."""

    def __post_init__(self) -> None:
        check_range("hidden_size", self.hidden_size, 1, 1 << 20)
        check_range("ffn_size", self.ffn_size, 1, 1 << 24)
        check_range("layers", self.layers, 1, 1024)
        coerce_enum(self, "dtype", WorkloadDtype)
        check_range("max_tokens", self.max_tokens, 1, 1 << 24)
        check_range("warmup_steps", self.warmup_steps, 1, 1_000_000)
        if self.warmup_steps > self.max_tokens:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must not exceed max_tokens "
                f"({self.max_tokens}): each warm-up step must ask for more tokens"
            )
        if not isinstance(self.lock, bool):
            raise ValueError(f"lock must be true or false, got {self.lock!r}")
        check_range("steps", self.steps, 0, 1 << 62)
        if isinstance(self.pace, bool) or not isinstance(self.pace, (int, float)) \
                or not 0 <= self.pace <= 3600:
            raise ValueError(f"pace must be a number of seconds in [0, 3600], got {self.pace!r}")
        if isinstance(self.oversize_chance, bool) or not isinstance(self.oversize_chance, (int, float)) \
                or not 0 <= self.oversize_chance <= 1:
            raise ValueError(f"oversize_chance must be a number in [0, 1], got {self.oversize_chance!r}")
        check_range("seed", self.seed, 0, 2**63 - 1)
