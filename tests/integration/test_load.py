"""Load: 32 concurrent clients against a coordinator with heartbeats flowing.

The coordinator runs as ``wsd coordinator`` (a process of its own, as in
production) with 16 simulated ranks (``python -m wsd.agent.simulated``, another
process, torch-free, speaking the real agent protocol) heartbeating every
0.2 s with a 1 s timeout. 32 threads, each with its own ``Client`` and no
retries (a lost reply would show as an error, not be hidden by a retry),
alternate ``stats`` (a fan-out to every rank) and ``status`` for a bounded
time. Latency percentiles are printed (``-s``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from conftest import one_engine, wait_until
from procs import COORDINATOR_READY, coordinator_section, python, spawn, write_config  # noqa: F401

from wsd_client.client import Client, ClientError
from wsd_client.results import Stats

CLIENTS = 32
RANKS = 16
TP_SIZE = 2
DURATION = 5.0
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 1.0
CALL_TIMEOUT = 5.0


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of already sorted values."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def hammer(endpoint: str, until: float, out: dict[str, Any]) -> None:
    """One client: stats and status in turn until ``until``; every outcome recorded."""
    latencies: dict[str, list[float]] = {"stats": [], "status": []}
    errors: list[str] = []
    incomplete = 0
    with Client(endpoint, timeout=CALL_TIMEOUT, retries=0) as client:
        turn = 0
        while time.monotonic() < until:
            op = ("stats", "status")[turn % 2]
            turn += 1
            started = time.monotonic()
            try:
                result = one_engine(client.stats()) if op == "stats" else one_engine(client.status())
            except ClientError as e:  # Unavailable included: an unanswered request
                errors.append(f"{op}: {e}")
                continue
            latencies[op].append(time.monotonic() - started)
            # A rank missing is a loss; one stale (its heartbeat late past stats_stale_after, 3
            # intervals, on a starved machine) is still there, with its age, and is not.
            if isinstance(result, Stats) and (result["missing"] or len(result.reporting) != RANKS):
                incomplete += 1
            if op == "status" and result["ranks"]["live"] != RANKS:
                incomplete += 1
    out.update(latencies=latencies, errors=errors, incomplete=incomplete)


@pytest.mark.timeout(60)
def test_32_clients_with_heartbeats_flowing_lose_no_rank_and_no_request(tmp_path, spawn):  # noqa: F811
    """Without a loop that keeps serving agents between client batches, heartbeats would
    queue behind client requests and ranks would be falsely marked lost; without a reply
    to every request (or with one dropped under load), a client would time out."""
    config = write_config(tmp_path / "wsd.toml", {"coordinator": {
        **coordinator_section(tmp_path), "world_size": RANKS, "tp_size": TP_SIZE,
        "heartbeat_interval": HEARTBEAT_INTERVAL, "heartbeat_timeout": HEARTBEAT_TIMEOUT,
        "stats_timeout": 2.0}})
    coordinator = spawn(python("-m", "wsd.programs.cli", "coordinator", "--config", config), name="wsd coordinator")
    agents, clients = coordinator.wait_for(COORDINATOR_READY, 30).groups()
    spawn(python("-m", "wsd.agent.simulated", "--endpoint", agents, "--ranks", str(RANKS), "--tp-size",
                 str(TP_SIZE), "--heartbeat-interval", str(HEARTBEAT_INTERVAL),
                 "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)), name="simulated ranks")
    with Client(clients, timeout=5) as client:
        wait_until(lambda: client.status()["ranks"]["live"] == RANKS, 30, f"{RANKS} simulated ranks live")
        cursor = client.events(limit=10_000)["cursor"]

        until = time.monotonic() + DURATION
        outcomes: list[dict[str, Any]] = [{} for _ in range(CLIENTS)]
        threads = [threading.Thread(target=hammer, args=(clients, until, outcomes[i]), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DURATION + 3 * CALL_TIMEOUT)
        assert not any(t.is_alive() for t in threads), "a client thread hung"

        errors = [e for o in outcomes for e in o["errors"]]
        latencies = {op: sorted(x for o in outcomes for x in o["latencies"][op]) for op in ("stats", "status")}
        answered = sum(len(v) for v in latencies.values())
        lines = [f"{CLIENTS} clients for {DURATION:g} s against {RANKS} simulated ranks: "
                 f"{answered} requests answered, {len(errors)} unanswered or failed"]
        for op, values in latencies.items():
            if values:
                lines.append(f"  {op:6} n={len(values):5}  p50 {percentile(values, 50) * 1000:6.1f} ms  "
                             f"p95 {percentile(values, 95) * 1000:6.1f} ms  "
                             f"p99 {percentile(values, 99) * 1000:6.1f} ms  "
                             f"max {values[-1] * 1000:6.1f} ms")
        print("\n" + "\n".join(lines))

        assert not errors, errors[:5]
        assert all(len(v) >= CLIENTS for v in latencies.values()), {k: len(v) for k, v in latencies.items()}
        assert sum(o["incomplete"] for o in outcomes) == 0, "a reply under load lacked a rank"
        after = client.events(cursor, limit=10_000)["events"]
        assert [e for e in after if e["kind"] in ("lost", "back", "superseded")] == []
        assert client.status()["ranks"] == {"live": RANKS, "stalled": 0, "lost": 0, "stopped": 0, "missing": 0}
