"""wsd's patches of vLLM, part by part: what each wrapper does, and when each part applies.

``wsd.integrations.vllm.patches`` declares every point (``POINTS``) and checks
it; this module holds what goes there. Each part is checked and applied in the
processes that import the module it patches, when they import it
(``install_when_imported``). The engine calls that the worker's wrappers see are
told to ``EngineHooks`` (``wsd.integrations.vllm.lifecycle.Engine``), under one
rule: only the outermost engine call on a thread counts, and one that vLLM
makes from inside another passes straight through.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Any, Protocol

from wsd.integrations.vllm import patches
from wsd.integrations.vllm.patches import API_SERVER, CPU_WORKER, ENGINE_CORE, WORKER

__all__ = ["EngineHooks", "install_api_server", "install_cpu_worker", "install_engine_core", "install_when_imported",
           "install_worker"]

logger = logging.getLogger(__name__)

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class EngineHooks(Protocol):
    """What the patches tell the plugin, and ask of it, about the engine of this process
    (``wsd.integrations.vllm.lifecycle.Engine``)."""

    def enter(self) -> bool:
        """One of the engine's wrapped calls begins: True for the outermost on its thread."""
        ...

    def leave(self) -> None:
        """The call ``enter`` began ends."""
        ...

    def step(self) -> None:
        """An outermost engine step begins."""
        ...

    def warmed(self) -> None:
        """The outermost warm-up has returned."""
        ...

    def sleeping(self, asleep: bool) -> None:
        """The engine goes to sleep (True)."""
        ...

    def woke(self, tags: Any) -> None:
        """``wake_up(tags)`` returned."""
        ...

    def agree_now(self) -> list[int]:
        """``wsd_step``: one agreement of the TP group."""
        ...

    def offer(self) -> dict[str, int] | None:
        """``wsd_offer``."""
        ...

    def settle(self, agreed: dict[int, int]) -> list[int]:
        """``wsd_apply``."""
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
            patches.check(WORKER)
            install_worker(module, manager_class=manager_class, attach=attach, detach=detach, engine=engine)
        except Exception as e:
            failed(e, "patching vLLM's worker")
            return
        worker_patched = True

    def cpu_worker(module: Any) -> None:
        if not worker_patched:  # it imports the worker first: that part failed, or was never
            return
        try:
            install_cpu_worker(module.CPUWorker, attach=attach, engine=engine)
        except Exception as e:
            failed(e, "patching vLLM's CPU worker")

    def engine_core(module: Any) -> None:
        try:
            patches.check(ENGINE_CORE)
            install_engine_core(module)
        except Exception as e:
            failed(e, "patching vLLM's engine core")

    def api_server(module: Any) -> None:
        try:
            patches.check(API_SERVER)
            install_api_server(module, served)
        except Exception as e:
            failed(e, "patching vLLM's /metrics")

    when_imported(WORKER, worker)
    when_imported(CPU_WORKER, cpu_worker)  # after the worker's: it imports the worker
    when_imported(ENGINE_CORE, engine_core)
    when_imported(API_SERVER, api_server)


def install_api_server(module: Any, served: Callable[[Any], None]) -> None:
    """The API server's part: the registry ``attach_router`` serves at ``/metrics``, shown to
    ``served`` before vLLM serves it."""
    def get_prometheus_registry(original: Callable[[], Any]) -> Callable[[], Any]:
        def registry() -> Any:
            served_registry = original()
            served(served_registry)
            return served_registry
        return registry

    patches.apply_points(API_SERVER, {"get_prometheus_registry": get_prometheus_registry}, {}, module)


def install_worker(module: Any, *, manager_class: type, attach: Callable[[Any], None],
                    detach: Callable[[], None], engine: EngineHooks) -> None:
    """The worker's part: wsd's manager class in vLLM's place, the worker's methods wrapped and
    the round's methods added."""
    from wsd.integrations.vllm.stream import WSD_APPLY, WSD_OFFER
    from wsd.integrations.vllm.wake import WSD_STEP

    def reset_workspace_manager(original: Callable[[], None]) -> Callable[[], None]:
        def reset() -> None:
            detach()
            original()
        return reset

    def shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(self: Any, *args: Any, **kwargs: Any) -> Any:
            detach()
            return original(self, *args, **kwargs)
        return stop

    def wsd_step(self: Any) -> list[int]:
        """One agreement of the TP group outside ``execute_model`` (the engine core asks it of every worker)."""
        return engine.agree_now()

    def wsd_offer(self: Any) -> dict[str, int] | None:
        """What this worker holds and may apply (the first call of a round in vLLM's stream)."""
        return engine.offer()

    def wsd_apply(self: Any, agreed: dict[int, int]) -> list[int]:
        """Apply up to this worker's TP group's agreed number (the second call of a round)."""
        return engine.settle(agreed)

    patches.apply_points(
        WORKER, {"reset_workspace_manager": reset_workspace_manager, "execute_model": _stepping(engine),
                 "execute_dummy_batch": _stepping(engine), "sample_tokens": _inside(engine),
                 "shutdown": shutdown, **_lifecycle(attach, engine)},
        {"WorkspaceManager": manager_class, WSD_STEP: wsd_step, WSD_OFFER: wsd_offer, WSD_APPLY: wsd_apply},
        module)


