"""The wire's vocabulary and the fields of every message: ``Op``, ``Field``, ``SCHEMAS``.

What each operation's body holds, each field with its type, bounds and default,
and ``validate_body``, which checks a decoded body against them and names the
field it refuses (a ``ProtocolError`` of ``BAD_FIELD``). Apart from the framing
(``wsd.wire.protocol``: the envelope, msgpack, what decoding may cost), which
re-exports every name here, so that ``p.Op`` and ``p.SCHEMAS`` read as before.

No I/O, no msgpack, no torch. Every row of the command table is an operation of
the same name, with its arguments' bounds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from wsd.commands import COMMANDS
from wsd.errors import ErrorCode, ProtocolError, StrEnum
from wsd.fmt import one_line
from wsd.names import ENGINE_NAME, MAX_ENGINE_NAME, engine_name_problem
from wsd.slotstats import MAX_LANES, MAX_UBATCHES

__all__ = [
    "ACK_MEMORY",
    "ACK_MEMORY_ERROR",
    "AGENT_OPS",
    "CLIENT_OPS",
    "COMMAND_OPS",
    "COORDINATOR_OPS",
    "COORDINATOR_STATE_OPS",
    "INT_MAX",
    "MAX_PRESIZE_SLOTS",
    "MAX_PROFILE_PAGE",
    "MAX_STATUS_GROUPS",
    "NEVER_REGISTERED",
    "READ_ONLY_OPS",
    "REGISTER_BYTES",
    "SCHEMAS",
    "AckRecord",
    "Field",
    "Op",
    "validate_body",
]


class Op(StrEnum):
    # client -> coordinator: read-only
    PING = "ping"
    ENGINES = "engines"
    STATUS = "status"
    RANKS = "ranks"
    STATS = "stats"
    EVENTS = "events"
    STACKS = "stacks"
    PROFILES = "profiles"
    # client -> coordinator: the coordinator's own state
    DROP_PROFILE = "drop_profile"
    # client -> coordinator: state-changing commands
    LOCK = "lock"
    UNLOCK = "unlock"
    SET_UBATCHES = "set_ubatches"
    RESERVE = "reserve"
    EQUALIZE = "equalize"
    TRIM = "trim"
    # agent -> coordinator
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    ACK = "ack"
    STATS_REPLY = "stats_reply"
    STATS_PUSH = "stats_push"
    STACKS_REPLY = "stacks_reply"
    EVENT = "event"
    GOODBYE = "goodbye"
    # coordinator -> agent
    REGISTERED = "registered"
    CHALLENGE = "challenge"
    PULSE = "pulse"
    COMMAND = "command"
    STATS_REQUEST = "stats_request"
    STATS_ACK = "stats_ack"
    STACKS_REQUEST = "stacks_request"
    REJECTED = "rejected"


# Every row of the command table is an operation of the same name (ValueError here, at
# import, for a row without its Op member).
COMMAND_OPS = frozenset(Op(name) for name in COMMANDS)
READ_ONLY_OPS = frozenset({Op.PING, Op.ENGINES, Op.STATUS, Op.RANKS, Op.STATS, Op.EVENTS, Op.PROFILES})
OPERATOR_READ_OPS = frozenset({Op.STACKS})
"""Requests that change nothing but that a viewer may not make: every thread's stack names the
code and files a worker runs, and gathering them interrupts every worker asked."""
COORDINATOR_STATE_OPS = frozenset({Op.DROP_PROFILE})
"""Requests that change the coordinator's own state and no rank's (no sequence number): an
admin's under CURVE, as commands are."""
CLIENT_OPS = COMMAND_OPS | READ_ONLY_OPS | OPERATOR_READ_OPS | COORDINATOR_STATE_OPS
AGENT_OPS = frozenset({Op.REGISTER, Op.HEARTBEAT, Op.ACK, Op.STATS_REPLY, Op.STATS_PUSH, Op.STACKS_REPLY, Op.EVENT,
                       Op.GOODBYE})
