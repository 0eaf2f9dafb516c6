"""The vLLM plugin: wsd's manager and an agent in every vLLM worker.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) once in
every process: the front end, the engine core and each worker, before the
worker class is chosen. It does nothing unless wsd is configured: a worker
joins wsd when ``WSD_COORDINATOR_CONNECT_ENDPOINT`` is set, or when the file
named by ``WSD_CONFIG`` says in ``[coordinator]`` where agents connect.
Otherwise vLLM runs exactly as without wsd.

Configured, it checks every patch point (``patches``), then:

- every manager vLLM builds is wsd's (``workspace.WorkspaceManager``); the CPU
  worker, which builds none, gets one sized from vLLM's configuration;
- each worker starts one agent: rank = vLLM's global rank over DP x PP x TP,
  world and TP size from vLLM's parallel configuration, and the per-step
  agreement on vLLM's own gloo group of the TP group;
- ``execute_model`` is the step boundary; an idle engine is woken (``wake``)
  when a command waits;
- shutdown (or ``reset_workspace_manager``) says goodbye and detaches.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from wsd.config import WsdConfig, load_config

__all__ = ["attached_agent", "enabled", "register"]

logger = logging.getLogger(__name__)

_installed = False
_attachment: _Attachment | None = None
_attach_lock = threading.Lock()


def enabled(env: dict[str, str] | None = None) -> bool:
    """True when wsd is configured for this process (see the module docstring)."""
    env = dict(os.environ) if env is None else env
    if env.get("WSD_COORDINATOR_CONNECT_ENDPOINT"):
        return True
    path = env.get("WSD_CONFIG")
    if not path:
        return False
    from wsd.config import read_toml  # the loader's own reader: same errors, naming the file

    coordinator = read_toml(path).get("coordinator", {})
    return isinstance(coordinator, dict) and bool(
        coordinator.get("connect_endpoint") or coordinator.get("agent_endpoint"))


def register() -> None:
    """vLLM's entry point: install wsd's patches if wsd is configured (idempotent)."""
    global _installed
    if _installed or not enabled():
        return
    config = load_config()  # a bad file or variable fails the start, naming the key
    from wsd.integrations.vllm import patches

    patches.check()
    _install(config)
    _installed = True
    logger.info("wsd plugin installed (vLLM %s): workers join the coordinator at %s",
                patches.vllm_version(), _endpoint(config))


def attached_agent() -> Any:
    """This worker's agent, or None (not a worker, not yet attached, or detached)."""
    attachment = _attachment
    return None if attachment is None else attachment.agent


def _endpoint(config: WsdConfig) -> str:
    return config.coordinator.connect_endpoint or config.coordinator.agent_endpoint


# -- the patches ----------------------------------------------------------------


