"""WorkspaceManager reconfiguration, persistent resources and stats snapshots."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import msgpack
import pytest
import torch

import wsd
from wsd import (
    ManagerStats,
    WorkspaceLockedError,
    WorkspaceLockHeldError,
    WorkspaceManager,
    use_lane,
    use_ubatch,
)

F32 = torch.float32


def grow(manager: WorkspaceManager, ubatch: int, nbytes: int, lane: int = 0) -> torch.Tensor:
    with use_ubatch(ubatch), use_lane(lane):
        (view,) = manager.get_simultaneous(((nbytes,), torch.uint8))
    return view


def capacities(manager: WorkspaceManager) -> list[int]:
    return [s.capacity_bytes for s in manager.stats().slots]


# -- set_num_ubatches ------------------------------------------------------


def test_set_num_ubatches_up_keeps_buffers_and_adds_empty_slots():
    manager = WorkspaceManager("cpu", 2)
    ptrs = [grow(manager, u, 1024).data_ptr() for u in range(2)]
    manager.set_num_ubatches(4)
    assert manager.num_ubatches == 4
    assert capacities(manager) == [1024, 1024, 0, 0]
    assert [grow(manager, u, 16).data_ptr() for u in range(2)] == ptrs
    grow(manager, 3, 16)  # the new slots work


def test_set_num_ubatches_down_drops_slots_but_views_stay_valid():
    manager = WorkspaceManager("cpu", 3)
    view = grow(manager, 2, 512)
    view.fill_(7)
    manager.set_num_ubatches(1)
    assert capacities(manager) == [0]
    assert torch.all(view == 7)
    with use_ubatch(2), pytest.raises(IndexError, match="num_ubatches=1"):
        manager.get_simultaneous(((1,), F32))


def test_set_num_ubatches_when_locked_presizes_new_slots_to_largest():
    """Locked execution on a slot added after lock must not fail (DBO sibling slots)."""
    manager = WorkspaceManager("cpu", 1, 2)
    grow(manager, 0, 4096)
    grow(manager, 0, 1024, lane=1)
    with use_ubatch(0):
        manager.get_persistent("scales", (4,), F32)
        manager.get_persistent_resource("meta", lambda: {"t": torch.zeros(2)})
    manager.lock()
    manager.set_num_ubatches(3)
    assert capacities(manager) == [4096, 1024, 4096, 4096, 4096, 4096]
    for u in (1, 2):
        for lane in (0, 1):
            assert grow(manager, u, 4096, lane).numel() == 4096
            with use_ubatch(u), use_lane(lane):
                assert manager.get_persistent("scales", (4,), F32).shape == (4,)
                assert "t" in manager.get_persistent_resource("meta", dict)


def test_set_num_ubatches_validates():
    manager = WorkspaceManager("cpu", 2)
    with pytest.raises(ValueError, match="num_ubatches must be between 1 and 64, got 0"):
        manager.set_num_ubatches(0)
    assert manager.num_ubatches == 2


# -- reserve, equalize, trim ----------------------------------------------


def test_reserve_sizes_every_slot_for_a_request():
    manager = WorkspaceManager("cpu", 2, 2)
    manager.reserve(((100,), F32), ((10,), torch.int64))
    assert capacities(manager) == [768] * 4  # 400 -> 512, 80 -> 256
    manager.lock()
    for u in range(2):
        for lane in range(2):
            with use_ubatch(u), use_lane(lane):
                manager.get_simultaneous(((100,), F32), ((10,), torch.int64))


def test_reserve_refused_when_locked():
    manager = WorkspaceManager("cpu", 2)
    manager.lock()
    with pytest.raises(WorkspaceLockedError, match="reserve"):
        manager.reserve(((100,), F32))
    assert capacities(manager) == [0, 0]


def test_equalize_grows_every_slot_to_the_largest():
    manager = WorkspaceManager("cpu", 3)
    grow(manager, 0, 8192)
    grow(manager, 1, 256)
    keep = grow(manager, 0, 1).data_ptr()
    manager.equalize()
    assert capacities(manager) == [8192] * 3
    assert grow(manager, 0, 1).data_ptr() == keep  # the largest did not move
    manager.lock()
    grow(manager, 2, 8192)


def test_equalize_refused_when_locked_and_growth_needed():
    manager = WorkspaceManager("cpu", 2)
    grow(manager, 0, 1024)
    manager.lock()
    with pytest.raises(WorkspaceLockedError, match="equalize"):
        manager.equalize()
    assert capacities(manager) == [1024, 0]


def test_trim_releases_every_buffer_and_keeps_persistent():
    manager = WorkspaceManager("cpu", 2)
    grow(manager, 0, 1024)
    grow(manager, 1, 2048)
    with use_ubatch(1):
        kept = manager.get_persistent("k", (3,), F32)
    manager.trim()
    assert capacities(manager) == [0, 0]
    with use_ubatch(1):
        assert manager.get_persistent("k", (3,), F32) is kept
    assert grow(manager, 0, 16).numel() == 16  # regrows


def test_trim_refused_when_locked_is_not_a_lock_violation():
    """A trim while locked is an operator's mistake: refused, but no kernel asked for
    memory, so no violation is counted or reported."""
    manager = WorkspaceManager("cpu", 1)
    reported = []
    manager.add_violation_listener(lambda *args: reported.append(args))
    grow(manager, 0, 1024)
    manager.lock()
    with pytest.raises(WorkspaceLockHeldError, match="trim refused: the workspace is locked"):
        manager.trim()
    assert capacities(manager) == [1024]
    assert manager.stats().lock_violations == 0 and reported == []


# -- persistent buffers and resources ---------------------------------------


def test_get_persistent_is_per_slot_and_created_once():
    manager = WorkspaceManager("cpu", 2)
    with use_ubatch(0):
        a = manager.get_persistent("k", (4, 2), F32, zero_init=True)
        assert torch.all(a == 0)
        assert manager.get_persistent("k", (4, 2), F32) is a
    with use_ubatch(1):
        b = manager.get_persistent("k", (4, 2), F32)
    assert b.data_ptr() != a.data_ptr()


def test_get_persistent_mismatch_is_value_error():
    manager = WorkspaceManager("cpu", 1)
    manager.get_persistent("k", (4,), F32)
    with pytest.raises(ValueError, match=r"shape=\(4,\).*requested shape=\(5,\)"):
        manager.get_persistent("k", (5,), F32)
    with pytest.raises(ValueError, match="dtype"):
        manager.get_persistent("k", (4,), torch.float16)


def test_tensors_and_resources_have_separate_key_spaces():
    """As in vLLM (tensors live under (torch.Tensor, key)): one key names a tensor and a
    resource at once, and neither replaces the other."""
    manager = WorkspaceManager("cpu", 1)
    tensor = manager.get_persistent("k", (4,), F32)
    resource = manager.get_persistent_resource("k", object)
    assert manager.get_persistent("k", (4,), F32) is tensor
    assert manager.get_persistent_resource("k", object) is resource
    kinds = sorted(p.kind for p in manager.stats().slots[0].persistent)
    assert kinds == ["resource", "tensor"]


class _Key:
    """A key like vLLM's ``(SomeClass, n, m, device)``: hashable, not text."""


