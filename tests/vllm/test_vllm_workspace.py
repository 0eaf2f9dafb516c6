"""wsd's stand-in for ``vllm.v1.worker.workspace`` beside the installed vLLM's.

vLLM's own tests run against the stand-in in ``tests/vllm/vllm_peer``, and random
call sequences are compared in ``test_vllm_differential.py``; these pin what
neither covers: the words vLLM's callers match on, and the lane both modules
share inside vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: nothing to compare with")

import vllm.v1.worker.workspace as vllm_workspace

import wsd.integrations.vllm.workspace as wsd_workspace

CPU = torch.device("cpu")


def _locked_growth(ws: ModuleType) -> None:
    manager = ws.WorkspaceManager(CPU)
    manager.lock()
    manager.get_simultaneous(((512,), torch.uint8))


def _locked_new_tensor(ws: ModuleType) -> None:
    manager = ws.WorkspaceManager(CPU)
    manager.lock()
    manager.get_persistent(("locks",), (8,), torch.int32)


def _locked_new_resource(ws: ModuleType) -> None:
    manager = ws.WorkspaceManager(CPU)
    manager.lock()
    manager.get_persistent_resource(("scratch",), object)


def _persistent_changed(ws: ModuleType) -> None:
    manager = ws.WorkspaceManager(CPU)
    manager.get_persistent(("locks",), (8,), torch.int32)
    manager.get_persistent(("locks",), (16,), torch.int32)


def _lane_not_configured(ws: ModuleType) -> None:
    manager = ws.WorkspaceManager(CPU, num_lanes=1)
    with ws.use_workspace_lane(1):
        manager.get_persistent_resource(("scratch",), object)


def _negative_lane(ws: ModuleType) -> None:
    with ws.use_workspace_lane(-1):
        pass


def _no_lanes(ws: ModuleType) -> None:
    ws.WorkspaceManager(CPU, num_lanes=0)


def _not_initialized(ws: ModuleType) -> None:
    ws.current_workspace_manager()


# (what, provoke, vLLM's type, phrases vLLM's callers and tests match on)
CASES: list[tuple[str, Callable[[ModuleType], None], type[Exception], tuple[str, ...]]] = [
    ("locked growth", _locked_growth, AssertionError,
     ("Workspace is locked", "Workspace growth is not allowed after locking")),
    ("locked new tensor", _locked_new_tensor, AssertionError,
     ("Workspace is locked", "was not allocated during warmup")),
    ("locked new resource", _locked_new_resource, AssertionError,
     ("Workspace is locked", "was not allocated during warmup")),
    ("persistent changed", _persistent_changed, ValueError,
     ("Persistent workspace", "requested shape")),
    ("lane not configured", _lane_not_configured, RuntimeError, ("is not configured",)),
    ("negative lane", _negative_lane, ValueError, ("non-negative",)),
    ("no lanes", _no_lanes, ValueError, ("at least one",)),
    ("not initialized", _not_initialized, AssertionError,
     ("WorkspaceManager not initialized", "init_workspace_manager()")),
]


@pytest.mark.parametrize(("provoke", "kind", "phrases"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_errors_carry_the_phrases_vllm_callers_match_on(monkeypatch, provoke, kind, phrases):
    """A caller of vLLM that catches its exception type and matches its words
    (vLLM's own tests do: ``pytest.raises(AssertionError, match="Workspace is
    locked")``) must see both from wsd. Each phrase is checked in vLLM's message
    too, so the list cannot drift from the vLLM installed."""
    for ws in (vllm_workspace, wsd_workspace):
        monkeypatch.setattr(ws, "_manager", None)
        with pytest.raises(kind) as raised:
            provoke(ws)
        for phrase in phrases:
            assert phrase in str(raised.value), (ws.__name__, phrase)


def test_lane_set_through_either_module_selects_it_in_both():
    """Inside vLLM, vLLM's code enters lanes with its own ``use_workspace_lane``
    while kernels may run on wsd's manager (and the other way round): both
    must read one lane, or a draft model's scratch lands in the target's slot."""
    ours = wsd_workspace.WorkspaceManager(CPU, num_lanes=2)
    theirs = vllm_workspace.WorkspaceManager(CPU, num_lanes=2)
    with vllm_workspace.use_workspace_lane(1):
        ours.get_persistent_resource(("scratch",), object)
    with wsd_workspace.use_workspace_lane(1):
        theirs.get_persistent_resource(("scratch",), object)
    for manager in (ours, theirs):
        assert [set(r) for r in manager._persistent_resources] == [set(), {("scratch",)}]
