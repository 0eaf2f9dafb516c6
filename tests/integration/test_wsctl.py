"""``wsctl`` against the real coordinator on random loopback ports, with real in-process agents.

Every command is run through ``wsctl.main`` (its human and its ``--json``
output), and once as the installed console script with torch unimportable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import datetime

import msgpack
import pytest
import torch
import zmq
from conftest import wait_until

from wsd import WorkspaceManager, use_ubatch
from wsd.agent.thread import Agent
from wsd.fmt import format_bytes
from wsd_client import render, wsctl
from wsd_client.client import Client
from wsd_client.rows import stats_rows

KiB = 1024


@pytest.fixture
def cluster(start_coordinator):
    """``cluster(world, ranks=...)``: a coordinator expecting ``world`` ranks, agents for ``ranks``."""
    made: list[Agent] = []

    def start(world: int, ranks: tuple[int, ...] | None = None, **manager_options):
        coordinator = start_coordinator(world_size=world, tp_size=1)
        for rank in range(world) if ranks is None else ranks:
            manager = WorkspaceManager("cpu", 2, **manager_options)
            agent = Agent(manager, endpoint=coordinator.agent_endpoint, rank=rank, world_size=world, idle=True,
                          heartbeat_interval=0.2, heartbeat_timeout=1.0).start()
            made.append(agent)
            assert agent.wait_registered(10), f"rank {rank} did not register"
        started = [a.rank for a in made]
        wait_until(lambda: all(r in coordinator.core.engine().snapshots.latest.ranks for r in started), 5,
                   "every rank's first pushed snapshot")
        return coordinator, list(made)

    yield start
    for agent in made:
        agent.stop(timeout=10)


def run(capsys, endpoint: str | None, *argv: str) -> tuple[int, str, str]:
    """``wsctl argv... --endpoint endpoint``: exit code, stdout, stderr."""
    extra = ["--endpoint", endpoint] if endpoint else []
    code = wsctl.main([*argv, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, endpoint: str, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, endpoint, *argv, "--json")
    lines = out.splitlines()
    assert len(lines) == 1, f"expected one JSON document, got {out!r} (stderr {err!r})"
    return code, json.loads(lines[0])


def test_command_set_is_pinned():
    """A command added to or dropped from wsctl must be deliberate: update this list with it."""
    expected = {"status", "ranks", "stats", "events", "watch", "lock", "unlock", "set-ubatches",
                "reserve", "equalize", "trim", "ping", "engines", "keygen", "config", "completion", "stacks",
                "profiles"}
    assert set(wsctl.COMMANDS) == expected
    sub = next(a for a in wsctl._parser()._actions if isinstance(a.choices, dict))
    assert set(sub.choices) == expected


def test_ping_human_and_json(cluster, capsys):
    """Fails if ping does not reach the coordinator or its JSON keys change."""
    coordinator, _ = cluster(1)
    ep = coordinator.client_endpoint
    code, doc = run_json(capsys, ep, "ping")
    assert code == 0
    assert set(doc) == {"endpoint", "epoch", "seq", "time", "rtt_ms"}
    assert doc["epoch"] == coordinator.core.epoch and doc["endpoint"] == ep and doc["rtt_ms"] > 0
    code, out, _ = run(capsys, ep, "ping")
    assert code == 0 and out.startswith(f"pong from {ep} in ") and coordinator.core.epoch[:8] in out


def test_common_options_anywhere_and_endpoint_from_the_environment(cluster, capsys, monkeypatch):
    """Fails if options given before the command name are lost, or WSD_ENDPOINT is ignored."""
    coordinator, _ = cluster(1)
    ep = coordinator.client_endpoint
    code = wsctl.main(["--json", "--endpoint", ep, "--timeout", "3", "ping"])
    assert code == 0 and json.loads(capsys.readouterr().out)["endpoint"] == ep
    monkeypatch.setenv("WSD_ENDPOINT", ep)
    code, doc = run_json(capsys, None, "ping")
    assert code == 0 and doc["endpoint"] == ep


def test_status_and_ranks(cluster, capsys):
    """Fails if status/ranks misreport the live ranks, or their tables lose a rank."""
    coordinator, _agents = cluster(2)
    ep = coordinator.client_endpoint
    code, doc = run_json(capsys, ep, "status")
    assert code == 0
    assert doc["world_size"] == 2 and doc["ranks"] == {"live": 2, "stalled": 0, "lost": 0, "stopped": 0, "missing": 0}
    assert [(g["tp_group"], g["live"]) for g in doc["groups"]] == [(0, [0]), (1, [1])]
    code, out, _ = run(capsys, ep, "status")
    assert code == 0 and "2 live, 0 lost, 0 stopped, 0 missing" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "1", "1"]]  # group, ranks, live

    code, doc = run_json(capsys, ep, "ranks")
    assert code == 0 and doc["missing"] == []
    assert [(r["rank"], r["state"], r["pid"], r["num_ubatches"]) for r in doc["ranks"]] == [
        (0, "live", os.getpid(), 2), (1, "live", os.getpid(), 2)]
    code, out, _ = run(capsys, ep, "ranks")
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["RANK", "STATE", "GROUP"]
    assert [r.split()[:2] for r in rows] == [["0", "live"], ["1", "live"]]
    assert all(str(os.getpid()) in r for r in rows)


def test_stats_match_the_managers(cluster, capsys):
    """Fails if stats per rank and slot (JSON or table) differ from what the managers hold."""
    coordinator, (a0, a1) = cluster(2)
    ep = coordinator.client_endpoint
    with use_ubatch(1):
        a0.manager.get_simultaneous(((1000,), torch.float32))
    a1.manager.get_simultaneous(((300,), torch.float32), ((5,), torch.int8))
    code, doc = run_json(capsys, ep, "stats", "--fresh")
    assert code == 0 and doc["complete"] and doc["missing"] == []
    for agent in (a0, a1):
        (got,) = [r for r in doc["ranks"] if r["rank"] == agent.rank]
        want = agent.manager.stats()
        assert [(s["ubatch"], s["lane"], s["capacity_bytes"], s["peak_requested_bytes"])
                for s in got["slots"]] == [
            (s.ubatch, s.lane, s.capacity_bytes, s.peak_requested_bytes) for s in want.slots]
        assert got["total_bytes"] == want.total_bytes
    assert doc["total_bytes"] == 4096 + 1280 + 256  # each view rounded up to 256 bytes

    code, out, _ = run(capsys, ep, "stats", "--fresh")
    assert code == 0 and "2/2 ranks reporting" in out
    # the per-slot table: RANK UBATCH LANE CAPACITY (two words) PEAK (two words) ...
    slot_rows = {}
    for line in out.split("\n\n")[2].splitlines()[1:]:
        words = line.split()
        slot_rows[(int(words[0]), int(words[1]))] = (" ".join(words[3:5]), " ".join(words[5:7]))
    for agent in (a0, a1):
        for s in agent.manager.stats().slots:
            assert slot_rows[(agent.rank, s.ubatch)] == (
                format_bytes(s.capacity_bytes), format_bytes(s.peak_requested_bytes))

    code, doc = run_json(capsys, ep, "stats", "--group", "1", "--fresh")
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == [1] and doc["total_bytes"] == 1280 + 256


def test_state_changing_commands(cluster, capsys):
    """Fails if a command does not reach every manager, or its report (JSON or human) is wrong."""
    coordinator, agents = cluster(2)
    ep = coordinator.client_endpoint
    code, doc = run_json(capsys, ep, "lock")
    assert code == 0 and all(a.manager.is_locked() for a in agents)
    assert set(doc) == {"seq", "action", "group", "waited", "complete", "acked", "failed", "same_step",
                        "pending", "lost", "missing"}
    assert doc["seq"] == 1 and doc["action"] == "lock" and doc["complete"] and doc["waited"]
    assert sorted(a["rank"] for a in doc["acked"]) == [0, 1] and doc["same_step"] == {"0": True, "1": True}

    code, out, _ = run(capsys, ep, "unlock")
    assert code == 0 and not any(a.manager.is_locked() for a in agents)
    assert out.splitlines()[0] == ("unlock: seq 2 on all groups: applied by 2 ranks "
                                   "(group 0: same step; group 1: same step)")
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [["0", "0", "yes"], ["1", "0", "yes"]]

    code, doc = run_json(capsys, ep, "set-ubatches", "3")
    assert code == 0 and doc["complete"] and [a.manager.num_ubatches for a in agents] == [3, 3]

    code, doc = run_json(capsys, ep, "reserve", "64KiB", "--group", "1")
    assert code == 0 and doc["group"] == 1 and [a["rank"] for a in doc["acked"]] == [1]
    assert [s.capacity_bytes for s in agents[1].manager.stats().slots] == [64 * KiB] * 3
    assert agents[0].manager.stats().total_bytes == 0

    with use_ubatch(2):
        agents[0].manager.get_simultaneous(((1024,), torch.uint8))
    code, doc = run_json(capsys, ep, "equalize", "--group", "0")
    assert code == 0 and [s.capacity_bytes for s in agents[0].manager.stats().slots] == [KiB] * 3

    code, out, _ = run(capsys, ep, "trim")
    assert code == 0 and out.startswith("trim: seq 6 on all groups: applied by 2 ranks")
    assert [a.manager.stats().total_bytes for a in agents] == [0, 0]


def test_no_wait_returns_before_the_acknowledgements(cluster, capsys):
    """Fails if --no-wait waits, or its command is not applied after all."""
    coordinator, (agent,) = cluster(1)
    code, doc = run_json(capsys, coordinator.client_endpoint, "lock", "--no-wait")
    assert code == 0 and doc["waited"] is False and doc["seq"] == 1 and doc["acked"] == []
    wait_until(agent.manager.is_locked, 5, "the lock to be applied")
    code, out, _ = run(capsys, coordinator.client_endpoint, "unlock", "--no-wait")
    assert code == 0 and "not waiting for acknowledgements" in out


def test_exit_3_when_a_rank_is_missing(cluster, capsys):
    """Fails if a missing rank does not turn stats, status, ranks, watch and commands into exit 3."""
    coordinator, (agent,) = cluster(2, ranks=(0,))
    ep = coordinator.client_endpoint
    code, doc = run_json(capsys, ep, "stats")
    assert code == 3 and not doc["complete"]
    assert doc["missing"] == [{"rank": 1, "reason": "never registered"}]
    assert [r["rank"] for r in doc["ranks"]] == [0]
    code, out, _ = run(capsys, ep, "stats")
    assert code == 3 and "1/2 ranks reporting" in out and "missing: rank 1 (never registered)" in out
    assert run_json(capsys, ep, "status")[0] == 3
    code, out, _ = run(capsys, ep, "ranks")
    assert code == 3 and out.splitlines()[-1].split()[:2] == ["1", "missing"]
    code, doc = run_json(capsys, ep, "lock")
    assert code == 3 and not doc["complete"]
    assert doc["missing"] == [{"rank": 1, "reason": "never registered"}]
    assert agent.manager.is_locked()  # the rank that is there applied it
    assert run(capsys, ep, "watch", "--count", "1", "--interval", "0.1")[0] == 3
    assert run(capsys, ep, "ping")[0] == 0  # ping says nothing about ranks


def test_a_stopped_rank_is_shown_stopped_and_missing(cluster, capsys):
    """Fails if a rank whose worker stopped cleanly is not shown ``stopped`` by status and
    ranks, or does not make them exit 3 as a lost or never registered rank does."""
    coordinator, (_a0, a1) = cluster(2)
    ep = coordinator.client_endpoint
    a1.stop()
    code, doc = wait_until(lambda: (r := run_json(capsys, ep, "status"))[1]["ranks"]["stopped"] == 1 and r,
                           5, "rank 1 to be stopped")
    assert code == 3 and doc["ranks"] == {"live": 1, "stalled": 0, "lost": 0, "stopped": 1, "missing": 0}
    code, out, _ = run(capsys, ep, "status")
    assert code == 3 and "1 live, 0 lost, 1 stopped, 0 missing" in out
    assert "rank 1 (stopped (said goodbye at " in out
    code, doc = run_json(capsys, ep, "ranks")
    assert code == 3 and [(r["rank"], r["state"]) for r in doc["ranks"]] == [(0, "live"), (1, "stopped")]
    assert doc["ranks"][1]["stopped_at"] is not None
    code, out, _ = run(capsys, ep, "ranks")
    assert code == 3 and [r.split()[:2] for r in out.splitlines()[1:]] == [["0", "live"], ["1", "stopped"]]


def test_exit_1_when_the_coordinator_is_unreachable(capsys, zmq_socket):
    """Fails if an unanswered request hangs, exits otherwise than 1, or says nothing clear."""
    endpoint = zmq_socket(zmq.ROUTER, bind=True).LAST_ENDPOINT.decode()  # bound, never answers
    code, out, err = run(capsys, endpoint, "stats", "--json", "--timeout", "0.2")
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"wsctl: unavailable: no reply from {endpoint} to stats within 0.2 s")


def test_exit_1_with_the_code_on_a_coordinator_error(cluster, capsys):
    """Fails if a refusal is not one line naming its code, or leaks output on stdout."""
    coordinator, _ = cluster(1)
    ep = coordinator.client_endpoint
    assert run(capsys, ep, "lock")[0] == 0
    code, out, err = run(capsys, ep, "reserve", "64MiB", "--json")
    assert (code, out) == (1, "")
    assert err == "wsctl: conflict: reserve: TP group(s) [0] are locked; unlock first\n"
    code, _, err = run(capsys, ep, "stats", "--group", "5")
    assert code == 1 and err.startswith("wsctl: bad_field: group: no TP group 5")


def test_exit_1_when_a_rank_fails_to_apply(cluster, capsys):
    """Fails if a command some rank refused is reported as a success."""
    coordinator, _ = cluster(1, max_slot_bytes=KiB)
    code, out, err = run(capsys, coordinator.client_endpoint, "reserve", "4KiB")
    assert code == 1 and "applied by 1 rank" in out
    assert err.startswith("wsctl: reserve failed on 1 rank(s): rank 0: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["reserve", "12XB"], "argument SIZE: expected a size"),
    (["reserve"], "the following arguments are required: SIZE"),
    (["set-ubatches", "0"], "argument N: must be between 1 and 64, got 0"),
    (["set-ubatches", "two"], "argument N: expected an integer, got 'two'"),
    (["set-ubatches", "65"], "argument N: must be between 1 and 64, got 65"),
    (["stats", "--timeout", "0"], "argument --timeout: must be more than 0 and at most 3600 seconds, got 0"),
    (["watch", "--count", "0"], "argument --count: must be between 1 and 1000000000, got 0"),
    (["lock", "--group", "-1"], "argument --group: must be between 0 and 65535"),
    (["explode"], "invalid choice: 'explode'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_exit_2_on_usage_errors(capsys, argv, message):
    """Fails if bad input reaches the coordinator or the error does not name the argument."""
    code, out, err = run(capsys, None, *argv)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize("argv, message", [
    # Each was a traceback, a silent wait of centuries, or a refusal by the coordinator (exit 1).
    (["ping", "--timeout", "1e308"], "argument --timeout: must be more than 0 and at most 3600 seconds, got 1e308"),
    (["ping", "--timeout", "inf"], "argument --timeout: must be more than 0 and at most 3600 seconds, got inf"),
    (["ping", "--timeout", "nan"], "argument --timeout: must be more than 0 and at most 3600 seconds, got nan"),
    (["ping", "--timeout", "-1"], "argument --timeout: must be more than 0 and at most 3600 seconds, got -1"),
    (["ping", "--timeout", "3601"], "argument --timeout: must be more than 0 and at most 3600 seconds, got 3601"),
    (["watch", "--interval", "1e308"], "argument --interval: must be between 0.01 and 3600 seconds, got 1e308"),
    (["watch", "--interval", "nan"], "argument --interval: must be between 0.01 and 3600 seconds, got nan"),
    (["events", "-f", "--interval", "0.0001"], "argument --interval: must be between 0.01 and 3600 seconds"),
    (["watch", "--count", "99999999999999999999999"], "argument --count: must be between 1 and 1000000000"),
    (["events", "--count", "1e308"], "argument --count: expected an integer, got '1e308'"),
    (["events", "--since", "9223372036854775808"], "argument --since: must be between 0 and 9223372036854775807"),
    (["events", "--since", "-1"], "argument --since: must be between 0 and 9223372036854775807, got -1"),
    (["events", "--last", "99999999999999999999999"], "argument --last: must be between 0 and 10000000"),
    (["stats", "--group", "65536"], "argument --group: must be between 0 and 65535, got 65536"),
    (["lock", "--group", "inf"], "argument --group: expected a TP group number, got 'inf'"),
    (["reserve", "99999999999999999999999"], "argument SIZE: must be between 0 and 1125899906842624 bytes"),
    (["reserve", "1125899906842625"], "argument SIZE: must be between 0 and 1125899906842624 bytes"),
    (["set-ubatches", "99999999999999999999999"], "argument N: must be between 1 and 64"),
    (["ping", "--endpoint", "tcp://127.0.0.1:99999"], "argument --endpoint: must have a port from 1 to 65535"),
    (["ping", "--endpoint", "tcp://127.0.0.1:0"], "argument --endpoint: must have a port from 1 to 65535"),
    (["ping", "--endpoint", "tcp://*:7601"], "argument --endpoint: must name the host to connect to"),
    (["ping", "--endpoint", "127.0.0.1:7601"], "argument --endpoint: must be a ZeroMQ endpoint: tcp://HOST:PORT"),
])
def test_exit_2_on_numbers_and_endpoints_out_of_range(capsys, argv, message):
    """Fails if a non-finite, negative or absurd number, or an endpoint ZeroMQ would turn into
    another one, gets past argparse: each must be a usage error naming the option and the range."""
    code, out, err = run(capsys, None, *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_the_largest_allowed_numbers_are_accepted(capsys):
    """Fails if the bounds are off by one: these reach the network (nothing listens, so: unavailable)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        for argv in (["ping", "--timeout", "0.05"], ["stats", "--group", "65535", "--timeout", "0.05"],
                     ["events", "--since", str(2**63 - 1), "--last", "10000000", "--timeout", "0.05"]):
            code, _out, err = run(capsys, endpoint, *argv)
            assert code == 1 and err.startswith("wsctl: unavailable: no reply"), (argv, err)


