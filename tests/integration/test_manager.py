"""The per-rank WorkspaceManager: sizing, slot selection, layout, growth, lock."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

import wsd
from wsd import (
    SlotOutOfRangeError,
    WorkspaceLimitError,
    WorkspaceLockedError,
    WorkspaceManager,
    use_lane,
    use_ubatch,
)
from wsd.slotstats import RetainedStats

F32 = torch.float32


def slot_ptr(manager: WorkspaceManager, ubatch: int, lane: int = 0) -> int:
    with use_ubatch(ubatch), use_lane(lane):
        (view,) = manager.get_simultaneous(((1,), torch.uint8))
    return view.data_ptr()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_slot_count_follows_configuration_and_slots_are_distinct(count):
    """Without sizing from num_ubatches (vLLM's old [None, None]) counts != 2 break."""
    manager = WorkspaceManager("cpu", count)
    assert len(manager.stats().slots) == count
    ptrs = {slot_ptr(manager, u) for u in range(count)}
    assert len(ptrs) == count
    with use_ubatch(count), pytest.raises(SlotOutOfRangeError):
        manager.get_simultaneous(((1,), F32))


def test_none_means_one_slot_and_nothing_allocated_at_construction():
    manager = WorkspaceManager("cpu", None)
    stats = manager.stats()
    assert (stats.num_ubatches, stats.num_lanes, len(stats.slots)) == (1, 1, 1)
    assert stats.total_bytes == 0
    assert all(s.capacity_bytes == 0 and s.resizes == 0 for s in stats.slots)


def test_out_of_range_ubatch_names_id_and_count():
    """ubatch 2 with num_ubatches=2 must not be a bare IndexError or alias lane slot."""
    manager = WorkspaceManager("cpu", 2, 2)
    with use_ubatch(2), pytest.raises(SlotOutOfRangeError) as info:
        manager.get_simultaneous(((4,), F32))
    assert "ubatch id 2 is out of range" in str(info.value)
    assert "num_ubatches=2" in str(info.value)
    assert (info.value.value, info.value.count) == (2, 2)
    assert manager.stats().slots[3].requests == 0  # no slot was touched


def test_out_of_range_lane_names_id_and_count():
    manager = WorkspaceManager("cpu", 2, 2)
    with use_lane(2), pytest.raises(SlotOutOfRangeError, match=r"lane id 2 .*num_lanes=2"):
        manager.get_simultaneous(((4,), F32))


@pytest.mark.parametrize("bad", [-1, 1.0, "0", None])
def test_bad_ubatch_from_engine_callable_is_named(bad):
    manager = WorkspaceManager("cpu", 2, ubatch_id=lambda: bad)
    with pytest.raises(SlotOutOfRangeError, match="ubatch id"):
        manager.get_simultaneous(((4,), F32))


def test_use_ubatch_rejects_negative_and_non_int():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="ubatch id"), use_ubatch(bad):
            pass


def test_counts_validated_against_documented_maximum():
    with pytest.raises(ValueError, match="num_ubatches must be between 1 and 64, got 0"):
        WorkspaceManager("cpu", 0)
    with pytest.raises(ValueError, match="num_ubatches must be between 1 and 64, got 65"):
        WorkspaceManager("cpu", 65)
    with pytest.raises(ValueError, match="num_lanes must be between 1 and 64"):
        WorkspaceManager("cpu", 1, 0)
    assert len(WorkspaceManager("cpu", 64).stats().slots) == 64


def test_engine_callable_chooses_the_ubatch():
    current = [0]
    manager = WorkspaceManager("cpu", 3, ubatch_id=lambda: current[0])
    current[0] = 2
    manager.get_simultaneous(((8,), F32))
    assert [s.requests for s in manager.stats().slots] == [0, 0, 1]


