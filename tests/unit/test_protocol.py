"""The wire (wsd/wire/protocol.py): round trips, every kind of bad input, the pinned contract.

Pure logic: no sockets, no torch. Each bad-input test asserts the error code and
that the message names the offending field: what refusing bad input clearly
gives an operator.
"""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wsd.config import MAX_UBATCHES
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode, Op, ProtocolError

# One valid body per operation; every Op must appear here (checked below).
VALID: dict[Op, dict] = {
    Op.PING: {},
    Op.ENGINES: {},
    Op.STATUS: {"engine": "node-a-llama"},
    Op.RANKS: {},
    Op.STATS: {"group": 1, "timeout": 2.5, "fresh": True},
    Op.EVENTS: {"cursor": 7, "limit": 50, "engine": "e_2"},
    Op.STACKS: {"engine": "e_2", "rank": 3, "timeout": 2.0},
    Op.PROFILES: {},
    Op.DROP_PROFILE: {"key": "meta-llama/Llama-3.1-8B:tp2:ub2:ln1"},
    Op.LOCK: {"group": 0, "wait": False, "timeout": 1.0},
    Op.UNLOCK: {},
    Op.SET_UBATCHES: {"n": 4, "wait": True},
    Op.RESERVE: {"bytes": 1 << 20, "group": 3},
    Op.EQUALIZE: {"timeout": 3.0},
    Op.TRIM: {"group": None},
    Op.REGISTER: {
        "rank": 3, "world_size": 4, "tp_size": 2, "tp_group": 1, "host": "node-a", "pid": 4242,
        "device": "cpu", "applied_seq": 5, "acks": [[5, 10, True, None]], "step": 10, "idle": True,
        "state": {"locked": False, "num_ubatches": 2}, "config": {"num_lanes": 1},
        "engine": "node-a-Llama-3-1-8B", "model": "meta-llama/Llama-3.1-8B", "presize": [2, 1],
    },
    Op.HEARTBEAT: {"rank": 0, "step": 9, "applied_seq": 2, "held_seq": 3, "state": {"locked": True},
                   "in_step": 61.5},
    Op.ACK: {"rank": 1, "seq": 4, "step": 12, "ok": False, "error": "WorkspaceLockedError: ..."},
    Op.STATS_REPLY: {"rank": 2, "request": 9, "stats": {"slots": []}, "step": 3},
    Op.STATS_PUSH: {"rank": 2, "version": 5, "base": 4, "step": 30, "applied_seq": 2, "held_seq": 2,
                    "state": {"locked": True}, "delta": {"columns": {"requests": [[0], [7]]}}},
    Op.STACKS_REPLY: {"rank": 1, "request": 0, "step": 40, "in_step": 60.25, "threads": [
        {"name": "MainThread", "ident": 1, "engine": True, "daemon": False, "dropped": 0,
         "frames": ["worker.py:10:main", "torch/distributed/distributed_c10d.py:2501:all_reduce"]}]},
    Op.EVENT: {"rank": 0, "kind": "lock_violation", "detail": {"slot": 1, "caller": "x.py:1:f"}},
    Op.GOODBYE: {"rank": 3, "step": 120},
    Op.REGISTERED: {"epoch": "abc", "baseline_seq": 0, "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0,
                    "stall_after": 60.0, "desired": {"locked": True, "num_ubatches": 3, "reserve_bytes": None},
                    "presize": [[0, 0, 1 << 20], [1, 0, 3 << 19]]},
    Op.CHALLENGE: {"nonce": "c0ffee" * 5, "proof": "ab" * 32},
    Op.PULSE: {"epoch": "abc", "registered": False},
    Op.COMMAND: {"seq": 1, "action": "set_ubatches", "args": {"n": 4}, "group": 0, "mac": "cd" * 32},
    Op.STATS_REQUEST: {"request": 1},
    Op.STATS_ACK: {"version": 5, "ok": False},
    Op.STACKS_REQUEST: {"request": 2},
    Op.REJECTED: {"code": "mismatch", "message": "rank 9 is not below its world_size=4"},
}


