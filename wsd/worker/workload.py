"""The built-in engine loop: a tensor-parallel MLP stack driving the workspace.

Each layer is Megatron-style: a column-parallel linear (each TP rank holds
``ffn_size / tp`` columns of the first weight), an activation, a row-parallel
linear (the matching rows of the second weight), and an ``all_reduce`` over
the TP group that sums the partial outputs. Each step runs every ubatch slot
in turn, as dual-batch overlap does, and takes every intermediate buffer from
``get_simultaneous``, so the workspace is sized exactly as an engine's is:
rising token counts during warm-up grow it, ``lock()`` freezes it, and steady
steps with varied token counts up to the warm-up maximum reuse it. With
``oversize_chance``, a locked step sometimes asks for more, and the refusal is
counted (the agent reports it) instead of killing the worker.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from wsd.config import WorkloadConfig
from wsd.errors import ConfigError, WorkspaceLockedError
from wsd.manager.core import WorkspaceManager, use_lane, use_ubatch

__all__ = ["TensorParallelMlp", "WorkloadResult", "run_workload", "steady_tokens", "warmup_tokens"]

logger = logging.getLogger(__name__)

ShapeAndDtype = tuple[tuple[int, ...], torch.dtype]


def warmup_tokens(config: WorkloadConfig) -> list[int]:
    """Strictly rising token counts, one per warm-up step, the last ``max_tokens``."""
    n, top = config.warmup_steps, config.max_tokens
    return [top * (i + 1) // n for i in range(n)]


def steady_tokens(rng: random.Random, config: WorkloadConfig, locked: bool) -> int:
    """A steady step's token count: up to ``max_tokens``, or beyond it by chance while locked.

    Both draws are made at every step whatever the lock state, so the
    sequence stays the same on every rank that shares the seed.
    """
    tokens = rng.randint(1, config.max_tokens)
    over = rng.random() < config.oversize_chance
    extra = rng.randint(1, config.max_tokens)
    # Only while locked: unlocked, an oversize request would just grow the
    # slot and make every later one fit, hiding what the knob is for.
    return config.max_tokens + extra if over and locked else tokens


class TensorParallelMlp:
    """This rank's shards of ``layers`` column- then row-parallel MLP layers."""

    def __init__(self, config: WorkloadConfig, *, tp_rank: int, tp_size: int,
                 device: torch.device, group: Any) -> None:
        if config.ffn_size % tp_size:
            raise ConfigError(
                f"[workload] ffn_size ({config.ffn_size}) must be a multiple of the TP size ({tp_size})"
            )
        self.hidden = config.hidden_size
        self.shard = config.ffn_size // tp_size
        self.dtype = getattr(torch, config.dtype.value)
        self.device = device
        self.group = group
        # Each rank draws its own shard; the values do not matter, the shapes do.
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + tp_rank)
        scale_in, scale_out = self.hidden ** -0.5, self.shard ** -0.5
        self.w_in = [(torch.randn(self.hidden, self.shard, generator=gen) * scale_in).to(device, self.dtype)
                     for _ in range(config.layers)]
        self.w_out = [(torch.randn(self.shard, self.hidden, generator=gen) * scale_out).to(device, self.dtype)
                      for _ in range(config.layers)]

    def buffers(self, tokens: int) -> list[ShapeAndDtype]:
        """Every intermediate of one forward pass: the input, then per layer (hidden, output)."""
        wanted: list[ShapeAndDtype] = [((tokens, self.hidden), self.dtype)]
        for _ in self.w_in:
            wanted += [((tokens, self.shard), self.dtype), ((tokens, self.hidden), self.dtype)]
        return wanted

    def forward(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        x = buffers[0]
        x.fill_(1.0 / self.hidden)  # replicated input: the same on every rank of the group
        for layer, (w_in, w_out) in enumerate(zip(self.w_in, self.w_out)):
            h, out = buffers[1 + 2 * layer], buffers[2 + 2 * layer]
            torch.matmul(x, w_in, out=h)  # column-parallel: this rank's slice of the hidden units
            torch.nn.functional.silu(h, inplace=True)
            torch.matmul(h, w_out, out=out)  # row-parallel: a partial sum of the output
            dist.all_reduce(out, group=self.group)
            x = out
        return x


@dataclass(frozen=True)
class WorkloadResult:
    steps: int
    """Steps run, warm-up included."""
    violations: int
    """Requests the locked workspace refused (each ran on a temporary buffer instead)."""


def run_workload(
    manager: WorkspaceManager,
    mlp: TensorParallelMlp,
    config: WorkloadConfig,
    *,
    step_boundary: Callable[[], object],
    should_stop: Callable[[], bool],
    wait: Callable[[float], object] = time.sleep,
    warmed: Callable[[], object] = lambda: None,
    stepping: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> WorkloadResult:
    """Warm up, lock (if configured), then run steady steps until done or stopped.

    ``step_boundary`` is the agent's ``step()``; ``should_stop`` is called at
    every step boundary on every rank (the worker's stop vote, a collective);
    ``wait`` fills each step up to ``config.pace``; ``warmed`` is called once,
    when warm-up is over (the agent's ``mark_warm``: commands apply from then on);
    ``stepping()`` is held around each step, not the wait after it (the agent's: a rank
    inside one step too long, a peer frozen in its collective, is stalled).
    """
    rng = random.Random(config.seed)
    warmup = warmup_tokens(config)
    total = len(warmup) + config.steps if config.steps else None
    step = violations = 0
    while total is None or step < total:
        started = time.monotonic()
        with stepping():  # the step, its collectives and its agreement; not the wait after it
            tokens = warmup[step] if step < len(warmup) else steady_tokens(rng, config, manager.is_locked())
            # Read the ubatch count at every step: set_ubatches changes it at a step boundary.
            for ubatch in range(manager.num_ubatches):
                with use_ubatch(ubatch), use_lane(step % manager.num_lanes):
                    violations += _forward(manager, mlp, tokens)
            step += 1
            if step == len(warmup):
                if config.lock:
                    manager.lock()
                logger.info("warm-up done after %d steps at %d tokens: slots %s bytes, %s",
                            step, tokens, sorted({s.capacity_bytes for s in manager.stats().slots}),
                            "locked" if manager.is_locked() else "unlocked")
            if step >= len(warmup):
                warmed()
            step_boundary()
            stopping = should_stop()
        if stopping:
            break
        left = config.pace - (time.monotonic() - started)
        if left > 0:
            wait(left)
    return WorkloadResult(steps=step, violations=violations)


def _forward(manager: WorkspaceManager, mlp: TensorParallelMlp, tokens: int) -> int:
    """One ubatch's forward pass; 1 if the locked workspace refused it, else 0."""
    wanted = mlp.buffers(tokens)
    try:
        buffers = manager.get_simultaneous(*wanted)
        refused = 0
    except WorkspaceLockedError:
        # Run on temporary buffers instead, so that this rank still joins every
        # all_reduce of the step: a rank that skipped one would hang its group.
        buffers = [torch.empty(shape, dtype=dtype, device=mlp.device) for shape, dtype in wanted]
        refused = 1
    mlp.forward(buffers)
    return refused
