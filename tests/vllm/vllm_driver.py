"""A real vLLM engine (TP=2 by default, the tiny dummy model) driven line by line over stdin.

Run by tests/vllm/test_vllm_engine.py, tests/vllm/test_vllm_shapes.py and bench/bench_vllm.py
as its own process (``DRIVER_TP``: its TP size; ``DRIVER_EXECUTOR``: vLLM's executor),
because vLLM spawns its engine core and workers and wants a ``__main__`` guard.
Each command is one JSON line on stdin; each answer one line on stdout,
``RESULT <json>``. wsd joins the engine when the environment says so
(``WSD_COORDINATOR_CONNECT_ENDPOINT``), through the installed vLLM plugin:
this script never imports wsd's plugin itself.

Commands:
  {"op": "start", "wsd": bool}          build the engine, with or without wsd
  {"op": "generate", "n": N, "max_tokens": T}     greedy, token-id prompts
  {"op": "generate_async", ...}         the same, in a thread; "wait" joins it
  {"op": "rpc", "fn": NAME, "args": [...]}   a function below, on every worker
  {"op": "sleep", "level": 1} / {"op": "wake_up", "tags": [...]}   vLLM's sleep mode
  {"op": "stop"}                        shut the engine down
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

# What runs on every worker through collective_rpc, in a module of its own beside
# this script (its folder is on the path): see tests/vllm/vllm_rpc.py.
from vllm_rpc import FUNCTIONS

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "rope_theta": 10000.0,
}


def write_model(folder: str) -> str:
    """A model folder with only a config: vLLM loads it with dummy weights."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    return folder


LLM_ARGS: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                                max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
                                kv_cache_memory_bytes=64 << 20, seed=0)
"""vLLM's engine arguments for the tiny model, beside the model and its parallel layout
(shared with tests/vllm/vllm_launcher_script.py, so both build the same engine)."""


def prompts(n: int) -> list[list[int]]:
    return [[1, 5 + i, 9 + 2 * i, 13, 21 + i] for i in range(n)]


# -- the driver ---------------------------------------------------------------------


class Driver:
    def __init__(self, model: str, tp: int) -> None:
        self.model = model
        self.tp = tp
        self.llm: Any = None
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self.endpoint = os.environ.pop("WSD_COORDINATOR_CONNECT_ENDPOINT", None)

    def start(self, wsd: bool) -> dict[str, Any]:
        from vllm import LLM

        # The engine core and workers inherit this process's environment when spawned.
        if wsd and self.endpoint:
            os.environ["WSD_COORDINATOR_CONNECT_ENDPOINT"] = self.endpoint
        else:
            os.environ.pop("WSD_COORDINATOR_CONNECT_ENDPOINT", None)
        began = time.monotonic()
        # DRIVER_EXECUTOR=uni runs the engine core and its one worker in this process
        # (with VLLM_ENABLE_V1_MULTIPROCESSING=0: on CPU, vLLM forces mp otherwise).
        self.llm = LLM(model=self.model, tensor_parallel_size=self.tp,
                       distributed_executor_backend=os.environ.get("DRIVER_EXECUTOR", "mp"), **LLM_ARGS)
        return {"seconds": time.monotonic() - began}

    def generate(self, n: int = 2, max_tokens: int = 16) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        began = time.monotonic()
        # vLLM requires Python 3.11 and imports typing.NotRequired, which mypy's python_version 3.10
        # does not have: every key of vLLM's TypedDict reads as required.
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts(n)]  # type: ignore[typeddict-item]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.monotonic() - began
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return {"tokens": tokens, "seconds": seconds, "generated": sum(len(t) for t in tokens)}

    def generate_async(self, **kwargs: Any) -> dict[str, Any]:
        self.thread = threading.Thread(target=lambda: setattr(self, "result", self.generate(**kwargs)))
        self.thread.start()
        return {"started": True}

    def wait(self) -> dict[str, Any]:
        assert self.thread is not None
        self.thread.join()
        self.thread = None
        return self.result

    def rpc(self, fn: str, args: list[Any] | None = None) -> dict[str, Any]:
        return {"results": self.llm.collective_rpc(FUNCTIONS[fn], args=tuple(args or ()))}

    def sleep(self, level: int = 1) -> dict[str, Any]:
        self.llm.sleep(level=level)
        return {"asleep": True}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        self.llm.wake_up(tags=tags)
        return {"asleep": False}

    def stop(self) -> dict[str, Any]:
        began = time.monotonic()
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        return {"seconds": time.monotonic() - began}


def main() -> int:
    model = write_model(sys.argv[1])
    driver = Driver(model, int(os.environ.get("DRIVER_TP", "2")))
    print("DRIVER READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = getattr(driver, op)(**command)
        except Exception as e:  # reported to the test, which decides
            answer = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(answer), flush=True)
        if op == "stop":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
