"""Two engines on one real coordinator: simulated ranks over real ZeroMQ sockets on loopback,
steered and read with wsctl (in process) and the Python client, scraped over real HTTP.

Ranks 0..3 of two engines are all live; a command for one engine reaches only its ranks;
naming none, every engine answers for itself; the metrics carry each rank's engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest import coordinator_config, wait_until
from test_metrics import by, scrape

from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.loop import Coordinator
from wsd_client import wsctl
from wsd_client.client import Client
from wsd_client.results import PerEngine, by_engine


@pytest.fixture
def fleet(tmp_path) -> Iterator[tuple[Coordinator, dict[str, SimulatedRanks]]]:
    coordinator = Coordinator(coordinator_config(tmp_path, metrics_port=0, metrics_refresh=0.2)).start()
    engines: dict[str, SimulatedRanks] = {}
    try:
        for name, tp in (("replica-a", 2), ("replica-b", 1)):
            engines[name] = SimulatedRanks(coordinator.agent_endpoint, range(4), world_size=4, tp_size=tp,
                                           num_ubatches=2, heartbeat_interval=0.2, heartbeat_timeout=3.0,
                                           engine=name).start()
        for name, sim in engines.items():
            assert sim.wait_registered(10.0), f"{name}: only {sim.registered()} of 4 ranks registered"
        yield coordinator, engines
    finally:
        for sim in engines.values():
            sim.stop(timeout=10)
        coordinator.stop()


def run(capsys, *argv: str) -> tuple[int, list[dict]]:
    code = wsctl.main([*argv, "--json", "--timeout", "10"])
    out = capsys.readouterr().out
    return code, [json.loads(line) for line in out.splitlines()]


def test_two_engines_of_the_same_ranks_are_both_live_and_listed(fleet, capsys):
    coordinator, _ = fleet
    endpoint = coordinator.client_endpoint
    code, [listed] = run(capsys, "engines", "--endpoint", endpoint)
    assert code == wsctl.Exit.OK
    rows = {e["engine"]: e for e in listed["engines"]}
    assert rows["replica-a"]["live"] == 4 and rows["replica-a"]["tp_size"] == 2
    assert rows["replica-b"]["live"] == 4 and rows["replica-b"]["tp_size"] == 1
    code, docs = run(capsys, "ranks", "--endpoint", endpoint)
    assert code == wsctl.Exit.OK and len(docs) == 2  # one document per engine
    for doc in docs:
        assert len({r["engine"] for r in doc["ranks"]}) == 1 and sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2, 3]
    code, [one] = run(capsys, "ranks", "--engine", "replica-b", "--endpoint", endpoint)
    assert {r["engine"] for r in one["ranks"]} == {"replica-b"}


def test_a_lock_for_one_engine_locks_only_its_ranks(fleet, capsys):
    coordinator, engines = fleet
    code, [result] = run(capsys, "lock", "--engine", "replica-a", "--endpoint", coordinator.client_endpoint)
    assert code == wsctl.Exit.OK and result["complete"] and len(result["acked"]) == 4
    assert all(m.locked for m in engines["replica-a"].managers)
    assert not any(m.locked for m in engines["replica-b"].managers)
    with Client(coordinator.client_endpoint, timeout=10.0) as client:
        status = client.status(engine="replica-b")
        assert not isinstance(status, PerEngine) and status.engine == "replica-b" and status.desired["locked"] is None
        both = client.unlock()  # naming none: every engine numbers its own
        assert isinstance(both, PerEngine) and sorted(both) == ["replica-a", "replica-b"]
        assert all(r.complete for r in by_engine(both).values())
        assert both["replica-a"].seq == 2 and both["replica-b"].seq == 1
    assert not any(m.locked for sim in engines.values() for m in sim.managers)


def test_the_scrape_names_each_ranks_engine(fleet):
    coordinator, _ = fleet
    url = coordinator.metrics_url
    assert url is not None
    samples = wait_until(lambda: (s := scrape(url)) and len(by(s, "wsd_rank_workspace_bytes", "engine", "rank")) == 8
                         and s, 15, "both engines' ranks in the scrape")
    up = by(samples, "wsd_rank_up", "engine", "rank", "tp_group")
    assert up[("replica-a", "3", "1")] == 1 and up[("replica-b", "3", "3")] == 1
    assert by(samples, "wsd_ranks", "engine", "state")[("replica-b", "live")] == 4
