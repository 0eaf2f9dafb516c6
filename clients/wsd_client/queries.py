"""``wsctl``'s read-only commands: ping, engines, status, ranks, stats, watch, events, stacks,
profiles (whose ``--drop`` changes the coordinator's profiles, and nothing of any rank).

Each is a ``Handler``: it asks the coordinator through a ``Client``, writes each
engine's answer through ``Output`` (under a line naming the engine where several
answered, ``titled``) and returns the exit code for what it saw (``worst`` of
the engines'). ``wsd_client.wsctl`` puts them in its command table.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TextIO

from wsd.errors import ExitCode as Exit
from wsd.wire.protocol import ErrorCode
from wsd_client import render
from wsd_client.client import TAIL, Client, ClientError, Events
from wsd_client.output import CLEAR, Output
from wsd_client.profiles import render as render_profiles
from wsd_client.profiles import render_dropped
from wsd_client.results import by_engine
from wsd_client.select import Selection, complete
from wsd_client.stacks import render as render_stacks

__all__ = ["engines", "events", "ping", "profiles", "ranks", "stacks", "stats", "status", "titled", "watch", "worst"]

# Events asked for per request while reading the log (the protocol allows 10,000).
_EVENT_PAGE = 1000


def ping(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    start = time.monotonic()
    result = client.ping()
    rtt_ms = (time.monotonic() - start) * 1000
    doc = {"endpoint": client.endpoint, "epoch": result["epoch"], "seq": result["seq"],
           "time": result["time"], "rtt_ms": round(rtt_ms, 3)}
    out.emit(doc, lambda: render.ping(doc))
    return Exit.OK


def titled(name: str | None, several: bool, render_part: Callable[..., str], *args: Any, **kw: Any) -> str:
    """One engine's part of an answer (``render_part(*args, **kw)``): under a line naming the
    engine where several engines answered."""
    text = render_part(*args, **kw)
    return f"engine {name}\n{text}" if several and name is not None else text


def worst(codes: list[Exit]) -> Exit:
    """One exit code for several engines' answers: an error first, then a partial answer."""
    return Exit.ERROR if Exit.ERROR in codes else Exit.PARTIAL if Exit.PARTIAL in codes else Exit.OK


