"""The wire: message types, their fields and validation, msgpack encode/decode.

No I/O and no torch. Every message is one msgpack map:

    request   {"v": 1, "op": "<Op>", "id": <int>, "body": {...}}
    reply     {"v": 1, "id": <int>, "ok": true,  "result": {...}}
              {"v": 1, "id": <int>, "ok": false, "error": {"code": "<ErrorCode>", "message": "..."}}

Agents and the coordinator also send each other requests that need no reply
(heartbeat, command, ack, ...); they use the same envelope. ``decode`` turns any
bytes into a validated ``Message`` or a ``ProtocolError`` naming the field: it
never lets another exception out. No pickle anywhere.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import msgpack

from wsd.config import MAX_UBATCHES
from wsd.errors import WsdError

__all__ = [
    "CLIENT_OPS",
    "COMMAND_OPS",
    "PROTOCOL_VERSION",
    "READ_ONLY_OPS",
    "ErrorCode",
    "Message",
    "Op",
    "ProtocolError",
    "decode",
    "decode_reply",
    "encode",
    "error_reply",
    "ok_reply",
    "ok_reply_packed",
]

PROTOCOL_VERSION = 1


class StrEnum(str, enum.Enum):
    """``enum.StrEnum`` for Python 3.10 too: members are their string values."""

    def __str__(self) -> str:
        return str(self.value)


class Op(StrEnum):
    # client -> coordinator: read-only
    PING = "ping"
    STATUS = "status"
    RANKS = "ranks"
    STATS = "stats"
    EVENTS = "events"
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
    EVENT = "event"
    GOODBYE = "goodbye"
    # coordinator -> agent
    REGISTERED = "registered"
    PULSE = "pulse"
    COMMAND = "command"
    STATS_REQUEST = "stats_request"
    REJECTED = "rejected"


class ErrorCode(StrEnum):
    BAD_MESSAGE = "bad_message"
    """Not a msgpack map, or no usable envelope: fix the sender."""
    BAD_VERSION = "bad_version"
    """Another protocol version: upgrade the older side."""
    UNKNOWN_OP = "unknown_op"
    """No such operation (or not on this socket)."""
    BAD_FIELD = "bad_field"
    """A field missing, of the wrong type or out of range: the message names it."""
    TOO_LARGE = "too_large"
    """Larger than the socket's message limit."""
    MISMATCH = "mismatch"
    """A rank's world does not match the coordinator's: fix the launch."""
    CONFLICT = "conflict"
    """Refused by the desired state (e.g. reserve while locked): unlock first."""
    FORBIDDEN = "forbidden"
    """This client's key may only read."""
    TIMEOUT = "timeout"
    """No reply in time: retry, or check the coordinator."""
    UNAVAILABLE = "unavailable"
    """The coordinator cannot be reached: check it runs and the endpoint."""
    STORAGE = "storage"
    """The coordinator cannot write its state file (a full disk, permissions): the
    message names the file. Nothing was numbered or sent; free space and retry."""
    INTERNAL = "internal"
    """A bug in wsd: report it with the coordinator's log."""