def test_a_bad_endpoint_in_the_environment_is_a_usage_error(capsys, monkeypatch):
    """Fails if WSD_ENDPOINT=tcp://127.0.0.1:99999 is tried (and times out, exit 1) instead of refused."""
    monkeypatch.setenv("WSD_ENDPOINT", "tcp://127.0.0.1:99999")
    code, out, err = run(capsys, None, "ping")
    assert (code, out) == (2, "")
    assert err == "wsctl: environment variable WSD_ENDPOINT must have a port from 1 to 65535, " \
                  "got 'tcp://127.0.0.1:99999'\n"


def test_events_human_and_json(cluster, capsys):
    """Fails if events are lost, --since/--last select wrongly, or the lines drop details."""
    coordinator, (agent,) = cluster(1)
    ep = coordinator.client_endpoint
    agent.manager.lock()
    with pytest.raises(AssertionError):
        agent.manager.get_simultaneous(((64,), torch.float32))

    def violation():
        events = run_json(capsys, ep, "events", "--last", "100")[1]["events"]
        return [e for e in events if e["kind"] == "lock_violation"]

    (event,) = wait_until(violation, 5, "the lock violation event")
    assert event["rank"] == 0 and event["requested"] == 256
    assert event["caller"].endswith("test_events_human_and_json")
    code, doc = run_json(capsys, ep, "events")
    assert code == 0 and set(doc) == {"events", "cursor"}
    assert [e["kind"] for e in doc["events"]] == ["started", "joined", "lock_violation"]
    assert doc["cursor"] == doc["events"][-1]["id"]
    code, doc = run_json(capsys, ep, "events", "--since", "1")
    assert [e["id"] for e in doc["events"]] == [2, 3]
    code, doc = run_json(capsys, ep, "events", "--last", "1")
    assert [e["kind"] for e in doc["events"]] == ["lock_violation"]
    code, out, _ = run(capsys, ep, "events")
    header, *lines = out.splitlines()
    assert header.split() == ["ID", "TIME", "KIND", "DETAIL"]
    assert [line.split()[0] for line in lines] == ["1", "2", "3"]
    assert "lock_violation" in lines[2] and "requested=256 B" in lines[2] and "capacity=0 B" in lines[2]
    assert f"caller={event['caller']}" in lines[2]


