"""Benchmark of the per-rank manager's hot path and growth policies.

Side by side in one run (absolute times on a shared machine mean little):

* steady-state ``get_simultaneous`` (no growth) for 1, 3 and 8 tensors, wsd's
  manager against (a) a faithful re-implementation of vLLM's algorithm
  (DESIGN.md section 1) and (b) the bare cost of slicing the same views from
  precomputed offsets; rounds are interleaved and the median taken;
* on a warm-up trace of rising request sizes, the resizes and final bytes of
  each growth policy, against exact growth.

Run: ``python -m bench.bench_manager [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from math import prod
from typing import Any

import torch

from bench.helpers import Row
from wsd import WorkspaceManager

# -- vLLM's algorithm, re-implemented faithfully ---------------------------------

_THREAD_ID_TO_CONTEXT: dict[int, int] = {}


def dbo_current_ubatch_id() -> int:
    """As vLLM's ubatching module: 0 unless dual-batch overlap threads registered."""
    if len(_THREAD_ID_TO_CONTEXT) == 0:
        return 0
    return _THREAD_ID_TO_CONTEXT[threading.get_ident()]


def _round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


class VllmWorkspaceManager:
    """vLLM's WorkspaceManager hot path: per-call byte maths, slice, view, reshape."""

    def __init__(self, device: torch.device, num_ubatches: int | None = None) -> None:
        self._device = device
        self._num_ubatches = num_ubatches if num_ubatches is not None else 1
        self._current_workspaces: list[torch.Tensor | None] = [None] * self._num_ubatches
        self._locked = False

    @staticmethod
    def _workspace_size_bytes(workspace: torch.Tensor | None) -> int:
        if workspace is None:
            return 0
        return workspace.numel() * workspace.element_size()

    def get_simultaneous(self, *shapes_and_dtypes):
        actual_bytes = [prod(s) * d.itemsize for s, d in shapes_and_dtypes]
        aligned_bytes = [_round_up(actual, 256) for actual in actual_bytes]
        total_bytes = sum(aligned_bytes)
        offsets = list(accumulate([0] + aligned_bytes[:-1]))  # noqa: RUF005 (vLLM's own expression: the timed baseline)
        current_workspace = self._ensure_workspace_size(total_bytes)
        return [
            current_workspace[offsets[i] : offsets[i] + actual_bytes[i]]
            .view(shapes_and_dtypes[i][1])
            .reshape(shapes_and_dtypes[i][0])
            for i in range(len(shapes_and_dtypes))
        ]

    def _ensure_workspace_size(self, required_bytes: int) -> torch.Tensor:
        ubatch_id = dbo_current_ubatch_id()
        current_workspace = self._current_workspaces[ubatch_id]
        current_size = self._workspace_size_bytes(current_workspace)
        if current_size < required_bytes:
            if self._locked:
                raise AssertionError("Workspace is locked")
            self._current_workspaces[ubatch_id] = None
            self._current_workspaces[ubatch_id] = torch.empty(
                (required_bytes,), dtype=torch.uint8, device=self._device
            )
        # As vLLM's, unnarrowed (the entry was just set): no check added to the timed baseline.
        return self._current_workspaces[ubatch_id]  # type: ignore[return-value]


# -- the requests ------------------------------------------------------------------

REQUESTS = {
    1: (((512, 4096), torch.bfloat16),),
    3: (((512, 4096), torch.bfloat16), ((512, 8), torch.int32), ((512, 8), torch.float32)),
    8: tuple(
        ((512, d), dt)
        for d, dt in [(4096, torch.bfloat16), (8, torch.int32), (8, torch.float32), (128, torch.float16),
                      (1, torch.int64), (64, torch.float32), (2048, torch.uint8), (16, torch.bfloat16)]
    ),
}


def bare_views(buffer: torch.Tensor, request) -> Callable[[], list[torch.Tensor]]:
    sizes = [prod(s) * d.itemsize for s, d in request]
    offsets = list(accumulate([0] + [_round_up(n, 256) for n in sizes[:-1]]))
    plan = [(o, o + n, d, s) for o, n, (s, d) in zip(offsets, sizes, request)]
    return lambda: [buffer[a:b].view(d).view(s) for a, b, d, s in plan]


def get_simultaneous(manager: WorkspaceManager | VllmWorkspaceManager, request: tuple) -> Callable[[], object]:
    """``manager.get_simultaneous(*request)`` as a call of no arguments (a closure, as ``bare_views``'s)."""
    return lambda: manager.get_simultaneous(*request)


def layout(views: Sequence[torch.Tensor]) -> list[tuple]:
    base = views[0].data_ptr()
    return [(v.data_ptr() - base, tuple(v.shape), v.dtype, v.stride()) for v in views]


