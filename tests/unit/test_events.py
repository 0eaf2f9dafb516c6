"""The coordinator's event log (``wsd.coordinator.events.EventLog``): what peers cause never
pushes out the operator's trail, and no one source fills the rest."""

from __future__ import annotations

from wsd.coordinator.events import OPERATOR, SOURCE_SHARE, EventKind, EventLog


def test_a_flood_of_peer_events_never_pushes_out_the_operators_trail():
    """Two ranks flipping stalled/unstalled with whole stacks once evicted every `command`
    event from the 16 MiB log in 10-11 s."""
    log = EventLog(capacity=100, max_bytes=64 << 10)
    log.add(EventKind.COMMAND, 0.0, seq=1, action="lock", by={"user": "alice"})
    for i in range(10_000):  # from many sources: no one source's share stops them
        log.add(EventKind.STALLED, float(i), source=("e", "rank", i % 4096), rank=i % 4096, stacks="x" * 512)
    events, _ = log.since(0, 10_000)
    assert [e["kind"] for e in events].count("command") == 1 and events[0]["seq"] == 1
    assert log.bytes <= 64 << 10 and len(log) <= 100
    assert [e["id"] for e in events] == sorted(e["id"] for e in events), "events out of id order"
    for seq in range(2, 40):  # the operator's own part is bounded too: its oldest go first
        log.add(EventKind.COMMAND, 0.0, seq=seq, action="lock")
    commands = [e["seq"] for e in log.since(0, 10_000)[0] if e["kind"] == "command"]
    assert commands == list(range(40 - 25, 40)) and EventKind.COMMAND in OPERATOR


def test_one_source_holds_at_most_its_share_of_the_log_and_the_rest_is_counted():
    log = EventLog(capacity=10_000, max_bytes=1 << 20)
    share = log.source_bytes
    assert share == (1 << 20) * 3 // 4 // SOURCE_SHARE
    kept = [log.add(EventKind.STALLED, 0.0, source=("e", "rank", 0), stacks="y" * 1000) for _ in range(200)]
    held = sum(1 for k in kept if k is not None)
    assert held * 1000 <= share < (held + 2) * 1100, (held, share)
    assert log.take_over_budget() == {"stalled": 200 - held} and log.take_over_budget() == {}
    assert log.add(EventKind.STALLED, 0.0, source=("e", "rank", 1), stacks="z") is not None, "another source"
    # once its events leave the log, the source may write again
    small = EventLog(capacity=4, max_bytes=1 << 20)
    for _ in range(10):
        assert small.add(EventKind.JOINED, 0.0, source=("e", "rank", 0), rank=0) is not None
    assert len(small) == 3  # the peers' three quarters of the log


def test_ids_stay_consecutive_across_both_parts_and_the_tail_finds_the_last_ones():
    log = EventLog(capacity=100)
    for i in range(6):
        kind = EventKind.COMMAND if i % 3 == 0 else EventKind.JOINED
        log.add(kind, 0.0, source=None if kind is EventKind.COMMAND else ("e", i), n=i)
    assert log.since(2**63 - 1, 1) == ([], 6)
    assert [e["n"] for e in log.since(6 - 3, 100)[0]] == [3, 4, 5]


def test_what_a_terminal_would_act_on_is_escaped_and_one_field_stays_on_one_line():
    """wsctl prints every answer through ``printable``: ESC, BEL and C1 controls, bidi overrides
    (U+202E reverses what follows) and line separators are escaped, a table's own newlines
    kept; ``one_line`` escapes those too, for a field that must not start a line."""
    from wsd.coordinator.events import bounded_detail
    from wsd.fmt import one_line, printable

    assert printable("a\x1b[2Jb\x9bc\nd\te") == "a\\x1b[2Jb\\x9bc\nd\te"
    assert printable("model \u202eevil\u2028next\u200f café 中") == "model \\u202eevil\\u2028next\\u200f café 中"
    assert one_line("f\nrank 1: forged\tx") == "f\\nrank 1: forged\\tx"
    detail = bounded_detail({"caller\n": "x.py:1\nrank 2 (node): lost", "note": "\u202eabc"})
    assert detail == {"caller\\n": "x.py:1\\nrank 2 (node): lost", "note": "\\u202eabc"}
