"""The package's modules by side: those that may import torch, and every other one.

Shared by the unit tier's torch-free import check and the packaging tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import wsd

__all__ = ["TORCH_FREE", "TORCH_SIDE", "WSD_MODULES", "run"]

# The torch side: the only modules that may import torch. Every other module
# of the package (the coordinator and wire subpackages whole, every
# configuration section, the snapshots, the agent's protocol logic, the
# simulated ranks, the launchers) must import without it, and so must the clients.
TORCH_SIDE = {"wsd.manager.core", "wsd.manager.slots", "wsd.manager.demo", "wsd.manager.buffers",
              "wsd.manager.allocator", "wsd.manager.refusals", "wsd.manager.persistent",
              "wsd.manager.operator_commands",
              "wsd.agent.thread", "wsd.worker.__main__",
              "wsd.programs.worker", "wsd.worker.distributed", "wsd.agent.collectives",
              "wsd.worker.workload", "wsd.integrations.vllm.plugin", "wsd.integrations.vllm.workspace"}


def _modules(package: str, root: str) -> list[str]:
    names = (".".join((package, *p.relative_to(root).with_suffix("").parts)) for p in Path(root).rglob("*.py"))
    return sorted(name.removesuffix(".__init__") for name in names)


WSD_MODULES = _modules("wsd", wsd.__path__[0])
TORCH_FREE = [m for m in WSD_MODULES if m not in TORCH_SIDE] + ["wsd_client", "wsd_client.client",
                                                                  "wsd_client.wsctl", "wsd_client.render"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
