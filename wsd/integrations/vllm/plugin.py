"""The vLLM plugin: wsd's manager in every vLLM worker, with or without a coordinator.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) once in
every process: the front end, the engine core and each worker, before the
worker class is chosen. It does nothing unless wsd is turned on (``mode``):

- ``WSD_VLLM=standalone``: no coordinator needed. Every worker gets wsd's
  manager with its ``[workspace]`` configuration (its growth policy, ``fallback``
  included), its lock violations are said in vLLM's log with the caller, and its
  per-slot figures are in vLLM's own ``/metrics``, under vLLM's ``model_name``
  and ``engine`` labels (``wsd.integrations.vllm.metrics``). A coordinator
  configured as well adds steering and nothing else: the workers join it too;
- a coordinator configured (``WSD_COORDINATOR_CONNECT_ENDPOINT``, or
  ``[coordinator]`` in the file ``WSD_CONFIG`` names): the same, each worker
  joining it;
- ``WSD_VLLM=off``, or neither: vLLM runs exactly as without wsd, and each
  worker says so in one line.

On, and on a vLLM release wsd was verified with (``patches.verified``: any
other leaves wsd off with one WARNING line, unless ``WSD_VLLM_UNVERIFIED=1``),
it checks the patch points of each part (``patches``) in the processes that
import what that part patches, when they import it (the workers, the engine
core, the API server's ``/metrics``), then:

- every manager vLLM builds is wsd's (``workspace.WorkspaceManager``); the CPU
  worker, which builds none, gets one sized from vLLM's configuration;
- with a coordinator, each worker starts one agent: rank and world are vLLM's
  own (its world group: DP x PP x PCP x TP across data-parallel engines of one
  model, each dense data-parallel replica a world of its own, as vLLM runs it),
  TP size from vLLM's parallel configuration;
- commands apply where vLLM's engine core puts a round in its ordered stream
  to the workers, between two steps, when an agent asks for one
  (``wsd.integrations.vllm.stream``); where no engine core drives the workers,
  at the TP group's agreement on vLLM's gloo group of the TP group
  (``wsd.integrations.vllm.lifecycle``);
- shutdown (or ``reset_workspace_manager``) says goodbye and detaches.

Fail-safe: no wsd error stops vLLM. An error while loading or attaching logs
one ERROR line with the cause, turns wsd off in that process, and vLLM runs
on (its rank then reads ``missing`` in ``wsctl``). ``WSD_VLLM_STRICT=1``
makes such an error stop vLLM instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from wsd.config import Presize, WsdConfig, load_config
from wsd.errors import ConfigError
from wsd.integrations.vllm.layout import Placement, default_engine, identity, placement, served_model
from wsd.integrations.vllm.lifecycle import Engine, Wake
from wsd.integrations.vllm.logs import log_with_vllm

__all__ = ["MODE", "STRICT", "VLLM_APPLY_EVERY", "Mode", "enabled", "mode", "register", "strict"]

logger = logging.getLogger(__name__)

VLLM_APPLY_EVERY = 16
"""Steps between agreements in a vLLM worker unless ``[agent] apply_every`` says.

An agreement is a gloo all_reduce on the TP group: about 0.8 ms on the tiny
TP=2 CPU engine's 5 ms step, 19% of its throughput when made at every step
(``python -m bench --only vllm``). A waiting command does not wait for the
16th step: the agent asks the engine for one agreement step after 0.2 s.
"""

STRICT = "WSD_VLLM_STRICT"
"""The environment variable that makes a wsd error stop vLLM (fail-closed)."""

_installed = False
_attachment: _Attachment | None = None
_attach_lock = threading.Lock()


def strict(env: dict[str, str] | None = None) -> bool:
    """True when ``WSD_VLLM_STRICT`` asks for fail-closed (1, true, yes or on)."""
    value = (os.environ if env is None else env).get(STRICT, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


MODE = "WSD_VLLM"
"""The environment variable that turns wsd on without a coordinator, or off whatever is configured."""


class Mode(enum.Enum):
    """How wsd runs in this vLLM (``mode``)."""

    STANDALONE = "standalone"
    """``WSD_VLLM=standalone``: wsd's manager, its violations in vLLM's log, its figures in
    vLLM's /metrics; a coordinator too where one is configured."""
    COORDINATOR = "coordinator"
    """A coordinator is configured: the same, every worker joining it."""


