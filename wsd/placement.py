"""Where a rank runs, as other monitoring names it: the labels that join wsd's series with
DCGM's, vLLM's and Kubernetes'.

An agent registers with them (in its registration's ``config``, which every
coordinator accepts), and the coordinator shows them on ``wsd_rank_info``:

- ``model_name``: what its engine serves, vLLM's label of the same name;
- ``rank_pod``, ``rank_namespace``, ``rank_node``: its Kubernetes pod, namespace
  and node, from the variables the downward API sets (``POD_NAME``,
  ``POD_NAMESPACE``, ``NODE_NAME``; the recipes in ``deploy/kubernetes`` set
  them). Not ``pod`` and ``namespace``: Prometheus gives those to every series
  it scrapes, from the coordinator's own pod;
- ``UUID``: its GPU, as DCGM's exporter and ``nvidia-smi -L`` name it
  (``GPU-...``), where its device is a CUDA one.

A module of the shared floor: no torch (the GPU's UUID is read where torch is,
``wsd.agent.thread``) and nothing of wsd's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FROM_ENV", "LABELS", "MAX_VALUE", "from_env", "labels"]

LABELS = ("model_name", "rank_pod", "rank_namespace", "rank_node", "UUID")
"""The labels ``wsd_rank_info`` adds to host, pid and device, in that order."""

FROM_ENV = {"rank_pod": "POD_NAME", "rank_namespace": "POD_NAMESPACE", "rank_node": "NODE_NAME"}
"""Each label read from the environment, and its variable (Kubernetes' downward API)."""

MAX_VALUE = 253
"""The longest value kept: a Kubernetes name (DNS subdomain) at most; a longer one is not a
name Kubernetes gave, and is left out."""


def from_env(env: Mapping[str, str]) -> dict[str, str]:
    """The labels the environment gives (``FROM_ENV``), those that are set."""
    return {label: env[name] for label, name in FROM_ENV.items() if env.get(name)}


def labels(config: Mapping[str, Any], model: str | None) -> tuple[str, ...]:
    """``LABELS``' values for a rank that registered with ``config`` and ``model``: each a
    printable string of at most ``MAX_VALUE`` characters, else empty (no such label)."""
    given = {**{k: config.get(k) for k in LABELS}, "model_name": model}
    return tuple(_value(given[k]) for k in LABELS)


def _value(value: Any) -> str:
    if isinstance(value, str) and 0 < len(value) <= MAX_VALUE and value.isprintable():
        return value
    return ""