def test_a_command_from_wsctl_is_logged_with_the_user_and_host_it_ran_as(cluster, capsys):
    import getpass
    import socket

    coordinator, _ = cluster(1)
    ep = coordinator.client_endpoint
    assert run(capsys, ep, "lock")[0] == 0
    (event,) = [e for e in run_json(capsys, ep, "events")[1]["events"] if e["kind"] == "command"]
    assert event["by"] == {"user": getpass.getuser(), "host": socket.gethostname()}
    (line,) = [x for x in run(capsys, ep, "events")[1].splitlines() if " command " in x]
    assert f"by={getpass.getuser()}@{socket.gethostname()}" in line


def test_events_follow_prints_new_events_until_count(cluster, capsys):
    """Fails if --follow does not pick up events that happen after it started, or ignores --count."""
    coordinator, _ = cluster(1)
    ep = coordinator.client_endpoint
    with Client(ep, timeout=5) as client:
        cursor = client.events()["cursor"]
        # Count the follower's event polls, to act only once it is following.
        polls: list[str] = []
        handle = coordinator.core.handle_client

        def counting(route, frame, role=None, key=None):
            polls.append(msgpack.unpackb(frame)["op"])
            return handle(route, frame, role, key)

        coordinator.core.handle_client = counting
        codes: list[int] = []
        follower = threading.Thread(target=lambda: codes.append(wsctl.main(
            ["events", "--follow", "--since", str(cursor), "--count", "2", "--interval", "0.05",
             "--json", "--endpoint", ep])), daemon=True)
        follower.start()
        try:
            wait_until(lambda: polls.count("events") >= 2, 5, "the follower to poll with nothing new")
            client.lock()  # two new events: command, command_applied
        finally:
            follower.join(timeout=10)
    assert not follower.is_alive(), "events --follow --count 2 did not stop"
    out = capsys.readouterr().out
    docs = [json.loads(line) for line in out.splitlines()]
    assert codes == [0]
    assert [(d["kind"], d["seq"]) for d in docs] == [("command", 1), ("command_applied", 1)]
    assert all(d["id"] > cursor for d in docs)