def test_lanes_and_ubatches_compose_without_aliasing():
    manager = WorkspaceManager("cpu", 3, 2)
    seen = {}
    for u in range(3):
        for lane in range(2):
            with use_ubatch(u), use_lane(lane):
                (view,) = manager.get_simultaneous(((16,), F32))
                view.fill_(u * 10 + lane)
                seen[(u, lane)] = view
    for (u, lane), view in seen.items():
        assert torch.all(view == u * 10 + lane)
    slots = manager.stats().slots
    assert [(s.ubatch, s.lane) for s in slots] == [(u, lane) for u in range(3) for lane in range(2)]
    assert all(s.requests == 1 for s in slots)


def test_contextvars_are_per_thread():
    manager = WorkspaceManager("cpu", 2)
    done = threading.Event()

    def other():
        with use_ubatch(1):
            manager.get_simultaneous(((4,), F32))
        done.set()

    with use_ubatch(0):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=10)
        manager.get_simultaneous(((4,), F32))
    assert done.is_set()
    assert [s.requests for s in manager.stats().slots] == [1, 1]


def test_alignment_and_packing_offsets_from_zero():
    """The layout must be vLLM's: each request rounded to 256 bytes, packed from 0."""
    manager = WorkspaceManager("cpu", 1)
    a, b, c = manager.get_simultaneous(((3,), F32), ((100,), torch.int64), ((5, 7), torch.bfloat16))
    base = a.data_ptr()
    assert b.data_ptr() - base == 256  # 12 bytes -> 256
    assert c.data_ptr() - base == 256 + 1024  # 800 bytes -> 1024
    assert manager.stats().slots[0].capacity_bytes == 256 + 1024 + 256
    assert (a.shape, a.dtype) == (torch.Size([3]), F32)
    assert (c.shape, c.dtype) == (torch.Size([5, 7]), torch.bfloat16)
    assert c.is_contiguous()
    # Every call starts again at offset 0.
    (d,) = manager.get_simultaneous(((1,), torch.int8))
    assert d.data_ptr() == base


def test_configurable_alignment():
    manager = WorkspaceManager("cpu", 1, alignment=64)
    a, b = manager.get_simultaneous(((3,), F32), ((1,), F32))
    assert b.data_ptr() - a.data_ptr() == 64
    with pytest.raises(ValueError, match="power of two"):
        WorkspaceManager("cpu", 1, alignment=96)


def test_views_of_one_call_never_overlap():
    manager = WorkspaceManager("cpu", 1)
    shapes = [((n,), dt) for n, dt in [(1, torch.int8), (63, F32), (300, torch.float16), (7, torch.float64)]]
    views = manager.get_simultaneous(*shapes)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    for i, v in enumerate(views):
        v.fill_(i + 1)
    for i, v in enumerate(views):
        assert torch.all(v == i + 1)


def test_smaller_request_reuses_buffer():
    manager = WorkspaceManager("cpu", 1)
    (big,) = manager.get_simultaneous(((1024,), F32))
    (small,) = manager.get_simultaneous(((10,), F32))
    assert small.data_ptr() == big.data_ptr()
    assert manager.stats().slots[0].resizes == 1


def test_growth_is_exact_and_only_of_the_requesting_slot():
    manager = WorkspaceManager("cpu", 2)
    before = slot_ptr(manager, 1)
    with use_ubatch(0):
        manager.get_simultaneous(((10_000,), F32))
    assert slot_ptr(manager, 1) == before
    slots = manager.stats().slots
    assert slots[0].capacity_bytes == 40_192  # 40_000 rounded up to 256
    assert slots[1].capacity_bytes == 256


def test_granular_growth_rounds_up():
    manager = WorkspaceManager("cpu", 1, growth="granular", granularity=1 << 20)
    manager.get_simultaneous(((10,), F32))
    manager.get_simultaneous(((1000,), F32))
    slot = manager.stats().slots[0]
    assert (slot.capacity_bytes, slot.resizes) == (1 << 20, 1)


