"""A stand-in for ``vllm.v1.worker.workspace``, name for name, backed by wsd's manager.

Checked against the releases of ``patches.CHECKED_VERSIONS`` (0.32.0's module is
byte-identical to 0.33.0's; 0.34.0's adds ``WorkspaceManager.get_retained`` and
``_VIEW_ALIGNMENT``, both here). Everything that module offers is here with the
same signature:
``WorkspaceManager(device, num_ubatches=None, num_lanes=1, alloc_context=nullcontext)``,
``use_workspace_lane``, ``init_workspace_manager``, ``current_workspace_manager``,
``is_workspace_manager_initialized``, ``lock_workspace``, ``unlock_workspace``,
``reset_workspace_manager``, and a module-level ``dbo_current_ubatch_id`` that the
manager looks up at every call (vLLM's tests monkeypatch it). The errors are
vLLM's types with vLLM's phrases first and wsd's detail after.

It is one implementation, not two: the class is wsd's ``WorkspaceManager``, so
stats, reserve, equalize, ``set_num_ubatches`` and violation reporting work on
it. Where vLLM is installed, the ubatch id is vLLM's ``dbo_current_ubatch_id``
and the lane is vLLM's own context variable, so that vLLM code calling its own
``use_workspace_lane`` selects the same lane as code calling this one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import torch

from wsd.config import WorkspaceConfig
from wsd.manager import core as _wsd_manager
from wsd.manager.slots import LANE_ID, UBATCH_ID, count_as_manager

__all__ = [
    "WorkspaceManager",
    "configured",
    "current_workspace_manager",
    "dbo_current_ubatch_id",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
    "use_workspace_lane",
]

logger = logging.getLogger(__name__)

# This module stands in for vLLM's, in front of wsd's manager: a lock violation's
# caller is the kernel that asked, the first frame outside both.
count_as_manager(__file__)

_workspace_lane: ContextVar[int]
dbo_current_ubatch_id: Callable[[], int]
try:  # inside vLLM: its own ubatch id and lane variable, so both modules agree
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    from vllm.v1.worker.workspace import _workspace_lane
except ImportError:  # without vLLM: wsd's own (use_ubatch, use_lane)
    dbo_current_ubatch_id = UBATCH_ID.get
    _workspace_lane = LANE_ID

_manager: WorkspaceManager | None = None

_VIEW_ALIGNMENT = 256
"""vLLM 0.34's: every view starts at a multiple of it, and a retained span's start is
rounded down to it (wsd's managers built here keep the default alignment, 256)."""


def _ubatch_id() -> int:
    # Looked up in this module's namespace at every call, as vLLM does, so that
    # a monkeypatched ``dbo_current_ubatch_id`` takes effect.
    return dbo_current_ubatch_id()


@contextlib.contextmanager
def use_workspace_lane(lane: int) -> Iterator[None]:
    """Select an independent workspace lane (slot) for this execution context."""
    if lane < 0:
        raise ValueError(f"Workspace lane must be non-negative, got {lane}.")
    token = _workspace_lane.set(lane)
    try:
        yield
    finally:
        _workspace_lane.reset(token)


class WorkspaceManager(_wsd_manager.WorkspaceManager):
    """vLLM's ``WorkspaceManager``: wsd's, with vLLM's slot selection and lock semantics.

    The engine's own ``lock()`` pins the buffers (vLLM locks after CUDA-graph
    capture), and the engine's ubatch count is the floor of
    ``set_num_ubatches``. wsd's options (``on_locked_growth``, growth policy,
    ...) pass through as keywords.
    """

    def __init__(
        self,
        device: torch.device | str,
        num_ubatches: int | None = None,
        num_lanes: int = 1,
        alloc_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        **options: Any,
    ) -> None:
        options.setdefault("ubatch_id", _ubatch_id)
        options.setdefault("lane_id", _workspace_lane.get)
        options.setdefault("pin_on_lock", True)
        options.setdefault("min_ubatches", 1 if num_ubatches is None else num_ubatches)
        super().__init__(device, num_ubatches, num_lanes, alloc_context, **options)


def configured(config: WorkspaceConfig) -> type[WorkspaceManager]:
    """A ``WorkspaceManager`` class whose managers take ``config``'s policies.

    vLLM builds its manager with its own ubatch and lane counts and nothing
    else; the plugin puts this class in vLLM's place, so that ``[workspace]``'s
    ``on_locked_growth``, ``growth``, ``granularity`` and ``max_slot_bytes``
    apply too. ``alignment`` stays vLLM's 256: vLLM's kernels assume it.
    """

    class ConfiguredWorkspaceManager(WorkspaceManager):
        def __init__(self, *args: Any, **options: Any) -> None:
            options.setdefault("on_locked_growth", config.on_locked_growth)
            options.setdefault("growth", config.growth)
            options.setdefault("granularity", config.granularity)
            options.setdefault("max_slot_bytes", config.max_slot_bytes)
            super().__init__(*args, **options)

    ConfiguredWorkspaceManager.__qualname__ = ConfiguredWorkspaceManager.__name__ = "WorkspaceManager"
    return ConfiguredWorkspaceManager


def is_workspace_manager_initialized() -> bool:
    return _manager is not None


def current_workspace_manager() -> WorkspaceManager:
    """The process-wide manager; an ``AssertionError`` (as vLLM's) when there is none."""
    if _manager is None:
        raise _wsd_manager.not_initialized()
    return _manager


def init_workspace_manager(
    device: torch.device | str,
    num_ubatches: int | None = None,
    num_lanes: int = 1,
    alloc_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Create the process-wide manager, replacing (with a warning) any earlier one."""
    global _manager
    if _manager is not None:
        logger.warning(
            "WorkspaceManager already initialized on device %s, reinitializing on device %s",
            _manager.device, device,
        )
    # Looked up at call time, as vLLM does, so a substituted class takes effect.
    _manager = WorkspaceManager(device, num_ubatches, num_lanes, alloc_context)


def lock_workspace() -> None:
    current_workspace_manager().lock()


def unlock_workspace() -> None:
    current_workspace_manager().unlock()


def reset_workspace_manager() -> None:
    global _manager
    _manager = None
