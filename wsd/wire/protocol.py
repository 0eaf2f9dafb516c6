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

import gc
import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from wsd.commands import COMMANDS

# Here too, the wire's error and its codes: p.ProtocolError, p.ErrorCode.
from wsd.errors import ErrorCode, ProtocolError, StrEnum
from wsd.names import ENGINE_NAME, MAX_ENGINE_NAME, engine_name_problem

__all__ = [
    "CLIENT_OPS",
    "COMMAND_OPS",
    "NEVER_REGISTERED",
    "PROTOCOL_VERSION",
    "READ_ONLY_OPS",
    "ErrorCode",
    "Message",
    "Op",
    "ProtocolError",
    "StrEnum",
    "decode",
    "decode_reply",
    "encode",
    "error_reply",
    "ok_reply",
    "ok_reply_packed",
]

PROTOCOL_VERSION = 1


class Op(StrEnum):
    # client -> coordinator: read-only
    PING = "ping"
    ENGINES = "engines"
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
    STATS_PUSH = "stats_push"
    EVENT = "event"
    GOODBYE = "goodbye"
    # coordinator -> agent
    REGISTERED = "registered"
    CHALLENGE = "challenge"
    PULSE = "pulse"
    COMMAND = "command"
    STATS_REQUEST = "stats_request"
    STATS_ACK = "stats_ack"
    REJECTED = "rejected"


# Every row of the command table is an operation of the same name (ValueError here, at
# import, for a row without its Op member).
COMMAND_OPS = frozenset(Op(name) for name in COMMANDS)
READ_ONLY_OPS = frozenset({Op.PING, Op.ENGINES, Op.STATUS, Op.RANKS, Op.STATS, Op.EVENTS})
CLIENT_OPS = COMMAND_OPS | READ_ONLY_OPS
AGENT_OPS = frozenset({Op.REGISTER, Op.HEARTBEAT, Op.ACK, Op.STATS_REPLY, Op.STATS_PUSH, Op.EVENT, Op.GOODBYE})
COORDINATOR_OPS = frozenset({Op.REGISTERED, Op.CHALLENGE, Op.PULSE, Op.COMMAND, Op.STATS_REQUEST, Op.STATS_ACK,
                             Op.REJECTED})