def raw(**envelope) -> bytes:
    """A frame with exactly this envelope (no defaults), for bad-input tests."""
    return msgpack.packb(envelope, use_bin_type=True)


def req(op, body, request_id=1, v=p.PROTOCOL_VERSION) -> bytes:
    return raw(v=v, op=str(op), id=request_id, body=body)


def refused(frame: bytes, code: ErrorCode, *named: str, allowed=None) -> ProtocolError:
    """decode must raise ProtocolError with ``code`` and a message containing each of ``named``."""
    with pytest.raises(ProtocolError) as info:
        p.decode(frame, allowed)
    error = info.value
    assert error.code is code, f"{error.code} != {code}: {error}"
    for text in named:
        assert text in str(error), f"{text!r} not named in {str(error)!r}"
    return error


# -- contract --------------------------------------------------------------


def test_contract_pins_ops_codes_and_socket_sets():
    """A change to the wire vocabulary must be deliberate: agents, clients and
    coordinators of different builds talk to each other only if these agree."""
    assert p.PROTOCOL_VERSION == 1
    assert {str(op) for op in Op} == {
        "ping", "engines", "status", "ranks", "stats", "events", "stacks", "profiles", "drop_profile",
        "lock", "unlock", "set_ubatches", "reserve", "equalize", "trim",
        "register", "heartbeat", "ack", "stats_reply", "stats_push", "stacks_reply", "event", "goodbye",
        "registered", "challenge", "pulse", "command", "stats_request", "stats_ack", "stacks_request", "rejected",
    }
    assert {str(c) for c in ErrorCode} == {
        "bad_message", "bad_version", "unknown_op", "bad_field", "too_large", "mismatch",
        "conflict", "forbidden", "timeout", "unavailable", "storage", "internal",
    }
    assert p.READ_ONLY_OPS == {Op.PING, Op.ENGINES, Op.STATUS, Op.RANKS, Op.STATS, Op.EVENTS, Op.PROFILES}
    assert p.COMMAND_OPS == {Op.LOCK, Op.UNLOCK, Op.SET_UBATCHES, Op.RESERVE, Op.EQUALIZE, Op.TRIM}
    assert p.OPERATOR_READ_OPS == {Op.STACKS}
    assert p.COORDINATOR_STATE_OPS == {Op.DROP_PROFILE}
    assert p.CLIENT_OPS == p.READ_ONLY_OPS | p.OPERATOR_READ_OPS | p.COMMAND_OPS | p.COORDINATOR_STATE_OPS
    assert p.AGENT_OPS == {Op.REGISTER, Op.HEARTBEAT, Op.ACK, Op.STATS_REPLY, Op.STATS_PUSH, Op.STACKS_REPLY,
                           Op.EVENT, Op.GOODBYE}
    assert p.COORDINATOR_OPS == {Op.REGISTERED, Op.CHALLENGE, Op.PULSE, Op.COMMAND, Op.STATS_REQUEST, Op.STATS_ACK,
                                 Op.STACKS_REQUEST, Op.REJECTED}
    # The sets partition the ops: each op belongs to exactly one socket direction.
    parts = [p.CLIENT_OPS, p.AGENT_OPS, p.COORDINATOR_OPS]
    assert sum(len(s) for s in parts) == len(Op) and set().union(*parts) == set(Op)
    assert not p.READ_ONLY_OPS & p.COMMAND_OPS
    assert set(p.SCHEMAS) == set(Op)
    # What a fresh process starts from: its baseline and its group's desired state
    # there (optional, nil to a re-registration), which an older agent ignores; and the
    # interval of its pushes (optional: an older coordinator says none, and takes none).
    registered = {f.name: f.required for f in p.SCHEMAS[Op.REGISTERED]}
    assert registered == {"epoch": True, "baseline_seq": True, "heartbeat_interval": True,
                          "heartbeat_timeout": True, "stats_interval": False, "stall_after": False, "desired": False,
                          "rebase": False, "presize": False, "proof": False}
    assert p.decode(p.encode(Op.REGISTERED, {k: v for k, v in VALID[Op.REGISTERED].items()
                                             if k != "desired"})).body["desired"] is None


