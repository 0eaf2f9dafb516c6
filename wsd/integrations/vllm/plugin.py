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
import dataclasses
import logging
import os
import threading
from typing import Any

from wsd.config import WsdConfig, load_config

__all__ = ["VLLM_APPLY_EVERY", "enabled", "register"]

logger = logging.getLogger(__name__)

VLLM_APPLY_EVERY = 16
"""Steps between agreements in a vLLM worker unless ``[agent] apply_every`` says.

An agreement is a gloo all_reduce on the TP group: about 0.8 ms on the tiny
TP=2 CPU engine's 5 ms step, 19% of its throughput when made at every step
(``python -m bench --only vllm``). A waiting command does not wait for the
16th step: the agent wakes the engine core for one agreement step after 0.2 s.
"""

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


def _endpoint(config: WsdConfig) -> str:
    return config.coordinator.connect_endpoint or config.coordinator.agent_endpoint


# -- what the patches call ------------------------------------------------------


def _install(config: WsdConfig) -> None:
    from wsd.integrations.vllm import patches, workspace

    patches.install(manager_class=workspace.configured(config.workspace),
                    attach=lambda worker: _attach(worker, config), detach=_detach, step=_step)


def _step(*, agree: bool) -> list[int]:
    """The step boundary (``execute_model``, or a woken engine's ``wsd_step``, which agrees)."""
    attachment = _attachment
    return [] if attachment is None else attachment.agent.step(agree=agree)


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

    from wsd.agent.thread import Agent
    from wsd.integrations.vllm import workspace
    from wsd.integrations.vllm.patches import vllm_version
    from wsd.integrations.vllm.wake import WakeSender, wake_endpoint
    from wsd.security import load_agent_token
    from wsd.wire.curve import agent_keys

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
            tp_group=tp.cpu_group if tp_size > 1 else None,
            config=dataclasses.replace(config.agent,
                                       apply_every=config.agent.apply_every or VLLM_APPLY_EVERY),
            heartbeat_interval=config.coordinator.heartbeat_interval,
            heartbeat_timeout=config.coordinator.heartbeat_timeout,
            extra={"engine": "vllm", "vllm_version": vllm_version(),
                   "local_rank": getattr(worker, "local_rank", None),
                   "tp_rank": tp.rank_in_group, "dp_rank": parallel.data_parallel_rank},
            curve=agent_keys(config.security), on_pending=wake, token=load_agent_token(config.security),
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
