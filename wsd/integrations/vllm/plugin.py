"""The vLLM plugin: wsd's manager and an agent in every vLLM worker.

vLLM calls ``register()`` (entry point group ``vllm.general_plugins``) once in
every process: the front end, the engine core and each worker, before the
worker class is chosen. It does nothing unless wsd is configured: a worker
joins wsd when ``WSD_COORDINATOR_CONNECT_ENDPOINT`` is set, or when the file
named by ``WSD_CONFIG`` says in ``[coordinator]`` where agents connect.
Otherwise vLLM runs exactly as without wsd.

Configured, it checks the patch points of each part (``patches``) in the
processes that import what that part patches, when they import it (the
workers, the engine core; never the API server), then:

- every manager vLLM builds is wsd's (``workspace.WorkspaceManager``); the CPU
  worker, which builds none, gets one sized from vLLM's configuration;
- each worker starts one agent: rank and world are vLLM's own (its world
  group: DP x PP x PCP x TP across data-parallel engines of one model, each
  dense data-parallel replica a world of its own, as vLLM runs it), TP size
  from vLLM's parallel configuration, and the per-step agreement on vLLM's own
  gloo group of the TP group;
- ``execute_model`` (and ``execute_dummy_batch``, a data-parallel rank's idle
  step) is the step boundary; an idle engine gets a step when a command waits
  (``_Wake``);
- shutdown (or ``reset_workspace_manager``) says goodbye and detaches.

Fail-safe: no wsd error stops vLLM. An error while loading or attaching logs
one ERROR line with the cause, turns wsd off in that process, and vLLM runs
on (its rank then reads ``missing`` in ``wsctl``). ``WSD_VLLM_STRICT=1``
makes such an error stop vLLM instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from wsd.config import WsdConfig, load_config
from wsd.names import engine_name

__all__ = ["STRICT", "VLLM_APPLY_EVERY", "Placement", "enabled", "placement", "register", "strict"]

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
    """vLLM's entry point: install wsd's patches if wsd is configured (idempotent).

    Never raises unless ``WSD_VLLM_STRICT`` says so: vLLM aborts a process whose
    plugin function raises.
    """
    global _installed
    if _installed:
        return
    try:
        _log_with_vllm()
        if not enabled():
            return
        config = load_config()
        from wsd.integrations.vllm import patches

        _install(config)
    except Exception as e:
        if strict():
            raise
        _off(e, "loading wsd's vLLM plugin")
        return
    _installed = True
    logger.debug("wsd plugin loaded (vLLM %s): workers join the coordinator at %s",
                 patches.vllm_version(), _endpoint(config))


class _ToVllmLog(logging.Handler):
    """Hands wsd's log records to vLLM's own handlers, as they are when the record comes.

    vLLM configures its own logger only (``vllm``, which does not propagate), and
    later than plugins load: wsd's lines would otherwise reach no handler but
    Python's last resort, WARNING and up, unformatted, and an operator would never
    see that wsd attached. Before vLLM has a handler (a plugin that fails to load
    says so then), WARNING and up go to standard error, with their level and time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.early = logging.StreamHandler()  # sys.stderr
        self.early.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        handlers = theirs.handlers
        try:
            if handlers:
                if record.levelno >= theirs.getEffectiveLevel():
                    if not hasattr(record, "vllm_process_name"):  # made before vLLM's record factory
                        record.vllm_process_name = record.processName
                    for handler in handlers:
                        if record.levelno >= handler.level:
                            handler.handle(record)
            elif record.levelno >= logging.WARNING:
                self.early.handle(record)
        except Exception:
            self.handleError(record)


def _log_with_vllm() -> None:
    """wsd's log lines in vLLM's log, in vLLM's format (unless logging is configured already)."""
    ours = logging.getLogger("wsd")
    if ours.handlers or logging.getLogger().handlers:
        return
    ours.addHandler(_ToVllmLog())
    ours.setLevel(logging.INFO)  # vLLM's own level decides, at each record
    ours.propagate = False


def _off(error: BaseException, doing: str) -> None:
    """The one line that says wsd is off in this process, why, and what to do."""
    logger.error("wsd is off in this process (pid %d), vLLM runs on without it: %s failed: "
                 "%s: %s. Fix the cause and restart, or set %s=1 to make this stop vLLM instead",
                 os.getpid(), doing, type(error).__name__, error, STRICT)


def _endpoint(config: WsdConfig) -> str:
    return config.coordinator.connect_endpoint or config.coordinator.agent_endpoint


# -- where a worker stands in vLLM's layout ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """A vLLM worker's place as wsd registers it."""

    rank: int
    """vLLM's global rank in its torch world (TP innermost, then PCP, PP, DP)."""
    world_size: int
    """vLLM's world: PP x PCP x TP, times DP where the DP ranks share one world
    (MoE data parallelism, the external launcher); a dense DP replica is its own."""
    tp_size: int

    @property
    def tp_group(self) -> int:
        return self.rank // self.tp_size


