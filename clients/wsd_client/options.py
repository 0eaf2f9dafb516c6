"""The options of ``wsctl``'s commands, each range-checked as the protocol checks it.

One function per option or group of options, adding it to a command's parser;
``wsd_client.wsctl`` lists which command takes which. Imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from wsd.commands import CommandSpec
from wsd.coordinator.config import MAX_EVENT_CAPACITY
from wsd.endpoints import endpoint_problem
from wsd.fieldchecks import flag_number, parse_size
from wsd.names import engine_name_problem
from wsd.wire.protocol import MAX_STATUS_GROUPS, SCHEMAS, Op
from wsd_client import render
from wsd_client.select import STATES, number_list, state_list

__all__ = ["CONFIG_ACTIONS", "DEFAULT_TIMEOUT", "arguments", "common", "config", "count_interval", "endpoint",
           "events", "fresh", "keygen", "selection", "target", "wire"]

DEFAULT_TIMEOUT = 5.0
# Most seconds between two refreshes of ``watch`` or polls of ``events --follow``.
MAX_INTERVAL = 3600.0
# Least: a shorter pace would only poll the coordinator in a busy loop.
MIN_INTERVAL = 0.01
# Most rounds or events ``--count`` waits for: beyond any real use, so a typo is caught.
MAX_COUNT = 1_000_000_000


def wire(op: Op, name: str) -> tuple[Any, Any]:
    """The bounds the protocol puts on a field: a flag refuses what the coordinator would."""
    field = next(f for f in SCHEMAS[op] if f.name == name)
    return field.low, field.high


def size(low: int, high: int) -> Callable[[str], int]:
    """A size on the command line (4096, 512KiB, 64MiB) within ``low..high`` bytes."""
    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high} bytes, got {text}")
        return value
    return parse


def endpoint(text: str) -> str:
    problem = endpoint_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


_seconds = flag_number(float, 0, wire(Op.STATS, "timeout")[1], what="seconds", unit=" seconds",
                       above_low=True)
_interval = flag_number(float, MIN_INTERVAL, MAX_INTERVAL, what="seconds", unit=" seconds")
_count = flag_number(int, 1, MAX_COUNT, what="an integer")


def group(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", metavar="G", type=flag_number(int, *wire(Op.STATS, "group"),
                                                            what="a TP group number"),
                   default=None,
                   help="only this TP group (default: every group)")


def stacks(p: argparse.ArgumentParser) -> None:
    """``stacks``: one rank's worker, or one TP group's, or (neither) every rank's."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", metavar="R", default=None,
                       type=flag_number(int, *wire(Op.STACKS, "rank"), what="a rank"), help="this rank's worker")
    which.add_argument("--group", metavar="G", default=None,
                       type=flag_number(int, *wire(Op.STACKS, "group"), what="a TP group number"),
                       help="every rank of this TP group (default, with neither: every rank)")


def profiles(p: argparse.ArgumentParser) -> None:
    """``profiles``: list them, or drop one."""
    p.add_argument("--drop", metavar="KEY", default=None,
                   help="forget this sizing profile (NAME:tpT:ubU:lnL, as listed); admin only under CURVE")


def selection(p: argparse.ArgumentParser) -> None:
    """``stats`` and ``watch``: which ranks and groups, and how (one line per slot or per group)."""
    p.add_argument("--group", metavar="G", default=None,
                   type=number_list(*wire(Op.STATS, "group"), "TP group number"),
                   help="only these TP groups: 3, or a list such as 0-3,8 (default: every group)")
    p.add_argument("--rank", metavar="R", default=None, type=number_list(*wire(Op.REGISTER, "rank"), "rank"),
                   help="only these ranks: 5, or a list such as 0-7,64-71")
    p.add_argument("--state", metavar="S", default=None, type=state_list,
                   help="only ranks in one of these states: " + "; ".join(f"{k}: {v}" for k, v in STATES.items())
                        + " (a list such as stale,absent)")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--by-group", dest="grouped", action="store_const", const=True, default=None,
                      help=f"one line per TP group (the default above {render.SUMMARY_ABOVE} slots)")
    view.add_argument("--by-slot", dest="grouped", action="store_const", const=False,
                      help="one line per rank and slot, however many")


def fresh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fresh", action="store_true",
                   help="ask every rank now and wait for the slowest (default: the snapshots the ranks "
                        "pushed, each with its age)")


def page(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offset", metavar="N", type=_bounded("--offset", 0, 1 << 20), default=0,
                   help="the first TP group to list (default 0)")
    p.add_argument("--limit", metavar="N", type=_bounded("--limit", 1, MAX_STATUS_GROUPS), default=512,
                   help=f"TP groups to list, at most {MAX_STATUS_GROUPS} (default 512)")