COORDINATOR_OPS = frozenset({Op.REGISTERED, Op.CHALLENGE, Op.PULSE, Op.COMMAND, Op.STATS_REQUEST, Op.STATS_ACK,
                             Op.STACKS_REQUEST, Op.REJECTED})

INT_MAX = 2**63 - 1
MAX_STATUS_GROUPS = 4096
MAX_PROFILE_PAGE = 256
"""The most sizing profiles one ``profiles`` answer carries (each up to a grid's slots)."""
"""The most TP groups one ``status`` answer lists (``limit``); the rest are further pages."""
NEVER_REGISTERED = "never registered"
"""The reason a missing rank reads in ``ranks``, ``status`` and ``stats`` when it has not
registered since the coordinator started (else ``lost`` or ``stopped``)."""
# Types whose values Field.check may accept on its fast path.
_PLAIN = frozenset({int, str, bool, dict, list, bytes})
_SIZED = frozenset({str, bytes, dict, list})
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _unprintable(value: str) -> bool:
    """A control character, or beyond ASCII a format character (a bidi override), a line or
    paragraph separator, or anything else a terminal would not show as itself."""
    return bool(_CONTROL.search(value)) if value.isascii() else not value.isprintable()
"""C0 and C1 control characters, DEL: never in a host name, a device or an event kind."""


@dataclass(frozen=True, slots=True)
class Field:
    """One body field: its type(s), whether required, its default and bounds."""

    name: str
    types: tuple[type, ...]
    required: bool = True
    default: Any = None
    low: float | None = None
    high: float | None = None
    nullable: bool = False
    max_len: int | None = None
    """The most characters, bytes, items or entries of a string, bytes, list or map."""
    printable: bool = False
    """A string that must hold no control character (a host name, a device): one from a peer
    would otherwise reach an operator's terminal raw (ESC, BEL)."""
    pattern: re.Pattern[str] | None = None
    """A string that must match this whole (an engine's name)."""

    def check(self, value: Any, where: str) -> Any:
        # The common case in one test: exactly a listed type (so never a bool
        # where a number is meant) and no float (whose finiteness the full
        # check tests), within bounds. Every agent message passes here.
        kind = type(value)
        if kind in self.types and kind in _PLAIN:
            if kind in _SIZED:
                if (self.max_len is None or len(value) <= self.max_len) and not (
                        self.printable and _unprintable(value)) and (
                        self.pattern is None or self.pattern.fullmatch(value)):
                    return value
            elif (self.low is None or self.low <= value) and (self.high is None or value <= self.high):
                return value
        if value is None and self.nullable:
            return None
        # bool is an int in Python; it is never accepted where a number is meant.
        if isinstance(value, bool) and bool not in self.types:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{self.name}: expected {self._kind()}, got a boolean")
        if float in self.types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.types):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{where}{self.name}: expected {self._kind()}, got {type(value).__name__}",
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{self.name}: must be finite")
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and ((self.low is not None and value < self.low) or (self.high is not None and value > self.high))):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{where}{self.name}: must be between {self.low:g} and {self.high:g}, got {value}",
            )
        if isinstance(value, (str, bytes, list, dict)) and self.max_len is not None and len(value) > self.max_len:
            unit = "characters" if isinstance(value, str) else "bytes" if isinstance(value, bytes) else "entries"
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"{where}{self.name}: at most {self.max_len} {unit}, got {len(value)}")
        if self.printable and isinstance(value, str) and _unprintable(value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{self.name}: must hold no control, format (bidi) or "
                                                     f"line-separator character, got {one_line(value)[:80]!r}")
        if self.pattern is not None and isinstance(value, str) and not self.pattern.fullmatch(value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{self.name}: {engine_name_problem(value)}")
        return value

    def _kind(self) -> str:
        names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                 dict: "a map", list: "a list", bytes: "bytes"}
        kind = " or ".join(names[t] for t in self.types)
        return kind + " or nil" if self.nullable else kind


def _f(name: str, *types: type, **kw: Any) -> Field:
    return Field(name, types, **kw)


def _int(name: str, low: int = 0, high: int = INT_MAX, **kw: Any) -> Field:
    return Field(name, (int,), low=low, high=high, **kw)