def placement(parallel: Any, world_rank: int, world_size: int) -> Placement:
    """The placement of the worker at ``world_rank`` of vLLM's world group of ``world_size``.

    vLLM's world group is already the right world in every layout: its
    ``init_distributed_environment`` offsets the rank by the DP rank and widens
    the world to ``world_size_across_dp`` where DP ranks share one (MoE DP), and
    a dense DP replica is reset to DP = 1 with a world of its own. TP groups are
    contiguous ranks (``initialize_model_parallel``: TP is the innermost axis).
    """
    tp_size = parallel.tensor_parallel_size
    if tp_size < 1 or world_size % tp_size or not 0 <= world_rank < world_size:
        raise ValueError(f"vLLM's world group (rank {world_rank} of {world_size}) does not hold "
                         f"whole TP groups of {tp_size}")
    return Placement(rank=world_rank, world_size=world_size, tp_size=tp_size)


def served_model(vllm_config: Any) -> str | None:
    """The name vLLM serves its model under (the first, where it has several)."""
    model_config = getattr(vllm_config, "model_config", None)
    served = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served) if served else None


def default_engine(vllm_config: Any, host: str, env: Mapping[str, str] = os.environ) -> str:
    """The engine a vLLM worker joins when ``[agent] engine`` (``WSD_ENGINE``) names none:
    ``HOST-MODEL``, stable across restarts of the same replica, every other character ``-``.

    Where one host runs several replicas of one model, each on its own GPUs, the first GPU
    of ``CUDA_VISIBLE_DEVICES`` tells them apart (``-gpu2``); a dense data-parallel replica
    other than the first adds its index (``-dp1``: vLLM resets each to a world of its own and
    keeps only ``data_parallel_index``). MoE data parallelism is one engine: its ranks share
    one world. Anything else on one host (two replicas on the same GPUs) names its engines.
    """
    parts = [host, served_model(vllm_config) or "vllm"]
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible:
        parts.append(f"gpu{visible}")
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    if parallel.data_parallel_size == 1 and isinstance(index, int) and index > 0:
        parts.append(f"dp{index}")
    return engine_name("-".join(parts))


# -- what the patches call ------------------------------------------------------


