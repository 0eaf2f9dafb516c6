"""Human output of ``wsctl``: one function per result, each returning text.

Pure functions of the coordinator's plain-data results (the same documents
``--json`` prints; for ``stats`` and ``watch``, the answer expanded into rows
by ``wsd_client.rows.stats_rows``), so that what a human reads and what a
script parses never drift apart. Sizes are shown in B/KiB/MiB/GiB, tables are aligned
(``wsd.fmt``). Imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from wsd.commands import DESIRED_FIELDS
from wsd.fmt import format_bytes, format_time, table
from wsd.manager.stats import SLOT_NUMBERS

__all__ = ["command", "event_line", "events", "events_header", "ping", "ranks", "stats", "status",
           "watch"]

# Event and desired-state keys that hold byte counts, shown as sizes.
_BYTE_KEYS = frozenset({"requested", "capacity", "bytes", "reserve_bytes"})
# Fields every event has, shown in their own columns rather than as details.
_EVENT_COLUMNS = ("id", "time", "kind")


def _opt(value: Any) -> str:
    """``-`` for an unknown value, yes/no for a flag, the value otherwise."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _set(values: Iterable[Any]) -> str:
    """The distinct values a TP group's live ranks report: one, several (disagreeing) or none."""
    shown = [_opt(v) for v in values]
    return "/".join(shown) if shown else "-"


def _ints(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values) or "-"


def _missing(missing: list[dict[str, Any]]) -> str:
    return "; ".join(f"rank {m['rank']} ({m['reason']})" for m in missing)


