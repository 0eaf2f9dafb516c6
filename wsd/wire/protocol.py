"""The wire: message framing, msgpack encode/decode, and what decoding may cost.

The operations and their fields are ``wsd.wire.schemas``' (re-exported here).
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
from dataclasses import dataclass
from typing import Any

import msgpack

# Here too, the wire's error and its codes (p.ProtocolError, p.ErrorCode), and its vocabulary
# and schemas (p.Op, p.SCHEMAS, wsd.wire.schemas): every name of the wire reads as p.NAME.
from wsd.errors import ErrorCode, ProtocolError, StrEnum
from wsd.wire.schemas import (
    ACK_MEMORY,
    ACK_MEMORY_ERROR,
    AGENT_OPS,
    CLIENT_OPS,
    COMMAND_OPS,
    COORDINATOR_OPS,
    COORDINATOR_STATE_OPS,
    INT_MAX,
    MAX_PRESIZE_SLOTS,
    MAX_STATUS_GROUPS,
    NEVER_REGISTERED,
    OPERATOR_READ_OPS,
    READ_ONLY_OPS,
    REGISTER_BYTES,
    SCHEMAS,
    AckRecord,
    Field,
    Op,
    validate_body,
)

__all__ = [
    "ACK_MEMORY",
    "ACK_MEMORY_ERROR",
    "AGENT_OPS",
    "CLIENT_OPS",
    "COMMAND_OPS",
    "COORDINATOR_OPS",
    "COORDINATOR_STATE_OPS",
    "LIMITS",
    "MAX_PRESIZE_SLOTS",
    "MAX_STATUS_GROUPS",
    "NEVER_REGISTERED",
    "OPERATOR_READ_OPS",
    "PROTOCOL_VERSION",
    "READ_ONLY_OPS",
    "REGISTER_BYTES",
    "SCHEMAS",
    "SMALL_FRAME",
    "AckRecord",
    "ErrorCode",
    "Field",
    "Limits",
    "Message",
    "Op",
    "ProtocolError",
    "Reply",
    "StrEnum",
    "decode",
    "decode_reply",
    "encode",
    "error_reply",
    "ok_reply",
    "ok_reply_packed",
    "peek_op",
    "spliced",
    "validate_body",
]

PROTOCOL_VERSION = 1
"""The shapes of every message and answer, as wsd 0.1.0 ships them. A change to a shape that a
released wsd reads (a field renamed, removed or retyped, an answer restructured) makes the
next release bump it; both sides then refuse the other version (``bad_version``) rather
than misread it, and no reader of a shape that never shipped in a release is kept
(docs/protocol.md, "Versions")."""


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
    # 64 threads of 48 frames of 240 characters, with room: about 750 KB at most.
    Op.STACKS_REPLY: Limits(1 << 20, str_len=1 << 10, array_len=64, map_len=16),
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
@dataclass(frozen=True, slots=True)
class Message:
    """A validated request: its operation, id and body (defaults filled in)."""

    op: Op
    id: int
    body: dict[str, Any]
    by: dict[str, str] | None = None
    """Who sent it, as the client says (``ISSUER_KEYS``): the envelope's ``by``, which a
    coordinator that predates it skips, so a newer client still talks to it. Not proof
    of anything, and shown as a claim."""
    proven: dict[str, str] | None = None
    """What the transport proved of the sender: its CURVE key's ``role`` and ``key`` (the
    key file's name). Set by the coordinator only, never from the message; None without
    CURVE."""

    def issuer(self) -> dict[str, Any]:
        """Who sent it, for an event: ``by`` (the claim) and ``proven``, each where there is one."""
        return {k: v for k, v in (("by", self.by), ("proven", self.proven)) if v}


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
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= INT_MAX:
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
