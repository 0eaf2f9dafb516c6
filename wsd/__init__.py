"""wsd: a distributed workspace service for GPU inference clusters.

The per-rank manager (``WorkspaceManager`` and vLLM's module functions) needs
torch and is imported on first use, so that ``import wsd`` and the torch-free
parts (configuration, protocol, coordinator, clients) work without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wsd.version import __version__

# Where each name of the package root lives: imported on first use (PEP 562), so that
# ``import wsd`` costs nothing (``wsctl`` starts in a fraction of a second), and the
# manager's names, which need torch, only where they are used.
_LAZY = {
    **dict.fromkeys(("GrowthPolicy", "LockedGrowthPolicy", "WorkspaceConfig", "WsdConfig", "load_config"),
                    "wsd.config"),
    **dict.fromkeys(("ConfigError", "SlotOutOfRangeError", "WorkspaceCaptureError", "WorkspaceError",
                     "WorkspaceLimitError", "WorkspaceLockedError", "WorkspaceLockHeldError",
                     "WorkspaceNotInitializedError", "WsdError"), "wsd.errors"),
    **dict.fromkeys(("LockViolation", "ManagerStats", "PersistentStats", "SlotStats"), "wsd.slotstats"),
}

if TYPE_CHECKING:
    from wsd.config import GrowthPolicy, LockedGrowthPolicy, WorkspaceConfig, WsdConfig, load_config
    from wsd.errors import (
        ConfigError,
        SlotOutOfRangeError,
        WorkspaceCaptureError,
        WorkspaceError,
        WorkspaceLimitError,
        WorkspaceLockedError,
        WorkspaceLockHeldError,
        WorkspaceNotInitializedError,
        WsdError,
    )
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
    from wsd.slotstats import LockViolation, ManagerStats, PersistentStats, SlotStats


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    # The manager's names: wsd.manager lists them and loads them lazily.
    manager = importlib.import_module("wsd.manager")
    if name in manager.__all__:
        return getattr(manager, name)
    raise AttributeError(f"module 'wsd' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "GrowthPolicy",
    "LockViolation",
    "LockedGrowthPolicy",
    "ManagerStats",
    "PersistentStats",
    "SlotOutOfRangeError",
    "SlotStats",
    "WorkspaceCaptureError",
    "WorkspaceConfig",
    "WorkspaceError",
    "WorkspaceLimitError",
    "WorkspaceLockHeldError",
    "WorkspaceLockedError",
    "WorkspaceManager",
    "WorkspaceNotInitializedError",
    "WsdConfig",
    "WsdError",
    "__version__",
    "current_lane",
    "current_ubatch",
    "current_workspace_manager",
    "init_workspace_manager",
    "is_workspace_manager_initialized",
    "load_config",
    "lock_workspace",
    "reset_workspace_manager",
    "unlock_workspace",
    "use_lane",
    "use_ubatch",
]