# -- round trips -----------------------------------------------------------


def test_every_op_has_a_valid_body_here():
    """Without it a new Op could ship without a round-trip test."""
    assert set(VALID) == set(Op)


@pytest.mark.parametrize("op", list(Op), ids=str)
def test_every_op_round_trips(op):
    """encode/decode must be inverse for every message type, on its own socket's op set."""
    frame = p.encode(op, VALID[op], request_id=77)
    allowed = next(s for s in (p.CLIENT_OPS, p.AGENT_OPS, p.COORDINATOR_OPS) if op in s)
    message = p.decode(frame, allowed)
    assert message.op is op and message.id == 77
    for key, value in VALID[op].items():
        assert message.body[key] == value
    # Every schema field is present after decoding (optional ones with their default).
    assert set(message.body) == {f.name for f in p.SCHEMAS[op]}


def test_spliced_frames_are_the_frames_encoded_whole():
    """A value encoded once and spliced in (a simulated rank's snapshot, the
    coordinator's stats answer built as replies arrive) must give exactly the
    message that encoding it whole gives, or the other side would read
    another message, or none."""
    stats = {"slots": {"capacity_bytes": [4096, 0]}, "locked": False}
    body = {"rank": 3, "request": 9, "step": 2}
    spliced = p.encode(Op.STATS_REPLY, body, 7, packed={"stats": msgpack.packb(stats)})
    assert p.decode(spliced) == p.decode(p.encode(Op.STATS_REPLY, {**body, "stats": stats}, 7))
    result = {"ranks": [{"rank": 0}], "complete": True}
    assert p.ok_reply_packed(5, msgpack.packb(result)) == p.ok_reply(5, result)


def test_defaults_filled_in_and_not_shared():
    """Optional fields get their documented default; a mutable default is a fresh
    copy, so one message mutating its body cannot change the next one's."""
    body = p.decode(p.encode(Op.LOCK)).body
    assert body == {"engine": None, "group": None, "wait": True, "timeout": None, "new_engine": False}
    assert p.decode(p.encode(Op.EVENTS)).body == {"cursor": 0, "limit": 100, "engine": None}
    minimal = {k: VALID[Op.REGISTER][k] for k in
               ("rank", "world_size", "tp_size", "tp_group", "host", "pid", "device")}
    first = p.decode(p.encode(Op.REGISTER, minimal)).body
    assert first["applied_seq"] is None and first["acks"] == [] and first["step"] == 0
    assert first["idle"] is False and first["state"] == {} and first["config"] == {}
    first["acks"].append("x")
    first["state"]["y"] = 1
    second = p.decode(p.encode(Op.REGISTER, minimal)).body
    assert second["acks"] == [] and second["state"] == {}


def test_int_promoted_to_float_for_float_fields():
    """msgpack senders often write 2 for 2.0; a float field must accept it as a float."""
    body = p.decode(p.encode(Op.STATS, {"timeout": 2})).body
    assert body["timeout"] == 2.0 and isinstance(body["timeout"], float)


def test_ok_reply_round_trips():
    reply = p.decode_reply(p.ok_reply(12, {"seq": 3, "ranks": [0, 1]}))
    assert reply.id == 12 and reply.ok and reply.result == {"seq": 3, "ranks": [0, 1]}
    assert reply.code is None
    assert p.decode_reply(p.ok_reply(5)).result == {}


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_error_reply_round_trips(code):
    reply = p.decode_reply(p.error_reply(9, code, "group: no TP group 7"))
    assert reply.id == 9 and not reply.ok and reply.code is code
    assert reply.message == "group: no TP group 7" and reply.result is None


