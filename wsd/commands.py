"""Every state-changing command, declared once: ``COMMANDS``.

A command's row says everything the rest of wsd needs to know about it:

- its name (the wire's operation and the command log's action), its ``wsctl``
  subcommand and help, and its arguments with their bounds (``Argument``);
- how it changes the desired state the coordinator keeps per TP group, and
  which of the state's fields it touches;
- its place when a fresh rank takes on its group's desired state, and the
  arguments it is applied with then;
- whether the coordinator refuses it while the target is meant to be locked;
- the manager method an agent calls for it, and with what.

The protocol (schemas), the command log (desired state), the agent and the
simulated ranks (``call``), the coordinator (refusals), the client (``Client.command``)
and ``wsctl`` (its subcommands) read this table. A new command is a row here, an
``Op`` member of the same name (``wsd.wire.schemas``: the wire's vocabulary), and its
method on the manager and on ``wsd.agent.simulated.SimulatedManager`` (plus its tests
and docs; a new desired-state field also goes in ``DESIRED_FIELDS``).
``CommandResult`` is the reply every command gets, built by the coordinator and
read by the client.

No I/O; imports neither torch nor the protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wsd.slotstats import MAX_UBATCHES

__all__ = ["COMMANDS", "DESIRED_FIELDS", "Argument", "CommandResult", "CommandSpec", "call", "start_actions"]

DESIRED_FIELDS = ("locked", "num_ubatches", "reserve_bytes")
"""The desired state of a TP group, each field None until a command sets it."""


@dataclass(frozen=True)
class Argument:
    """One argument of a command: an integer within bounds (the only kind so far)."""

    name: str
    """Its field on the wire and in the command log."""
    low: int
    high: int
    metavar: str
    help: str
    size: bool = False
    """Given on the command line as a size (4096, 512KiB, 64MiB)."""


Desired = dict[str, Any]
Args = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class CommandSpec:
    name: str
    """The operation on the wire and the action in the command log: ``set_ubatches``."""
    cli: str
    """wsctl's subcommand: ``set-ubatches``."""
    help: str
    method: str
    """The ``WorkspaceManager`` method an agent calls (a simulated rank has the same)."""
    args: tuple[Argument, ...] = ()
    call_args: Callable[[Args], tuple[Any, ...]] = lambda args: ()
    """The method's positional arguments, from the command's arguments."""
    desired: Callable[[Desired, Args], None] | None = None
    """How it changes a group's desired state (None: it does not)."""
    touches: tuple[str, ...] = ()
    """The desired-state fields ``desired`` changes."""
    relative: bool = False
    """Its change depends on the field's value before it (reserve only raises it)."""
    start: int | None = None
    """Its place when a fresh rank takes on its group's desired state (None: not part of it)."""
    start_args: Callable[[Desired], Args | None] = lambda desired: None
    """The arguments it is applied with then, from the desired state (None: not applied)."""
    refused_while_locked: bool = False
    """Refused by the coordinator (``conflict``) while a target group is meant to be locked."""

    def __post_init__(self) -> None:
        if not set(self.touches) <= set(DESIRED_FIELDS):
            raise ValueError(f"{self.name}: touches {self.touches}, not all desired-state fields")
        if (self.desired is None) != (not self.touches):
            raise ValueError(f"{self.name}: a change to the desired state and the fields it touches go together")
        if self.start is not None and self.desired is None:
            raise ValueError(f"{self.name}: only a command that changes the desired state takes it on at start")


def _set(field: str, value: Any) -> Callable[[Desired, Args], None]:
    def change(state: Desired, args: Args) -> None:
        state[field] = value
    return change


def _set_arg(field: str, arg: str) -> Callable[[Desired, Args], None]:
    def change(state: Desired, args: Args) -> None:
        state[field] = args[arg]
    return change


def _raise_reserve(state: Desired, args: Args) -> None:
    state["reserve_bytes"] = max(state.get("reserve_bytes") or 0, args["bytes"])


