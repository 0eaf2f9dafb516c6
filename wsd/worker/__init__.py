"""The built-in worker process, ``python -m wsd.worker``, run by torchrun.

- ``process``: its main (the torchrun environment, the agent, the loop);
- ``distributed``: the process groups and the TP groups;
- ``workload``: the built-in engine loop, a tensor-parallel MLP stack;
- ``config``: the ``[worker]`` and ``[workload]`` sections (no torch).
"""
