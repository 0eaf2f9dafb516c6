"""The per-rank workspace manager: vLLM's ``WorkspaceManager``, sized from configuration.

- ``core``: ``WorkspaceManager`` and vLLM's module functions (needs torch);
- ``slots``: one (ubatch, lane) slot's buffer and counters, and who called the manager;
- ``buffers``: how a request is laid out in a slot's buffer, and how one is made;
- ``refusals``: a locked slot's refusals, recorded and told to the listeners;
- ``persistent``: persistent buffers and resources, made once per slot;
- ``operator_commands``: reserve, equalize, trim, ``set_num_ubatches``;
- ``violationlog``: lock violations in the process's own log;
- ``config``: the ``[workspace]`` section (no torch);
- ``demo``: a short engine life of one manager, for ``wsd demo``.

The immutable snapshots a manager gives out, and the per-slot statistics schema,
are ``wsd.slotstats``, on the shared floor: the agent, the coordinator and the
clients read them without importing the manager.

``from wsd.manager import WorkspaceManager`` works as it always did: the names
of ``core`` are imported on first use, so that importing ``wsd.manager.config``
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wsd.manager.core import (
        WorkspaceManager,
        current_lane,
        current_ubatch,
        current_workspace_manager,
        init_workspace_manager,
        is_workspace_manager_initialized,
        lock_workspace,
        reset_workspace_manager,
        unlock_workspace,
        use_lane,
        use_ubatch,
    )

__all__ = [
    "WorkspaceManager",
    "current_lane",
    "current_ubatch",
    "current_workspace_manager",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
    "use_lane",
    "use_ubatch",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("wsd.manager.core"), name)
    raise AttributeError(f"module 'wsd.manager' has no attribute {name!r}")
