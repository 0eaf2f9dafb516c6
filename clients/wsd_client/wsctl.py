"""``wsctl``: the ops command line of wsd. Imports no torch.

Read-only commands::

    wsctl ping                      round trip to the coordinator
    wsctl engines                   every engine: name, model, ranks, lock, slots, scratch
    wsctl status                    world, desired state and every TP group at a glance
    wsctl ranks                     every rank: state, host, pid, step, lock and slot count
    wsctl stats [--group G] [--rank R] [--state S] [--by-group | --by-slot] [--fresh]
                                    per rank, per slot and per TP group: capacity, peak, skew
    wsctl events [--since ID] [--last N] [--follow [--count N] [--interval S]]
    wsctl watch [stats' options] [--interval S] [--count N]
                                    live per-rank, per-slot capacity and peak
    wsctl stacks [--rank R | --group G]
                                    every thread's Python stack of the workers
    wsctl profiles [--drop KEY]     sizing profiles: each slot's largest request per
                                    model (or engine), TP size and grid; --drop: admin

Above 256 slots, ``stats`` and ``watch`` show one line per TP group; ``--rank``,
``--group`` and ``--state`` select ranks; on a terminal, tables leave out their
least useful columns rather than wrap (docs/wsctl.md, "Large clusters").

State-changing commands (``[--group G] [--no-wait]``; every rank of the target
applies them at the same engine step)::

    wsctl lock | unlock | equalize | trim
    wsctl set-ubatches N            1..64 ubatch slots per lane
    wsctl reserve SIZE              size every slot, e.g. 4096, 512KiB, 64MiB

Contexts (each cluster's endpoint and keys by name, in $WSCTL_CONFIG, else
$XDG_CONFIG_HOME/wsd/wsctl.toml; no coordinator involved)::

    wsctl config get-contexts | use-context NAME | current-context

Shell completion (no coordinator involved)::

    wsctl completion bash|zsh       source <(wsctl completion bash)

Keys (no coordinator involved)::

    wsctl keygen NAME [--dir DIR]   a CURVE key pair: DIR/NAME.key (public) and
                                    DIR/NAME.key_secret (mode 0600)

Every command that talks to a coordinator but ``ping``, ``engines`` and ``profiles`` takes
``--engine NAME``: that engine only. Without it, a coordinator serving one
engine answers for it, and one serving several answers for each (under a line
``engine NAME``; in JSON, one document per engine with its ``engine``); a
command is then numbered and applied by every engine. ``watch`` follows one
engine.

Options taken by every command, before or after its name: ``--endpoint``
or ``--context NAME``, not both (default: ``$WSD_ENDPOINT``, else the current
context's, else ``tcp://127.0.0.1:7601``), ``--timeout`` seconds
for the whole command, retries included (for ``watch`` and ``events --follow``:
each round; default 5, at most 3600), ``--json``; with CURVE, ``--curve-server-key FILE`` (the
coordinator's public certificate, default ``$WSD_CURVE_SERVER_KEY``) and
``--curve-client-key FILE`` (your NAME.key_secret, default ``$WSD_CURVE_CLIENT_KEY``).

JSON output (``--json``): exactly one JSON document per result on stdout, one
per line, keys sorted; nothing on stdout when the command fails.

Every document's keys are in docs/wsctl.md, in one place (a copy here had
drifted from it).

``wsctl --version`` prints ``wsctl VERSION``.

Exit codes: 0 ok; 1 error (the coordinator refused, is unreachable, or a rank
failed to apply a command); 2 usage; 3 partial (stats incomplete, some ranks
lost, stopped or missing, or a command with ranks pending, lost or
missing); 130 interrupted (Ctrl-C ends ``watch`` and ``events --follow`` normally).
Errors are one line on stderr with their code, e.g.
``wsctl: conflict: reserve: TP group(s) [0] are locked; unlock first``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from wsd.commands import COMMANDS as COMMAND_TABLE
from wsd.commands import CommandSpec
from wsd.errors import ConfigError
from wsd.errors import ExitCode as Exit  # one list of exit codes for every wsd command
from wsd.fmt import printable
from wsd.version import __version__
from wsd_client import completion, queries, render
from wsd_client import options as opt
from wsd_client.client import BadEndpoint, Client, ClientError, CommandResult, endpoint_problem
from wsd_client.output import Handler, Output
from wsd_client.results import PerEngine, by_engine

__all__ = ["COMMANDS", "Exit", "main"]

_EXAMPLES = """\
examples:
  wsctl status                        the cluster at a glance (tcp://127.0.0.1:7601)
  wsctl --endpoint tcp://head:7601 ranks
                                      every rank of the coordinator on host "head"
  wsctl stats --group 0 --json        one TP group's numbers, for a script
  wsctl watch --interval 2            live capacity and peak, every 2 s
  wsctl events -f                     follow the event log
  wsctl lock --timeout 30             lock every workspace, waiting up to 30 s

--timeout bounds the whole command, retries included (watch, events -f: each round).
Exit codes: 0 ok, 1 error or unreachable, 2 usage, 3 partial, 130 interrupted.
"""


# -- read-only commands -------------------------------------------------------------


# -- state-changing commands --------------------------------------------------------


def _command(call: Callable[[Client, argparse.Namespace], CommandResult | PerEngine[CommandResult]]) -> Handler:
    """A handler that sends one command and reports its acknowledgements (per engine, where
    several numbered it)."""

    def run(client: Client, args: argparse.Namespace, out: Output) -> Exit:
        results = by_engine(call(client, args))
        codes = []
        for name, result in results.items():
            doc = result.to_dict()
            if len(results) > 1:
                doc["engine"] = name
            out.emit(doc, functools.partial(queries.titled, name, len(results) > 1, render.command, doc))
            if result.failed:
                errors = "; ".join(f"rank {a['rank']}: {a['error']}"
                                   for a in result.acked if not a["ok"])
                where = f" of engine {name}" if len(results) > 1 else ""
                print(printable(f"wsctl: {result.action} failed on {len(result.failed)} rank(s){where}: {errors}"),
                      file=sys.stderr)
                codes.append(Exit.ERROR)
            else:
                codes.append(Exit.PARTIAL if result.waited and not result.complete else Exit.OK)
        return queries.worst(codes)

    return run


# -- contexts -----------------------------------------------------------------------


def _connection(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """The endpoint and CURVE keys to connect with, None leaving it to ``Client`` ($WSD_*, default).

    ``--endpoint`` (never with ``--context``: ``main`` refuses both) or ``--context``'s; else
    ``$WSD_ENDPOINT``, or when it is unset the current context. A context applies whole or
    not at all: an ``--endpoint`` or ``$WSD_ENDPOINT`` names another coordinator, whose keys
    the context does not hold. Key flags win over a context's keys.
    """
    context = None
    if args.context is not None:
        from wsd_client.contexts import Contexts  # only where a context may be read

        context = Contexts.load().get(args.context)
    elif args.endpoint is None and not os.environ.get("WSD_ENDPOINT"):
        from wsd_client.contexts import Contexts

        contexts = Contexts.load()
        context = contexts.contexts[contexts.current] if contexts.current is not None else None
    keys = (args.curve_server_key, args.curve_client_key)
    if context is None:
        return args.endpoint, *keys
    if not any(keys):
        keys = (context.server_key, context.client_key)
    return context.endpoint, *keys


def _config(client: Client | None, args: argparse.Namespace, out: Output) -> Exit:
    from wsd_client.contexts import Contexts

    contexts = Contexts.load()
    if args.config_command == "use-context":
        contexts = contexts.use(args.name)
        doc: dict[str, Any] = {"file": str(contexts.path), "current": contexts.current}
        out.emit(doc, lambda: f"current context: {contexts.current} ({contexts.path})")
    elif args.config_command == "current-context":
        if contexts.current is None:
            print(f"wsctl: no current context in {contexts.path}", file=sys.stderr)
            return Exit.ERROR
        doc = {"file": str(contexts.path), "current": contexts.current}
        out.emit(doc, lambda: str(contexts.current))
    else:  # get-contexts
        doc = {"file": str(contexts.path), "current": contexts.current,
               "contexts": [dataclasses.asdict(c) for c in contexts.contexts.values()]}
        out.emit(doc, lambda: render.contexts(doc))
    return Exit.OK


# -- completion and keys -------------------------------------------------------------


def _completion(client: Client | None, args: argparse.Namespace, out: Output) -> Exit:
    text = completion.script(_parser(), args.shell)
    out.emit({"shell": args.shell, "script": text}, text.rstrip)
    return Exit.OK


def _completion_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", metavar="SHELL", choices=completion.SHELLS,
                   help=f"the shell: {', '.join(completion.SHELLS)}")



def _keygen(client: Client | None, args: argparse.Namespace, out: Output) -> Exit:
    from wsd.wire.curve import keygen  # ZeroMQ's CURVE: only for this command

    public, secret = keygen(args.name, args.dir)
    doc = {"public": str(public), "secret": str(secret)}
    out.emit(doc, lambda: (
        f"public key  {public}\n"
        f"secret key  {secret} (mode 0600: keep it where it is, readable by you only)\n"
        f"Copy {public.name} into the coordinator's [security] viewer_keys folder (read only) "
        f"or admin_keys folder (everything), or agent_keys for agents; then connect with\n"
        f"  wsctl --curve-client-key {secret} --curve-server-key SERVER.key ..."))
    return Exit.OK


# -- the command table ------------------------------------------------------------


def _send(spec: CommandSpec) -> Handler:
    return _command(lambda c, a: c.command(spec.name, a.group, wait=a.wait, engine=a.engine,
                                           new_engine=a.new_engine,
                                           **{arg.name: getattr(a, arg.name) for arg in spec.args}))


@dataclass(frozen=True)
class Spec:
    help: str
    run: Handler
    options: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    client: bool = True
    """Talks to a coordinator (``run`` gets a Client); False: ``run`` gets None."""
    rounds: bool = False
    """Runs in rounds until stopped (``watch``, ``events``): ``run`` puts each round under
    ``--timeout`` itself; else ``--timeout`` bounds the whole command."""


COMMANDS: dict[str, Spec] = {
    "ping": Spec("round trip to the coordinator", queries.ping),
    "engines": Spec("every engine: name, model, ranks, lock, slots, scratch, violations", queries.engines),
    "status": Spec("world, desired state and every TP group", queries.status, (opt.page,)),
    "ranks": Spec("every rank: state, host, pid, step, lock and slot count", queries.ranks),
    "stats": Spec("per rank, slot and TP group: capacity, peak, skew", queries.stats, (opt.selection, opt.fresh)),
    "events": Spec("the coordinator's event log", queries.events,
                   (opt.events, opt.count_interval(0.5, "events")), rounds=True),
    "stacks": Spec("every thread's Python stack of the workers, the engine's first", queries.stacks,
                   (opt.stacks,)),
    "profiles": Spec("sizing profiles: each slot's largest request per model, TP size and grid; --drop KEY",
                     queries.profiles, (opt.profiles,)),
    "watch": Spec("live per-rank, per-slot capacity and peak", queries.watch,
                  (opt.selection, opt.fresh, opt.count_interval(1.0, "rounds")), rounds=True),
    # The state-changing commands, from the command table.
    **{spec.cli: Spec(spec.help, _send(spec), (opt.arguments(spec), opt.target)) for spec in COMMAND_TABLE.values()},
    "keygen": Spec("write a CURVE key pair (NAME.key, NAME.key_secret)", _keygen,
                   (opt.keygen,), client=False),
    "completion": Spec("print a shell completion script (bash, zsh): source <(wsctl completion bash)",
                       _completion, (_completion_options,), client=False),
    "config": Spec("the contexts file: each cluster's endpoint and keys by name", _config, (opt.config,),
                   client=False),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsctl", description="Query and steer a wsd coordinator.",
                                     epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"wsctl {__version__}")
    opt.common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in COMMANDS.items():
        command = sub.add_parser(name, help=spec.help, description=spec.help)
        for add in spec.options:
            add(command)
        if spec.client and name not in ("ping", "engines", "profiles"):  # profiles: the coordinator's
            opt.engine(command)
        opt.common(command, top=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        # Not an argparse group: each may come before or after the command name, which
        # two parsers read. Together, one cluster's keys would go to another's endpoint.
        if args.endpoint is not None and args.context is not None:
            parser.error("argument --context: not allowed with argument --endpoint "
                         "(a context names its own endpoint and keys)")
    except SystemExit as e:  # usage error (2) or --help (0): a code, as for every outcome
        return e.code if isinstance(e.code, int) else Exit.USAGE
    out = Output(args.json, sys.stdout)
    spec = COMMANDS[args.command]
    from_env = os.environ.get("WSD_ENDPOINT")
    if spec.client and args.endpoint is None and args.context is None and from_env:  # --endpoint: by argparse
        problem = endpoint_problem(from_env)
        if problem is not None:
            print(f"wsctl: environment variable WSD_ENDPOINT {problem}", file=sys.stderr)
            return Exit.USAGE
    try:
        if not spec.client:
            return int(spec.run(None, args, out))  # type: ignore[arg-type]
        endpoint, server_key, client_key = _connection(args)
        with Client(endpoint, timeout=args.timeout, curve_server_key=server_key,
                    curve_client_key=client_key) as client:
            if spec.rounds:
                return int(spec.run(client, args, out))
            with client.deadline(args.timeout):
                return int(spec.run(client, args, out))
    except (ConfigError, BadEndpoint) as e:  # a key or contexts file wrong, unreadable or open to others
        print(f"wsctl: {e}", file=sys.stderr)
        return Exit.USAGE
    except ClientError as e:  # may carry a coordinator's message, and through it a peer's
        print(printable(f"wsctl: {e}"), file=sys.stderr)
        return Exit.ERROR
    except KeyboardInterrupt:
        print("wsctl: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``wsctl events -f | head``): stop quietly, and
        # keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