def time_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def bench_steady_state(rounds: int, calls: int) -> list[tuple[int, float, float, float, float]]:
    device = torch.device("cpu")
    results = []
    for n, request in REQUESTS.items():
        ours = WorkspaceManager(device, 1)
        theirs = VllmWorkspaceManager(device, 1)
        ours_views = ours.get_simultaneous(*request)
        theirs_views = theirs.get_simultaneous(*request)
        # What a caller observes must be the same: shapes, dtypes, strides, offsets.
        if layout(ours_views) != layout(theirs_views):
            raise SystemExit(f"layout differs from vLLM's for {n} tensors")
        buffer = theirs._current_workspaces[0]
        assert buffer is not None  # the first call allocated it
        bare = bare_views(buffer, request)
        candidates: dict[str, Callable[[], object]] = {
            "wsd": get_simultaneous(ours, request),
            "vllm": get_simultaneous(theirs, request),
            "bare": bare,
        }
        samples: dict[str, list[float]] = {k: [] for k in candidates}
        for _ in range(rounds):
            for name, fn in candidates.items():
                samples[name].append(time_per_call(fn, calls))
        med = {k: statistics.median(v) for k, v in samples.items()}
        results.append((n, med["wsd"], med["vllm"], med["bare"], med["wsd"] / med["vllm"]))
    return results


# -- growth policies on a warm-up trace ----------------------------------------------


def warmup_trace(hidden: int = 4096) -> list[tuple]:
    """Requests of rising size, as warm-up over rising batch sizes produces."""
    tokens = [1, 2, 4, 8, *range(16, 513, 16), *range(768, 8193, 256)]
    return [(((t, hidden), torch.bfloat16), ((t, 8), torch.float32)) for t in tokens]


def bench_growth() -> list[tuple[str, int, int, int]]:
    trace = warmup_trace()
    policies: dict[str, dict[str, Any]] = {
        "exact": {},
        "granular 2MiB": {"growth": "granular", "granularity": 2 << 20},
        "granular 16MiB": {"growth": "granular", "granularity": 16 << 20},
    }
    rows = []
    for name, options in policies.items():
        manager = WorkspaceManager("cpu", 1, **options)
        for request in trace:
            manager.get_simultaneous(*request)
        slot = manager.stats().slots[0]
        rows.append((name, slot.resizes, slot.capacity_bytes, slot.capacity_bytes - slot.peak_requested_bytes))
    return rows


TARGET = ("get_simultaneous[3] wsd/vllm", 0.5)


def run(quick: bool = False) -> list[Row]:
    """Measure, print the tables and return the ratios for ``python -m bench``."""
    rounds, calls = (7, 2000) if quick else (21, 5000)
    torch.set_num_threads(1)

    print("steady-state get_simultaneous, median of interleaved rounds (ns per call)")
    print(f"{'tensors':>7} {'wsd':>9} {'vllm':>9} {'bare':>9} {'wsd/vllm':>9} {'wsd/bare':>9}")
    rows: list[Row] = []
    for n, ours, theirs, bare, ratio in bench_steady_state(rounds, calls):
        print(f"{n:>7} {ours:>9.0f} {theirs:>9.0f} {bare:>9.0f} {ratio:>9.3f} {ours / bare:>9.3f}")
        name = f"get_simultaneous[{n}] wsd/vllm"
        rows.append(Row(name, ratio, "vLLM's algorithm re-implemented",
                        TARGET[1] if name == TARGET[0] else None))
        rows.append(Row(f"get_simultaneous[{n}] wsd/bare", ours / bare, "bare view slicing"))
    print()
    print("growth policies on a warm-up trace of rising sizes")
    growth = bench_growth()
    exact_resizes, exact_bytes = growth[0][1], growth[0][2]
    print(f"{'policy':<15} {'resizes':>7} {'final MiB':>9} {'waste MiB':>9} {'resizes/exact':>13} {'bytes/exact':>11}")
    for name, resizes, final, waste in growth:
        print(f"{name:<15} {resizes:>7} {final / 2**20:>9.1f} {waste / 2**20:>9.1f} "
              f"{resizes / exact_resizes:>13.3f} {final / exact_bytes:>11.3f}")
        if name != "exact":
            rows.append(Row(f"growth {name} resizes/exact", resizes / exact_resizes, "exact growth, same trace"))
            rows.append(Row(f"growth {name} bytes/exact", final / exact_bytes, "exact growth, same trace"))
    target = next(r for r in rows if r.name == TARGET[0])
    print(f"\ntarget: {target.name} <= {TARGET[1]}: {target.value:.3f} ({'met' if target.met else 'NOT met'})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a few seconds)")
    args = parser.parse_args(argv)
    return run(args.quick)


if __name__ == "__main__":
    main()
