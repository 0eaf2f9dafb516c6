"""The GPU tier: CUDA graphs over wsd's workspaces, on a real device.

vLLM captures CUDA graphs whose kernels write into workspace views, then locks the
manager; the graphs keep the raw addresses. These tests capture real graphs and hold
wsd to its promises (DESIGN.md 3.9 and 4): after the engine's lock no command an
operator sends moves a buffer, and under capture a kernel's first growth goes ahead
while an operator's command, or a fallback buffer, is refused.
"""

from __future__ import annotations

import pytest
import torch

from wsd import (
    WorkspaceCaptureError,
    WorkspaceLockedError,
    WorkspaceLockHeldError,
    WorkspaceManager,
    commands,
    use_ubatch,
)
from wsd.integrations.vllm.workspace import WorkspaceManager as VllmWorkspaceManager
from wsd.integrations.vllm.workspace import use_workspace_lane

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")

F32 = torch.float32
N = 256


def _small_ints(seed: int) -> torch.Tensor:
    """An N x N matrix of integers in [-3, 3]: its products are exact in fp32 (and TF32), so a
    graph's replay and an eager run agree bit for bit whatever kernel cuBLAS picks."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-3, 4, (N, N), device="cuda", generator=generator).to(F32)


# What an operator may send to a rank whose engine locked (pinned) its workspace after
# capture, and what becomes of it: refused (the error), or applied without moving a buffer.
PINNED_ATTEMPTS = [
    ("unlock", {}, WorkspaceLockHeldError, "engine locked this workspace"),
    ("trim", {}, WorkspaceLockHeldError, "engine locked this workspace"),
    ("reserve", {"bytes": 64 << 20}, WorkspaceLockHeldError, "engine locked this workspace"),
    ("equalize", {}, WorkspaceLockHeldError, "engine locked this workspace"),
    ("set_ubatches", {"n": 1}, ValueError, r"refused: the engine runs 2"),
    ("set_ubatches", {"n": 3}, None, None),  # a new slot, pre-sized; the two under the graph stay
    ("set_ubatches", {"n": 2}, None, None),
    ("lock", {}, None, None),
]


def test_a_captured_graph_replays_correctly_through_every_command_once_the_engine_locked():
    """vLLM captures graphs writing into workspace views, then locks. Were unlock, trim,
    reserve or equalize applied then, a slot's buffer would be freed or moved while the graph
    still writes to its old address: replays would corrupt memory someone else now owns. The
    drop-in manager's own lock() pins: each of those is refused with WorkspaceLockHeldError,
    set_ubatches moves none of the captured slots, every buffer keeps its address, and replay
    after each attempt computes what eager execution does."""
    manager = VllmWorkspaceManager("cuda", 2)
    x = _small_ints(0)
    weights = [_small_ints(1), _small_ints(2)]

    def forward() -> list[torch.Tensor]:
        outs = []
        for u, weight in enumerate(weights):
            with use_ubatch(u):
                hidden, out = manager.get_simultaneous(((N, N), F32), ((N, N), F32))
                torch.matmul(x, weight, out=hidden)
                torch.add(hidden, u + 1, out=out)
                outs.append(out)
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch asks: grows both slots
        with use_ubatch(0):
            manager.get_simultaneous(((4 * N, N), F32))  # slot 0 larger: equalize would move slot 1
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    manager.lock()  # the engine's lock, as vLLM after capture: pins
    assert manager.pinned
    addresses = [buffer.data_ptr() for buffer in manager._current_workspaces]
    capacities = [s.capacity_bytes for s in manager.stats().slots]
    assert capacities[0] > capacities[1] > 0

    def replay_matches(seed: int, after: str) -> None:
        x.copy_(_small_ints(seed))  # new input: the replay has to compute, not just leave old values
        graph.replay()
        expected = [x @ weight + (u + 1) for u, weight in enumerate(weights)]
        torch.cuda.synchronize()
        for u in range(2):
            assert torch.equal(outs[u], expected[u]), f"ubatch {u}'s graph output is wrong after {after}"
        assert [b.data_ptr() for b in manager._current_workspaces[:2]] == addresses, f"a buffer moved: {after}"
        assert [s.capacity_bytes for s in manager.stats().slots[:2]] == capacities, after
        assert manager.is_locked() and manager.pinned, after

    replay_matches(10, "the lock")
    for seed, (action, args, refused, words) in enumerate(PINNED_ATTEMPTS, start=11):
        if refused is None:
            commands.call(manager, action, args)
        else:
            with pytest.raises(refused, match=words):
                commands.call(manager, action, args)
        replay_matches(seed, f"{action} {args}")
    assert manager.stats().lock_violations == 0  # an operator's refusal is not a kernel's violation


def test_first_growth_under_capture_goes_ahead_but_no_operator_command_does():
    """vLLM's V2 runner captures its speculator on a lane of its own, whose first growth
    comes inside the capture: refused, the engine would not start. An operator's command in
    that window (reserve, equalize, trim, set_ubatches) would move buffers a graph captured a
    moment ago may point into: each raises WorkspaceCaptureError, and the graph replays right."""
    manager = VllmWorkspaceManager("cuda", 1, 2)
    (warm,) = manager.get_simultaneous(((1024,), F32))  # lane 0 warmed eagerly
    warm.zero_()
    source = torch.arange(1 << 20, device="cuda", dtype=F32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with use_workspace_lane(1):
            (view,) = manager.get_simultaneous(((1 << 20,), F32))  # lane 1's first growth
            torch.mul(source, 2, out=view)
        for action, args in (("reserve", {"bytes": 1 << 24}), ("equalize", {}), ("trim", {}),
                             ("set_ubatches", {"n": 2})):
            with pytest.raises(WorkspaceCaptureError, match="refused during CUDA graph capture"):
                commands.call(manager, action, args)
    source.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(view, source * 2)
    lane0, lane1 = manager.stats().slots
    assert (lane0.capacity_bytes, lane1.capacity_bytes) == (4096, 4 << 20)
    assert (lane0.resizes, lane1.resizes) == (1, 1)
    assert manager.num_ubatches == 1


def test_a_locked_fallback_manager_refuses_an_oversize_request_under_capture():
    """on_locked_growth="fallback" serves a locked request that does not fit from a one-off
    buffer. Under capture that buffer would come from the graph's pool and be freed under the
    graph after the call: the request is refused (WorkspaceLockedError) and counted instead,
    and the slot keeps its size. Outside capture the same request is served as the policy says."""
    manager = WorkspaceManager("cuda", 1, on_locked_growth="fallback")
    (small,) = manager.get_simultaneous(((1024,), F32))
    manager.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small.fill_(2.0)
        with pytest.raises(WorkspaceLockedError):
            manager.get_simultaneous(((1 << 20,), F32))
    graph.replay()
    torch.cuda.synchronize()
    assert bool((small == 2.0).all())
    (slot,) = manager.stats().slots
    assert (slot.capacity_bytes, slot.lock_violations) == (4096, 1)
    (big,) = manager.get_simultaneous(((1 << 20,), F32))  # eager: the one-off buffer
    big.fill_(3.0)
    assert big.numel() == 1 << 20 and float(big[-1]) == 3.0
    (slot,) = manager.stats().slots
    assert (slot.capacity_bytes, slot.lock_violations) == (4096, 2)
