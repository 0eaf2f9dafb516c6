"""The coordinator: torch-free, one per cluster.

- ``core``: ``CoordinatorCore``, every decision as plain methods, no I/O;
- ``loop``: ``Coordinator``, the socket loop that drives the core;
- ``registry``: who is registered, live, lost or stopped;
- ``admission`` and ``ratelimit``: what the agent endpoint lets in, at what cost;
- ``commandlog``: the numbered, durable command log and desired state;
- ``statefile``: the bytes of its snapshot and journal, and their durable writes;
- ``aggregate``: per-rank and per-TP-group statistics from the ranks' snapshots;
- ``pushed``: each rank's latest snapshot as its agent pushed it, and the answers built from them;
- ``snapshotcheck``: what a rank's snapshot must hold before it is aggregated;
- ``events``: the bounded event log;
- ``metrics``: the Prometheus families and endpoint;
- ``config``: the ``[coordinator]`` section.
"""