class _Engine:
    """This worker process's engine, as the patches see it: busy, warm, asleep.

    ``busy`` is held for each of the engine's own uses of the workspace
    (a step, its warm-up, sleeping and waking), so that an agreement step may
    run on the agent's thread between them (``step_between``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.warm = False
        self.asleep = False

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self.lock:
            yield

    def warmed(self) -> None:
        """vLLM's warm-up returned (its profile run, CUDA-graph capture and the lock after
        it): commands, a replayed desired state included, may apply from now on."""
        self.warm = True
        attachment = _attachment
        if attachment is not None:
            attachment.agent.mark_warm()

    def sleeping(self, asleep: bool) -> None:
        self.asleep = asleep

    def step(self, *, agree: bool) -> list[int]:
        """The step boundary (``execute_model``, or a woken engine's ``wsd_step``, which agrees).

        Commands wait while the engine sleeps: a waiting ``reserve`` would
        allocate the memory that sleep mode freed. Every rank of a TP group
        sleeps and wakes together, so they skip the same steps.
        """
        if not agree and not self.warm:
            self.warmed()  # an engine step comes after any warm-up: never wait for ever
        attachment = _attachment
        if attachment is None or self.asleep:
            return []
        try:
            return attachment.agent.step(agree=agree)
        except Exception as e:
            if strict():
                raise
            _off(e, "the agreement step")
            # On a thread of its own: this may be the agent's thread, which stop() joins.
            threading.Thread(target=_detach, name="wsd-detach", daemon=True).start()
            return []

    def step_between(self) -> None:
        """One agreement step on the calling thread, if the engine is warm, awake and
        between two of its own steps; else nothing (a TP group of one rank only)."""
        if not self.warm or self.asleep or not self.lock.acquire(blocking=False):
            return  # a busy engine agrees within apply_every steps anyway
        try:
            self.step(agree=True)
        finally:
            self.lock.release()


_engine = _Engine()


def _install(config: WsdConfig) -> None:
    """The patches, each part checked and applied where vLLM imports what it patches: the
    worker's in worker processes, the engine core's in engine cores; none in an API server."""
    from wsd.integrations.vllm import patches, workspace

    patches.install_when_imported(manager_class=workspace.configured(config.workspace),
                                  attach=lambda worker: _attach(worker, config), detach=_detach,
                                  engine=_engine, failed=_failed)


def _failed(error: BaseException, doing: str) -> None:
    """A part of the patches failed its check or its patching: that part stays vLLM's own."""
    if strict():
        raise error
    _off(error, doing)


class _Wake:
    """The agent's ``on_pending``: how this worker gets an agreement step out of its engine.

    In the order tried:

    1. an engine core in this process listens (the ``uni`` executor, whose worker
       lives in the engine core): ask it directly, and its own thread runs the step;
    2. a TP group of one rank: run the step here, on the agent's thread, between
       the engine's own steps (no other rank takes part, and the engine core is
       not disturbed; also the only way for an engine in the caller's process,
       ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
    3. the parent is an engine core (the multiprocess executor): tell it over its
       socket, and it runs ``wsd_step`` on every worker of the engine;
    4. none of these (Ray workers, a multi-node follower, the external launcher
       with TP > 1): the command waits for the engine's next agreement step, at
       most ``apply_every`` steps of traffic; said once at WARNING.
    """

    def __init__(self, rank: int, tp_size: int) -> None:
        from wsd.integrations.vllm.wake import WakeSender, wake_endpoint

        self.rank = rank
        self.tp_size = tp_size
        self.sender = WakeSender(wake_endpoint(os.getppid()))
        self._warned = False

    def __call__(self) -> None:
        from wsd.integrations.vllm.wake import local_listener

        listener = local_listener()
        if listener is not None:
            listener.request()
        elif self.tp_size == 1:
            _engine.step_between()
        elif self.sender.listening():
            self.sender()
        elif not self._warned:
            self._warned = True
            logger.warning("wsd: rank %d cannot wake its engine (no engine core listens at %s: "
                           "Ray, a multi-node follower or the external launcher); a waiting "
                           "command applies at the engine's next agreement step, within %d "
                           "steps of traffic", self.rank, self.sender.endpoint, VLLM_APPLY_EVERY)

    def close(self) -> None:
        self.sender.close()


# -- one worker's attachment ------------------------------------------------------


class _Attachment:
    """A worker's agent and what it needs to stop."""

    def __init__(self, agent: Any, wake: _Wake) -> None:
        self.agent = agent
        self.wake = wake

    def close(self) -> None:
        try:
            self.agent.stop()
        finally:
            self.wake.close()


def _attach(worker: Any, config: WsdConfig) -> None:
    """Join wsd from this worker; an error turns wsd off here (see ``strict``)."""
    try:
        _join(worker, config)
    except Exception as e:
        if strict():
            raise
        _off(e, "attaching this vLLM worker")


def _join(worker: Any, config: WsdConfig) -> None:
    """Give this worker a wsd manager (if vLLM built none) and start its agent."""
    global _attachment
    import torch
    import vllm.v1.worker.workspace as vllm_workspace
    from vllm.distributed import parallel_state

    from wsd.agent.thread import Agent
    from wsd.integrations.vllm import workspace
    from wsd.integrations.vllm.patches import vllm_version
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
            raise TypeError(f"vLLM's workspace manager is a {type(manager).__name__}, not wsd's")
        world = parallel_state.get_world_group()
        place = placement(parallel, world.rank, world.world_size)
        tp = parallel_state.get_tp_group()
        token = load_agent_token(config.security)
        curve = agent_keys(config.security)
        wake = _Wake(place.rank, place.tp_size)
        engine = config.agent.engine or default_engine(vllm_config, socket.gethostname())
        try:
            agent = Agent(
                manager, endpoint=_endpoint(config), rank=place.rank, world_size=place.world_size,
                tp_size=place.tp_size, tp_group=tp.cpu_group if place.tp_size > 1 else None,
                config=dataclasses.replace(config.agent, engine=engine,
                                           apply_every=config.agent.apply_every or VLLM_APPLY_EVERY),
                model=served_model(vllm_config),
                heartbeat_interval=config.coordinator.heartbeat_interval,
                heartbeat_timeout=config.coordinator.heartbeat_timeout,
                extra={"engine": "vllm", "vllm_version": vllm_version(),
                       "local_rank": getattr(worker, "local_rank", None),
                       "tp_rank": tp.rank_in_group, "dp_rank": parallel.data_parallel_rank,
                       "dp_index": getattr(parallel, "data_parallel_index", None),
                       "dp_size": parallel.data_parallel_size,
                       "executor": str(parallel.distributed_executor_backend)},
                curve=curve, on_pending=wake, token=token,
                warm=_engine.warm,  # attached in init_device: warm-up is still to come
            ).start()
        except BaseException:
            wake.close()
            raise
        _attachment = _Attachment(agent, wake)
        logger.info("wsd: rank %d of %d (TP group %d of size %d) of engine %s joined %s with %r", place.rank,
                    place.world_size, place.tp_group, place.tp_size, engine, _endpoint(config), manager)


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