def _install(config: WsdConfig) -> None:
    import vllm.v1.worker.workspace as vllm_workspace
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.worker.gpu_worker import Worker

    from wsd.integrations.vllm import workspace
    from wsd.integrations.vllm.patches import wrap
    from wsd.integrations.vllm.wake import WSD_STEP, WakeListener

    vllm_workspace.WorkspaceManager = workspace.WorkspaceManager

    def reset_workspace_manager(original: Callable[[], None]) -> Callable[[], None]:
        def reset() -> None:
            _detach()
            original()
        return reset

    wrap(vllm_workspace, "reset_workspace_manager", reset_workspace_manager)

    def init_device(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            _attach(self, config)
            return result
        return init

    wrap(Worker, "init_device", init_device)
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except ImportError:  # a vLLM build without the CPU worker: nothing to patch there
        CPUWorker = None
    if CPUWorker is not None and "init_device" in vars(CPUWorker):
        wrap(CPUWorker, "init_device", init_device)

    def execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            attachment = _attachment
            if attachment is not None:
                attachment.agent.step()
            return original(self, scheduler_output, *args, **kwargs)
        return execute

    wrap(Worker, "execute_model", execute_model)

    def shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(self: Any, *args: Any, **kwargs: Any) -> Any:
            _detach()
            return original(self, *args, **kwargs)
        return stop

    wrap(Worker, "shutdown", shutdown)

    def wsd_step(self: Any) -> list[int]:
        """One agreement step outside ``execute_model`` (the engine core asks it of every worker)."""
        attachment = _attachment
        return [] if attachment is None else attachment.agent.step()

    Worker.wsd_step = wsd_step

    def run_busy_loop(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._wsd_wake = listener = WakeListener(self.input_queue)
            atexit.register(listener.close)  # also when the loop is left by a signal
            try:
                return original(self, *args, **kwargs)
            finally:
                listener.close()
        return run

    wrap(EngineCoreProc, "run_busy_loop", run_busy_loop)

    def handle_client_request(original: Callable[..., Any]) -> Callable[..., Any]:
        def handle(self: Any, request_type: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if request_type is WSD_STEP or request_type == WSD_STEP:
                wake = getattr(self, "_wsd_wake", None)
                if wake is not None:
                    wake.queued.clear()  # wake-ups from now on ask for another step
                try:
                    self.collective_rpc(WSD_STEP)
                except Exception:  # a failed step must not take the engine down
                    logger.exception("wsd: the agreement step on the workers failed")
                return None
            return original(self, request_type, request, *args, **kwargs)
        return handle

    wrap(EngineCoreProc, "_handle_client_request", handle_client_request)


# -- one worker's attachment ------------------------------------------------------


class _Attachment:
    """A worker's agent and what it needs to stop."""

    def __init__(self, agent: Any, wake: Any) -> None:
        self.agent = agent
        self.wake = wake

    def close(self) -> None:
        try:
            self.agent.stop()
        finally:
            self.wake.close()


def _attach(worker: Any, config: WsdConfig) -> None:
    """Give this worker a wsd manager (if vLLM built none) and start its agent."""
    global _attachment
    import torch
    import vllm.v1.worker.workspace as vllm_workspace
    from vllm.distributed import parallel_state

    from wsd.agent import Agent
    from wsd.auth import agent_keys
    from wsd.integrations.vllm import workspace
    from wsd.integrations.vllm.patches import vllm_version
    from wsd.integrations.vllm.wake import WakeSender, wake_endpoint

    with _attach_lock:
        if _attachment is not None:
            return
        vllm_config = worker.vllm_config
        parallel = vllm_config.parallel_config
        if not vllm_workspace.is_workspace_manager_initialized():
            # The CPU worker builds none; size one as the GPU worker would.
            vllm_workspace.init_workspace_manager(
                getattr(worker, "device", torch.device("cpu")),
                2 if getattr(parallel, "enable_dbo", False) else 1, 1)
        manager = vllm_workspace.current_workspace_manager()
        if not isinstance(manager, workspace.WorkspaceManager):
            logger.error("wsd: vLLM's workspace manager is a %s, not wsd's; this worker does not "
                         "join wsd", type(manager).__name__)
            return
        tp = parallel_state.get_tp_group()
        tp_size = parallel.tensor_parallel_size
        engine_world = parallel.pipeline_parallel_size * tp_size
        rank = parallel.data_parallel_rank * engine_world + torch.distributed.get_rank()
        wake = WakeSender(wake_endpoint(os.getppid()))
        agent = Agent(
            manager, endpoint=_endpoint(config), rank=rank,
            world_size=parallel.data_parallel_size * engine_world, tp_size=tp_size,
            tp_group=tp.cpu_group if tp_size > 1 else None, config=config.agent,
            heartbeat_interval=config.coordinator.heartbeat_interval,
            heartbeat_timeout=config.coordinator.heartbeat_timeout,
            extra={"engine": "vllm", "vllm_version": vllm_version(),
                   "local_rank": getattr(worker, "local_rank", None),
                   "tp_rank": tp.rank_in_group, "dp_rank": parallel.data_parallel_rank,
                   "host": socket.gethostname()},
            curve=agent_keys(config.security), on_pending=wake,
        ).start()
        _attachment = _Attachment(agent, wake)
        logger.info("wsd: rank %d (TP group %d of size %d) joined %s with %r", rank,
                    rank // tp_size, tp_size, _endpoint(config), manager)


def _detach() -> None:
    """Say goodbye and stop this worker's agent (idempotent)."""
    global _attachment
    with _attach_lock:
        attachment, _attachment = _attachment, None
    if attachment is not None:
        try:
            attachment.close()
        except Exception:  # shutting down: log, never raise into vLLM's shutdown
            logger.exception("wsd: stopping the agent failed")


atexit.register(_detach)
