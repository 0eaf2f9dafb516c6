"""wsd inside vLLM.

``wsd.integrations.vllm.workspace`` stands in for ``vllm.v1.worker.workspace``.
"""
