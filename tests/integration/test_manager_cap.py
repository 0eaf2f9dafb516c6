"""An operator's growth under a capped device allocator (vLLM 0.34's extensible KV cache).

vLLM caps torch's caching allocator after warm-up; an operator's ``reserve``,
``equalize``, ``set-ubatches`` or ``presize`` that would grow the workspace beyond
what torch may still reserve under that cap is refused before it allocates, naming
both figures, and ``stats`` shows them. A CPU has no such cap: here the cap is the
manager's ``Buffers.cap`` set by hand (``tests/gpu/test_cuda_memory.py`` caps a real
CUDA allocator).
"""

from __future__ import annotations

import pytest
import torch
from conftest import wait_until

from wsd import WorkspaceManager, use_ubatch
from wsd.agent.thread import Agent
from wsd.errors import WorkspaceHeadroomError
from wsd.manager.allocator import AllocatorCap, Cap
from wsd.slotstats import ManagerStats
from wsd_client.client import Client
from wsd_client.render import stats as render_stats

MiB = 1 << 20


def capped(manager: WorkspaceManager, cap: int, headroom: int) -> WorkspaceManager:
    manager._buffers.cap = lambda: AllocatorCap(cap, headroom)
    return manager


def capacities(manager: WorkspaceManager) -> list[int]:
    return [s.capacity_bytes for s in manager.stats().slots]


def test_a_cpu_has_no_allocator_cap_and_its_stats_say_none():
    manager = WorkspaceManager("cpu", 2)
    assert Cap(torch.device("cpu"))() is None
    stats = manager.stats()
    assert stats.allocator_cap_bytes is None and "allocator_cap_bytes" not in stats.to_wire()
    manager.reserve_bytes(64 * MiB)  # nothing to refuse it
    assert capacities(manager) == [64 * MiB] * 2


@pytest.mark.parametrize("command", ["reserve", "equalize", "set_num_ubatches", "presize"])
def test_growth_beyond_the_headroom_is_refused_before_anything_is_allocated(command):
    """Two slots of 1 MiB, 3 MiB left under the cap: growing both to 4 MiB (6 MiB more) is
    refused naming both figures, and no slot changed; growth within the headroom applies."""
    manager = capped(WorkspaceManager("cpu", 2), cap=80 * MiB, headroom=3 * MiB)
    for ubatch in range(2):
        with use_ubatch(ubatch):
            manager.get_simultaneous(((MiB,), torch.uint8))
    if command == "equalize":
        manager._buffers.cap = lambda: None
        manager.reserve_bytes(MiB)
        with use_ubatch(0):
            manager.get_simultaneous(((7 * MiB,), torch.uint8))  # one slot of 7: equalize grows the other by 6
        capped(manager, 80 * MiB, 3 * MiB)
    before = capacities(manager)
    run = {"reserve": lambda: manager.reserve_bytes(4 * MiB),
           "equalize": manager.equalize,
           "set_num_ubatches": lambda: (manager.lock(), manager.set_num_ubatches(8)),  # 6 new slots of 1 MiB
           "presize": lambda: manager.presize([(0, 0, 4 * MiB), (1, 0, 4 * MiB)])}[command]
    with pytest.raises(WorkspaceHeadroomError) as refused:
        run()
    assert f"{6 * MiB} bytes" in str(refused.value) and f"only {3 * MiB} more" in str(refused.value)
    assert f"cap of {80 * MiB}" in str(refused.value) and str(refused.value).startswith(command)
    assert capacities(manager) == before, "something was allocated before the refusal"
    capped(manager, 80 * MiB, 6 * MiB)
    manager.unlock()
    run()
    assert sum(capacities(manager)) == sum(before) + 6 * MiB


def test_stats_carry_the_cap_and_headroom_to_the_coordinator_and_wsctl(start_coordinator):
    """Through a real coordinator: a rank's stats show its allocator's cap and headroom, the
    table shows them beside its slots, and a refused reserve's acknowledgement names both."""
    coordinator = start_coordinator()
    manager = capped(WorkspaceManager("cpu", 2), cap=80 * MiB, headroom=5 * MiB)
    wire = manager.stats().to_wire()
    assert (wire["allocator_cap_bytes"], wire["allocator_headroom_bytes"]) == (80 * MiB, 5 * MiB)
    assert ManagerStats.from_wire(wire) == manager.stats()
    agent = Agent(manager, endpoint=coordinator.agent_endpoint, rank=0, world_size=1, idle=True,
                  heartbeat_interval=0.2, heartbeat_timeout=5.0).start()  # idle: it applies on its own thread
    try:
        assert agent.wait_registered(10)
        with Client(coordinator.client_endpoint, timeout=5) as client:
            def reported() -> dict | None:
                doc = client.stats(fresh=True).rows()  # as wsctl stats --json prints it
                return doc if doc["ranks"] else None

            doc = wait_until(reported, 10, "the rank's stats")
            (rank,) = doc["ranks"]
            assert (rank["allocator_cap_bytes"], rank["allocator_headroom_bytes"]) == (80 * MiB, 5 * MiB)
            table = render_stats(doc, width=200)
            assert "ALLOCATOR CAP" in table and "HEADROOM" in table, table
            answer = client.reserve_bytes(4 * MiB, timeout=10)
            (ack,) = answer.acked
            assert not ack["ok"] and "WorkspaceHeadroomError" in ack["error"], answer
            assert f"only {5 * MiB} more bytes under its cap of {80 * MiB}" in ack["error"], ack
        assert capacities(manager) == [0, 0]
    finally:
        agent.stop()
