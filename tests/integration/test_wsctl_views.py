"""``wsctl stats`` and ``watch`` at scale: filters, one line per TP group, output fitted to the terminal.

A real coordinator on random loopback ports expecting 72 ranks in TP groups of 8,
64 of them simulated (``SimulatedRanks``, 8 slots each: 512 slot rows; group 8
never registers), driven through ``wsctl.main``, and once through the installed
console script in a real pseudo-terminal 80 columns wide.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import termios
import time

import pytest
from conftest import wait_until
from simkit import reporting

from wsd_client import render, wsctl
from wsd_client.client import Client
from wsd_client.select import Selection

WORLD, SIMULATED, TP, SLOTS = 72, 64, 8, 8


@pytest.fixture
def cluster(start_coordinator):
    coordinator = start_coordinator(world_size=WORLD, tp_size=TP)
    with reporting(coordinator, range(SIMULATED), world_size=WORLD, tp_size=TP, num_ubatches=SLOTS):
        yield coordinator


def run(capsys, endpoint: str, *argv: str) -> tuple[int, str, str]:
    code = wsctl.main([*argv, "--endpoint", endpoint])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, endpoint: str, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, endpoint, *argv, "--json")
    assert out.count("\n") == 1, (out, err)
    return code, json.loads(out)


def test_a_large_cluster_is_one_line_per_group_unless_asked_for_every_slot(cluster, capsys):
    """Fails if 512 slot rows are printed one by one by default, if the summary misses a
    group or misreports one, or if --by-slot and --by-group are not obeyed."""
    ep = cluster.client_endpoint
    code, out, _ = run(capsys, ep, "stats")
    assert code == 3  # group 8 never registered
    lines = out.splitlines()
    assert lines[0].startswith(f"{SIMULATED}/{WORLD} ranks reporting")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["GROUP", "RANKS"])
    rows = [line.split() for line in lines[header + 1:header + 1 + WORLD // TP]]
    assert [r[:3] for r in rows] == [[str(g), f"{g * TP}-{g * TP + TP - 1}", "8/8" if g < 8 else "0/8"]
                                     for g in range(WORLD // TP)]
    assert rows[8][3] == "64-71"  # MISSING
    assert "one line per TP group above 256" in out and "--by-slot" in out
    assert lines[-1] == "missing: ranks 64-71 (never registered)"

    code, out, _ = run(capsys, ep, "stats", "--by-slot")
    slot_table = out.split("\n\n")[2].splitlines()
    assert slot_table[0].split()[:2] == ["RANK", "UBATCH"] and len(slot_table) == 1 + SIMULATED * SLOTS
    code, out, _ = run(capsys, ep, "stats", "--by-group", "--rank", "0-3")  # few rows, still grouped
    assert "RANK  UBATCH" not in out and [line.split()[0] for line in out.splitlines()[3:4]] == ["0"]
    code, out, _ = run(capsys, ep, "watch", "--count", "1")
    assert "GROUP  RANKS" in out and "RANK  GROUP  AGE" not in out
    code, out, _ = run(capsys, ep, "watch", "--count", "1", "--group", "1")  # 64 slot rows: every slot
    assert len([line for line in out.splitlines() if line.split()[:1] in ([str(r)] for r in range(8, 16))]) == 64


def test_rank_group_and_state_select_what_is_shown(cluster, capsys):
    """Fails if --rank, --group (one or several) or --state keep a rank they do not select or
    drop one they do, in the JSON or the table, or if the exit code ignores the selection."""
    ep = cluster.client_endpoint
    code, out, _ = run(capsys, ep, "stats", "--rank", "0-3,17")
    assert code == 0 and out.splitlines()[0] == "5/5 ranks reporting, total 2.5 GiB, selected: ranks 0-3,17"
    code, doc = run_json(capsys, ep, "stats", "--rank", "0-3,17")
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3, 17] and doc["missing"] == []
    assert [g["tp_group"] for g in doc["groups"]] == [0, 2]
    assert doc["selection"] == {"ranks": [0, 1, 2, 3, 17], "groups": None, "states": []}
    assert all(len(r["slots"]) == SLOTS for r in doc["ranks"])  # a rank's slots are never cut
    code, doc = run_json(capsys, ep, "stats", "--group", "2,5")
    assert [r["rank"] for r in doc["ranks"]] == [*range(16, 24), *range(40, 48)]
    code, doc = run_json(capsys, ep, "stats", "--group", "3")  # one group: asked of the coordinator
    assert code == 0 and {r["tp_group"] for r in doc["ranks"]} == {3} and "selection" not in doc

    with Client(ep, timeout=5) as client:
        assert client.lock(group=1).complete
    code, doc = run_json(capsys, ep, "stats", "--state", "locked")
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == list(range(8, 16))
    code, doc = run_json(capsys, ep, "stats", "--state", "missing,locked", "--rank", "12-70")
    assert code == 3 and [r["rank"] for r in doc["ranks"]] == [12, 13, 14, 15]
    assert [m["rank"] for m in doc["missing"]] == [64, 65, 66, 67, 68, 69, 70]
    code, out, _ = run(capsys, ep, "stats", "--state", "unlocked", "--group", "1,2,8")
    assert code == 0 and "missing" not in out  # group 8's ranks are missing, not unlocked
    assert out.splitlines()[0].startswith("8/8 ranks reporting")
    assert "selected: groups 1,2,8 state unlocked" in out.splitlines()[0]
    assert sorted({int(line.split()[0]) for line in out.split("\n\n")[2].splitlines()[1:]}) == list(range(16, 24))


def test_state_missing_is_never_registered_and_absent_is_every_rank_not_reporting(start_coordinator, capsys):
    """Fails if --state missing keeps a rank that registered and then stopped (the rank state
    missing means never registered, as in ``ranks`` and ``status``), or if --state absent
    does not keep every expected rank absent from the answer. World of 4: ranks 0-1 report,
    rank 2 registered and fell silent (lost, after the coordinator's 1 s heartbeat timeout),
    rank 3 never registered."""
    coordinator = start_coordinator(world_size=4, tp_size=2)
    ep = coordinator.client_endpoint
    with reporting(coordinator, [2], world_size=4, tp_size=2, num_ubatches=1):
        pass  # registered, reported, then silent
    with Client(ep, timeout=5) as client:
        wait_until(lambda: [r.state for r in client.ranks().ranks] == ["lost"], 10, "rank 2 lost")
    with reporting(coordinator, [0, 1], world_size=4, tp_size=2, num_ubatches=1):
        code, doc = run_json(capsys, ep, "stats", "--state", "missing")
        assert code == 3 and doc["ranks"] == [] and doc["missing"] == [{"rank": 3, "reason": "never registered"}]
        assert [g["tp_group"] for g in doc["groups"]] == [1]
        code, doc = run_json(capsys, ep, "stats", "--state", "absent")
        assert code == 3 and doc["ranks"] == [] and [m["rank"] for m in doc["missing"]] == [2, 3]
        assert doc["missing"][0]["reason"].startswith("lost at")
        code, doc = run_json(capsys, ep, "stats", "--state", "missing", "--group", "0,1", "--rank", "0-2")
        assert code == 0 and doc["missing"] == []  # rank 2 lost: absent, not missing
        code, out, _ = run(capsys, ep, "stats", "--state", "missing")
        assert code == 3 and out.splitlines()[-1] == "missing: rank 3 (never registered)"


def test_selection_of_stale_ranks_and_violations():
    """Fails if --state stale or violations keeps a rank that is not, on an answer whose
    flags are set here (a stale rank takes seconds of silence to make for real)."""
    ranks = [{"rank": r, "tp_group": 0, "stale": r == 1, "locked": True, "lock_violations": 3 * (r == 2),
              "slots": []} for r in range(3)]
    doc = {"ranks": ranks, "missing": [], "stale": [1], "complete": False,
           "groups": [{"tp_group": 0, "ranks": [0, 1, 2]}]}
    assert [r["rank"] for r in Selection(states=frozenset({"stale"})).apply(doc)["ranks"]] == [1]
    picked = Selection(states=frozenset({"violations"})).apply(doc)
    assert [r["rank"] for r in picked["ranks"]] == [2] and picked["stale"] == []


def test_tables_fit_the_width_by_leaving_columns_out(cluster, capsys):
    """Fails if a table wraps at 80 columns (a line longer than the width) where columns could
    give way, drops one of the columns that must stay, or leaves columns out silently."""
    ep = cluster.client_endpoint
    with Client(ep, timeout=5) as client:
        doc = client.stats().rows()
        status, ranks = client.status().doc, client.ranks().doc
    wide = render.stats(doc, grouped=False)
    assert max(map(len, wide.splitlines())) > 80  # the check below has something to do
    for text in (render.stats(doc, 80, grouped=False), render.stats(doc, 80),
                 render.watch(doc, doc, f"wsctl watch {ep}  2026-12-03T08:47:12.031+00:00  round 1/2 every 1 s", 80,
                              grouped=False),
                 render.watch(doc, doc, "h", 80, grouped=True), render.status(status, ep, 80),
                 render.ranks(ranks, 80)):
        assert max(map(len, text.splitlines())) <= 80, text
    fitted = render.stats(doc, 80, grouped=False)
    slot_table = fitted.split("\n\n")[2].splitlines()
    kept = slot_table[0]
    assert all(h in kept for h in ("RANK", "UBATCH", "CAPACITY", "PEAK", "VIOLATIONS"))
    assert "PERSISTENT" not in kept and slot_table[-1].startswith("(") and "PERSISTENT" in slot_table[-1]
    assert len(slot_table) == 2 + SIMULATED * SLOTS  # header, every row, the note


def _pty_run(argv: list[str], columns: int, env: dict[str, str], timeout: float = 30) -> str:
    """The installed ``wsctl argv`` with its stdout on a pseudo-terminal ``columns`` wide."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(["wsctl", *argv], stdout=follower, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None  # a pipe: stderr=PIPE
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: the command is done
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) in (0, 3), proc.stderr.read()
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_on_an_80_column_terminal_tables_fit_and_json_is_whole(cluster):
    """Fails if wsctl on a real 80-column terminal wraps its table, or cuts its JSON."""
    env = {**os.environ, "WSD_ENDPOINT": cluster.client_endpoint}
    text = _pty_run(["stats", "--by-slot", "--rank", "0-1"], 80, env)
    assert text.startswith("2/2 ranks reporting") and max(map(len, text.splitlines())) <= 80, text
    assert "left out to fit 80 columns" in text
    doc = json.loads(_pty_run(["stats", "--json"], 80, env))
    assert len(doc["ranks"]) == SIMULATED and all(len(r["slots"]) == SLOTS for r in doc["ranks"])