def test_error_reply_without_request_id_uses_zero():
    """An error on a frame whose id could not be read still decodes as a reply."""
    reply = p.decode_reply(p.error_reply(None, ErrorCode.BAD_MESSAGE, "not msgpack"))
    assert reply.id == 0 and reply.code is ErrorCode.BAD_MESSAGE


def test_decode_reply_refuses_bad_replies():
    """A client must get a ProtocolError naming the field, not a KeyError."""
    with pytest.raises(ProtocolError, match="ok"):
        p.decode_reply(raw(v=p.PROTOCOL_VERSION, id=1, ok="yes"))
    with pytest.raises(ProtocolError, match="error"):
        p.decode_reply(raw(v=p.PROTOCOL_VERSION, id=1, ok=False))
    with pytest.raises(ProtocolError, match="error"):
        p.decode_reply(raw(v=p.PROTOCOL_VERSION, id=1, ok=False, error={"code": "internal"}))
    with pytest.raises(ProtocolError) as info:
        p.decode_reply(raw(v=p.PROTOCOL_VERSION + 1, id=1, ok=True))
    assert info.value.code is ErrorCode.BAD_VERSION
    # An error code from a newer peer is still an error reply, not a crash.
    reply = p.decode_reply(raw(v=p.PROTOCOL_VERSION, id=1, ok=False, error={"code": "from_the_future", "message": "m"}))
    assert reply.code is ErrorCode.INTERNAL and reply.message == "m"


# -- bad frames and envelopes ----------------------------------------------


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\xff\xff\xff", b"hello world"], ids=repr)
def test_not_msgpack(frame):
    refused(frame, ErrorCode.BAD_MESSAGE, "msgpack")