def install_cpu_worker(cpu_worker: Any, *, attach: Callable[[Any], None], engine: EngineHooks) -> None:
    """The CPU worker's own versions of the worker's life-cycle methods (no super()): wrapped
    likewise, those ``POINTS`` marks ``cpu_worker``."""
    lifecycle = _lifecycle(attach, engine)
    for point in patches.POINTS:
        if point.cpu_worker and point.name in vars(cpu_worker):
            patches.wrap(cpu_worker, point.name, lifecycle[point.name])


# Every wrapper of an engine call keeps one rule: ``engine.enter()`` says whether this is the
# outermost engine call on its thread; one that vLLM made from inside another (its GPU warm-up
# calls the worker's own execute_model and sample_tokens) passes straight through to vLLM.


def _stepping(engine: EngineHooks) -> Wrapper:
    """``execute_model`` and ``execute_dummy_batch``: an outermost one is a step."""
    def stepping(original: Callable[..., Any]) -> Callable[..., Any]:
        def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
            outermost = engine.enter()
            try:
                if outermost:
                    engine.step()
                return original(self, *args, **kwargs)
            finally:
                engine.leave()
        return execute
    return stepping


def _inside(engine: EngineHooks) -> Wrapper:
    """A call that is the engine's own use of the workspace, part of a step (``sample_tokens``)."""
    def inside(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            engine.enter()
            try:
                return original(self, *args, **kwargs)
            finally:
                engine.leave()
        return run
    return inside


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
            outermost = engine.enter()
            try:
                result = original(self, *args, **kwargs)
            finally:
                engine.leave()
            if outermost:
                engine.warmed()
            return result
        return run

    def sleep(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if engine.enter():
                engine.sleeping(True)  # first: nothing is applied from here on
            try:
                return original(self, *args, **kwargs)
            finally:
                engine.leave()
        return run

    def wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, tags: Any = None, *args: Any, **kwargs: Any) -> Any:
            outermost = engine.enter()
            try:
                result = original(self, tags, *args, **kwargs)
            finally:
                engine.leave()
            if outermost:
                engine.woke(tags)  # last: the memory is back
            return result
        return run

    return {"init_device": init_device, "compile_or_warm_up_model": warm_up, "sleep": sleep, "wake_up": wake_up}


def install_engine_core(core: Any) -> None:
    """The engine core's part: it names itself to the workers it builds, listens for their
    wake-ups and turns each into one round between engine steps."""
    import os

    import zmq

    from wsd.integrations.vllm.stream import ENGINE_CORE_PID, WSD_APPLY, WSD_OFFER, agree, stream_shape
    from wsd.integrations.vllm.wake import WSD_STEP, WakeListener

    def init(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            os.environ[ENGINE_CORE_PID] = str(os.getpid())  # before the executor spawns the workers
            return original(self, *args, **kwargs)
        return run

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

    def round_(self: Any) -> None:
        """One round on the engine core's thread, between two engine steps; none while the
        executor sleeps: its workers apply nothing asleep, and a checkpointed executor
        (vLLM 0.34's ``cuda_checkpoint``) refuses every call to them."""
        if getattr(getattr(self, "model_executor", None), "is_sleeping", False):
            return
        if not stream_shape(self.vllm_config.parallel_config):
            self.collective_rpc(WSD_STEP)
            return
        agreed = agree(self.collective_rpc(WSD_OFFER))
        if agreed is not None:
            self.collective_rpc(WSD_APPLY, args=(agreed,))

    def handle_client_request(original: Callable[..., Any]) -> Callable[..., Any]:
        def handle(self: Any, request_type: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(request_type, str) and request_type == WSD_STEP:
                wake = getattr(self, "_wsd_wake", None)
                if wake is not None:
                    wake.queued.clear()  # wake-ups from now on ask for another round
                try:
                    round_(self)
                except Exception:  # a failed round must not take the engine down
                    logger.exception("wsd: a round on the workers failed")
                return None
            return original(self, request_type, request, *args, **kwargs)
        return handle

    # DPEngineCoreProc's run_busy_loop is its own (no super()): wrapped likewise.
    patches.apply_points(ENGINE_CORE, {"__init__": init, "run_busy_loop": run_busy_loop,
                         "_handle_client_request": handle_client_request}, {}, core)