def _str(name: str, max_len: int, **kw: Any) -> Field:
    return Field(name, (str,), max_len=max_len, **kw)


def _map(name: str, max_len: int, **kw: Any) -> Field:
    return Field(name, (dict,), max_len=max_len, **kw)


def _opt(field: Field, default: Any = None) -> Field:
    return Field(field.name, field.types, False, default, field.low, field.high,
                 field.nullable or default is None, field.max_len, field.printable, field.pattern)


# The engine a request is for. None: the only engine the coordinator serves (its default
# engine while it serves none); with several, every engine, each answering for itself.
_ENGINE = _opt(Field("engine", (str,), max_len=MAX_ENGINE_NAME, pattern=ENGINE_NAME))
_TARGET = (
    _ENGINE,
    _opt(_int("group", 0, 65535)),
    _opt(_f("wait", bool), True),
    _opt(Field("timeout", (float,), low=0.0, high=3600.0)),
    # The named engine may be one the coordinator does not serve yet: the command sets the
    # desired state it starts into. Without it, an unknown engine is refused (a typo).
    _opt(_f("new_engine", bool), False),
)
_RANK = _int("rank", 0, 1 << 20)
# Bounds of what agents send: generous for every legitimate sender, small enough
# that nothing a peer claims costs the coordinator more than it can afford.
_HOST = _str("host", 255, printable=True)
_STATE = _opt(_map("state", 16), {})
_IN_STEP = _opt(Field("in_step", (float,), low=0.0, high=1e9))
MAX_PRESIZE_SLOTS = MAX_UBATCHES * MAX_LANES
"""The most slots a ``registered`` answer's ``presize`` sizes: a manager's whole grid."""
MAX_PROFILE_KEY = 300
"""The most characters of a sizing profile's key (``NAME:tpT:ubU:lnL``, a name of up to 256)."""
MAX_STACK_THREADS = 64
"""The most threads one stacks reply lists (wsd.agent.stacks.MAX_THREADS)."""
ACK_MEMORY = 64
"""Acknowledgements an agent keeps to resend when it registers again."""
ACK_MEMORY_ERROR = 200
"""Characters of each remembered acknowledgement's error that a registration resends."""


class AckRecord(NamedTuple):
    """A command's acknowledgement as an agent remembers it, to resend in its next registration
    (``register.acks``): on the wire a list of these fields in this order (``to_wire``), the
    fields of an ``ack`` message but its rank, and checked as one (``from_wire``)."""

    seq: int
    step: int
    ok: bool
    error: str | None
    """At most ``ACK_MEMORY_ERROR`` characters of the command's error; None: it applied."""

    def to_wire(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_wire(cls, value: Any, rank: int) -> AckRecord:
        """The record ``value`` holds, checked as ``rank``'s ``ack`` message would be;
        ProtocolError (``BAD_FIELD``) naming what is wrong."""
        if not (isinstance(value, list) and len(value) == len(cls._fields)):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"register.acks: expected [{', '.join(cls._fields)}]")
        body = validate_body(Op.ACK, {"rank": rank, **dict(zip(cls._fields, value))})
        return cls(*(body[name] for name in cls._fields))


REGISTER_BYTES = 128 << 10
"""The largest registration: ACK_MEMORY acks whose errors are ACK_MEMORY_ERROR characters
of up to 4 bytes each (about 52 KB), its state and config, with room to spare."""