def test_truncated_msgpack():
    frame = p.encode(Op.REGISTER, VALID[Op.REGISTER])
    for cut in (1, len(frame) // 2, len(frame) - 1):
        refused(frame[:cut], ErrorCode.BAD_MESSAGE, "msgpack")


def test_trailing_bytes():
    refused(p.encode(Op.PING) + b"\x00", ErrorCode.BAD_MESSAGE, "msgpack")


@pytest.mark.parametrize("value", [[1, 2], "ping", 3, None, b"bytes", 1.5], ids=repr)
def test_not_a_map(value):
    refused(msgpack.packb(value, use_bin_type=True), ErrorCode.BAD_MESSAGE, "map")


def test_non_string_map_keys():
    """Integer keys could never name a field: refused as a bad message."""
    refused(msgpack.packb({1: 2}), ErrorCode.BAD_MESSAGE, "msgpack")


def test_missing_envelope_fields():
    refused(raw(v=p.PROTOCOL_VERSION, op="ping", body={}), ErrorCode.BAD_FIELD, "id")
    refused(raw(op="ping", id=1, body={}), ErrorCode.BAD_VERSION, "v:")
    error = refused(raw(v=p.PROTOCOL_VERSION, id=4, body={}), ErrorCode.UNKNOWN_OP, "op")
    assert error.request_id == 4
    # body may be left out: it defaults to an empty map
    assert p.decode(raw(v=p.PROTOCOL_VERSION, op="ping", id=1)).op is Op.PING


@pytest.mark.parametrize("bad_id", [True, False, -1, "1", 1.0, None, [1], 2**63], ids=repr)
def test_bad_request_id(bad_id):
    """bool is an int in Python; an id of True must not pass as 1."""
    refused(raw(v=p.PROTOCOL_VERSION, op="ping", id=bad_id, body={}), ErrorCode.BAD_FIELD, "id")


def test_largest_request_id_accepted():
    assert p.decode(p.encode(Op.PING, request_id=2**63 - 1)).id == 2**63 - 1


@pytest.mark.parametrize("version", [0, 2, -1, "1", None, 1.5, True, 1.0], ids=repr)
def test_unknown_protocol_version(version):
    """Only the exact integer version is spoken; True and 1.0 are not 1 on the wire."""
    error = refused(req(Op.PING, {}, request_id=5, v=version), ErrorCode.BAD_VERSION, "v:", "version")
    assert error.request_id == 5


@pytest.mark.parametrize("op", ["nope", "PING", "", 3, None, ["ping"], {"a": 1}], ids=repr)
def test_unknown_op(op):
    error = refused(raw(v=p.PROTOCOL_VERSION, op=op, id=6, body={}), ErrorCode.UNKNOWN_OP, "op", repr(op))
    assert error.request_id == 6


@pytest.mark.parametrize(("op", "allowed"), [
    (Op.REGISTER, p.CLIENT_OPS),     # an agent message on the client socket
    (Op.LOCK, p.AGENT_OPS),          # a client command on the agent socket
    (Op.COMMAND, p.AGENT_OPS),       # coordinator -> agent, echoed back
    (Op.HEARTBEAT, p.COORDINATOR_OPS),
], ids=str)
def test_op_not_allowed_on_this_socket(op, allowed):
    refused(p.encode(op, VALID[op], 8), ErrorCode.UNKNOWN_OP, f"op: {op}", "not accepted", allowed=allowed)


@pytest.mark.parametrize("body", [[], "x", 1, None, True], ids=repr)
def test_body_not_a_map(body):
    error = refused(req(Op.PING, body, request_id=9), ErrorCode.BAD_FIELD, "body")
    assert error.request_id == 9


# -- bad bodies ------------------------------------------------------------


def test_unknown_body_field_named_with_the_allowed_ones():
    error = refused(req(Op.LOCK, {"grup": 1}, request_id=10), ErrorCode.BAD_FIELD, "lock.grup", "unknown field",
                    "group")
    assert error.request_id == 10
    refused(req(Op.PING, {"x": 1}), ErrorCode.BAD_FIELD, "ping.x", "allowed: none")


@pytest.mark.parametrize("op", [op for op in Op if any(f.required for f in p.SCHEMAS[op])], ids=str)
def test_missing_required_field(op):
    """Each required field, left out in turn, is named."""
    for f in p.SCHEMAS[op]:
        if f.required:
            body = {k: v for k, v in VALID[op].items() if k != f.name}
            error = refused(req(op, body, request_id=11), ErrorCode.BAD_FIELD, f"{op}.{f.name}", "missing")
            assert error.request_id == 11


WRONG_TYPES = [
    (Op.SET_UBATCHES, "n", "4", "an integer"),
    (Op.SET_UBATCHES, "n", 4.0, "an integer"),
    (Op.SET_UBATCHES, "n", True, "boolean"),        # bool where an int is meant
    (Op.RESERVE, "bytes", False, "boolean"),
    (Op.HEARTBEAT, "step", True, "boolean"),
    (Op.REGISTER, "rank", [0], "an integer"),
    (Op.REGISTER, "host", 5, "a string"),
    (Op.REGISTER, "device", b"cpu", "a string"),
    (Op.REGISTER, "acks", {"a": 1}, "a list"),
    (Op.REGISTER, "state", [], "a map"),
    (Op.REGISTER, "idle", 1, "a boolean"),           # an int where a bool is meant
    (Op.LOCK, "wait", "false", "a boolean"),
    (Op.LOCK, "timeout", "1", "a number"),
    (Op.LOCK, "timeout", True, "boolean"),
    (Op.ACK, "ok", None, "a boolean"),
    (Op.ACK, "error", 3, "a string or nil"),
    (Op.STATS_REPLY, "stats", "big", "a map"),
    (Op.COMMAND, "args", [], "a map"),
    (Op.REGISTERED, "heartbeat_interval", "1", "a number"),
]


@pytest.mark.parametrize(("op", "name", "value", "expected"), WRONG_TYPES,
                         ids=[f"{o}.{n}={v!r}" for o, n, v, _ in WRONG_TYPES])
def test_wrong_type(op, name, value, expected):
    body = {**VALID[op], name: value}
    refused(req(op, body), ErrorCode.BAD_FIELD, f"{op}.{name}", expected)


OUT_OF_RANGE = [
    (Op.SET_UBATCHES, "n", 0),                  # 0 where >= 1
    (Op.SET_UBATCHES, "n", -1),
    (Op.SET_UBATCHES, "n", MAX_UBATCHES + 1),
    (Op.RESERVE, "bytes", -1),
    (Op.RESERVE, "bytes", 2**50 + 1),
    (Op.LOCK, "group", -1),
    (Op.LOCK, "group", 65536),
    (Op.LOCK, "timeout", -0.5),
    (Op.LOCK, "timeout", 3600.5),
    (Op.EVENTS, "limit", 0),
    (Op.EVENTS, "cursor", -3),
    (Op.EVENTS, "cursor", 2**63),               # one past the largest int64
    (Op.EVENTS, "cursor", 2**64 - 1),           # the largest msgpack integer
    (Op.ACK, "seq", 0),                         # seqs start at 1
    (Op.REGISTER, "rank", 1 << 21),
    (Op.REGISTER, "world_size", 0),
    (Op.REGISTER, "pid", -1),
    (Op.HEARTBEAT, "applied_seq", -1),
    (Op.COMMAND, "seq", 0),
    (Op.REGISTERED, "heartbeat_interval", 0.0),
]


@pytest.mark.parametrize(("op", "name", "value"), OUT_OF_RANGE,
                         ids=[f"{o}.{n}={v!r}" for o, n, v in OUT_OF_RANGE])
def test_out_of_range(op, name, value):
    body = {**VALID[op], name: value}
    refused(req(op, body), ErrorCode.BAD_FIELD, f"{op}.{name}", "between", str(value))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=repr)