def _bounded(flag: str, low: int, high: int) -> Callable[[str], int]:
    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag}: must be between {low} and {high}, got {value}")
        return value
    return read


def engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", metavar="NAME", type=_engine_name, default=None,
                   help="that engine only (default: every engine, each answering for itself; "
                        "wsctl engines lists them)")


def _engine_name(text: str) -> str:
    problem = engine_name_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def target(p: argparse.ArgumentParser) -> None:
    group(p)
    p.add_argument("--no-wait", dest="wait", action="store_false",
                   help="return once the command is numbered, without waiting for the ranks")
    p.add_argument("--new-engine", action="store_true",
                   help="--engine names an engine that has not started yet: set the state it starts "
                        "into (without this, an engine the coordinator does not serve is refused)")


def count_interval(interval: float, what: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--interval", metavar="SECONDS", type=_interval, default=interval,
                       help=f"seconds between refreshes, {MIN_INTERVAL:g} to {MAX_INTERVAL:g} "
                            f"(default: {interval:g})")
        p.add_argument("--count", metavar="N", type=_count,
                       default=None, help=f"stop after N {what} (default: until Ctrl-C)")
    return add


def events(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", metavar="ID", default=None,
                   type=flag_number(int, *wire(Op.EVENTS, "cursor"), what="an event id"),
                   help="every event after this id (default: the last --last events)")
    p.add_argument("--last", metavar="N", default=20,
                   type=flag_number(int, 0, MAX_EVENT_CAPACITY, what="an integer"),
                   help="how many of the latest events to show first (default: 20)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")


def arguments(spec: CommandSpec) -> Callable[[argparse.ArgumentParser], None]:
    """A command's arguments, as its row of the command table declares them."""
    def add(p: argparse.ArgumentParser) -> None:
        for arg in spec.args:
            kind = size(arg.low, arg.high) if arg.size else flag_number(int, arg.low, arg.high,
                                                                         what="an integer")
            p.add_argument(arg.name, metavar=arg.metavar, type=kind, help=arg.help)
    return add


def keygen(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="file name of the pair: NAME.key, NAME.key_secret")
    p.add_argument("--dir", default=".", help="folder to write them in (default: the current one)")


CONFIG_ACTIONS = {
    "get-contexts": "list the contexts of the contexts file, the current one marked",
    "use-context": "make NAME the current context (rewrites `current` in the file)",
    "current-context": "print the current context's name",
}
"""``wsctl config``'s actions on the contexts file, with what each does."""


def config(p: argparse.ArgumentParser) -> None:
    """``wsctl config ACTION``: each action with the common options, so that they go anywhere."""
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    for name, text in CONFIG_ACTIONS.items():
        action = sub.add_parser(name, help=text, description=text)
        if name == "use-context":
            action.add_argument("name", metavar="NAME", help="a context of the file")
        common(action, top=False)


def common(p: argparse.ArgumentParser, top: bool) -> None:
    """The options every command takes, before or after its name.

    On the subcommands their default is SUPPRESS, so that an option given
    before the command name is not overwritten by the subcommand's default.
    """
    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    p.add_argument("--endpoint", type=endpoint, default=default(None),
                   help="the coordinator's client endpoint, not with --context (default: --context's, "
                        "else $WSD_ENDPOINT, else the current context's, else tcp://127.0.0.1:7601)")
    p.add_argument("--context", metavar="NAME", default=default(None),
                   help="a cluster's endpoint and keys by name, not with --endpoint, from the contexts "
                        "file ($WSCTL_CONFIG, "
                        "else $XDG_CONFIG_HOME/wsd/wsctl.toml; see `wsctl config`)")
    p.add_argument("--timeout", metavar="SECONDS", type=_seconds,
                   default=default(DEFAULT_TIMEOUT),
                   help=f"seconds for the whole command, retries included (watch, events -f: "
                        f"each round), at most {wire(Op.STATS, 'timeout')[1]:g} "
                        f"(default: {DEFAULT_TIMEOUT:g})")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="one JSON document per result per line on stdout (stable keys, see docs/wsctl.md)")
    p.add_argument("--curve-server-key", metavar="FILE", default=default(None),
                   help="the coordinator's public certificate, to connect with CURVE "
                        "(default: the context's, else $WSD_CURVE_SERVER_KEY)")
    p.add_argument("--curve-client-key", metavar="FILE", default=default(None),
                   help="your NAME.key_secret from `wsctl keygen` (default: the context's, "
                        "else $WSD_CURVE_CLIENT_KEY)")