def engines(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    answer = client.engines()
    out.emit(answer.doc, lambda: render.engines(answer.doc))
    return Exit.OK


def status(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    answers = by_engine(client.status(engine=args.engine, offset=args.offset, limit=args.limit))
    codes = []
    for name, status in answers.items():
        out.emit(status.doc, functools.partial(titled, name, len(answers) > 1, render.status, status.doc,
                                               client.endpoint, _width(out.stream)))
        codes.append(Exit.PARTIAL if status.counts.absent else Exit.OK)  # a stopped rank is absent as a lost one
    return worst(codes)


def ranks(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    answers = by_engine(client.ranks(engine=args.engine))
    codes = []
    for name, ranks in answers.items():
        out.emit(ranks.doc, functools.partial(titled, name, len(answers) > 1, render.ranks, ranks.doc,
                                              _width(out.stream)))
        gone = any(r["state"] != "live" for r in ranks.ranks)  # lost or stopped
        codes.append(Exit.PARTIAL if gone or ranks.missing else Exit.OK)
    return worst(codes)


def stacks(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    answers = by_engine(client.stacks(rank=args.rank, group=args.group, engine=args.engine))
    codes = []
    for name, answer in answers.items():
        out.emit(answer.doc, functools.partial(titled, name, len(answers) > 1, render_stacks, answer.doc))
        codes.append(Exit.PARTIAL if answer.missing else Exit.OK)
    return worst(codes)


def profiles(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    if args.drop is not None:  # a change to the coordinator's state: an admin's under CURVE
        dropped = client.drop_profile(args.drop)
        out.emit(dropped, lambda: render_dropped(dropped))
        return Exit.OK
    answer = client.profiles()
    out.emit(answer.doc, lambda: render_profiles(answer.doc))
    return Exit.OK


def _width(stream: TextIO) -> int | None:
    """The terminal's width (``$COLUMNS`` first) when the output goes to one; piped output
    is not fitted, so that a pipe gets every column."""
    return shutil.get_terminal_size().columns if stream.isatty() else None


def _selected_stats(client: Client, args: argparse.Namespace) -> dict[str | None, dict[str, Any]]:
    """Each engine's stats answer in rows, with only what ``--rank``, ``--group`` and ``--state``
    select; an engine's name is in its document (``engine``) where several answered.

    One group alone is asked of the coordinator (it answers for that group only); several are
    selected from the whole answer.
    """
    groups = args.group
    one = next(iter(groups)) if groups is not None and len(groups) == 1 else None
    selection = Selection(ranks=args.rank, groups=None if one is not None else groups,
                          states=args.state or frozenset())
    answers = by_engine(client.stats(one, fresh=args.fresh, engine=args.engine))
    docs = {}
    for name, stats in answers.items():
        doc = selection.apply(stats.rows())
        if len(answers) > 1:
            doc["engine"] = name
        docs[name] = doc
    return docs


def _stats_exit(doc: dict[str, Any]) -> Exit:
    """3 when the answer is incomplete; for a selection, when a rank it selects is missing or stale."""
    return Exit.OK if complete(doc) else Exit.PARTIAL


def stats(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    docs = _selected_stats(client, args)
    for name, doc in docs.items():
        out.emit(doc, functools.partial(titled, name, len(docs) > 1, render.stats, doc, _width(out.stream),
                                        grouped=args.grouped))
    return worst([_stats_exit(doc) for doc in docs.values()])


def watch(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    redraw = not out.as_json and out.stream.isatty()
    previous: dict[str, Any] | None = None
    code, rounds = Exit.OK, 0
    try:
        while True:
            with client.deadline(args.timeout):  # --timeout bounds each round
                docs = _selected_stats(client, args)
            if len(docs) > 1:
                raise ClientError(ErrorCode.BAD_FIELD, f"watch follows one engine: name one of "
                                                       f"{', '.join(sorted(map(str, docs)))} with --engine")
            doc = next(iter(docs.values()))
            rounds += 1
            # When the frame was taken, ISO 8601 with the local zone's offset, on the frame and the JSON.
            doc["time"] = datetime.now(timezone.utc).astimezone().isoformat(timespec="milliseconds")
            code = _stats_exit(doc)
            of = f"/{args.count}" if args.count else ""
            header = f"wsctl watch {client.endpoint}  {doc['time']}  round {rounds}{of} every {args.interval:g} s"
            if rounds > 1 and not redraw and not out.as_json:
                print(file=out.stream)  # frames one after the other when not on a terminal
            out.emit(doc, functools.partial(_frame, doc, previous, header, args.grouped, redraw, out.stream))
            previous = doc
            if out.closed or (args.count and rounds >= args.count):
                break
            time.sleep(args.interval)  # the refresh pace, not a wait for a condition
    except KeyboardInterrupt:
        pass
    return code  # the last round's


def _frame(doc: dict[str, Any], previous: dict[str, Any] | None, header: str, grouped: bool | None,
           redraw: bool, stream: TextIO) -> str:
    frame = render.watch(doc, previous, header, _width(stream), grouped=grouped)
    return CLEAR + frame if redraw else frame


def _read_events(client: Client, cursor: int, engine: str | None) -> tuple[list[dict[str, Any]], Events]:
    """Every event after ``cursor`` the coordinator still holds, page by page, and the last page."""
    events: list[dict[str, Any]] = []
    while True:
        page = client.events(cursor, _EVENT_PAGE, engine=engine)
        events += page.events
        cursor = page.cursor
        if len(page.events) < _EVENT_PAGE:
            return events, page


def events(client: Client, args: argparse.Namespace, out: Output) -> Exit:
    with client.deadline(args.timeout):  # the whole command, or with --follow its first round
        # No cursor given: the last few, as tail does; ids are consecutive, so they
        # start --last before the tail (no need to read the whole log for them).
        start = args.since if args.since is not None else max(client.events(TAIL).cursor - args.last, 0)
        backlog, last = _read_events(client, start, args.engine)
    if not args.follow:
        if args.since is None:  # events that came in meanwhile do not count among the last N
            backlog = backlog[max(len(backlog) - args.last, 0):]
        doc = {"events": backlog, "cursor": last.cursor}
        out.emit(doc, lambda: render.events(backlog))
        return Exit.OK
    if not out.as_json:
        print(render.events_header(), file=out.stream, flush=True)
    queue, shown, cursor, epoch = deque(backlog), 0, last.cursor, last.epoch
    try:
        while args.count is None or shown < args.count:
            if not queue:
                with client.deadline(args.timeout):  # --timeout bounds each round
                    page = client.events(cursor, _EVENT_PAGE, engine=args.engine)
                if page.epoch != epoch:
                    # A restarted coordinator numbers its events from 1 again:
                    # start over from its beginning instead of waiting forever.
                    epoch, cursor = page.epoch, 0
                    continue
                queue.extend(page.events)
                cursor = page.cursor
                if not queue:
                    time.sleep(args.interval)  # the polling pace
                    continue
            event = queue.popleft()
            out.emit(event, functools.partial(render.event_line, event))
            if out.closed:
                break
            shown += 1
    except KeyboardInterrupt:
        pass
    return Exit.OK
