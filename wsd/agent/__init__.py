"""The agent: one rank's side of the coordinator's protocol.

- ``core``: ``AgentCore``, the protocol logic, with no sockets, threads or torch;
- ``push``: ``StatsPush``, when the rank's snapshot is pushed and what the coordinator holds;
- ``thread``: ``Agent``, its I/O thread beside a real manager, and ``step()``,
  where the ranks of a TP group agree on the commands to apply (torch);
- ``collectives``: small msgpack collectives over gloo, by which the ranks of a TP
  group agree (the worker's start-up uses them too), and ``tp_groups``, which
  builds a TP group and its gloo twin together;
- ``simulated``: many torch-free ranks on the same logic, for scale tests and
  benchmarks (``python -m wsd.agent.simulated``);
- ``config``: the ``[agent]`` section.
"""