def test_hashable_keys_are_shown_as_text_and_encode():
    """vLLM keys persistent objects by any Hashable; a snapshot shows them as bounded
    text, so it still encodes to msgpack (it failed to before)."""
    manager = WorkspaceManager("cpu", 1)
    manager.get_persistent_resource((_Key, 4, 8, torch.device("cpu")), object)
    manager.get_persistent(("x" * 1000,), (2,), F32)
    keys = [p.key for p in manager.stats().slots[0].persistent]
    assert all(isinstance(k, str) and len(k) <= 200 for k in keys)
    assert "_Key" in keys[0] and "4, 8" in keys[0]
    msgpack.packb(manager.stats().to_wire())


def test_persistent_creation_refused_once_locked_but_existing_returned():
    manager = WorkspaceManager("cpu", 1)
    existing = manager.get_persistent("old", (2,), F32)
    made = manager.get_persistent_resource("res", lambda: object())
    manager.lock()
    assert manager.get_persistent("old", (2,), F32) is existing
    assert manager.get_persistent_resource("res", object) is made
    with pytest.raises(WorkspaceLockedError, match="persistent buffer 'new'"):
        manager.get_persistent("new", (2,), F32)
    with pytest.raises(WorkspaceLockedError, match="persistent resource 'r2'"):
        manager.get_persistent_resource("r2", object)


def test_persistent_resource_factory_called_once_per_slot():
    manager = WorkspaceManager("cpu", 2)
    calls = []
    for _ in range(3):
        for u in range(2):
            with use_ubatch(u):
                manager.get_persistent_resource("r", lambda: calls.append(1) or torch.zeros(8))
    assert len(calls) == 2


# -- stats -------------------------------------------------------------------