COMMANDS: dict[str, CommandSpec] = {spec.name: spec for spec in (
    CommandSpec(
        name="lock", cli="lock", help="lock the workspaces: no slot may grow", method="operator_lock",
        desired=_set("locked", True), touches=("locked",),
        start=3, start_args=lambda d: {} if d.get("locked") is True else None,
    ),
    CommandSpec(
        # refused by the manager while the engine's own lock pins the buffers
        name="unlock", cli="unlock", help="unlock the workspaces", method="operator_unlock",
        desired=_set("locked", False), touches=("locked",),
        start=0, start_args=lambda d: {} if d.get("locked") is False else None,
    ),
    CommandSpec(
        name="set_ubatches", cli="set-ubatches", help="set the number of ubatch slots per lane",
        method="set_num_ubatches",
        args=(Argument("n", 1, MAX_UBATCHES, "N", f"ubatch slots per lane, 1..{MAX_UBATCHES}"),),
        call_args=lambda a: (a["n"],),
        desired=_set_arg("num_ubatches", "n"), touches=("num_ubatches",),
        start=1, start_args=lambda d: None if d.get("num_ubatches") is None else {"n": d["num_ubatches"]},
    ),
    CommandSpec(
        name="reserve", cli="reserve", help="size every slot to at least SIZE bytes (unlocked only)",
        method="reserve_bytes",
        args=(Argument("bytes", 0, 2**50, "SIZE", "bytes per slot: 4096, 512KiB, 64MiB, ...", size=True),),
        call_args=lambda a: (a["bytes"],),
        desired=_raise_reserve, touches=("reserve_bytes",), relative=True,
        start=2, start_args=lambda d: {"bytes": d["reserve_bytes"]} if d.get("reserve_bytes") else None,
        refused_while_locked=True,
    ),
    CommandSpec(name="equalize", cli="equalize", help="grow every slot to the largest one", method="equalize"),
    CommandSpec(
        name="trim", cli="trim", method="trim",
        help="release every slot's scratch buffer; the next request regrows it (unlocked only)",
        desired=_set("reserve_bytes", None), touches=("reserve_bytes",), refused_while_locked=True,
    ),
)}
_starts = [s.start for s in COMMANDS.values() if s.start is not None]
if len(_starts) != len(set(_starts)):
    raise ValueError(f"two commands take the same place at start: {sorted(_starts)}")


def start_actions(desired: Desired) -> list[tuple[str, Args]]:
    """What a fresh rank applies, in order, to take on its group's desired state.

    The rows' ``start`` give the order: an unlock first (so that a reserve can
    apply if the engine locked itself), then the slot count, the reservation
    (which sizes every slot, the new ones too), and a lock last, once the
    buffers are as big as they are meant to be.
    """
    order = sorted((s for s in COMMANDS.values() if s.start is not None), key=lambda s: s.start or 0)
    actions = []
    for spec in order:
        args = spec.start_args(desired)
        if args is not None:
            actions.append((spec.name, args))
    return actions


def call(target: Any, action: str, args: Args) -> None:
    """Apply ``action`` to ``target`` (a manager, or a simulated one) by its table row.

    ValueError for an action not in the table (a newer coordinator's): reported in
    the acknowledgement, never raised into the engine by the agent.
    """
    spec = COMMANDS.get(action)
    if spec is None:
        raise ValueError(f"unknown action {action!r}")
    getattr(target, spec.method)(*spec.call_args(args))


@dataclass(frozen=True)
class CommandResult:
    """The outcome of a state-changing command: built by the coordinator, read by the client."""

    seq: int
    action: str
    group: int | None
    waited: bool
    """False: answered once numbered (``wait: false``); the rest is then empty."""
    complete: bool = False
    """Every expected rank acknowledged."""
    acked: tuple[dict[str, Any], ...] = ()
    """``{rank, step, ok, error}`` per acknowledging rank."""
    failed: tuple[int, ...] = ()
    same_step: dict[int, bool] | None = None
    """Per TP group (keyed by its number, as ``steps()`` by rank): did all its ranks apply it
    at the same step. On the wire the keys are strings (msgpack maps from peers are read
    with string keys only)."""
    pending: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    missing: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The one encoding of a result: the reply's result on the wire, and the document
        ``wsctl --json`` prints (every field; with ``waited`` false, the rest empty).

        Shallow, not ``dataclasses.asdict``: that deep-copies every ack, 35 times the
        cost at 1,024 ranks, on the coordinator's loop. msgpack writes tuples as arrays.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.same_step is not None:
            out["same_step"] = {str(g): same for g, same in self.same_step.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommandResult:
        """Every field by name, sequences as tuples; a key this version does not know is ignored
        (a newer coordinator's, docs/protocol.md)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                value = d[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
        if values.get("same_step") is not None:
            values["same_step"] = {int(g): same for g, same in values["same_step"].items()}
        return cls(**values)

    def steps(self) -> dict[int, int]:
        return {a["rank"]: a["step"] for a in self.acked}