def test_watch_rounds_show_every_rank_and_slot(cluster, capsys):
    """Fails if watch does not stop after --count rounds, or a frame misses a rank's slot or its sizes."""
    coordinator, agents = cluster(2)
    ep = coordinator.client_endpoint
    with use_ubatch(1):
        agents[1].manager.get_simultaneous(((2048,), torch.uint8))
    code, out, _ = run(capsys, ep, "watch", "--count", "2", "--interval", "0.1", "--fresh")
    assert code == 0
    frames = out.split("\n\n")
    assert len(frames) == 2
    for number, frame in enumerate(frames, 1):
        header, columns, *rows = frame.splitlines()
        assert f"round {number}/2 every 0.1 s" in header
        assert columns.split()[:8] == ["RANK", "GROUP", "AGE", "UBATCH", "LANE", "LOCKED", "CAPACITY", "PEAK"]
        cells = {(int(r.split()[0]), int(r.split()[3])): r.split()[6:10] for r in rows}
        assert cells == {(0, 0): ["0", "B", "0", "B"], (0, 1): ["0", "B", "0", "B"],
                         (1, 0): ["0", "B", "0", "B"], (1, 1): ["2.0", "KiB", "2.0", "KiB"]}
    code, out, _ = run(capsys, ep, "watch", "--count", "2", "--interval", "0.1", "--json", "--fresh")
    docs = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(docs) == 2
    times = [datetime.fromisoformat(d["time"]) for d in docs]  # ISO 8601, with the zone's offset
    assert all(at.utcoffset() is not None for at in times) and times[0] < times[1]
    assert all(d["ranks"][1]["slots"][1]["capacity_bytes"] == 2048 for d in docs)


