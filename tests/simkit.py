"""Simulated ranks reporting to a real coordinator, for the client and wsctl tests.

``reporting(coordinator, ranks, ...)`` starts ``wsd.agent.simulated.SimulatedRanks`` on
the coordinator's agent endpoint, waits (bounded) until every one has registered and its
first snapshot has arrived, and stops them on leaving.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from conftest import wait_until

from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.loop import Coordinator

__all__ = ["reporting"]


@contextmanager
def reporting(coordinator: Coordinator, ranks: Iterable[int], *, world_size: int, tp_size: int,
              num_ubatches: int, timeout: float = 10.0) -> Iterator[SimulatedRanks]:
    """``ranks`` simulated (heartbeat 0.2 s, lost after 3 s), each registered and with its first
    snapshot in the coordinator's hands; stopped afterwards."""
    ranks = list(ranks)
    sim = SimulatedRanks(coordinator.agent_endpoint, ranks, world_size=world_size, tp_size=tp_size,
                         num_ubatches=num_ubatches, heartbeat_interval=0.2, heartbeat_timeout=3.0).start()
    try:
        assert sim.wait_registered(timeout), f"only {sim.registered()} of {len(ranks)} ranks registered"
        latest = coordinator.core.engine().snapshots.latest
        wait_until(lambda: set(ranks) <= set(latest.ranks), timeout, "every rank's first snapshot")
        yield sim
    finally:
        sim.stop(timeout=10)