def _size(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


# -- read-only results ----------------------------------------------------------


def ping(doc: dict[str, Any]) -> str:
    return (f"pong from {doc['endpoint']} in {doc['rtt_ms']:.1f} ms: "
            f"epoch {doc['epoch'][:8]}, seq {doc['seq']}")


# How each desired-state field is shown; a field added to the command table without
# an entry here is shown by its name.
_DESIRED_SHOWN: dict[str, tuple[str, Callable[[Any], str]]] = {
    "locked": ("locked", _opt), "num_ubatches": ("ubatches", _opt), "reserve_bytes": ("reserve", _size)}


def _desired(desired: dict[str, Any]) -> str:
    shown = (_DESIRED_SHOWN.get(field, (field, _opt)) for field in DESIRED_FIELDS)
    return " ".join(f"{label}={show(desired.get(field))}" for field, (label, show) in zip(DESIRED_FIELDS, shown))


def status(doc: dict[str, Any], endpoint: str) -> str:
    counts = doc["ranks"]
    world = "open world" if doc["world_size"] is None else f"world {doc['world_size']} ranks"
    tp = "" if doc["tp_size"] is None else f", TP size {doc['tp_size']}"
    lines = [
        f"coordinator {endpoint}  epoch {doc['epoch'][:8]}  seq {doc['seq']}  "
        f"started {format_time(doc['started'], date=True)}"
        + ("  (state recovered)" if doc["recovered"] else ""),
        f"{world}{tp}: {counts['live']} live, {counts['lost']} lost, "
        f"{counts.get('stopped', 0)} stopped, {counts['never_registered']} never registered",
        f"desired (default): {_desired(doc['desired'])}",
        f"pending commands: {_ints(doc['pending_commands'])}",
    ]
    refused = doc.get("agents_refused") or {}
    if "agents_authenticated" in doc:
        lines.append("agents: " + ("authenticated by token" if doc["agents_authenticated"] else
                                   "NOT authenticated (no agent token)")
                     + (", refused: " + ", ".join(f"{why} {n}" for why, n in refused.items()) if refused else ""))
    rows = [
        [g["tp_group"], _ints(g["ranks"]), _ints(g["live"]), _missing(g["missing"]) or "-",
         _set(g["locked"]), _set(g["num_ubatches"]), _ints(g["applied_seq"]),
         _opt(g["consistent"]), _desired(g["desired"]), "; ".join(g.get("drift") or []) or "-"]
        for g in doc["groups"]
    ]
    if rows:
        lines += ["", table(["GROUP", "RANKS", "LIVE", "MISSING", "LOCKED", "UBATCHES",
                             "APPLIED SEQ", "CONSISTENT", "DESIRED", "DRIFT"], rows)]
    return "\n".join(lines)


def ranks(doc: dict[str, Any]) -> str:
    rows = [
        [r["rank"], r["state"], r["tp_group"], r["host"], r["pid"], r["device"], _opt(r["idle"]),
         r["step"], r["applied_seq"], _opt(r["locked"]), _opt(r["num_ubatches"])]
        for r in doc["ranks"]
    ]
    rows += [[m["rank"], "missing", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
             for m in doc["never_registered"]]
    if not rows:
        return "no ranks registered"
    rows.sort(key=lambda row: row[0])
    return table(["RANK", "STATE", "GROUP", "HOST", "PID", "DEVICE", "IDLE", "STEP", "APPLIED SEQ",
                  "LOCKED", "UBATCHES"], rows)


def _violation(slot: dict[str, Any]) -> str:
    last = slot.get("last_violation")
    if not last:
        return "-"
    sizes = f"{format_bytes(last['requested'])} > {format_bytes(last['capacity'])}"
    return f"{last['caller']} ({sizes})"


# Each slot number's unit, by the name of its column and of each group column derived from it.
_UNITS = {n.name: n.unit for n in SLOT_NUMBERS} | {c.name: n.unit for n in SLOT_NUMBERS for c in n.group}
# The TP group summary's columns that wsctl shows (the rest are in the JSON only).
_GROUP_SHOWN = [c for n in SLOT_NUMBERS for c in n.group if c.header is not None]


def _number(name: str, value: Any) -> Any:
    """A slot number as ``wsctl`` shows it: bytes as sizes, the rest as they are."""
    return format_bytes(value) if _UNITS[name] == "bytes" else value


def _age(rank: dict[str, Any]) -> str:
    """A rank's snapshot age, ``STALE`` after it when older than the coordinator's bound."""
    return f"{rank['age']:.1f}s" + (" STALE" if rank["stale"] else "")


def _summary(doc: dict[str, Any]) -> str:
    """How many ranks an answer covers, its total, and what it lacks."""
    reporting = len(doc["ranks"])
    expected = reporting + len(doc["missing"])
    line = f"{reporting}/{expected} ranks reporting"
    if doc["stale"]:
        line += f" ({len(doc['stale'])} stale)"
    line += f", total {format_bytes(doc['total_bytes'])}"
    if doc["fresh"]:
        line += ", asked now"
    return line + ("" if doc["complete"] else "  (INCOMPLETE)")


def stats(doc: dict[str, Any]) -> str:
    lines = [_summary(doc)]
    if doc["ranks"]:
        lines += ["", table(
            ["RANK", "GROUP", "STEP", "AGE", "DEVICE", "UBATCHES", "LANES", "LOCKED", "CAPACITY", "TOTAL",
             "VIOLATIONS"],
            [[r["rank"], r["tp_group"], r["step"], _age(r), r["device"], r["num_ubatches"], r["num_lanes"],
              _opt(r["locked"]), format_bytes(r["capacity_bytes"]), format_bytes(r["total_bytes"]),
              r["lock_violations"]] for r in doc["ranks"]],
        )]
        lines += ["", table(
            ["RANK", "UBATCH", "LANE", *(n.header for n in SLOT_NUMBERS), "PERSISTENT", "LAST VIOLATION"],
            [[r["rank"], s["ubatch"], s["lane"], *(_number(n.name, s[n.name]) for n in SLOT_NUMBERS),
              format_bytes(sum(p["nbytes"] for p in s["persistent"])), _violation(s)]
             for r in doc["ranks"] for s in r["slots"]],
        )]
    if doc["groups"]:
        lines += ["", table(
            ["GROUP", "RANKS", "REPORTING", "TOTAL", "MIN RANK", "MAX RANK", "SKEW", "LOCKED SAME",
             "UBATCHES SAME"],
            [[g["tp_group"], _ints(g["ranks"]), _ints(g["reporting"]),
              format_bytes(g["total_bytes"]),
              format_bytes(g["rank_bytes_min"]), format_bytes(g["rank_bytes_max"]),
              format_bytes(g["skew_bytes"]), _opt(g["locked_consistent"]),
              _opt(g["num_ubatches_consistent"])] for g in doc["groups"]],
        )]
        slot_rows = [
            [g["tp_group"], s["ubatch"], s["lane"], _ints(s["ranks"]),
             *(_number(c.name, s[c.name]) for c in _GROUP_SHOWN)]
            for g in doc["groups"] for s in g["slots"]
        ]
        if slot_rows:
            lines += ["", table(["GROUP", "UBATCH", "LANE", "RANKS", *(str(c.header) for c in _GROUP_SHOWN)],
                                slot_rows)]
    if doc["missing"]:
        lines += ["", f"missing: {_missing(doc['missing'])}"]
    return "\n".join(lines)


def watch(doc: dict[str, Any], previous: dict[str, Any] | None, header: str) -> str:
    """One ``wsctl watch`` frame: per rank and slot, capacity, peak, growth since ``previous``."""
    before: dict[tuple[int, int, int], int] = {}
    for r in (previous or {}).get("ranks", ()):
        for s in r["slots"]:
            before[(r["rank"], s["ubatch"], s["lane"])] = s["capacity_bytes"]
    rows = []
    for r in doc["ranks"]:
        for s in r["slots"]:
            old = before.get((r["rank"], s["ubatch"], s["lane"]))
            grown = s["capacity_bytes"] - old if old is not None else 0
            rows.append([r["rank"], r["tp_group"], _age(r), s["ubatch"], s["lane"], _opt(r["locked"]),
                         *(_number(n.name, s[n.name]) for n in SLOT_NUMBERS),
                         ("+" if grown > 0 else "") + format_bytes(grown) if grown else ""])
    lines = [f"{header}  {_summary(doc)}"]
    if rows:
        lines.append(table(["RANK", "GROUP", "AGE", "UBATCH", "LANE", "LOCKED", *(n.header for n in SLOT_NUMBERS),
                            "GROWN"], rows))
    else:
        lines.append("no ranks reporting")
    if doc["missing"]:
        lines.append(f"missing: {_missing(doc['missing'])}")
    return "\n".join(lines)


# -- events -----------------------------------------------------------------------


def _detail_value(key: str, value: Any) -> str:
    if key in _BYTE_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return _opt(value)


def events_header() -> str:
    return f"{'ID':>7}  {'TIME':<12}  {'KIND':<18}  DETAIL"


def event_line(event: dict[str, Any]) -> str:
    """One event on one line, in fixed-width columns so that followed lines stay aligned."""
    detail = " ".join(f"{k}={_detail_value(k, v)}"
                      for k, v in event.items() if k not in _EVENT_COLUMNS)
    when = format_time(event["time"])
    return f"{event['id']:>7}  {when:<12}  {event['kind']:<18}  {detail}".rstrip()


def events(items: list[dict[str, Any]]) -> str:
    if not items:
        return "no events"
    return "\n".join([events_header(), *(event_line(e) for e in items)])


# -- commands -----------------------------------------------------------------------


def command(doc: dict[str, Any]) -> str:
    target = "all groups" if doc["group"] is None else f"group {doc['group']}"
    head = f"{doc['action']}: seq {doc['seq']} on {target}"
    if not doc["waited"]:
        return f"{head}: sent, not waiting for acknowledgements (--no-wait)"
    acked = doc["acked"]
    steps = "; ".join(f"group {g}: {'same step' if same else 'DIFFERENT steps'}"
                      for g, same in (doc["same_step"] or {}).items())
    lines = [f"{head}: applied by {len(acked)} rank{'s' if len(acked) != 1 else ''}"
             + (f" ({steps})" if steps else "")
             + ("" if doc["complete"] else "  (INCOMPLETE)")]
    if acked:
        lines.append(table(["RANK", "STEP", "OK", "ERROR"],
                           [[a["rank"], a["step"], _opt(a["ok"]), _opt(a["error"])]
                            for a in acked]))
    if doc["pending"]:
        lines.append(f"pending (no acknowledgement in time): ranks {_ints(doc['pending'])}")
    if doc["lost"]:
        lines.append(f"lost while applying: ranks {_ints(doc['lost'])}")
    if doc["missing"]:
        lines.append(f"missing: {_missing(doc['missing'])}")
    return "\n".join(lines)
