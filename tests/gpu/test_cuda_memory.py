"""The GPU tier: wsd's buffers in CUDA's allocator, on streams, on a real device.

What a CPU run cannot show: where the scratch buffers come from when vLLM passes its
sleep-mode memory pool, that two ubatches on two streams each keep to their own slot
through a reserve, that memory an operator's command allocated is held for the
streams that use it, and that a retained span survives kernels writing below it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from wsd import WorkspaceManager, commands, use_ubatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device")

F32 = torch.float32


def _in_pool(tensor: torch.Tensor, pool: torch.cuda.MemPool) -> bool:
    """Whether ``tensor``'s memory lies in one of ``pool``'s segments."""
    address = tensor.data_ptr()
    return any(s["address"] <= address < s["address"] + s["total_size"] for s in pool.snapshot())


def test_fallback_buffers_never_enter_the_memory_pool_context():
    """vLLM's sleep-mode allocator (cumem) makes a new torch.cuda.MemPool at each entry of
    the context it passes as alloc_context, and keeps it for ever. A one-off fallback buffer
    allocated inside it would leave one pool behind per locked request that does not fit,
    for as long as the engine serves. Slot growth enters the context (its buffers live in
    the pool, so sleep mode can offload them); N fallback requests enter it 0 times."""
    if not hasattr(torch.cuda, "use_mem_pool"):
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.MemPool (vLLM's cumem allocator needs one)")
    pools: list[torch.cuda.MemPool] = []

    @contextlib.contextmanager
    def a_new_pool_each_time() -> Iterator[None]:
        pool = torch.cuda.MemPool()
        pools.append(pool)
        with torch.cuda.use_mem_pool(pool):
            yield

    manager = WorkspaceManager("cuda", 2, 1, a_new_pool_each_time, on_locked_growth="fallback")
    for u in range(2):
        with use_ubatch(u):
            manager.get_simultaneous(((1 << 16,), F32))
    assert len(pools) == 2
    assert all(b is not None and _in_pool(b, pool) for b, pool in zip(manager._current_workspaces, pools))
    manager.lock()
    for i in range(8):
        (big,) = manager.get_simultaneous(((1 << 20,), F32))  # 4 MiB: past the 256 KiB slot
        big.fill_(float(i))
        assert float(big[-1]) == i
        assert not any(_in_pool(big, pool) for pool in pools)
    assert len(pools) == 2, "a fallback buffer entered the pool context"
    assert manager.stats().lock_violations == 8
    assert [s.capacity_bytes for s in manager.stats().slots] == [1 << 18, 1 << 18]
    manager.unlock()
    manager.get_simultaneous(((1 << 20,), F32))  # growth again: in a pool of its own
    assert len(pools) == 3 and _in_pool(manager._current_workspaces[0], pools[2])
    del big
    manager.trim()  # the buffers go before the pools they live in
    torch.cuda.synchronize()
    pools.clear()


def test_two_ubatch_streams_stay_in_their_slots_through_a_reserve_between_steps():
    """Dual-batch overlap runs each ubatch's kernels on a stream of its own, each in its own
    slot, at the same time. A reserve applied at the step boundary (once the step's streams
    are synchronised, as the agent applies commands between steps) reallocates both slots.
    Were two ubatches given one slot, or a buffer freed while a stream still wrote to it,
    the values each stream reads back would be the other's or stale; views held from before
    the reserve keep their old memory and values."""
    manager = WorkspaceManager("cuda", 2)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    n = 1 << 20

    def step(k: int) -> list[torch.Tensor]:
        """Both ubatches at once: each fills its slot with its own value and works it over."""
        main = torch.cuda.current_stream()
        outs = []
        for u, stream in enumerate(streams):
            stream.wait_stream(main)
            with use_ubatch(u), torch.cuda.stream(stream):
                a, b = manager.get_simultaneous(((n,), F32), ((n,), F32))
                a.fill_(float(10 * k + u))
                for _ in range(8):  # long enough for the two streams to overlap
                    torch.add(a, 1.0, out=b)
                    torch.sub(b, 1.0, out=a)
                torch.add(a, 0.5, out=b)
                outs.append(b)
        for stream in streams:
            main.wait_stream(stream)
        return outs

    def check(outs: list[torch.Tensor], k: int) -> None:
        for u, out in enumerate(outs):
            assert bool((out == 10 * k + u + 0.5).all()), f"ubatch {u} read wrong values at step {k}"

    for k in range(3):
        check(step(k), k)
    held = step(3)
    torch.cuda.synchronize()  # the step boundary
    before = [buffer.data_ptr() for buffer in manager._current_workspaces]
    commands.call(manager, "reserve", {"bytes": 16 << 20})
    after = [buffer.data_ptr() for buffer in manager._current_workspaces]
    assert [s.capacity_bytes for s in manager.stats().slots] == [16 << 20, 16 << 20]
    assert len(set(after)) == 2 and not set(after) & set(before), "reserve did not reallocate both slots"
    for k in range(4, 8):
        check(step(k), k)
    check(held, 3)  # still the old buffers' values: never reused under the views
    torch.cuda.synchronize()


def test_a_retained_span_keeps_its_contents_on_the_gpu():
    """vLLM 0.34's get_retained: the span at the end of the slot's buffer outlives requests
    that do not reach it, and says so (intact). Kernels writing the views below it must leave
    its bytes alone; a request reaching into it ends it (intact False next time)."""
    manager = WorkspaceManager("cuda", 1)
    manager.get_simultaneous(((1 << 20,), torch.uint8))
    kept, intact = manager.get_retained("kv", (1024,), F32)
    assert not intact
    kept.copy_(torch.arange(1024, device="cuda", dtype=F32))
    expected = kept.clone()
    for k in range(3):
        a, b = manager.get_simultaneous(((4096,), F32), ((4096,), F32))  # 32 KiB, below the span
        a.fill_(float(-k))
        torch.mul(a, 3, out=b)
        again, intact = manager.get_retained("kv", (1024,), F32)
        assert intact and again.data_ptr() == kept.data_ptr()
        assert torch.equal(again, expected), f"the retained span changed after request {k}"
    (whole,) = manager.get_simultaneous(((1 << 20,), torch.uint8))  # reaches into the span
    whole.zero_()
    _, intact = manager.get_retained("kv", (1024,), F32)
    assert not intact


def test_an_operators_reserve_is_held_for_the_ubatch_stream_that_uses_it():
    """A reserve applied between steps allocates on the applying thread's stream; dual-batch
    overlap then uses the slot on its ubatch's stream. Were that use not recorded, the
    caching allocator would hand the memory out again on the first stream as soon as the
    last view of it went, while the ubatch stream's kernels were still writing it: the
    next allocation there would get the same address. Recorded, it waits for that work."""
    manager = WorkspaceManager("cuda", 2)
    n = 8 << 20
    commands.call(manager, "reserve", {"bytes": n})  # on the current (main) stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with use_ubatch(1), torch.cuda.stream(side):
        (view,) = manager.get_simultaneous(((n,), torch.uint8))
    address = view.data_ptr()
    commands.call(manager, "reserve", {"bytes": 2 * n})  # the slot lets go; the view holds it
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of queued work on the ubatch stream
        view.fill_(1)
    del view  # the memory is free once the ubatch stream is done with it
    assert side.query() is False, "the ubatch stream's work ended before the test could look"
    fresh = torch.empty(n, dtype=torch.uint8, device="cuda")  # on the main stream
    assert fresh.data_ptr() != address, "memory still in use on the ubatch stream was handed out again"
    torch.cuda.synchronize()


def test_only_an_operators_allocation_records_the_streams_that_use_it():
    """Only an operator's allocation is made on another stream than the kernel's: a slot a
    kernel grew, on the stream that uses it, costs its requests nothing more."""
    manager = WorkspaceManager("cuda", 1)
    manager.get_simultaneous(((1 << 20,), torch.uint8))
    assert manager._slots[0].made_on is None
    commands.call(manager, "reserve", {"bytes": 4 << 20})
    assert manager._slots[0].made_on == torch.cuda.current_stream()


def test_an_operators_growth_that_the_capped_allocator_cannot_hold_is_refused_before_it_allocates():
    """vLLM 0.34's extensible KV cache caps torch's allocator after warm-up
    (``set_per_process_memory_fraction``): the manager's stats show the cap and what torch may
    still reserve under it, and a reserve beyond that is refused, naming both, with nothing
    allocated; one within it applies."""
    from wsd.errors import WorkspaceHeadroomError

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    manager = WorkspaceManager(device, 2)
    assert manager.stats().allocator_cap_bytes is None  # torch's default: no cap
    try:
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (256 << 20)) / total, device)
        stats = manager.stats()
        assert stats.allocator_cap_bytes is not None and 0 < stats.allocator_headroom_bytes <= 256 << 20
        with pytest.raises(WorkspaceHeadroomError, match=rf"under its cap of {stats.allocator_cap_bytes}"):
            manager.reserve_bytes(stats.allocator_headroom_bytes)  # two slots: twice the headroom
        assert [s.capacity_bytes for s in manager.stats().slots] == [0, 0]
        manager.reserve_bytes(32 << 20)
        assert [s.capacity_bytes for s in manager.stats().slots] == [32 << 20] * 2
        assert manager.stats().allocator_headroom_bytes <= stats.allocator_headroom_bytes - (64 << 20)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