def test_non_finite_numbers(value):
    """NaN passes every < and > comparison, so a range check alone would let it in."""
    refused(req(Op.STATS, {"timeout": value}), ErrorCode.BAD_FIELD, "stats.timeout", "finite")
    refused(req(Op.REGISTERED, {**VALID[Op.REGISTERED], "heartbeat_timeout": value}),
            ErrorCode.BAD_FIELD, "registered.heartbeat_timeout", "finite")
    # a float where an integer is meant is a type error, NaN or not
    refused(req(Op.SET_UBATCHES, {"n": value}), ErrorCode.BAD_FIELD, "set_ubatches.n", "an integer")


def test_too_large_for_msgpack_checked_by_the_schema():
    """2**64 cannot be packed; a body built in-process with it still gets BAD_FIELD."""
    with pytest.raises(ProtocolError) as info:
        p.validate_body(Op.EVENTS, {"cursor": 2**64})
    assert info.value.code is ErrorCode.BAD_FIELD and "events.cursor" in str(info.value)


def test_range_edges_accepted():
    """The bounds themselves are valid (an off-by-one would refuse them)."""
    assert p.decode(req(Op.SET_UBATCHES, {"n": 1})).body["n"] == 1
    assert p.decode(req(Op.SET_UBATCHES, {"n": MAX_UBATCHES})).body["n"] == MAX_UBATCHES
    assert p.decode(req(Op.EVENTS, {"cursor": 2**63 - 1})).body["cursor"] == 2**63 - 1
    assert p.decode(req(Op.RESERVE, {"bytes": 0})).body["bytes"] == 0
    assert p.decode(req(Op.LOCK, {"group": 65535})).body["group"] == 65535