def mode(env: Mapping[str, str] | None = None) -> Mode | None:
    """How wsd runs in this process (see the module docstring); None: off.

    ConfigError for a ``WSD_VLLM`` that is neither ``standalone`` nor ``off``, or a
    configuration file that cannot be read.
    """
    env = os.environ if env is None else env
    asked = env.get(MODE, "").strip().lower()
    if asked not in ("", "standalone", "off"):
        raise ConfigError(f"{MODE}={env[MODE]!r}: expected standalone (wsd with no coordinator) or off")
    if asked == "off":
        return None
    if asked == "standalone":
        return Mode.STANDALONE
    return Mode.COORDINATOR if _coordinator_configured(env) else None


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when wsd is on in this process (``mode``)."""
    return mode(env) is not None


def _coordinator_configured(env: Mapping[str, str]) -> bool:
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
    """vLLM's entry point: install wsd's patches if wsd is configured (idempotent).

    Never raises unless ``WSD_VLLM_STRICT`` says so: vLLM aborts a process whose
    plugin function raises.
    """
    global _installed
    if _installed:
        return
    try:
        log_with_vllm()
        on = mode()
        if on is None:
            _say_off_in_workers()
            return
        config = load_config()
        from wsd.integrations.vllm import metrics, patches

        if not patches.verified():
            return

        metrics.share_directory()  # named before this process starts the others
        endpoint = _endpoint(config) if _coordinator_configured(os.environ) else ""
        if endpoint and _snapshotting():
            endpoint = ""  # the snapshot may hold no connection out of its process tree
        _install(config, endpoint)
    except Exception as e:
        if strict():
            raise
        _off(e, "loading wsd's vLLM plugin")
        return
    _installed = True
    logger.debug("wsd plugin loaded (vLLM %s, %s): coordinator %s", patches.vllm_version(), on.value,
                 endpoint or "none")


SNAPSHOT = "WSD_VLLM_SNAPSHOT"
"""Set by the plugin in the root of a vLLM snapshot (``vllm snapshot create`` runs the engine
as ``python -m vllm.snapshot.server``), for the engine core and workers it starts."""


def _snapshotting(main_module: str | None = None) -> bool:
    """True in every process of an engine that ``vllm snapshot create`` (vLLM 0.34) runs to
    snapshot; the root process says so, once, and tells its children.

    CRIU refuses a process tree holding an established TCP connection to anything outside it
    (``vllm/snapshot/runtime.py``, ``_validate_tcp_connections``), which an agent's
    connection to a coordinator is; and a restored copy of that connection would be a second
    rank under the same identity. So such an engine's workers run wsd standalone.
    """
    if os.environ.get(SNAPSHOT) == "1":
        return True
    if main_module is None:
        import sys

        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_module = getattr(spec, "name", None)
    if main_module != "vllm.snapshot.server":
        return False
    os.environ[SNAPSHOT] = "1"
    logger.warning("wsd: vllm snapshot create: this engine's workers run wsd standalone (wsd's manager, "
                   "its figures in vLLM's /metrics) without joining the coordinator, since a snapshot may "
                   "hold no connection out of its processes; an engine restored from it is not steered. "
                   "To steer an engine, start it without a snapshot")
    return True


def _say_off_in_workers() -> None:
    """One INFO line in each worker that imports vLLM's worker: wsd is off, and why."""
    from wsd.integrations.vllm.imports import when_imported
    from wsd.integrations.vllm.patches import WORKER

    why = (f"{MODE}=off" if os.environ.get(MODE, "").strip().lower() == "off" else
           f"neither {MODE}=standalone nor a coordinator (WSD_COORDINATOR_CONNECT_ENDPOINT, WSD_CONFIG) is set")
    when_imported(WORKER, lambda _: logger.info("wsd is off in this worker (pid %d): %s", os.getpid(), why))