def test_watch_frame_shows_growth_since_the_last_round(cluster):
    """Fails if a slot that grew between two rounds is not marked with how much."""
    coordinator, (agent,) = cluster(1)
    with Client(coordinator.client_endpoint, timeout=5) as client:
        before = stats_rows(client.stats(fresh=True))
        with use_ubatch(1):
            agent.manager.get_simultaneous(((4096,), torch.uint8))
        after = stats_rows(client.stats(fresh=True))
    rows = {int(r.split()[3]): r for r in render.watch(after, before, "h").splitlines()[2:]}
    assert "+4.0 KiB" in rows[1] and "+" not in rows[0]


def test_installed_wsctl_runs_without_torch(cluster, tmp_path):
    """Fails if the wsctl console script imports torch, or cannot drive a coordinator without it."""
    coordinator, agents = cluster(2)
    blocker = tmp_path / "no_torch"
    blocker.mkdir()
    # Runs at interpreter start-up: from then on any 'import torch' raises ImportError.
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "WSD_ENDPOINT": coordinator.client_endpoint}
    proof = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert proof.returncode != 0 and "import of torch halted" in proof.stderr  # really blocked

    def wsctl_(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["wsctl", *argv, "--json"], env=env, capture_output=True, text=True,
                              timeout=60)

    locked = wsctl_("lock")
    assert locked.returncode == 0, locked.stderr
    assert json.loads(locked.stdout)["complete"] and all(a.manager.is_locked() for a in agents)
    stats = wsctl_("stats")
    assert stats.returncode == 0, stats.stderr
    doc = json.loads(stats.stdout)
    assert [(r["rank"], r["locked"]) for r in doc["ranks"]] == [(0, True), (1, True)]
