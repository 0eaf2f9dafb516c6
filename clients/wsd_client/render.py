"""Human output of ``wsctl``: one function per result, each returning text.

Pure functions of the coordinator's plain-data results (the same documents
``--json`` prints; for ``stats`` and ``watch``, the answer expanded into rows
by ``Stats.rows()`` and narrowed by ``wsd_client.select``), so that what a
human reads and what a script parses never drift apart. Sizes are shown in
B/KiB/MiB/GiB, rank lists as ranges (``0-7``); tables are aligned and, given a
``width``, fitted to it (``wsd_client.layout``). Above ``SUMMARY_ABOVE`` slot
rows, ``stats`` and ``watch`` show one line per TP group instead of one per
slot. Imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from wsd.commands import DESIRED_FIELDS
from wsd.fmt import format_bytes, format_time, table
from wsd.slotstats import SLOT_NUMBERS
from wsd_client.layout import Column, fit
from wsd_client.results import RankCounts
from wsd_client.select import complete, ranges

__all__ = ["SUMMARY_ABOVE", "command", "contexts", "event_line", "events", "events_header", "groups", "ping", "ranks",
           "stats", "status", "watch"]

SUMMARY_ABOVE = 256
"""Most slot rows ``stats`` and ``watch`` show one by one (32 ranks of 8 slots); above it,
one line per TP group, unless asked otherwise (``--by-slot``, ``--by-group``)."""

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
    return ranges(values)


def _missing(missing: list[dict[str, Any]]) -> str:
    """Missing ranks by reason: ``ranks 8-15 (never registered); rank 3 (lost at ...)``."""
    by_reason: dict[str, list[int]] = {}
    for m in missing:
        by_reason.setdefault(m["reason"], []).append(m["rank"])
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {ranges(r)} ({why})" for why, r in by_reason.items())


def _spread(parts: list[str], width: int | None, sep: str = "  ") -> list[str]:
    """``parts`` ``sep`` apart on one line, or on as many as ``width`` needs."""
    lines = [parts[0]]
    for part in parts[1:]:
        if width is not None and len(lines[-1]) + len(sep) + len(part) > width:
            lines.append(part)
        else:
            lines[-1] += sep + part
    return lines


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


def status(doc: dict[str, Any], endpoint: str, width: int | None = None) -> str:
    counts = RankCounts.from_wire(doc["ranks"])
    world = "open world" if doc["world_size"] is None else f"world {doc['world_size']} ranks"
    tp = "" if doc["tp_size"] is None else f", TP size {doc['tp_size']}"
    head = [f"coordinator {endpoint}", f"epoch {doc['epoch'][:8]}", f"seq {doc['seq']}",
            f"started {format_time(doc['started'], date=True)}", *(["(state recovered)"] if doc["recovered"] else [])]
    lines = [
        *_spread(head, width),
        f"{world}{tp}: {counts.live} live, " + (f"{counts.stalled} stalled, " if counts.stalled else "")
        + f"{counts.lost} lost, {counts.stopped} stopped, {counts.missing} missing",
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
        lines += ["", fit(_STATUS_COLUMNS, rows, width)]
    total, offset = doc.get("groups_total", len(rows)), doc.get("offset", 0)
    if offset or total > offset + len(rows):
        lines.append(f"groups {offset}..{offset + len(rows) - 1} of {total} shown: the next with "
                     f"--offset {offset + len(rows)}")
    return "\n".join(lines)


_STATUS_COLUMNS = (Column("GROUP"), Column("RANKS", drop=3), Column("LIVE", drop=4), Column("MISSING", cut_to=16),
                   Column("LOCKED"), Column("UBATCHES"), Column("APPLIED SEQ", drop=2), Column("CONSISTENT"),
                   Column("DESIRED", drop=1, cut_to=16), Column("DRIFT", cut_to=16))
_RANKS_COLUMNS = (Column("RANK"), Column("STATE"), Column("GROUP"), Column("HOST", cut_to=12), Column("PID", drop=2),
                  Column("DEVICE", drop=3), Column("STEP"), Column("APPLIED SEQ", drop=1),
                  Column("LOCKED"), Column("UBATCHES"))


def engines(doc: dict[str, Any]) -> str:
    """``wsctl engines``: one line per engine the coordinator serves, its default marked ``*``."""
    rows = [[e["engine"] + ("*" if e["engine"] == doc["default"] else ""), _opt(e["model"]),
             f"{e['live']}/{_opt(e['world_size'])}", _opt(e["tp_size"]), _opt(e["locked"]),
             _opt(e["num_ubatches"]), format_bytes(e["workspace_bytes"]), e["lock_violations"], e["seq"]]
            for e in doc["engines"]]
    return table(["ENGINE", "MODEL", "LIVE/WORLD", "TP", "LOCKED", "UBATCHES", "SCRATCH", "VIOLATIONS", "SEQ"],
                 rows) + "\n* the default engine: that of agents naming none"


def _rank_state(r: dict[str, Any]) -> str:
    """A live rank whose engine is still warming up reads ``warming``: nothing applies to it yet.
    A stalled one says for how long its engine has been inside its step."""
    if r["state"] == "stalled" and r.get("in_step") is not None:
        return f"stalled {r['in_step']:.0f}s"
    return "warming" if r["state"] == "live" and r.get("warming") else str(r["state"])


def ranks(doc: dict[str, Any], width: int | None = None) -> str:
    rows = [
        [r["rank"], _rank_state(r), r["tp_group"], r["host"], r["pid"], r["device"],
         r["step"], r["applied_seq"], _opt(r["locked"]), _opt(r["num_ubatches"])]
        for r in doc["ranks"]
    ]
    rows += [[m["rank"], "missing", "-", "-", "-", "-", "-", "-", "-", "-"]
             for m in doc["missing"]]
    if not rows:
        return "no ranks registered"
    rows.sort(key=lambda row: row[0])
    return fit(_RANKS_COLUMNS, rows, width)


def _retained(slot: dict[str, Any]) -> str:
    """The slot's retained span (vLLM 0.34's ``get_retained``): its size and key."""
    span = slot.get("retained")
    return "-" if not span else f"{format_bytes(span['nbytes'])} {span['key']}"


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
    selected = "selection" in doc  # the total of the ranks shown, not of the whole answer
    line += f", total {format_bytes(sum(r['total_bytes'] for r in doc['ranks']) if selected else doc['total_bytes'])}"
    if doc["fresh"]:
        line += ", asked now"
    if doc.get("selection"):
        line += f", selected: {_selection(doc['selection'])}"
    return line + ("" if complete(doc) else "  (INCOMPLETE)")


def _selection(selection: dict[str, Any]) -> str:
    parts = [f"{what} {_ints(selection[key])}" for key, what in (("ranks", "ranks"), ("groups", "groups"))
             if selection[key] is not None]
    if selection["states"]:
        parts.append("state " + ",".join(selection["states"]))
    return " ".join(parts)


def by_group(doc: dict[str, Any], choice: bool | None) -> bool:
    """Whether ``doc`` is shown one line per TP group: as chosen, else when it has more
    than ``SUMMARY_ABOVE`` slot rows."""
    return choice if choice is not None else sum(len(r["slots"]) for r in doc["ranks"]) > SUMMARY_ABOVE


# The slot numbers that never give way to fit a width (the others go after the lanes).
_KEPT_NUMBERS = frozenset({"capacity_bytes", "peak_requested_bytes", "lock_violations", "capacity_min",
                           "capacity_max", "skew_bytes", "peak_requested_max"})


def _numbers(names_and_headers: Iterable[tuple[str, str]]) -> list[Column]:
    return [Column(header, drop=0 if name in _KEPT_NUMBERS else 5) for name, header in names_and_headers]


_RANK_COLUMNS = (Column("RANK"), Column("GROUP"), Column("STEP", drop=3), Column("AGE"), Column("DEVICE", drop=4),
                 Column("UBATCHES", drop=2), Column("LANES", drop=6), Column("LOCKED"), Column("CAPACITY"),
                 Column("TOTAL", drop=1), Column("VIOLATIONS"))
_CAP_COLUMNS = (Column("ALLOCATOR CAP"), Column("HEADROOM"))
_SLOT_COLUMNS = (Column("RANK"), Column("UBATCH"), Column("LANE", drop=4),
                 *_numbers((n.name, n.header) for n in SLOT_NUMBERS),
                 Column("PERSISTENT", drop=6), Column("RETAINED", drop=6, cut_to=24),
                 Column("LAST VIOLATION", drop=3, cut_to=24))
_GROUP_COLUMNS = (Column("GROUP"), Column("RANKS", drop=2, cut_to=8), Column("REPORTING", drop=3, cut_to=8),
                  Column("TOTAL"), Column("MIN RANK", drop=1), Column("MAX RANK", drop=1), Column("SKEW"),
                  Column("LOCKED SAME", drop=4), Column("UBATCHES SAME", drop=4))
_GROUP_SLOT_COLUMNS = (Column("GROUP"), Column("UBATCH"), Column("LANE", drop=4), Column("RANKS", drop=3, cut_to=8),
                       *_numbers((c.name, str(c.header)) for c in _GROUP_SHOWN))


def stats(doc: dict[str, Any], width: int | None = None, *, grouped: bool | None = None) -> str:
    """The ``stats`` answer in rows: per rank, per slot and per TP group, or one line per
    TP group (``grouped``; None: above ``SUMMARY_ABOVE`` slot rows)."""
    lines = [_summary(doc)]
    if by_group(doc, grouped):
        if doc["groups"]:
            lines += ["", groups(doc, width=width)]
        if grouped is None:
            lines.append(_summary_hint(doc, width))
    else:
        lines += _stats_tables(doc, width)
    if doc["missing"]:
        lines += ["", f"missing: {_missing(doc['missing'])}"]
    return "\n".join(lines)


def _summary_hint(doc: dict[str, Any], width: int | None) -> str:
    slots = sum(len(r["slots"]) for r in doc["ranks"])
    parts = [f"({slots} slots: one line per TP group above {SUMMARY_ABOVE};", "select with --rank, --group, --state,",
             "or see every slot with --by-slot)"]
    return "\n".join(_spread(parts, width, " "))


def _stats_tables(doc: dict[str, Any], width: int | None) -> list[str]:
    lines = []
    if doc["ranks"]:
        rows = [[r["rank"], r["tp_group"], r["step"], _age(r), r["device"], r["num_ubatches"], r["num_lanes"],
                 _opt(r["locked"]), format_bytes(r["capacity_bytes"]), format_bytes(r["total_bytes"]),
                 r["lock_violations"]] for r in doc["ranks"]]
        columns: tuple[Column, ...] = _RANK_COLUMNS
        if any(r.get("allocator_cap_bytes") is not None for r in doc["ranks"]):
            # a capped allocator (vLLM's extensible KV cache): what an operator's growth may take
            columns += _CAP_COLUMNS
            for row, r in zip(rows, doc["ranks"]):
                capped = r.get("allocator_cap_bytes") is not None
                row += [format_bytes(r["allocator_cap_bytes"]) if capped else "-",
                        format_bytes(r["allocator_headroom_bytes"]) if capped else "-"]
        lines += ["", fit(columns, rows, width)]
        lines += ["", fit(_SLOT_COLUMNS, [
            [r["rank"], s["ubatch"], s["lane"], *(_number(n.name, s[n.name]) for n in SLOT_NUMBERS),
             format_bytes(sum(p["nbytes"] for p in s["persistent"])), _retained(s), _violation(s)]
            for r in doc["ranks"] for s in r["slots"]], width)]
    if doc["groups"]:
        lines += ["", fit(_GROUP_COLUMNS, [
            [g["tp_group"], _ints(g["ranks"]), _ints(g["reporting"]), format_bytes(g["total_bytes"]),
             format_bytes(g["rank_bytes_min"]), format_bytes(g["rank_bytes_max"]), format_bytes(g["skew_bytes"]),
             _opt(g["locked_consistent"]), _opt(g["num_ubatches_consistent"])] for g in doc["groups"]], width)]
        slot_rows = [[g["tp_group"], s["ubatch"], s["lane"], _ints(s["ranks"]),
                      *(_number(c.name, s[c.name]) for c in _GROUP_SHOWN)]
                     for g in doc["groups"] for s in g["slots"]]
        if slot_rows:
            lines += ["", fit(_GROUP_SLOT_COLUMNS, slot_rows, width)]
    return lines


_SUMMARY_COLUMNS = (Column("GROUP"), Column("RANKS", drop=4, cut_to=8), Column("REPORTING"),
                    Column("MISSING", cut_to=8), Column("STALE", cut_to=8), Column("LOCKED"),
                    Column("UBATCHES", drop=3), Column("TOTAL"), Column("MAX RANK", drop=2), Column("SKEW", drop=1),
                    Column("VIOLATIONS"), Column("GROWN", drop=5))


def groups(doc: dict[str, Any], previous: dict[str, Any] | None = None, width: int | None = None) -> str:
    """One line per TP group of a stats answer in rows: its ranks reporting, missing and
    stale, lock state and slot count as its ranks report them, total, skew, violations, and
    its growth since ``previous`` (``watch``)."""
    members: dict[int, list[dict[str, Any]]] = {g["tp_group"]: [] for g in doc["groups"]}
    for r in doc["ranks"]:
        members.setdefault(r["tp_group"], []).append(r)
    before = {g["tp_group"]: g["total_bytes"] for g in (previous or {}).get("groups", ())}
    stale = set(doc["stale"])
    rows = []
    for g in doc["groups"]:
        ranks = members[g["tp_group"]]
        old = before.get(g["tp_group"])
        grown = g["total_bytes"] - old if old is not None else 0
        rows.append([
            g["tp_group"], _ints(g["ranks"]), f"{len(g['reporting'])}/{len(g['ranks'])}",
            _ints(m["rank"] for m in g["missing"]), _ints(r for r in g["reporting"] if r in stale),
            _set(sorted({r["locked"] for r in ranks}, key=str)),
            _set(sorted({r["num_ubatches"] for r in ranks})), format_bytes(g["total_bytes"]),
            format_bytes(g["rank_bytes_max"]), format_bytes(g["skew_bytes"]),
            sum(r["lock_violations"] for r in ranks), _grown(grown)])
    return fit(_SUMMARY_COLUMNS, rows, width)


def _grown(grown: int) -> str:
    return ("+" if grown > 0 else "") + format_bytes(grown) if grown else ""


_WATCH_COLUMNS = (Column("RANK"), Column("GROUP", drop=3), Column("AGE"), Column("UBATCH"), Column("LANE", drop=4),
                  Column("LOCKED"), *_numbers((n.name, n.header) for n in SLOT_NUMBERS), Column("GROWN"))


def watch(doc: dict[str, Any], previous: dict[str, Any] | None, header: str, width: int | None = None, *,
          grouped: bool | None = None) -> str:
    """One ``wsctl watch`` frame: per rank and slot, capacity, peak, growth since ``previous``;
    or one line per TP group (``grouped``; None: above ``SUMMARY_ABOVE`` slot rows)."""
    lines = _spread([*header.split("  "), _summary(doc)], width)  # the header's parts are two spaces apart
    if by_group(doc, grouped):
        lines.append(groups(doc, previous, width) if doc["groups"] else "no ranks reporting")
        if grouped is None:
            lines.append(_summary_hint(doc, width))
    else:
        lines.append(_watch_slots(doc, previous, width))
    if doc["missing"]:
        lines.append(f"missing: {_missing(doc['missing'])}")
    return "\n".join(lines)


def _watch_slots(doc: dict[str, Any], previous: dict[str, Any] | None, width: int | None) -> str:
    before: dict[tuple[int, int, int], int] = {}
    for r in (previous or {}).get("ranks", ()):
        for s in r["slots"]:
            before[(r["rank"], s["ubatch"], s["lane"])] = s["capacity_bytes"]
    rows = []
    for r in doc["ranks"]:
        for s in r["slots"]:
            old = before.get((r["rank"], s["ubatch"], s["lane"]))
            rows.append([r["rank"], r["tp_group"], _age(r), s["ubatch"], s["lane"], _opt(r["locked"]),
                         *(_number(n.name, s[n.name]) for n in SLOT_NUMBERS),
                         _grown(s["capacity_bytes"] - old if old is not None else 0)])
    return fit(_WATCH_COLUMNS, rows, width) if rows else "no ranks reporting"


def contexts(doc: dict[str, Any]) -> str:
    """``wsctl config get-contexts``: one line per context, ``*`` at the current one."""
    if not doc["contexts"]:
        return f"no contexts in {doc['file']}"
    return table(["CURRENT", "NAME", "ENDPOINT", "CURVE"],
                 [["*" if c["name"] == doc["current"] else "", c["name"], c["endpoint"],
                   _opt(c["server_key"] is not None)] for c in doc["contexts"]])


# -- events -----------------------------------------------------------------------


def _detail_value(key: str, value: Any) -> str:
    if key in _BYTE_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    if key == "by" and isinstance(value, dict):  # a command's issuer as its client says: a claim
        return ("@".join(str(value[k]) for k in ("user", "host") if k in value) or "?") + " (claimed)"
    if key == "proven" and isinstance(value, dict):  # what CURVE proved: the key's role and name
        return f"{value.get('role', '?')} key {value.get('key', '?')}"
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
