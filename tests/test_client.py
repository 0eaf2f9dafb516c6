"""The Python client, ``wsd_client.client.Client``: typed answers, one row shape, the events
tail, one error for every unavailability.

A real coordinator on random loopback ports (``start_coordinator``) and simulated ranks
(``wsd.agent.simulated.SimulatedRanks``) on one thread; ``wsctl.main`` in this process
where the client and ``wsctl`` must agree.
"""

from __future__ import annotations

from wsd.coordinator.events import EventKind, EventLog


def test_a_cursor_past_the_newest_event_is_the_tail():
    """Fails if asking past the newest id returns that id back (a follower would skip
    the next events) instead of the newest id, or if ``tail - n`` misses the last n."""
    log = EventLog(capacity=100)
    for rank in range(5):
        log.add(EventKind.JOINED, 0.0, rank=rank)
    assert log.since(2**63 - 1, 1) == ([], 5)
    events, cursor = log.since(5 - 2, 100)
    assert [e["rank"] for e in events] == [3, 4] and cursor == 5
    log.add(EventKind.LOST, 0.0, rank=4)
    assert [e["id"] for e in log.since(5, 100)[0]] == [6]