_INT_MAX = 2**63 - 1
MAX_STATUS_GROUPS = 4096
"""The most TP groups one ``status`` answer lists (``limit``); the rest are further pages."""
NEVER_REGISTERED = "never registered"
"""The reason a missing rank reads in ``ranks``, ``status`` and ``stats`` when it has not
registered since the coordinator started (else ``lost`` or ``stopped``)."""
# Types whose values Field.check may accept on its fast path.
_PLAIN = frozenset({int, str, bool, dict, list, bytes})
_SIZED = frozenset({str, bytes, dict, list})
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
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
                        self.printable and _CONTROL.search(value)) and (
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
        if self.printable and isinstance(value, str) and _CONTROL.search(value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{where}{self.name}: must hold no control character, "
                                                     f"got {_CONTROL.sub('?', value)[:80]!r}")
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


def _int(name: str, low: int = 0, high: int = _INT_MAX, **kw: Any) -> Field:
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
)
_RANK = _int("rank", 0, 1 << 20)
# Bounds of what agents send: generous for every legitimate sender, small enough
# that nothing a peer claims costs the coordinator more than it can afford.
_HOST = _str("host", 255, printable=True)
_STATE = _opt(_map("state", 16), {})
ACK_MEMORY = 64
"""Acknowledgements an agent keeps to resend when it registers again."""
ACK_MEMORY_ERROR = 200
"""Characters of each remembered acknowledgement's error that a registration resends."""
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
    ),
    # ``stats_version``: the agent has just found its snapshot unchanged since the push
    # of that version the coordinator acknowledged (so that version is fresh now).
    Op.HEARTBEAT: (_RANK, _int("step"), _int("applied_seq"), _int("held_seq"), _STATE,
                   _opt(_int("stats_version", 1))),
    Op.ACK: (_RANK, _int("seq", 1), _int("step"), _f("ok", bool), _opt(_str("error", 4096))),
    Op.STATS_REPLY: (_RANK, _int("request"), _map("stats", 64), _opt(_int("step"), 0)),
    # A changed snapshot, pushed by the agent; also a heartbeat. ``base`` nil: ``stats`` is
    # the whole snapshot; else ``delta`` holds what changed since the acknowledged push
    # numbered ``base`` (wsd.slotstats.snapshot_delta).
    Op.STATS_PUSH: (_RANK, _int("version", 1), _opt(_int("base", 1)), _int("step"), _int("applied_seq"),
                    _int("held_seq"), _STATE, _opt(_map("stats", 64)), _opt(_map("delta", 8))),
    Op.EVENT: (_RANK, _str("kind", 64, printable=True), _opt(_map("detail", 32), {})),
    # A worker shutting down cleanly: its rank is stopped, not lost. No answer.
    Op.GOODBYE: (_RANK, _opt(_int("step"), 0), _opt(_int("applied_seq")), _opt(_int("held_seq")), _STATE),
    Op.REGISTERED: (_f("epoch", str), _int("baseline_seq"),
                    Field("heartbeat_interval", (float,), low=0.001, high=3600.0),
                    Field("heartbeat_timeout", (float,), low=0.001, high=3600.0),
                    # Seconds between the agent's looks at its snapshot (it pushes what changed).
                    _opt(Field("stats_interval", (float,), low=0.001, high=3600.0)),
                    # To a fresh process: its TP group's desired state at baseline_seq
                    # ({locked, num_ubatches, reserve_bytes}, each nil if never set).
                    _opt(_f("desired", dict)),
                    # To a process the kept log cannot bring up to date (it applied less than
                    # the oldest command kept, or than a resume_seq): start again from
                    # baseline_seq with the desired state, as a fresh process does.
                    _opt(_f("rebase", bool), False),
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
    # The push numbered ``version`` is the coordinator's now (``ok``), or it could not use
    # it (a delta on another base, or invalid): the agent pushes its whole snapshot next.
    Op.STATS_ACK: (_int("version", 1), _f("ok", bool)),
    Op.REJECTED: (_f("code", str), _f("message", str)),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """What decoding one operation's body may cost: its bytes, and msgpack's length
    limits on every string, bytes, list and map in it (checked as it decodes)."""

    body_bytes: int
    str_len: int = 4096
    bin_len: int = 4096
    array_len: int = 256
    map_len: int = 64


_SMALL = Limits(4096)
# A client's request is bounded by the client endpoint's max_message_bytes
# alone, so that a field too long is refused naming the field.
_CLIENT = Limits(1 << 24, str_len=1 << 24, bin_len=1 << 24, array_len=1 << 24, map_len=1 << 24)
# Per operation. A stats reply is the one large message an agent sends (every
# slot's columns, up to MAX_UBATCHES x MAX_LANES slots); everything else it sends
# fits in a few KiB.
LIMITS: dict[Op, Limits] = {
    **{op: _SMALL for op in Op},
    **{op: _CLIENT for op in CLIENT_OPS},
    Op.REGISTER: Limits(REGISTER_BYTES, array_len=ACK_MEMORY),
    Op.ACK: Limits(8 << 10),  # an error of up to 4,096 characters, some of them multi-byte
    Op.EVENT: Limits(16 << 10, str_len=16 << 10),
    Op.STATS_REPLY: Limits(16 << 20, str_len=1 << 16, bin_len=16 << 20, array_len=1 << 16, map_len=1 << 16),
    Op.STATS_PUSH: Limits(16 << 20, str_len=1 << 16, bin_len=16 << 20, array_len=1 << 16, map_len=1 << 16),
    # Coordinator to agent, which trusts its coordinator's sizes.
    Op.COMMAND: Limits(64 << 10),
    Op.REGISTERED: Limits(64 << 10),
    Op.REJECTED: Limits(64 << 10, str_len=1 << 16),
}
# A frame this small is decoded whole at once: whatever it holds, it holds at
# most this many objects (a few hundred microseconds at worst).
SMALL_FRAME = 4096
# The envelope's own values ("v", "op", "id") are tiny.
_ENVELOPE = {"max_str_len": 64, "max_bin_len": 64, "max_array_len": 8, "max_map_len": 8}
_ENVELOPE_KEYS = 8

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
    by: dict[str, str] | None = None
    """Who sent it, as the client says (``ISSUER_KEYS``): the envelope's ``by``, which a
    coordinator that predates it skips, so a newer client still talks to it. Not proof
    of anything: a CURVE role, where there is one, is the coordinator's own knowledge."""


ISSUER_KEYS = ("user", "host")
"""What a client says of itself in a request's envelope (``by``)."""
MAX_ISSUER_TEXT = 64
"""The longest of each, in characters."""


def _issuer(raw: Any, request_id: int) -> dict[str, str]:
    """The envelope's ``by``, checked: a map of ``ISSUER_KEYS`` to short printable text."""
    if not isinstance(raw, dict) or not set(raw) <= set(ISSUER_KEYS):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"by: expected a map of {', '.join(ISSUER_KEYS)}", request_id)
    for key, value in raw.items():
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ISSUER_TEXT or not value.isprintable():
            raise ProtocolError(ErrorCode.BAD_FIELD, f"by.{key}: expected 1 to {MAX_ISSUER_TEXT} printable characters",
                                request_id)
    return dict(raw)


def encode(op: Op, body: dict[str, Any] | None = None, request_id: int = 0, *,
           packed: dict[str, bytes] | None = None, by: dict[str, str] | None = None) -> bytes:
    """One request frame; ``packed`` adds body fields whose values are already msgpack-encoded;
    ``by``: who sends it (``Message.by``)."""
    envelope: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": str(op), "id": request_id}
    if by:
        envelope["by"] = by
    if packed:
        return spliced(envelope, {"body": spliced(body or {}, packed)})
    return msgpack.packb({**envelope, "body": body or {}}, use_bin_type=True)