def test_max_slot_bytes_refuses_larger_requests():
    manager = WorkspaceManager("cpu", 1, max_slot_bytes=4096)
    manager.get_simultaneous(((1024,), F32))
    with pytest.raises(WorkspaceLimitError, match="max_slot_bytes=4096"):
        manager.get_simultaneous(((1025,), F32))


def test_views_taken_before_a_resize_keep_their_data():
    manager = WorkspaceManager("cpu", 1)
    (old,) = manager.get_simultaneous(((16,), F32))
    old.copy_(torch.arange(16, dtype=F32))
    (new,) = manager.get_simultaneous(((4096,), F32))
    new.fill_(-1)
    assert torch.equal(old, torch.arange(16, dtype=F32))
    assert new.data_ptr() != old.data_ptr()


def test_a_lock_violations_caller_is_outside_the_manager_and_the_vllm_stand_in():
    """The vLLM stand-in counts its own frames as the manager's (it registers its file
    when it loads; the manager knows no integration by path): without that, a request
    passing through it would name the stand-in instead of the kernel that asked."""
    import wsd.integrations.vllm.workspace as stand_in

    through: dict[str, Any] = {}  # a function whose frame is the stand-in's file
    exec(compile("def ask(m, r):\n    return m.get_simultaneous(r)\n", stand_in.__file__, "exec"), through)
    manager = stand_in.WorkspaceManager("cpu", 1)
    manager.get_simultaneous(((256,), F32))
    manager.lock()
    with pytest.raises(WorkspaceLockedError) as info:
        through["ask"](manager, ((1024,), F32))
    assert info.value.caller.startswith(__file__), info.value.caller
    assert info.value.caller.endswith(":test_a_lock_violations_caller_is_outside_the_manager_and_the_vllm_stand_in")


def test_locked_growth_raises_with_caller_slot_and_sizes_and_unlocked_succeeds():
    manager = WorkspaceManager("cpu", 2)
    with use_ubatch(1):
        manager.get_simultaneous(((256,), F32))
        manager.lock()
        assert manager.is_locked()
        manager.get_simultaneous(((100,), F32))  # fits: fine
        with pytest.raises(WorkspaceLockedError) as info:
            manager.get_simultaneous(((1024,), F32))  # the caller line
    error = info.value
    assert isinstance(error, AssertionError)
    assert error.caller.startswith(__file__) and error.caller.endswith(
        "test_locked_growth_raises_with_caller_slot_and_sizes_and_unlocked_succeeds"
    )
    assert (error.ubatch, error.lane, error.requested, error.capacity) == (1, 0, 4096, 1024)
    text = str(error)
    assert "Workspace is locked but allocation from" in text
    assert "ubatch=1" in text and "4096 bytes" in text and "1024 bytes" in text
    slot = manager.stats().slots[1]
    assert slot.lock_violations == 1
    assert slot.last_violation.requested == 4096 and slot.last_violation.capacity == 1024
    assert slot.capacity_bytes == 1024  # nothing moved
    manager.unlock()
    with use_ubatch(1):
        (view,) = manager.get_simultaneous(((1024,), F32))
    assert view.numel() == 1024


def test_violation_listener_hears_refusals():
    manager = WorkspaceManager("cpu", 1)
    heard = []
    manager.add_violation_listener(lambda u, lane, v: heard.append((u, lane, v.requested)))
    manager.lock()
    with pytest.raises(WorkspaceLockedError):
        manager.get_simultaneous(((1,), F32))
    assert heard == [(0, 0, 256)]


def test_zero_byte_requests_work():
    manager = WorkspaceManager("cpu", 1)
    empty, other = manager.get_simultaneous(((0,), F32), ((0, 5), torch.float16))
    assert empty.numel() == 0 and other.shape == (0, 5)
    manager.lock()
    (again,) = manager.get_simultaneous(((0,), F32))  # zero bytes always fit
    assert again.numel() == 0


def test_shape_given_as_list_works_like_tuple():
    manager = WorkspaceManager("cpu", 1)
    (a,) = manager.get_simultaneous(([2, 3], F32))
    (b,) = manager.get_simultaneous(((2, 3), F32))
    assert a.shape == b.shape == (2, 3) and a.data_ptr() == b.data_ptr()


