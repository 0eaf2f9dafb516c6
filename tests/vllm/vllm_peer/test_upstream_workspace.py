"""vLLM's own workspace tests, run unmodified against wsd's stand-in module.

``upstream_test_workspace.py`` beside this file is vLLM's
``tests/v1/worker/test_workspace.py`` byte for byte, licence header included
(Apache-2.0, copyright the vLLM contributors): the version of vllm-project/vllm
commit 02579a5f, 11 tests, for the workspace module vLLM 0.33.0 ships, pinned
by ``UPSTREAM_SHA256``. It is a peer's test of the contract
``wsd.integrations.vllm.workspace`` claims; its name keeps pytest from
collecting it on its own (it would then test vLLM against itself). This module
imports it with ``vllm.v1.worker.workspace`` resolving to wsd's module, and its
tests run here. ``WSD_VLLM_SOURCE``, the root of a vLLM checkout, runs that
checkout's copy instead (it must match the pin). Skipped only without vLLM.

The swap lasts only for the import: the upstream file binds ``workspace`` once,
at import, so its tests keep wsd's module, and every other test in the process
that imports ``vllm.v1.worker.workspace`` still gets vLLM's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

UPSTREAM_PATH = Path("tests", "v1", "worker", "test_workspace.py")
UPSTREAM_SHA256 = "f47f29c07234bfb363033738937df40790621e1845209a678a857809eae90327"
_TARGET = "vllm.v1.worker.workspace"


def _upstream_file() -> Path:
    source = os.environ.get("WSD_VLLM_SOURCE")
    path = Path(source, UPSTREAM_PATH) if source else Path(__file__).with_name("upstream_test_workspace.py")
    if not path.is_file():
        raise FileNotFoundError(
            f"WSD_VLLM_SOURCE={source!r} has no {UPSTREAM_PATH}: it must be the root of "
            f"a vllm-project/vllm checkout"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != UPSTREAM_SHA256:
        raise RuntimeError(
            f"{path} is not the pinned version (sha256 {digest}, expected "
            f"{UPSTREAM_SHA256}: vllm-project/vllm commit 02579a5f, 11 tests of vLLM "
            f"0.33.0's workspace module): check that version out, or re-pin after "
            f"reading what changed"
        )
    return path


# Checked before vLLM is imported, which takes seconds.
_path = _upstream_file()
pytest.importorskip("vllm", reason="vLLM is not installed: no peer to test against")

# Before the swap, so that gpu_worker (whose _num_workspace_lanes the upstream
# file tests) binds vLLM's own workspace names, as it does in a real engine.
# (E402: after the pin check and the skip, on purpose.)
import vllm.v1.worker  # noqa: E402
import vllm.v1.worker.gpu_worker  # noqa: E402
import vllm.v1.worker.workspace  # noqa: E402

import wsd.integrations.vllm.workspace as wsd_workspace  # noqa: E402

VLLM_WORKSPACE = vllm.v1.worker.workspace


def _import_with_wsd_workspace(path: Path) -> ModuleType:
    """Import ``path`` with ``vllm.v1.worker.workspace`` resolving to wsd's module.

    ``import vllm.v1.worker.workspace as workspace`` reads the attribute on the
    package first and ``sys.modules`` after, so both are swapped, and both are
    put back whatever the import does.
    """
    name = "vllm_peer_upstream_test_workspace"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    package = vllm.v1.worker
    sys.modules[_TARGET] = package.workspace = wsd_workspace
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.modules[_TARGET] = package.workspace = VLLM_WORKSPACE
    return module


upstream = _import_with_wsd_workspace(_path)

# pytest collects the test functions it finds in this module's namespace.
globals().update({name: obj for name, obj in vars(upstream).items() if name.startswith("test_")})


def test_upstream_tests_ran_against_wsd_and_vllm_is_restored():
    """Without the swap the upstream tests would test vLLM against itself and
    prove nothing about wsd; without the restore, later tests in this process
    would get wsd's module when they ask for vLLM's."""
    assert upstream.workspace is wsd_workspace
    assert upstream.workspace.WorkspaceManager.__module__ == "wsd.integrations.vllm.workspace"
    assert sys.modules[_TARGET] is VLLM_WORKSPACE
    assert vllm.v1.worker.workspace is VLLM_WORKSPACE
    assert VLLM_WORKSPACE.WorkspaceManager.__module__ == _TARGET
