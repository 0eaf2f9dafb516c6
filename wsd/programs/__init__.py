"""The process tops: each module is the main of a program wsd runs, and may import anything below.

- ``cli``: ``wsd`` (the console script), its subcommands;
- ``up``: ``wsd up``, a coordinator and ``torchrun`` workers on this machine;
- ``coordinator``: the coordinator's process, started, served and stopped (``wsd coordinator``,
  the worker's embedded mode, ``wsd up``);
- ``torchrun``: ``torchrun`` as ``wsd up`` runs it, one line per failed rank;
- ``worker``: a worker's main (``python -m wsd.worker``): the built-in engine, its manager and agent.

Nothing below imports these (``tests/layers.py``).
"""
