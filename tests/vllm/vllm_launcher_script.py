"""One rank of a vLLM engine under torchrun (``distributed_executor_backend="external_launcher"``).

Run by tests/vllm/test_vllm_launcher.py as

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/vllm/vllm_launcher_script.py MODEL_DIR GOFILE

Every torchrun rank builds the same engine (TP=2 on the tiny dummy model of
``vllm_driver``), generates once and prints ``FIRST <rank> <tokens>``, then
waits (bounded) for GOFILE to exist: the test issues a command meanwhile. An
idle engine under an external launcher has no engine core to wake, so the
command applies at the next step boundary: the second generation, printed as
``TOKENS <rank> <tokens>``. wsd joins through the installed plugin when
``WSD_COORDINATOR_CONNECT_ENDPOINT`` is set; this script never imports it.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_driver import LLM_ARGS, prompts, write_model

GO_TIMEOUT = 120.0
"""Seconds to wait for GOFILE before giving up (the test creates it within seconds)."""


def wait_for_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)


def say(line: str) -> None:
    """One line in one write: both ranks share torchrun's stdout, and a write under
    PIPE_BUF bytes is never interleaved with the other rank's (print's may be)."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(argv: list[str]) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, gofile = argv
    rank = int(os.environ["RANK"])  # torchrun sets it; a missing one is an error
    model = write_model(model_dir)
    llm = LLM(model=model, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              **LLM_ARGS)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # vLLM requires Python 3.11 and imports typing.NotRequired, which mypy's python_version 3.10
    # does not have: every key of vLLM's TypedDict reads as required.
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts(2)]  # type: ignore[typeddict-item]

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]

    try:
        say(f"FIRST {rank} {json.dumps(generate())}")
        wait_for_file(gofile, GO_TIMEOUT)
        say(f"TOKENS {rank} {json.dumps(generate())}")
    finally:
        # The in-process engine core shuts its worker down (the plugin says goodbye)
        # before torchrun reaps us.
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