def test_nullable_fields():
    """Optional fields documented as nil-able accept nil; the others refuse it."""
    assert p.decode(req(Op.LOCK, {"group": None, "timeout": None})).body["group"] is None
    assert p.decode(req(Op.REGISTER, {**VALID[Op.REGISTER], "applied_seq": None})).body["applied_seq"] is None
    assert p.decode(req(Op.ACK, {**VALID[Op.ACK], "error": None})).body["error"] is None
    assert p.decode(req(Op.COMMAND, {**VALID[Op.COMMAND], "group": None})).body["group"] is None
    refused(req(Op.LOCK, {"wait": None}), ErrorCode.BAD_FIELD, "lock.wait", "got NoneType")
    refused(req(Op.EVENTS, {"cursor": None}), ErrorCode.BAD_FIELD, "events.cursor")
    refused(req(Op.SET_UBATCHES, {"n": None}), ErrorCode.BAD_FIELD, "set_ubatches.n")
    refused(req(Op.HEARTBEAT, {**VALID[Op.HEARTBEAT], "rank": None}), ErrorCode.BAD_FIELD, "heartbeat.rank")


def test_request_id_carried_on_body_errors():
    """So the coordinator can answer the right request even when its body is bad."""
    error = refused(req(Op.SET_UBATCHES, {"n": 0}, request_id=123), ErrorCode.BAD_FIELD, "set_ubatches.n")
    assert error.request_id == 123


# -- property: nothing but ProtocolError escapes ---------------------------

_leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.binary(max_size=12)
           | st.sampled_from([str(op) for op in Op] + ["v", "op", "id", "body", "rank", "seq"]))
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8) | st.sampled_from(["v", "op", "id", "body"]),
                                         inner, max_size=4), max_leaves=20)
_envelopes = st.fixed_dictionaries(
    {}, optional={"v": st.sampled_from([1, 1, 2, True, None]), "id": _leaves,
                  "op": st.sampled_from([str(op) for op in Op]) | _leaves,
                  "body": st.dictionaries(st.sampled_from(sorted({f.name for s in p.SCHEMAS.values() for f in s}))
                                          | st.text(max_size=5), _values, max_size=6) | _values})
_FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_protocol_error(frame: bytes) -> None:
    for allowed in (None, p.CLIENT_OPS, p.AGENT_OPS):
        try:
            message = p.decode(frame, allowed)
        except ProtocolError as e:
            assert isinstance(e.code, ErrorCode) and str(e)
        else:
            assert isinstance(message.op, Op) and isinstance(message.id, int)
    try:
        p.decode_reply(frame)
    except ProtocolError:
        pass


@_FAST
@given(st.binary(max_size=64))
def test_decode_arbitrary_bytes_raises_only_protocol_error(frame):
    _decode_or_protocol_error(frame)


@_FAST
@given(_values | _envelopes)
def test_decode_arbitrary_structures_raises_only_protocol_error(value):
    _decode_or_protocol_error(msgpack.packb(value, use_bin_type=True))


@pytest.mark.parametrize("op, field, value", [
    (Op.REGISTER, "host", "node\x1b]0;pwned\x07"),
    (Op.REGISTER, "host", "node\x9b31m"),  # a C1 control: CSI in one character
    (Op.REGISTER, "device", "cpu\x1b[2J"),
    (Op.EVENT, "kind", "lock_violation\x07"),
    (Op.REGISTER, "model", "llama\u202e8b-ogol"),  # a bidi override: prints reversed in wsctl engines
    (Op.REGISTER, "host", "node\u2028rank 9 live"),  # a line separator: a forged line
    (Op.REGISTER, "host", "node\u200f"),
])
def test_names_a_peer_claims_hold_no_control_character(op, field, value):
    """A peer without the token once put ESC and BEL in its host; `wsctl events` printed them raw,
    clearing the screen and retitling the terminal; a model name with U+202E printed raw in
    `wsctl engines`. Refused where no legitimate name has one."""
    body = {**VALID[op], field: value}
    with pytest.raises(ProtocolError, match=rf"{field}: must hold no control, format") as info:
        p.decode(p.encode(op, body))
    assert info.value.code == ErrorCode.BAD_FIELD and str(info.value).isprintable()
    clean = "".join(c for c in value if c.isprintable())
    assert p.decode(p.encode(op, {**VALID[op], field: clean})).body[field] == clean