def test_bad_request_is_a_clear_error():
    manager = WorkspaceManager("cpu", 1)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype"):
        manager.get_simultaneous(((2,), "float32"))
    with pytest.raises(ValueError, match="negative"):
        manager.get_simultaneous(((-2,), F32))


def test_in_place_metadata_changes_do_not_corrupt_later_calls():
    """The hot path caches bound views; a caller's unsqueeze_/resize_/t_ must not leak."""
    manager = WorkspaceManager("cpu", 1)
    request = (((4, 8), F32), ((16,), torch.int32))
    a, b = manager.get_simultaneous(*request)
    ptr_a, ptr_b = a.data_ptr(), b.data_ptr()
    a.unsqueeze_(0)
    b.resize_(2, 2)
    a.squeeze_(0).t_()
    a2, b2 = manager.get_simultaneous(*request)
    assert (a2.shape, a2.stride(), b2.shape) == ((4, 8), (8, 1), (16,))
    assert (a2.data_ptr(), b2.data_ptr()) == (ptr_a, ptr_b)
    a2.as_strided_((2,), (1,))
    b2.set_(torch.empty(3, dtype=torch.int32))
    a3, b3 = manager.get_simultaneous(*request)
    assert (a3.shape, b3.shape, b3.data_ptr()) == ((4, 8), (16,), ptr_b)


def test_repeat_calls_return_new_tensor_objects_over_the_same_memory():
    manager = WorkspaceManager("cpu", 1)
    (a,) = manager.get_simultaneous(((8,), F32))
    (b,) = manager.get_simultaneous(((8,), F32))
    assert a is not b and a.data_ptr() == b.data_ptr()
    a.fill_(3)
    assert torch.all(b == 3)  # aliasing, as with vLLM


def test_works_in_inference_mode_and_out():
    manager = WorkspaceManager("cpu", 1)
    with torch.inference_mode():
        (a,) = manager.get_simultaneous(((8,), F32))
        a.add_(1)
    (b,) = manager.get_simultaneous(((8,), F32))
    b.add_(1)


def test_module_functions_as_vllm():
    wsd.reset_workspace_manager()
    assert not wsd.is_workspace_manager_initialized()
    with pytest.raises(wsd.WorkspaceNotInitializedError, match="init_workspace_manager"):
        wsd.current_workspace_manager()
    manager = wsd.init_workspace_manager("cpu", 2)
    try:
        assert wsd.is_workspace_manager_initialized()
        assert wsd.current_workspace_manager() is manager
        wsd.lock_workspace()
        assert manager.is_locked()
        wsd.unlock_workspace()
        assert not manager.is_locked()
    finally:
        wsd.reset_workspace_manager()
    assert not wsd.is_workspace_manager_initialized()


def test_properties_are_read_only():
    manager = WorkspaceManager("cpu", 2, 3)
    assert (manager.device, manager.num_ubatches, manager.num_lanes) == (torch.device("cpu"), 2, 3)
    with pytest.raises(AttributeError):
        manager.num_ubatches = 5


# -- vLLM 0.34's retained span -----------------------------------------------------------


def _retained(manager, key="kv", n=16):
    view, intact = manager.get_retained(key, (n,), torch.float32)
    return view, intact


def test_a_retained_span_is_the_tail_of_the_slot_and_intact_while_nothing_reaches_it():
    """The span sits at the end (its start rounded down to 256), survives requests that
    stay below it, and is reported intact to the same key; DeepSeek V4.1 keeps a chunk's
    KV columns there across layers."""
    manager = WorkspaceManager("cpu", 1)
    manager.get_simultaneous(((4096,), torch.uint8))
    view, intact = _retained(manager)
    assert not intact and view.shape == (16,)
    assert view.storage_offset() * 4 == (4096 - 64) // 256 * 256 == 3840
    view.fill_(7.0)
    manager.get_simultaneous(((1000,), torch.uint8))  # ends at 1024: below the span
    again, intact = _retained(manager)
    assert intact and again.data_ptr() == view.data_ptr() and bool((again == 7.0).all())
    _, intact = _retained(manager, key="other")
    assert not intact, "another key took the span over: what it holds is not the first key's"
    _, intact = _retained(manager, key="kv")
    assert not intact, "only the latest key is remembered"


