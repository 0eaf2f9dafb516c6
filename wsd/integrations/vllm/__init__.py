"""wsd inside vLLM: the only package of wsd that knows vLLM's internals.

- ``wsd.integrations.vllm.workspace`` stands in for ``vllm.v1.worker.workspace``
  name for name, backed by wsd's manager.
- ``register`` is the ``vllm.general_plugins`` entry point: turned on by
  ``WSD_VLLM=standalone`` or a coordinator (``WSD_COORDINATOR_CONNECT_ENDPOINT``,
  ``WSD_CONFIG``), it puts wsd's manager in every vLLM worker, with an agent
  where a coordinator is set (``plugin``), and the workers' figures in vLLM's
  ``/metrics`` (``metrics``); off, it does nothing.
- ``patches`` lists every point where wsd reaches into vLLM, with the versions
  they were checked against.

Nothing else in wsd imports this package; importing it does not import vLLM.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM's plugin entry point (``vllm.general_plugins``); see ``plugin.register``."""
    from wsd.integrations.vllm.plugin import register as install

    install()