@pytest.mark.parametrize("name", ["", "a/b", "x@y", "-lead", "a.b", "é", "a" * 129, "a\nb"])
def test_an_engine_name_that_could_leave_its_state_file_or_its_label_is_refused(name):
    """An engine's name becomes part of a file name (STATE_FILE@NAME), a Prometheus label and
    a command-line argument: a slash, a dot, an at sign or a control character is refused
    before any of that, naming the field."""
    for op, body in ((Op.STATUS, {"engine": name}), (Op.REGISTER, {**VALID[Op.REGISTER], "engine": name})):
        with pytest.raises(ProtocolError) as e:
            p.decode(p.encode(op, body))
        assert e.value.code is ErrorCode.BAD_FIELD and "engine" in str(e.value)


# -- who sends a request: the envelope's `by` -------------------------------------------------------


def test_a_request_says_who_sends_it_in_its_envelope():
    by = {"user": "alice", "host": "ops-1"}
    small = p.encode(Op.LOCK, {}, 7, by=by)
    assert p.decode(small, None).by == by
    # Past SMALL_FRAME the envelope is read apart from the body: there too.
    large = p.encode(Op.STATS_PUSH, {"rank": 0, "version": 1, "step": 0, "applied_seq": 0, "held_seq": 0,
                                     "state": {}, "stats": {"pad": "x" * 8000}}, 8, by=by)
    assert len(large) > p.SMALL_FRAME and p.decode(large, None).by == by
    assert p.decode(p.encode(Op.LOCK, {}, 9), None).by is None


def test_a_coordinator_skips_envelope_keys_it_does_not_know():
    """What lets a newer client send ``by`` to a coordinator that predates it: such a
    coordinator's decode reads v, op, id and body and skips the rest, small frames and
    large ones alike (this one's too, for whatever a later client adds)."""
    for pad in (0, 8000):
        frame = msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "ping", "id": 3, "body": {},
                               "later": {"what": "x" * 60}, "pad": b"\0" * pad})
        assert p.decode(frame, None).op is Op.PING


@pytest.mark.parametrize("by", [{"user": "a", "role": "admin"}, {"user": ""}, {"user": "x" * 65},
                                {"host": "a\x1b[31m"}, ["alice"], {"user": 7}])
def test_a_bad_by_is_refused_naming_it(by):
    with pytest.raises(ProtocolError, match=r"^by") as e:
        p.decode(msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "lock", "id": 4, "body": {}, "by": by}), None)
    assert e.value.code is ErrorCode.BAD_FIELD and e.value.request_id == 4


def test_the_ack_record_a_registration_resends_is_an_ack_messages_fields_but_its_rank():
    """Fails if the remembered ack and the ``ack`` message drift apart (a field added to one
    alone), or if a reader unpacks the record by position instead of through ``AckRecord``."""
    assert p.AckRecord._fields == tuple(f.name for f in p.SCHEMAS[Op.ACK] if f.name != "rank")
    record = p.AckRecord(seq=3, step=9, ok=False, error="RuntimeError: no")
    assert p.AckRecord.from_wire(p.decode(p.encode(Op.REGISTER, {**VALID[Op.REGISTER], "acks": [record.to_wire()]}),
                                          p.AGENT_OPS).body["acks"][0], 1) == record
    for bad in ([3, 9, False], [3, "9", False, None], (3, 9, False, None), [0, 9, True, None]):
        with pytest.raises(p.ProtocolError, match=r"acks|seq|step"):
            p.AckRecord.from_wire(bad, 1)