@pytest.mark.parametrize("argv, message", [
    (["stats", "--rank", "5-2"], "argument --rank: a range must not go down, got '5-2'"),
    (["stats", "--rank", "x"], "argument --rank: expected ranks and ranges such as 0-3,8, got 'x'"),
    (["watch", "--group", "0,65536"], "argument --group: must be between 0 and 65535, got 65536"),
    (["stats", "--state", "sleepy"],
     "argument --state: must be among missing, absent, stale, locked, unlocked, violations"),
    (["stats", "--by-group", "--by-slot"], "argument --by-slot: not allowed with argument --by-group"),
])
def test_bad_selections_are_usage_errors(capsys, argv, message):
    code = wsctl.main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and message in err


def test_a_cut_caller_keeps_its_file_name_line_and_function():
    """Cut from the left, a violation's caller lost its file name; cut in the middle, the
    folders go first, then the two ends share what is left."""
    from wsd_client.layout import _cut

    caller = "/work/main/wsd/worker/workload.py:157:_forward"
    assert _cut(caller, 30) == "/work…workload.py:157:_forward"
    assert _cut(caller, len(caller)) == caller
    assert _cut("node-a.very.long.cluster.local", 12) == "node-….local"
    assert all(len(_cut(caller, w)) == w for w in range(2, len(caller)))