def test_stats_counts_match_what_happened():
    manager = WorkspaceManager("cpu", 2)
    for n in (100, 50, 300, 300):
        grow(manager, 0, n)
    with use_ubatch(1):
        manager.get_persistent("p", (10,), F32)
        manager.get_persistent_resource("r", lambda: [torch.zeros(4, dtype=torch.int64), "x"])
    manager.lock()
    with pytest.raises(WorkspaceLockedError):
        grow(manager, 1, 10)
    stats = manager.stats()
    s0, s1 = stats.slots
    assert (s0.requests, s0.resizes, s0.capacity_bytes, s0.peak_requested_bytes) == (4, 2, 512, 512)
    assert (s1.requests, s1.resizes, s1.lock_violations) == (1, 0, 1)
    assert s1.last_violation.caller.split(":")[-1] == "grow"
    assert s1.last_violation.requested == 256 and s1.last_violation.capacity == 0
    assert {(p.key, p.kind, p.nbytes) for p in s1.persistent} == {
        ("p", "tensor", 40), ("r", "resource", 32)
    }
    assert s1.persistent_bytes == 72
    assert stats.total_bytes == 512 + 72
    assert stats.locked and stats.device == "cpu" and stats.num_ubatches == 2


def test_stats_is_immutable_plain_data_that_round_trips_msgpack():
    manager = WorkspaceManager("cpu", 2)
    grow(manager, 1, 100)
    stats = manager.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.locked = True
    wire = msgpack.unpackb(msgpack.packb(stats.to_dict()))
    assert ManagerStats.from_dict(wire) == stats
    grow(manager, 1, 10_000)
    assert stats.slots[1].capacity_bytes == 256  # the snapshot did not change


def test_stats_from_another_thread_while_engine_runs():
    manager = WorkspaceManager("cpu", 4)
    stop = threading.Event()
    errors = []

    def reader():
        try:
            while not stop.is_set():
                snap = manager.stats()
                assert len(snap.slots) in (2, 4)
                time.sleep(0)  # yield the GIL so the engine thread runs
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(400):
            grow(manager, i % manager.num_ubatches, 64 + i)
            if i % 100 == 99:
                manager.set_num_ubatches(2 if manager.num_ubatches == 4 else 4)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and errors == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_first_growth_during_cuda_graph_capture_is_allowed_as_in_vllm():  # pragma: no cover - GPU only
    """vLLM's V2 runner captures its speculator on a lane of its own, whose first growth
    comes inside the capture: vLLM allocates there, and an engine refused it would not
    start. An operator's reserve during capture is refused instead."""
    from wsd import WorkspaceCaptureError

    manager = WorkspaceManager("cuda", 1)
    manager.get_simultaneous(((16,), F32))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        (view,) = manager.get_simultaneous(((1 << 20,), F32))
        view.fill_(1.0)
        with pytest.raises(WorkspaceCaptureError, match="reserve refused during CUDA graph capture"):
            manager.reserve_bytes(1 << 24)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((view == 1.0).all())


def test_under_capture_a_kernel_grows_but_an_operator_moves_nothing(monkeypatch):
    """The same rules without a GPU (capture as the manager sees it): a kernel's growth
    goes ahead, without emptying the allocator's cache (a synchronisation a capture
    forbids); reserve, equalize, trim and set_num_ubatches are refused; a locked
    request under the fallback policy is refused, not served from a one-off buffer."""
    from wsd import WorkspaceCaptureError

    manager = WorkspaceManager("cpu", 1, on_locked_growth="fallback")
    emptied = []
    monkeypatch.setattr(manager._buffers, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(manager._buffers, "capturing", lambda: True)
    (view,) = manager.get_simultaneous(((1024,), torch.uint8))
    assert view.numel() == 1024 and emptied == []
    for command in (lambda: manager.reserve_bytes(1 << 20), manager.equalize, manager.trim,
                    lambda: manager.set_num_ubatches(2)):
        with pytest.raises(WorkspaceCaptureError, match="refused during CUDA graph capture"):
            command()
    manager.lock()
    with pytest.raises(WorkspaceLockedError):
        manager.get_simultaneous(((4096,), torch.uint8))
    monkeypatch.setattr(manager._buffers, "capturing", lambda: False)
    manager.unlock()
    manager.get_simultaneous(((8192,), torch.uint8))
    assert emptied == [1]


# -- vLLM's contracts: alloc_context, exception types, the engine's lock, fallback ----


def test_alloc_context_wraps_every_scratch_allocation():
    """vLLM passes its sleep-mode pool as the fourth positional argument; every
    scratch buffer (growth, reserve, equalize) is allocated inside it."""
    entered = []

    class Pool:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *exc):
            return False

    manager = WorkspaceManager("cpu", 2, 1, Pool)
    grow(manager, 0, 512)
    assert len(entered) == 1
    manager.reserve_bytes(1024)
    assert len(entered) == 3  # both slots grew to 1024
    grow(manager, 0, 4096)
    manager.equalize()
    assert len(entered) == 5


