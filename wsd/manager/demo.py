"""A short, real engine life of one manager, for ``wsd demo``.

Warm-up requests of rising size on every ubatch slot, ``equalize`` and
``lock`` (what an engine does before CUDA-graph capture), steady-state
requests that fit, and one request larger than warm-up reached, which the
locked manager refuses with its caller and sizes.
"""

from __future__ import annotations

import torch

from wsd.config import load_config
from wsd.errors import WorkspaceLockedError
from wsd.fmt import format_bytes, table
from wsd.manager.core import WorkspaceManager, use_lane, use_ubatch


def run_demo(config_path: str | None, device: str, steps: int) -> str:
    config = load_config(config_path)
    manager = WorkspaceManager.from_config(device, config)
    hidden = 256
    out = [f"config: {config.source}", repr(manager), ""]

    def request(tokens: int) -> None:
        manager.get_simultaneous(
            ((tokens, hidden), torch.bfloat16), ((tokens,), torch.int32), ((tokens, 8), torch.float32)
        )

    # Warm-up grows only slot (0, 0) to the largest batch, as a warm-up run does.
    for tokens in (16, 64, 256, 1024):
        request(tokens)
    manager.equalize()
    manager.lock()
    for step in range(steps):
        with use_ubatch(step % manager.num_ubatches), use_lane(step % manager.num_lanes):
            request(1 + (step * 37) % 1024)
    try:
        request(4096)
    except WorkspaceLockedError as e:
        out += ["a locked request larger than warm-up was refused:", f"  {e}", ""]
    stats = manager.stats()
    rows = [
        (s.ubatch, s.lane, format_bytes(s.capacity_bytes), format_bytes(s.peak_requested_bytes),
         s.requests, s.resizes, s.lock_violations)
        for s in stats.slots
    ]
    out.append(table(("UBATCH", "LANE", "CAPACITY", "PEAK", "REQUESTS", "RESIZES", "VIOLATIONS"), rows))
    out.append(f"total {format_bytes(stats.total_bytes)} on {stats.device}, locked={stats.locked}")
    return "\n".join(out)