def _off(error: BaseException, doing: str) -> None:
    """The one line that says wsd is off in this process, why, and what to do."""
    logger.error("wsd is off in this process (pid %d), vLLM runs on without it: %s failed: "
                 "%s: %s. Fix the cause and restart, or set %s=1 to make this stop vLLM instead",
                 os.getpid(), doing, type(error).__name__, error, STRICT)


def _endpoint(config: WsdConfig) -> str:
    return config.coordinator.connect_endpoint or config.coordinator.agent_endpoint


# -- what the patches call ------------------------------------------------------


def _agreement_failed(error: BaseException) -> None:
    """Applying commands raised in this worker: wsd goes off here (or, strict, stops vLLM)."""
    if strict():
        raise error
    _off(error, "applying commands")
    # On a thread of its own: this may be the agent's thread, which stop() joins.
    threading.Thread(target=_detach, name="wsd-detach", daemon=True).start()


_engine = Engine(_agreement_failed)


def _install(config: WsdConfig, endpoint: str) -> None:
    """The patches, each part checked and applied where vLLM imports what it patches: the
    worker's in worker processes, the engine core's in engine cores; none in an API server."""
    from wsd.integrations.vllm import install, metrics, workspace

    install.install_when_imported(manager_class=workspace.configured(config.workspace),
                                  attach=lambda worker: _attach(worker, config, endpoint), detach=_detach,
                                  engine=_engine, served=metrics.serve_workers, failed=_failed)


def _failed(error: BaseException, doing: str) -> None:
    """A part of the patches failed its check or its patching: that part stays vLLM's own."""
    if strict():
        raise error
    _off(error, doing)


# -- one worker's attachment ------------------------------------------------------


class _Attachment:
    """What a worker attached: its figures for vLLM's /metrics, and its agent where a
    coordinator steers it; and what they need to stop."""

    def __init__(self, publisher: Any, agent: Any = None, wake: Wake | None = None) -> None:
        self.publisher = publisher
        self.agent = agent
        self.wake = wake

    def close(self) -> None:
        try:
            if self.agent is not None:
                self.agent.stop()
        finally:
            try:
                if self.wake is not None:
                    self.wake.close()
            finally:
                self.publisher.stop()


def _attach(worker: Any, config: WsdConfig, endpoint: str) -> None:
    """Attach wsd to this worker, joining the coordinator at ``endpoint`` ("": standalone); an
    error turns wsd off here (see ``strict``)."""
    try:
        _join(worker, config, endpoint)
    except Exception as e:
        if strict():
            raise
        _off(e, "attaching this vLLM worker")


