"""WorkspaceManager reconfiguration, persistent resources and stats snapshots."""

from __future__ import annotations

import dataclasses
import threading
import time

import msgpack
import pytest
import torch

from wsd import ManagerStats, WorkspaceLockedError, WorkspaceManager, use_lane, use_ubatch

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


def test_trim_refused_when_locked():
    manager = WorkspaceManager("cpu", 1)
    grow(manager, 0, 1024)
    manager.lock()
    with pytest.raises(WorkspaceLockedError, match="trim"):
        manager.trim()
    assert capacities(manager) == [1024]


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
    with pytest.raises(ValueError, match=r"shape \(4,\).*requested shape \(5,\)"):
        manager.get_persistent("k", (5,), F32)
    with pytest.raises(ValueError, match="dtype"):
        manager.get_persistent("k", (4,), torch.float16)
    with pytest.raises(ValueError, match="holds a tensor"):
        manager.get_persistent_resource("k", object)


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
def test_growth_during_cuda_graph_capture_is_refused():  # pragma: no cover - GPU only
    from wsd import WorkspaceCaptureError

    manager = WorkspaceManager("cuda", 1)
    manager.get_simultaneous(((16,), F32))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(WorkspaceCaptureError, match="warm up first"):
        with torch.cuda.graph(graph):
            manager.get_simultaneous(((1 << 20,), F32))
