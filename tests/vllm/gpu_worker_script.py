"""vLLM's own GPU ``Worker`` life cycle, run on CPU with only its device-bound leaves stubbed.

Run by tests/vllm/test_vllm_gpu_worker.py as a process of its own (vLLM loads its
plugins once per process, and wsd's patches are the process's). wsd is loaded
the way vLLM loads it, by ``load_general_plugins()``, before the GPU worker's
module is imported; nothing of wsd is imported here.

What runs is vLLM 0.32's own code: ``Worker.init_device`` (its CUDA branch),
``_init_workspace_and_model_runner``, ``compile_or_warm_up_model`` (kernel
warm-up, the V2 runner's JIT warm-up calling the worker's own ``execute_model``
and ``sample_tokens``, capture), ``execute_model``, ``sample_tokens``, ``sleep``,
``wake_up`` with and without tags, ``shutdown``. What is stubbed is what needs
a GPU: torch's device calls (``gw.torch.accelerator``, a CUDA device made a CPU
one), the platform, the memory snapshot and model loader, the sleep-mode
allocator backend, ``kernel_warmup``, and the model runner (the model, its
kernels and CUDA-graph capture: its ``capture_model`` asks the workspace for
memory and ends in vLLM's own ``lock_workspace()``, as the V2 runner's does).
``warmup_kernels`` calls the two methods it is given, as vLLM's does first.

Each phase prints one ``PHASE <name> <json>`` line with what it observed; a
phase that hangs is caught by the test's timeout, with the threads' stacks
printed by ``faulthandler`` first.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_driver import LLM_ARGS, write_model


def say(phase: str, **what: Any) -> None:
    """One phase's line, with wsd's view of the engine (read only: wsd is vLLM's to load)."""
    engine = getattr(sys.modules.get("wsd.integrations.vllm.plugin"), "_engine", None)
    if engine is not None:
        what["wsd"] = {name: getattr(engine, name, None) for name in ("steps", "warm", "asleep", "inside")}
        what["wsd"]["agent"] = getattr(engine, "agent", None) is not None
    print("PHASE", phase, json.dumps(what, default=str), flush=True)


def bounded(phase: str, call: Any, timeout: float = 20.0) -> Any:
    """``call()`` on a thread of its own; its stacks and exit 3 if it has not returned in time."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as e:  # reported as the phase's failure
            result["error"] = e

    thread = threading.Thread(target=run, name=f"vllm-{phase}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        say(phase, hung=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)
    if "error" in result:
        raise result["error"]
    return result.get("value")


class Runner:
    """The model runner's device-bound part: what the worker's own code asks of it."""

    def __init__(self, events: list[str]) -> None:
        import vllm.v1.worker.workspace as ws

        self.events = events
        self.ws = ws
        self.lora_config = None
        self.is_pooling_model = False
        self.model = SimpleNamespace(named_buffers=lambda: [])

    def get_model(self) -> Any:
        return self.model

    def maybe_remove_all_loras(self, lora_config: Any) -> None:
        pass

    def needs_cudagraph_capture(self) -> bool:
        return False  # no graph-capture profiler: vLLM then captures under a null context

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        import torch

        self.events.append("runner.execute_model")
        manager = self.ws.current_workspace_manager()
        manager.get_simultaneous(((4096,), torch.uint8))  # what an attention kernel asks each step
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.events.append("runner.sample_tokens")
        return None

    def capture_model(self) -> int:
        import torch

        self.events.append("runner.capture_model")
        self.ws.current_workspace_manager().get_simultaneous(((8192,), torch.uint8))
        self.ws.lock_workspace()  # the V2 runner locks after capture (model_runner.py:1119-1121)
        return 0

    def shutdown(self) -> None:
        self.events.append("runner.shutdown")


class _Device:
    """torch as the GPU worker's module sees it: a CUDA device is this machine's CPU."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.accelerator = SimpleNamespace(set_device_index=lambda device: None, empty_cache=lambda: None,
                                           device_count=lambda: 1, synchronize=lambda: None,
                                           get_memory_info=lambda: (1 << 30, 2 << 30))

    def device(self, spec: Any, *args: Any) -> Any:
        return self._torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def main() -> int:
    faulthandler.enable()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # wsd's plugin, as every vLLM process loads it
    import torch
    import vllm.v1.worker.gpu_worker as gw
    import vllm.v1.worker.workspace as ws
    from vllm.engine.arg_utils import EngineArgs

    events: list[str] = []
    wrapped = sorted(name for name in ("init_device", "compile_or_warm_up_model", "execute_model",
                                       "sample_tokens", "sleep", "wake_up", "shutdown")
                     if getattr(getattr(gw.Worker, name), "__wsd_wrapped__", False))
    say("loaded", wrapped=wrapped, manager=ws.WorkspaceManager.__module__)

    # The device-bound leaves (set on the module as Any: they are stand-ins, not vLLM's types).
    leaves: Any = gw
    leaves.torch = _Device(torch)
    leaves.current_platform = SimpleNamespace(logical_device_id_to_visible_device_id=lambda rank: rank,
                                          check_if_supports_dtype=lambda dtype: None, dist_backend="gloo",
                                          is_cuda_alike=lambda: False, is_rocm=lambda: False, is_xpu=lambda: False,
                                          is_cpu=lambda: True)
    leaves.MemorySnapshot = lambda device: SimpleNamespace(free_memory=1 << 30, total_memory=2 << 30)
    leaves.get_model_loader = lambda load_config: SimpleNamespace(get_external_weight_memory=lambda config: 0)
    leaves.request_memory = lambda snapshot, cache_config, external: 1 << 30
    leaves.warn_if_flashinfer_kernels_missing = lambda: None
    leaves.report_usage_stats = lambda config: None
    leaves.kernel_warmup = lambda worker: events.append("kernel_warmup")

    def warmup_kernels(model_runner: Any, execute_model: Any, sample_tokens: Any) -> None:
        events.append("warmup_kernels")  # vLLM's: scheduler-realistic steps through the worker's own methods
        execute_model(SimpleNamespace(total_num_scheduled_tokens=0))
        sample_tokens(None)

    leaves.warmup_kernels = warmup_kernels

    model = write_model(os.path.join(os.environ["GPU_WORKER_TMP"], "model"))
    args = {k: v for k, v in LLM_ARGS.items() if k != "enforce_eager"}
    config = EngineArgs(model=model, enforce_eager=False, **args).create_engine_config()
    config.model_config.enforce_eager = False  # the GPU worker captures CUDA graphs
    config.kernel_config.enable_jit_warmup = True  # vLLM's default on a GPU
    worker: Any = object.__new__(gw.Worker)
    backend = SimpleNamespace(suspend=lambda level: events.append(f"suspend {level}"),
                              resume=lambda tags: events.append(f"resume {tags}"))
    configs = {name: getattr(config, name, None) for name in (
        "model_config", "cache_config", "lora_config", "load_config", "parallel_config", "scheduler_config",
        "speculative_config", "observability_config", "kv_transfer_config", "compilation_config",
        "profiler_config")}
    worker.__dict__.update(
        vllm_config=config, **configs, device_config=SimpleNamespace(device_type="cuda", device="cuda"),
        local_rank=0, rank=0, distributed_init_method=f"tcp://127.0.0.1:{os.environ['GPU_WORKER_PORT']}",
        use_v2_model_runner=True, profiler=None, _pp_send_work=[], _sleep_mode_backend=backend,
        _sleep_saved_buffers={}, _sleep_saved_draft_buffers={}, _sleep_saved_parameters={},
        elastic_ep_executor=SimpleNamespace(shutdown=lambda: None),
    )
    worker._make_model_runner = lambda: Runner(events)

    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        bounded("init_device", worker.init_device)
    manager: Any = ws.current_workspace_manager()
    say("init_device", manager=type(manager).__module__, slots=manager.num_ubatches * manager.num_lanes)

    inner: list[Any] = []
    runner_execute = Runner.execute_model

    def execute_inside_warm_up(self: Any, *args: Any) -> Any:  # what wsd made of the warm-up's own step
        engine = sys.modules["wsd.integrations.vllm.plugin"]._engine
        inner.append({"steps": engine.steps, "warm": engine.warm, "locked": manager.is_locked()})
        return runner_execute(self, *args)

    runner_class: Any = Runner
    runner_class.execute_model = execute_inside_warm_up
    bounded("warm_up", worker.compile_or_warm_up_model)
    runner_class.execute_model = runner_execute
    say("warm_up", events=events, locked=manager.is_locked(), inner=inner)
    events.clear()

    for _ in range(3):
        bounded("step", lambda: worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=1)))
        bounded("step", lambda: worker.sample_tokens(None))
    say("steps", events=events)
    events.clear()

    bounded("sleep", lambda: worker.sleep(1))
    say("sleep", events=events)
    bounded("wake_weights", lambda: worker.wake_up(["weights"]))
    say("wake_weights", events=events)
    bounded("wake", lambda: worker.wake_up(None))
    say("wake", events=events)
    events.clear()
    if os.environ.get("GPU_WORKER_HOLD"):  # the test steers the attached worker, then says go on
        say("hold")
        sys.stdin.readline()
    bounded("shutdown", worker.shutdown)
    say("shutdown", events=events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
