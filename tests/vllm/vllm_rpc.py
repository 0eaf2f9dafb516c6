"""What tests/vllm/vllm_driver.py runs on every vLLM worker (``collective_rpc`` passes the worker first).

A module of its own, imported by name in the driver, so that cloudpickle sends
these functions by reference whatever its version: the workers import this
file, and a lock violation's caller names it (``vllm_rpc.py:<line>:grow``).
"""

from __future__ import annotations

from typing import Any


def engine_lock(worker: Any) -> bool:
    """What vLLM's GPU model runner does after CUDA-graph capture."""
    from vllm.v1.worker.workspace import current_workspace_manager, lock_workspace

    lock_workspace()
    return current_workspace_manager().is_locked()


def engine_unlock(worker: Any) -> bool:
    from vllm.v1.worker.workspace import current_workspace_manager, unlock_workspace

    unlock_workspace()
    return current_workspace_manager().is_locked()


def grow(worker: Any, nbytes: int) -> str:
    """A kernel asking vLLM's workspace for more than it holds; returns the refusal."""
    import torch
    from vllm.v1.worker.workspace import current_workspace_manager

    try:
        current_workspace_manager().get_simultaneous(((nbytes,), torch.uint8))
    except AssertionError as e:
        return f"{type(e).__name__}: {e}"
    return "served"


def manager_class(worker: Any) -> str:
    from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        return "none"
    cls = type(current_workspace_manager())
    return f"{cls.__module__}.{cls.__qualname__}"


FUNCTIONS = {f.__name__: f for f in (engine_lock, engine_unlock, grow, manager_class)}