SCHEMAS: dict[Op, tuple[Field, ...]] = {
    Op.PING: (),
    Op.ENGINES: (),
    # ``offset``, ``limit``: the page of TP groups the answer lists (a world of 2**20 ranks of
    # TP size 1 once made a 185 MB answer); ``groups_total`` says how many there are.
    Op.STATUS: (_ENGINE, _opt(_int("offset", 0, 1 << 20), 0), _opt(_int("limit", 1, MAX_STATUS_GROUPS), 512)),
    Op.RANKS: (_ENGINE,),
    # Answered from the snapshots the ranks pushed; ``fresh``: ask every rank now instead.
    Op.STATS: (_ENGINE, _opt(_int("group", 0, 65535)), _opt(Field("timeout", (float,), low=0.0, high=3600.0)),
               _opt(_f("fresh", bool), False)),
    # ``engine``: only the events of that engine (and those of none, such as the coordinator's start).
    Op.EVENTS: (_opt(_int("cursor"), 0), _opt(_int("limit", 1, 10_000), 100), _ENGINE),
    # Every thread's stack of the live ranks asked for: ``rank``, or ``group``, or (neither) all.
    Op.STACKS: (_ENGINE, _opt(_int("group", 0, 65535)), _opt(_int("rank", 0, 1 << 20)),
                _opt(Field("timeout", (float,), low=0.0, high=60.0))),
    # Every sizing profile the coordinator keeps (wsd.coordinator.profiles).
    Op.PROFILES: (_opt(_int("offset", 0, 1 << 20), 0), _opt(_int("limit", 1, MAX_PROFILE_PAGE), 64)),
    # Forget the sizing profile of this key (NAME:tpT:ubU:lnL, as ``profiles`` lists it).
    Op.DROP_PROFILE: (_str("key", MAX_PROFILE_KEY),),
    **{Op(spec.name): (*(_int(a.name, a.low, a.high) for a in spec.args), *_TARGET) for spec in COMMANDS.values()},
    Op.REGISTER: (
        _RANK,
        _int("world_size", 1, 1 << 20),
        _int("tp_size", 1, 1 << 20),
        _int("tp_group", 0, 1 << 20),
        _HOST,
        _int("pid", 0, 1 << 31),
        _str("device", 64, printable=True),
        _opt(_int("applied_seq")),
        _opt(Field("acks", (list,), max_len=ACK_MEMORY), []),
        _opt(_int("step"), 0),
        _opt(_f("idle", bool), False),
        _STATE,
        _opt(_map("config", 64), {}),
        # Who is registering: one value per agent process, kept across its
        # reconnections. Where there is an agent token: the agent's nonce, fresh per
        # registration; in its second REGISTER the coordinator's CHALLENGE nonce too, and
        # the proof that the sender holds the token (wsd.security.registration_proof).
        _opt(_str("instance", 64)),
        _opt(_str("proof", 128)),
        _opt(_str("nonce", 64)),
        _opt(_str("challenge", 64)),
        # The engine this rank belongs to (None: the coordinator's default engine), and what
        # it serves (a model's name), shown in ``wsctl engines``.
        _ENGINE,
        _opt(_str("model", 256, printable=True)),
        # [workspace] presize = "profile": [num_ubatches, num_lanes], the grid this rank wants
        # its profile's sizes for (answered in ``registered.presize``).
        _opt(Field("presize", (list,), max_len=2)),
    ),
    # ``stats_version``: the agent has just found its snapshot unchanged since the push
    # of that version the coordinator acknowledged (so that version is fresh now).
    # ``in_step``: seconds the engine has been inside its current step (nil: between steps).
    Op.HEARTBEAT: (_RANK, _int("step"), _int("applied_seq"), _int("held_seq"), _STATE,
                   _opt(_int("stats_version", 1)), _IN_STEP),
    Op.ACK: (_RANK, _int("seq", 1), _int("step"), _f("ok", bool), _opt(_str("error", 4096))),
    Op.STATS_REPLY: (_RANK, _int("request"), _map("stats", 64), _opt(_int("step"), 0)),
    # A changed snapshot, pushed by the agent; also a heartbeat. ``base`` nil: ``stats`` is
    # the whole snapshot; else ``delta`` holds what changed since the acknowledged push
    # numbered ``base`` (wsd.slotstats.snapshot_delta).
    Op.STATS_PUSH: (_RANK, _int("version", 1), _opt(_int("base", 1)), _int("step"), _int("applied_seq"),
                    _int("held_seq"), _STATE, _opt(_map("stats", 64)), _opt(_map("delta", 8)), _IN_STEP),
    # Every thread's stack (wsd.agent.stacks), for stacks request ``request``, or (0) sent
    # on the agent's own when its engine has been inside one step for ``stall_after``.
    Op.STACKS_REPLY: (_RANK, _int("request"), _int("step"), _IN_STEP,
                      Field("threads", (list,), max_len=MAX_STACK_THREADS)),
    Op.EVENT: (_RANK, _str("kind", 64, printable=True), _opt(_map("detail", 32), {})),
    # A worker shutting down cleanly: its rank is stopped, not lost. No answer.
    Op.GOODBYE: (_RANK, _opt(_int("step"), 0), _opt(_int("applied_seq")), _opt(_int("held_seq")), _STATE),
    Op.REGISTERED: (_f("epoch", str), _int("baseline_seq"),
                    Field("heartbeat_interval", (float,), low=0.001, high=3600.0),
                    Field("heartbeat_timeout", (float,), low=0.001, high=3600.0),
                    # Seconds between the agent's looks at its snapshot (it pushes what changed).
                    _opt(Field("stats_interval", (float,), low=0.001, high=3600.0)),
                    # Seconds inside one engine step after which the agent sends its stacks once.
                    _opt(Field("stall_after", (float,), low=0.001, high=1e6)),
                    # To a fresh process: its TP group's desired state at baseline_seq
                    # ({locked, num_ubatches, reserve_bytes}, each nil if never set).
                    _opt(_f("desired", dict)),
                    # To a process the kept log cannot bring up to date (it applied less than
                    # the oldest command kept, or than a resume_seq): start again from
                    # baseline_seq with the desired state, as a fresh process does.
                    _opt(_f("rebase", bool), False),
                    # To a registration that asked (``presize``): its profile's per-slot sizes,
                    # [[ubatch, lane, bytes], ...]; nil: no profile of its key is known.
                    _opt(Field("presize", (list,), max_len=MAX_PRESIZE_SLOTS)),
                    # Where there is an agent token: that this answer is the coordinator's own,
                    # to this registration (wsd.security.registered_proof).
                    _opt(_str("proof", 128))),
    # Where there is an agent token, the answer to a first REGISTER: the coordinator's nonce,
    # and its proof that it holds the token (wsd.security.challenge_proof).
    Op.CHALLENGE: (_str("nonce", 64), _str("proof", 128)),
    Op.PULSE: (_f("epoch", str), _opt(_f("registered", bool), True)),
    # ``mac``: where there is an agent token, the command authenticated under the registration's
    # session key (wsd.security.command_mac); an agent applies no command without it.
    Op.COMMAND: (_int("seq", 1), _f("action", str), _opt(_f("args", dict), {}), _opt(_int("group", 0, 65535)),
                 _opt(_str("mac", 128))),
    Op.STATS_REQUEST: (_int("request"),),
    Op.STACKS_REQUEST: (_int("request", 1),),
    # The push numbered ``version`` is the coordinator's now (``ok``), or it could not use
    # it (a delta on another base, or invalid): the agent pushes its whole snapshot next.
    Op.STATS_ACK: (_int("version", 1), _f("ok", bool)),
    Op.REJECTED: (_f("code", str), _f("message", str)),
}

_KNOWN = {op: frozenset(f.name for f in schema) for op, schema in SCHEMAS.items()}
_WHERE = {op: f"{op}." for op in Op}  # the prefix naming a body field in errors


def validate_body(op: Op, body: dict[Any, Any]) -> dict[str, Any]:
    schema = SCHEMAS[op]
    where = _WHERE[op]
    known = _KNOWN[op]
    if not known.issuperset(body):
        key = next(k for k in body if k not in known)
        allowed = ", ".join(sorted(known)) or "none"
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{key}: unknown field (allowed: {allowed})")
    out: dict[str, Any] = {}
    for f in schema:
        if f.name in body:
            out[f.name] = f.check(body[f.name], where)
        elif f.required:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{f.name}: missing required field")
        else:
            default = f.default
            out[f.name] = list(default) if isinstance(default, list) else (
                dict(default) if isinstance(default, dict) else default)
    return out