class ProtocolError(WsdError):
    """A message that cannot be accepted; ``code`` says why, the message names the field."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


COMMAND_OPS = frozenset({Op.LOCK, Op.UNLOCK, Op.SET_UBATCHES, Op.RESERVE, Op.EQUALIZE, Op.TRIM})
READ_ONLY_OPS = frozenset({Op.PING, Op.STATUS, Op.RANKS, Op.STATS, Op.EVENTS})
CLIENT_OPS = COMMAND_OPS | READ_ONLY_OPS
AGENT_OPS = frozenset({Op.REGISTER, Op.HEARTBEAT, Op.ACK, Op.STATS_REPLY, Op.EVENT, Op.GOODBYE})
COORDINATOR_OPS = frozenset({Op.REGISTERED, Op.PULSE, Op.COMMAND, Op.STATS_REQUEST, Op.REJECTED})

_INT_MAX = 2**63 - 1
# Types whose values Field.check may accept on its fast path.
_PLAIN = frozenset({int, str, bool, dict, list, bytes})


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

    def check(self, value: Any, where: str) -> Any:
        # The common case in one test: exactly a listed type (so never a bool
        # where a number is meant) and no float (whose finiteness the full
        # check tests), within bounds. Every agent message passes here.
        if type(value) in self.types and type(value) in _PLAIN and (
                self.low is None or self.low <= value) and (self.high is None or value <= self.high):
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                raise ProtocolError(
                    ErrorCode.BAD_FIELD,
                    f"{where}{self.name}: must be between {self.low:g} and {self.high:g}, got {value}",
                )
        return value

    def _kind(self) -> str:
        names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                 dict: "a map", list: "a list", bytes: "bytes"}
        kind = " or ".join(names[t] for t in self.types)
        return kind + " or nil" if self.nullable else kind


def _f(name: str, *types: type, **kw: Any) -> Field:
    return Field(name, types, **kw)


def _int(name: str, low: int = 0, high: int = _INT_MAX, **kw: Any) -> Field:
    return Field(name, (int,), low=low, high=high, **kw)


def _opt(field: Field, default: Any = None) -> Field:
    return Field(field.name, field.types, False, default, field.low, field.high, field.nullable or default is None)


_TARGET = (
    _opt(_int("group", 0, 65535)),
    _opt(_f("wait", bool), True),
    _opt(Field("timeout", (float,), low=0.0, high=3600.0)),
)
_RANK = _int("rank", 0, 1 << 20)

SCHEMAS: dict[Op, tuple[Field, ...]] = {
    Op.PING: (),
    Op.STATUS: (),
    Op.RANKS: (),
    Op.STATS: (_opt(_int("group", 0, 65535)), _opt(Field("timeout", (float,), low=0.0, high=3600.0))),
    Op.EVENTS: (_opt(_int("cursor"), 0), _opt(_int("limit", 1, 10_000), 100)),
    Op.LOCK: _TARGET,
    Op.UNLOCK: _TARGET,
    Op.SET_UBATCHES: (_int("n", 1, MAX_UBATCHES), *_TARGET),
    Op.RESERVE: (_int("bytes", 0, 2**50), *_TARGET),
    Op.EQUALIZE: _TARGET,
    Op.TRIM: _TARGET,
    Op.REGISTER: (
        _RANK,
        _int("world_size", 1, 1 << 20),
        _int("tp_size", 1, 1 << 20),
        _int("tp_group", 0, 1 << 20),
        _f("host", str),
        _int("pid", 0, 1 << 31),
        _f("device", str),
        _opt(_int("applied_seq")),
        _opt(_f("acks", list), []),
        _opt(_int("step"), 0),
        _opt(_f("idle", bool), False),
        _opt(_f("state", dict), {}),
        _opt(_f("config", dict), {}),
    ),
    Op.HEARTBEAT: (_RANK, _int("step"), _int("applied_seq"), _int("held_seq"), _opt(_f("state", dict), {})),
    Op.ACK: (_RANK, _int("seq", 1), _int("step"), _f("ok", bool), _opt(_f("error", str))),
    Op.STATS_REPLY: (_RANK, _int("request"), _f("stats", dict), _opt(_int("step"), 0)),
    Op.EVENT: (_RANK, _f("kind", str), _opt(_f("detail", dict), {})),
    # A worker shutting down cleanly: its rank is stopped, not lost. No answer.
    Op.GOODBYE: (_RANK, _opt(_int("step"), 0), _opt(_int("applied_seq")), _opt(_int("held_seq")),
                 _opt(_f("state", dict), {})),
    Op.REGISTERED: (_f("epoch", str), _int("baseline_seq"), Field("heartbeat_interval", (float,), low=0.001, high=3600.0),
                    Field("heartbeat_timeout", (float,), low=0.001, high=3600.0),
                    # To a fresh process: its TP group's desired state at baseline_seq
                    # ({locked, num_ubatches, reserve_bytes}, each nil if never set).
                    _opt(_f("desired", dict))),
    Op.PULSE: (_f("epoch", str), _opt(_f("registered", bool), True)),
    Op.COMMAND: (_int("seq", 1), _f("action", str), _opt(_f("args", dict), {}), _opt(_int("group", 0, 65535))),
    Op.STATS_REQUEST: (_int("request"),),
    Op.REJECTED: (_f("code", str), _f("message", str)),
}

# What decode looks up for every message, computed once.
_OPS = {op.value: op for op in Op}
_KNOWN = {op: frozenset(f.name for f in schema) for op, schema in SCHEMAS.items()}
_WHERE = {op: f"{op}." for op in Op}  # the prefix naming a body field in errors


@dataclass(frozen=True, slots=True)
class Message:
    """A validated request: its operation, id and body (defaults filled in)."""

    op: Op
    id: int
    body: dict[str, Any]


def encode(op: Op, body: dict[str, Any] | None = None, request_id: int = 0, *,
           packed: dict[str, bytes] | None = None) -> bytes:
    """One request frame; ``packed`` adds body fields whose values are already msgpack-encoded."""
    if packed:
        return _spliced({"v": PROTOCOL_VERSION, "op": str(op), "id": request_id},
                        {"body": _spliced(body or {}, packed)})
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "op": str(op), "id": request_id, "body": body or {}},
        use_bin_type=True,
    )


def _spliced(items: dict[str, Any], packed: dict[str, bytes]) -> bytes:
    """A msgpack map of ``items`` plus ``packed``, whose values are already encoded.

    msgpack frames a map as a header followed by its keys and values, so an
    encoded value is spliced in as it is, not decoded and encoded again: for
    a large value built in parts as they arrive (the ``stats`` answer) or
    encoded once and sent many times.
    """
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(items) + len(packed))]
    for key, value in items.items():
        parts += [packer.pack(key), packer.pack(value)]
    for key, raw in packed.items():
        parts += [packer.pack(key), raw]
    return b"".join(parts)


def ok_reply(request_id: int, result: Any = None) -> bytes:
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result if result is not None else {}},
        use_bin_type=True,
    )


def ok_reply_packed(request_id: int, result: bytes) -> bytes:
    """``ok_reply`` of a result already msgpack-encoded (one whole object)."""
    return _spliced({"v": PROTOCOL_VERSION, "id": request_id, "ok": True}, {"result": result})


def error_reply(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "id": request_id if request_id is not None else 0, "ok": False,
         "error": {"code": str(code), "message": message}},
        use_bin_type=True,
    )


def _unpack(frame: bytes) -> dict[Any, Any]:
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of types for hostile bytes
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a message must be a msgpack map, got {type(data).__name__}")
    return data


def _envelope(data: dict[Any, Any]) -> int:
    request_id = data.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= _INT_MAX:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"id: expected a non-negative integer, got {request_id!r}")
    version = data.get("v")
    # Exactly the integer: True == 1 and 1.0 == 1 in Python, but neither is a version.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"v: protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})",
            request_id,
        )
    return request_id


def decode(frame: bytes, allowed: frozenset[Op] | None = None) -> Message:
    """Validate one request frame; ProtocolError (with the request id if known) otherwise."""
    data = _unpack(frame)
    request_id = _envelope(data)
    raw_op = data.get("op")
    # A plain lookup, not Op(raw_op): the enum's call costs a microsecond of every message.
    op = _OPS.get(raw_op) if type(raw_op) is str else None
    if op is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op: unknown operation {raw_op!r}", request_id)
    if allowed is not None and op not in allowed:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op: {op} is not accepted here", request_id)
    body = data.get("body", {})
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"body: expected a map, got {type(body).__name__}", request_id)
    try:
        return Message(op, request_id, validate_body(op, body))
    except ProtocolError as e:
        e.request_id = request_id
        raise


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


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    ok: bool
    result: Any
    code: ErrorCode | None
    message: str


def decode_reply(frame: bytes) -> Reply:
    """Validate a reply frame; ProtocolError if it is not one."""
    data = _unpack(frame)
    request_id = _envelope(data)
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError(ErrorCode.BAD_FIELD, "ok: expected a boolean", request_id)
    if ok:
        return Reply(request_id, True, data.get("result"), None, "")
    error = data.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        raise ProtocolError(ErrorCode.BAD_FIELD, "error: expected a map with code and message", request_id)
    try:
        code = ErrorCode(error.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    return Reply(request_id, False, None, code, error["message"])