@pytest.mark.parametrize("reach", [
    lambda m: m.get_simultaneous(((3900,), torch.uint8)),  # views that reach past the start
    lambda m: m.get_simultaneous(((8192,), torch.uint8)),  # growth: a new buffer
    lambda m: m.reserve_bytes(1 << 14),
    lambda m: m.trim(),
])
def test_anything_that_reaches_or_moves_the_span_forgets_it(reach):
    manager = WorkspaceManager("cpu", 1)
    manager.get_simultaneous(((4096,), torch.uint8))
    _retained(manager)
    assert _retained(manager)[1]
    assert manager.stats().slots[0].retained == RetainedStats(key="kv", nbytes=64)
    reach(manager)
    assert manager.stats().slots[0].retained is None, "stats show a span that is gone"
    assert not _retained(manager)[1]


def test_stats_show_the_latest_retained_span_per_slot_by_its_key_as_text():
    manager = WorkspaceManager("cpu", 2)
    assert [s.retained for s in manager.stats().slots] == [None, None]
    with use_ubatch(1):
        manager.get_retained(("layer", 3), (8, 4), torch.float16)
    _retained(manager, key="kv", n=100)
    _retained(manager, key="chunk", n=10)
    assert [s.retained for s in manager.stats().slots] == [RetainedStats("chunk", 40),
                                                           RetainedStats("('layer', 3)", 64)]
    assert manager.stats().total_bytes == 400 + 64, "a span inside the buffer is not counted twice"


def test_equalize_forgets_the_span_of_each_slot_it_reallocates():
    manager = WorkspaceManager("cpu", 2)
    with use_ubatch(1):
        manager.get_simultaneous(((8192,), torch.uint8))
    manager.get_simultaneous(((4096,), torch.uint8))
    _retained(manager)
    manager.equalize()  # slot 0 grows to 8192
    assert not _retained(manager)[1]
    with use_ubatch(1):  # slot 1 kept its buffer: its own record is separate, and new
        assert not _retained(manager)[1] and _retained(manager)[1]


def test_a_retained_span_grows_the_slot_and_is_refused_when_locked():
    manager = WorkspaceManager("cpu", 1)
    view, _ = _retained(manager, n=100)
    assert manager.stats().slots[0].capacity_bytes == 400 and view.storage_offset() == 0
    manager.lock()
    with pytest.raises(WorkspaceLockedError, match="Workspace is locked but allocation"):
        _retained(manager, n=1000)
    assert manager.stats().lock_violations == 1


def test_under_fallback_a_locked_span_is_served_outside_the_slot_and_never_intact():
    manager = WorkspaceManager("cpu", 1, on_locked_growth="fallback")
    _retained(manager, n=16)
    manager.lock()
    big, intact = _retained(manager, n=1000)
    assert not intact and big.shape == (1000,) and manager.stats().slots[0].capacity_bytes == 64
    assert not _retained(manager, n=1000)[1], "a one-off buffer holds nothing for next time"
    assert _retained(manager, n=16)[1], "the slot's own record stood"


def test_an_operators_allocation_on_a_cpu_records_no_stream():
    """Streams are CUDA's: on a CPU an operator's reserve leaves the requests' path as it was
    (on a GPU, tests/gpu/test_cuda_memory.py)."""
    manager = WorkspaceManager("cpu", 2)
    manager.reserve_bytes(1 << 12)
    manager.equalize()
    manager.set_num_ubatches(3)
    assert [s.made_on for s in manager._slots] == [None, None, None]