def spliced(items: dict[str, Any], packed: dict[str, bytes]) -> bytes:
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
    return spliced({"v": PROTOCOL_VERSION, "id": request_id, "ok": True}, {"result": result})


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


def _split(frame: bytes) -> tuple[dict[Any, Any], tuple[int, int] | None]:
    """The envelope's values, and where the body's bytes are, without decoding the body.

    The body is skipped (msgpack walks it without building an object), so that
    its cost is known from its size and operation before anything is built.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(frame), 1),
                                **_ENVELOPE)
    unpacker.feed(frame)
    envelope: dict[Any, Any] = {}
    body = None
    try:
        try:
            entries = unpacker.read_map_header()
        except ValueError:  # another type: decode it for the message that names it
            _unpack(frame)
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a msgpack map") from None
        if entries > _ENVELOPE_KEYS:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a message has at most {_ENVELOPE_KEYS} keys, got {entries}")
        for _ in range(entries):
            key = unpacker.unpack()
            if type(key) is not str:
                raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                    f"not a msgpack message of this protocol: a key {key!r} that is not a string")
            if key == "body":
                start = unpacker.tell()
                unpacker.skip()
                body = (start, unpacker.tell())
            elif key in ("v", "op", "id", "by"):
                try:
                    envelope[key] = unpacker.unpack()
                except ValueError as e:
                    if "exceeds max" not in str(e):
                        raise
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"{key}: not a valid {key} ({e})") from None
            else:
                unpacker.skip()
        if unpacker.tell() != len(frame):
            raise ProtocolError(ErrorCode.BAD_MESSAGE,
                                f"not a msgpack message: {len(frame) - unpacker.tell()} bytes after its end")
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types for hostile bytes
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message ({type(e).__name__}: {e})") from e
    return envelope, body


def _loads(raw: bytes, limits: Limits) -> Any:
    """One msgpack object, each string, list and map in it within ``limits``.

    Without the cyclic garbage collector while it builds: msgpack's objects hold
    no cycles, and a collection every few hundred containers made a body of
    millions of empty lists five times as costly to decode.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=limits.str_len,
                               max_bin_len=limits.bin_len, max_array_len=limits.array_len,
                               max_map_len=limits.map_len)
    except ValueError as e:
        if "exceeds max" in str(e):  # msgpack's words for a length limit
            raise ProtocolError(ErrorCode.TOO_LARGE, f"body: {e}") from e
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message ({type(e).__name__}: {e})") from e
    except Exception as e:  # msgpack raises a zoo of types for hostile bytes
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message ({type(e).__name__}: {e})") from e
    finally:
        if collecting:
            gc.enable()


def peek_op(frame: bytes) -> str | None:
    """The operation a frame names, without decoding its body (None if it names none).

    Costs a walk over the frame's bytes, building nothing: for deciding whether a
    large frame is wanted at all before ``decode`` builds its body.
    """
    try:
        envelope, _ = _split(frame)
    except ProtocolError:
        return None
    op = envelope.get("op")
    return op if type(op) is str else None


def decode(frame: bytes, allowed: frozenset[Op] | None = None) -> Message:
    """Validate one request frame; ProtocolError (with the request id if known) otherwise.

    Its cost is bounded by the operation's ``LIMITS``: the body is decoded only
    once the operation is known and the body's size is within its limit.
    """
    if len(frame) <= SMALL_FRAME:  # costs little whatever it holds: decoded in one call
        data, span = _unpack(frame), None
    else:
        data, span = _split(frame)
    request_id = _envelope(data)
    raw_op = data.get("op")
    # A plain lookup, not Op(raw_op): the enum's call costs a microsecond of every message.
    op = _OPS.get(raw_op) if type(raw_op) is str else None
    if op is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op: unknown operation {raw_op!r}", request_id)
    if allowed is not None and op not in allowed:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op: {op} is not accepted here", request_id)
    body: Any = data.get("body", {})
    if span is not None:
        limits = LIMITS[op]
        size = span[1] - span[0]
        if size > limits.body_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"body: {op} bodies are at most {limits.body_bytes} bytes, got {size}", request_id)
        try:
            body = _loads(frame[span[0]:span[1]], limits)
        except ProtocolError as e:
            e.request_id = request_id
            raise
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"body: expected a map, got {type(body).__name__}", request_id)
    by = data.get("by")  # most messages: none (agents never say)
    if by is not None:
        by = _issuer(by, request_id)
    try:
        return Message(op, request_id, validate_body(op, body), by)
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
    """Validate a reply frame; ProtocolError if it is not one.

    A large reply (a ``stats`` answer of thousands of ranks holds hundreds of
    thousands of objects) is decoded without the cyclic garbage collector, as
    ``_loads`` does: msgpack's objects hold no cycles.
    """
    if len(frame) <= SMALL_FRAME:
        data = _unpack(frame)
    else:
        collecting = gc.isenabled()
        gc.disable()
        try:
            data = _unpack(frame)
        finally:
            if collecting:
                gc.enable()
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