def test_exception_types_are_vllms():
    """vLLM's callers catch RuntimeError for an unconfigured lane and AssertionError for
    an uninitialised manager: wsd raises subclasses of the same."""
    manager = WorkspaceManager("cpu", 1, 1)
    with use_lane(1), pytest.raises(RuntimeError, match="Workspace lane 1 is not configured; "
                                                       r"manager has 1 lane\(s\)"):
        manager.get_simultaneous(((4,), F32))
    with pytest.raises(ValueError, match="at least one"):
        WorkspaceManager("cpu", 1, 0)
    wsd.reset_workspace_manager()
    with pytest.raises(AssertionError, match="WorkspaceManager not initialized"):
        wsd.current_workspace_manager()


def test_engine_lock_pins_buffers_against_operators():
    """With pin_on_lock (vLLM locks after CUDA-graph capture) an operator may not unlock,
    trim, reserve or equalize; an operator's own lock never pins; the engine's unlock
    lifts the pin."""
    manager = WorkspaceManager("cpu", 2, pin_on_lock=True)
    grow(manager, 0, 1024)
    manager.lock()
    assert manager.pinned
    for refused in (manager.operator_unlock, manager.trim, manager.equalize,
                    lambda: manager.reserve_bytes(4096)):
        with pytest.raises(WorkspaceLockHeldError, match="engine locked this workspace"):
            refused()
    assert manager.is_locked() and capacities(manager) == [1024, 0]
    assert manager.stats().lock_violations == 0
    manager.unlock()
    assert not manager.pinned
    manager.operator_lock()
    assert manager.is_locked() and not manager.pinned
    manager.operator_unlock()
    assert not manager.is_locked()


def test_set_num_ubatches_refused_below_the_engines_count():
    manager = WorkspaceManager("cpu", 2, min_ubatches=2)
    manager.set_num_ubatches(3)
    with pytest.raises(ValueError, match=r"set_num_ubatches\(1\) refused: the engine runs 2"):
        manager.set_num_ubatches(1)
    manager.set_num_ubatches(2)
    assert manager.num_ubatches == 2


def test_fallback_serves_a_locked_request_from_a_one_off_buffer():
    """on_locked_growth="fallback": the request is served, outside the slot (which keeps
    its size), and counted and reported as a violation each time."""
    manager = WorkspaceManager("cpu", 1, on_locked_growth="fallback")
    reported = []
    manager.add_violation_listener(lambda u, lane, v: reported.append((u, lane, v.requested)))
    (small,) = manager.get_simultaneous(((256,), torch.uint8))
    manager.lock()
    a, b = manager.get_simultaneous(((1024,), F32), ((3,), torch.int64))
    assert (a.shape, b.shape) == ((1024,), (3,))
    a.fill_(1.5)
    assert torch.all(a == 1.5)
    assert a.data_ptr() != small.data_ptr()
    (again,) = manager.get_simultaneous(((1024,), F32))
    assert again.data_ptr() != a.data_ptr()  # never cached: a new one-off each time
    assert capacities(manager) == [256]
    assert manager.stats().lock_violations == 2
    assert reported == [(0, 0, 4096 + 256), (0, 0, 4096)]
    (fits,) = manager.get_simultaneous(((64,), torch.uint8))
    assert fits.data_ptr() == small.data_ptr()


def test_fallback_buffers_never_enter_the_allocation_context():
    """vLLM's sleep-mode allocator (its alloc_context) makes a new memory pool at each entry
    and keeps it for ever: a fallback buffer per locked request must not make one each.
    The slots' own growth still allocates inside it."""
    entered = []

    @contextlib.contextmanager
    def pool():
        entered.append(1)
        yield

    manager = WorkspaceManager("cpu", 1, alloc_context=pool, on_locked_growth="fallback")
    manager.get_simultaneous(((256,), torch.uint8))
    assert len(entered) == 1  # the slot's growth
    manager.lock()
    for _ in range(5):
        manager.get_simultaneous(((4096,), torch.uint8))
    assert len(entered) == 1 and manager.stats().lock_violations == 5


def test_raise_policy_is_the_default():
    manager = WorkspaceManager("cpu", 1)
    manager.lock()
    with pytest.raises(WorkspaceLockedError):
        manager.get_simultaneous(((4,), F32))