def _join(worker: Any, config: WsdConfig, endpoint: str) -> None:
    """Give this worker a wsd manager (if vLLM built none), say its violations in vLLM's log,
    write its figures for vLLM's /metrics, and start its agent where a coordinator is set."""
    global _attachment
    import torch
    import vllm.v1.worker.workspace as vllm_workspace
    from vllm.distributed import parallel_state

    from wsd.agent.thread import gpu_uuid
    from wsd.integrations.vllm import metrics, workspace
    from wsd.integrations.vllm.stream import driven_by_engine_core, steered
    from wsd.manager.violationlog import ViolationLog

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
            raise TypeError(f"vLLM's workspace manager is a {type(manager).__name__}, not wsd's")
        world = parallel_state.get_world_group()
        place = placement(parallel, world.rank, world.world_size)
        engine = config.agent.engine or default_engine(vllm_config, socket.gethostname())
        stream = driven_by_engine_core(parallel, os.environ, os.getpid(), os.getppid())
        steers = steered(parallel, stream, place.tp_size)
        if endpoint and not steers:
            logger.warning("wsd: rank %d reports and applies no command: vLLM's --enable-fault-tolerance "
                           "claims the TP group's cpu_group, and with the %s executor no engine core drives "
                           "its workers through one stream", place.rank, parallel.distributed_executor_backend)
        labels = identity(worker, place, engine=engine, endpoint=endpoint, device=str(manager.device),
                          gpu_labels=gpu_uuid(manager.device))
        publisher = metrics.Publisher(manager, labels,
                                      directory=metrics.share_directory(), step=lambda: _engine.steps)
        publisher.start()
        agent = wake = None
        if endpoint:
            try:
                agent, wake = _start_agent(worker, config, manager, place, engine, endpoint, stream, steers)
            except BaseException:
                publisher.stop()
                raise
        manager.add_violation_listener(ViolationLog(logger, rank=place.rank,
                                                    policy=config.workspace.on_locked_growth))
        _attachment = _Attachment(publisher, agent, wake)
        _engine.attach(agent, stream=stream, group=place.tp_group, steered=steers)
        if agent is not None:  # [workspace] presize = "profile": after vLLM's start-of-worker memory
            # snapshot, before its profile run and capture, so its budget counts what is reserved
            agent.presize_from_profile(config.agent.connect_timeout)
        steered = f"joined {endpoint}" if endpoint else "attached standalone (no coordinator)"
        logger.info("wsd: rank %d of %d (TP group %d of size %d) of engine %s %s, its figures in vLLM's "
                    "/metrics, with %r", place.rank, place.world_size, place.tp_group, place.tp_size, engine,
                    steered, manager)


def _start_agent(worker: Any, config: WsdConfig, manager: Any, place: Placement, engine: str,
                 endpoint: str, stream: bool, steers: bool) -> tuple[Any, Wake]:
    """This worker's agent, joining the coordinator at ``endpoint``, and how it wakes its engine
    (never, where it is not ``steers``: it applies nothing)."""
    from vllm.distributed import parallel_state

    from wsd.agent.thread import Agent
    from wsd.integrations.vllm.patches import vllm_version
    from wsd.security import load_agent_token
    from wsd.wire.curve import agent_keys

    vllm_config = worker.vllm_config
    parallel = vllm_config.parallel_config
    tp = parallel_state.get_tp_group()
    token = load_agent_token(config.security)
    curve = agent_keys(config.security)
    apply_every = config.agent.apply_every or VLLM_APPLY_EVERY
    wake = Wake(_engine, place.rank, place.tp_size, apply_every)
    try:
        agent = Agent(
            manager, endpoint=endpoint, rank=place.rank, world_size=place.world_size,
            # Driven by its engine core, the group agrees through vLLM's stream: nothing on its cpu_group.
            tp_size=place.tp_size, tp_group=tp.cpu_group if place.tp_size > 1 and not stream and steers else None,
            config=dataclasses.replace(config.agent, engine=engine, apply_every=apply_every),
            model=served_model(vllm_config),
            heartbeat_interval=config.coordinator.heartbeat_interval,
            heartbeat_timeout=config.coordinator.heartbeat_timeout,
            extra={"engine": "vllm", "vllm_version": vllm_version(),
                   "local_rank": getattr(worker, "local_rank", None),
                   "tp_rank": tp.rank_in_group, "dp_rank": parallel.data_parallel_rank,
                   "dp_index": getattr(parallel, "data_parallel_index", None),
                   "dp_size": parallel.data_parallel_size,
                   "executor": str(parallel.distributed_executor_backend)},
            curve=curve, on_pending=wake if steers else None, token=token,
            warm=_engine.warm,  # attached in init_device: warm-up is still to come
            presize=config.workspace.presize is Presize.PROFILE,
        ).start()
    except BaseException:
        wake.close()
        raise
    return agent, wake


def _detach() -> None:
    """Say goodbye and stop this worker's agent (idempotent)."""
    global _attachment
    with _attach_lock:
        attachment, _attachment = _attachment, None
        _engine.detach()
    if attachment is not None:
        try:
            attachment.close()
        except Exception:  # shutting down: log, never raise into vLLM's shutdown
            logger.exception("wsd: stopping the agent failed")


atexit.register(_detach)
