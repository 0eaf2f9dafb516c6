"""The coordinator holds hundreds of ranks: real processes, as deployed.

``wsd coordinator`` and ``python -m wsd.agent.simulated`` (256 ranks, 8 slots each,
TP groups of 8) each in a process of their own, on loopback ports the OS
chose. The 1,024-rank, 60-second figures are the benchmark's
(``python -m bench.bench_scale``); this is the bounded check of the same
behaviour that runs with the suite.
"""

from __future__ import annotations

import time

from conftest import wait_until
from procs import (  # noqa: F401  (spawn is a fixture)
    COORDINATOR_READY,
    coordinator_section,
    python,
    spawn,
    write_config,
)

from wsd_client.client import Client
from wsd_client.rows import rank_columns

RANKS = 256
TP = 8
SLOTS = 8
# Twice the default rate, so that three timeouts fit in a few seconds and the
# coordinator sees 512 heartbeats a second, the load of 512 ranks at defaults.
INTERVAL = 0.5
TIMEOUT = 2.5


def test_hundreds_of_ranks_register_stay_live_and_answer(tmp_path, spawn):  # noqa: F811
    """256 ranks register; over three heartbeat timeouts none is lost or has to
    register again, and every rank's heartbeats keep arriving; then stats covers
    every rank and slot, complete, and a command is acknowledged by all.

    Without it, work per heartbeat that grows with the world (a walk over all
    ranks per message), pulses that stop reaching some agents, or a loop that
    falls behind would show up here as lost ranks, a partial stats answer or
    a command left pending."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        **coordinator_section(tmp_path), "world_size": RANKS, "tp_size": TP,
        "heartbeat_interval": INTERVAL, "heartbeat_timeout": TIMEOUT,
        "stats_timeout": 20.0, "command_timeout": 20.0,
    }})
    coordinator = spawn(["wsd", "coordinator", "--config", config], name="wsd coordinator")
    agents, clients = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    sim = spawn(python("-m", "wsd.agent.simulated", "--endpoint", agents, "--ranks", str(RANKS),
                       "--tp-size", str(TP), "--ubatches", str(SLOTS),
                       "--heartbeat-interval", str(INTERVAL), "--heartbeat-timeout", str(TIMEOUT)),
                name="simulated ranks")
    sim.wait_for(f"{RANKS} simulated ranks connecting", 30)
    with Client(clients, timeout=30) as client:
        wait_until(lambda: client.status()["ranks"]["live"] == RANKS, 60, f"all {RANKS} ranks to register")

        # Heartbeats only, for three timeouts: watched the whole time, not sampled at the end.
        soak_start = time.time()
        end = time.monotonic() + 3 * TIMEOUT
        while time.monotonic() < end:
            ranks = client.status()["ranks"]
            assert ranks == {"live": RANKS, "stalled": 0, "lost": 0, "stopped": 0, "missing": 0}, ranks
            time.sleep(INTERVAL)
        seen = client.ranks()["ranks"]
        assert len(seen) == RANKS
        stale = [r["rank"] for r in seen if r["state"] != "live" or r["last_seen"] < soak_start + 2 * TIMEOUT]
        assert not stale, f"ranks whose heartbeats stopped arriving: {stale[:10]}"
        events, cursor = [], 0
        while page := client.events(cursor, limit=5000)["events"]:
            events += page
            cursor = page[-1]["id"]
        hiccups = [e for e in events if e["kind"] in ("lost", "back", "superseded")]
        assert not hiccups, hiccups[:5]
        assert sum(e["kind"] == "joined" for e in events) == RANKS

        stats = wait_until(lambda: (s := client.stats())["complete"] and s, 30, "every rank's pushed snapshot")
        assert stats["missing"] == []
        assert [r["rank"] for r in stats.ranks] == list(range(RANKS))
        assert all(len(slots["capacity_bytes"]) == SLOTS for slots in rank_columns(stats).values())
        assert len(stats.groups) == RANKS // TP

        result = client.lock()
        assert result.complete, result
        assert sorted(result.steps()) == list(range(RANKS))
        wait_until(lambda: all(g["locked"] == [True] for g in client.status()["groups"]), 10,
                   "every group's heartbeats to report the lock")


def test_coordinator_raises_its_descriptor_limit_for_the_configured_world(tmp_path, spawn):  # noqa: F811
    """A coordinator configured for 1,024 ranks, started under a soft limit of 256
    descriptors, raises its own limit to hold one connection per rank. Without it
    libzmq fails to accept the connections past the limit, silently: those ranks
    would show as never registered."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        **coordinator_section(tmp_path), "world_size": 1024, "tp_size": TP}})
    coordinator = spawn(["bash", "-c", f'ulimit -Sn 256 && exec wsd coordinator --config "{config}"'],
                        name="wsd coordinator")
    coordinator.wait_for(COORDINATOR_READY, 30)
    with open(f"/proc/{coordinator.pid}/limits") as f:
        soft = next(line.split()[3] for line in f if line.startswith("Max open files"))
    assert soft == "unlimited" or int(soft) >= 1024, soft
