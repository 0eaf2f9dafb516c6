"""Hostile input against a live coordinator (refused clearly, at a bounded cost), and hostile configuration files.

One coordinator for the module, in a thread, on random loopback ports, with a
well-behaved simulated rank registered on its agent socket and one command
already recorded (so that its desired state is not blank). Hypothesis throws
at its client and agent sockets, through raw DEALER sockets: random bytes,
truncated and deeply nested msgpack, huge strings and arrays below and above
``max_message_bytes``, a wrong value in every field of every operation's
schema (generated from ``wsd.wire.protocol.SCHEMAS``), out-of-range numbers,
unknown operations and versions, and multi-frame garbage. After every input:
the coordinator still answers ``ping``; ``status`` shows the same sequence
number, desired state and no pending command; where a reply is possible it is
an error with a protocol code whose message names the field; the good rank is
still live. Configuration files get the same treatment through ``load_config``.

Every hypothesis example sends a batch of inputs (up to ``BATCH``), each checked as
it is answered, and checks the coordinator's state once after the batch: the
volume the project asks for (see ``hostile_kit``: the inputs tried are counted
by category, printed with the run's seed at the end of the session, and a full
run of this file must try its share of the 20,000) within the file's time bound.
Well-formed but malicious agent messages are in ``test_hostile_agents.py``.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections import Counter
from typing import Any

import msgpack
import pytest
import zmq
from conftest import coordinator_config, one_engine, wait_until
from hostile_kit import hostile_inputs_counted, seeded, tried  # noqa: F401 (a fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmqkit import Sockets

import wsd.config as config_module
from wsd.agent.simulated import SimulatedRanks
from wsd.coordinator.loop import Coordinator
from wsd.errors import ConfigError
from wsd.wire import protocol as p
from wsd.wire.protocol import AGENT_OPS, CLIENT_OPS, SCHEMAS, ErrorCode, Field, Op
from wsd_client.client import Client

MAX_MESSAGE = 64 * 1024
# The server drops (rather than reads) a client frame beyond this: see wsd.coordinator.loop.
HARD_LIMIT = 4 * MAX_MESSAGE
REPLY_TIMEOUT_MS = 5000
# The coordinator meters each agent connection that has not registered (a burst of
# about 500 small frames, then 256 a second) and drops the rest unread, as it should;
# these tests check each frame's answer, not the meter (test_agent_trust does), so
# they move to a fresh connection, as an attacker would, well before the burst is spent.
AGENT_FRAMES_PER_CONNECTION = 200
# A well-behaved rank must not be lost while the coordinator is busy refusing input.
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 2.0
REFUSALS = {str(c) for c in (ErrorCode.BAD_MESSAGE, ErrorCode.BAD_VERSION, ErrorCode.UNKNOWN_OP,
                             ErrorCode.BAD_FIELD, ErrorCode.TOO_LARGE)}

TRIED = tried(__file__)

FEW = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SOME = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
# Inputs per hypothesis example: each answer is checked as it comes, the state once a batch.
BATCH = 16


def batch(strategy: st.SearchStrategy[Any], most: int = BATCH) -> st.SearchStrategy[list[Any]]:
    return st.lists(strategy, min_size=max(1, most // 2), max_size=most)


# -- the live coordinator --------------------------------------------------------------------


class Live:
    """The coordinator, its good rank, a client, and a raw socket per endpoint."""

    def __init__(self, tmp: Any) -> None:
        self.coordinator = Coordinator(coordinator_config(
            tmp, world_size=2, tp_size=1, max_message_bytes=MAX_MESSAGE,
            heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_timeout=HEARTBEAT_TIMEOUT)).start()
        self.good = SimulatedRanks(self.coordinator.agent_endpoint, [0], world_size=2,
                                   heartbeat_interval=HEARTBEAT_INTERVAL,
                                   heartbeat_timeout=HEARTBEAT_TIMEOUT).start()
        self.client = Client(self.coordinator.client_endpoint, timeout=5, retries=0)
        self.sockets = Sockets()
        self.raw: dict[str, zmq.Socket] = {}
        self.sent: dict[str, int] = {}  # frames sent on each raw socket
        assert self.good.wait_registered(10), "the good rank did not register"
        locked = one_engine(self.client.lock(timeout=5))
        assert locked.seq == 1 and list(locked.steps()) == [0], locked  # rank 1 is never started
        self.baseline = self.view()

    def view(self) -> dict[str, Any]:
        """What no refused input may change."""
        status = one_engine(self.client.status())
        return {"seq": status["seq"], "desired": status["desired"], "pending": status["pending_commands"],
                "groups": [(g["tp_group"], g["desired"]) for g in status["groups"]],
                "live": status["ranks"]["live"]}

    def socket(self, which: str) -> zmq.Socket:
        sock = self.raw.get(which)
        if sock is None:
            sock = self.sockets.socket(zmq.DEALER, connect=self.coordinator.client_endpoint if which == "client"
                                       else self.coordinator.agent_endpoint)
            self.raw[which] = sock
        return sock

    def reset(self, which: str) -> None:
        """A fresh raw socket: after a dropped connection, or to leave nothing queued behind."""
        self.sent.pop(which, None)
        sock = self.raw.pop(which, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, which: str, *frames: bytes, wait_ms: int = REPLY_TIMEOUT_MS) -> dict[str, Any] | None:
        """Send one message (of one or more frames); its decoded reply, or None if none came."""
        if which != "client" and self.sent.get(which, 0) >= AGENT_FRAMES_PER_CONNECTION:
            self.reset(which)
        self.sent[which] = self.sent.get(which, 0) + 1
        self.socket(which).send_multipart(list(frames))
        return self.receive(which, wait_ms)

    def receive(self, which: str, wait_ms: int = REPLY_TIMEOUT_MS) -> dict[str, Any] | None:
        """The next reply on ``which``, decoded; None if none came within ``wait_ms``."""
        sock = self.socket(which)
        if not sock.poll(wait_ms):
            return None
        return msgpack.unpackb(sock.recv_multipart()[-1], raw=False)  # a REQ-framed reply has a delimiter first

    def still_serving(self) -> None:
        assert self.coordinator.serving, "the coordinator's loop ended"
        assert self.client.ping()["seq"] == self.baseline["seq"]
        assert self.view() == self.baseline
        assert self.good.registered() == 1

    def close(self) -> None:
        for which in list(self.raw):
            self.reset(which)
        self.sockets.close()
        self.client.close()
        self.good.stop()
        self.coordinator.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    live = Live(tmp_path_factory.mktemp("hostile"))
    try:
        yield live
        # The good rank was never lost, superseded or refused while all this went on.
        events = live.client.events(limit=10_000)["events"]
        kinds = Counter(e["kind"] for e in events if e.get("rank") == 0)
        assert kinds["joined"] == 1 and not kinds["lost"] and not kinds["superseded"], kinds
    finally:
        live.close()


def refused(reply: dict[str, Any] | None, *names: str) -> dict[str, Any]:
    """The reply is a protocol error whose message names one of ``names`` (if given)."""
    assert reply is not None, "no reply"
    assert reply["ok"] is False, reply
    error = reply["error"]
    assert error["code"] in REFUSALS, error
    if names:
        assert any(n in error["message"] for n in names), (names, error)
    return error


# -- values ---------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
_WIRE_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
_KIND_SAMPLES: dict[type, list[Any]] = {
    int: [0, 7, 2**63 - 1],
    float: [0.5, 1e300],
    str: ["", "lock", "x" * 300],
    bool: [True, False],
    dict: [{}, {"a": 1}],
    list: [[], [1, "two", None]],
    bytes: [b"", b"\x00\xff"],
}


def bad_values(f: Field) -> st.SearchStrategy[Any]:
    """Values ``f.check`` must refuse: every other type, and numbers out of its range."""
    wrong: list[Any] = []
    for kind, samples in _KIND_SAMPLES.items():
        accepted = kind in f.types or (kind is int and float in f.types)
        if kind is bool:
            accepted = bool in f.types
        if not accepted:
            wrong += samples
    if not f.nullable:
        wrong.append(None)
    numeric = [t for t in f.types if t in (int, float)]
    if numeric:
        wrong += [NAN, INF, -INF] if float in f.types else [1.5, NAN, INF]
        if f.low is not None:
            wrong += [f.low - 1, -(2**63)] + ([0] if f.low > 0 else [])
        if f.high is not None and f.high + 1 < 2**64:
            wrong.append(int(f.high) + 1 if int in f.types else f.high * 2 + 1)
        if f.high is not None and f.high < 2**63:
            wrong.append(2**63)
    # A deeply nested list is never a valid scalar or map.
    nested: Any = 0
    for _ in range(100):
        nested = [nested]
    if list not in f.types:
        wrong.append(nested)
    return st.sampled_from(wrong)


_GOOD: dict[str, Any] = {
    "rank": 1, "world_size": 2, "tp_size": 1, "tp_group": 1, "host": "h", "pid": 1, "device": "cpu",
    "step": 0, "applied_seq": 0, "held_seq": 0, "seq": 1, "ok": True, "request": 1, "stats": {},
    "kind": "x", "n": 2, "bytes": 1024, "version": 1, "threads": [], "key": "m:tp1:ub1:ln1",
}


def good_body(op: Op) -> dict[str, Any]:
    """The required fields of ``op`` with valid values (a rank the good one is not)."""
    return {f.name: _GOOD[f.name] for f in SCHEMAS[op] if f.required}


def mutated(op: Op) -> st.SearchStrategy[tuple[str, bytes]]:
    """(field name, frame): a message of ``op`` valid except for one field."""
    fields = SCHEMAS[op]
    return st.sampled_from(fields).flatmap(lambda f: bad_values(f).map(lambda v: (
        f"{op}.{f.name}", p.encode(op, {**good_body(op), f.name: v}, 9))))


def ops_with_fields(ops: frozenset[Op]) -> list[Op]:
    return sorted((op for op in ops if SCHEMAS[op]), key=str)


def envelope(v: Any = p.PROTOCOL_VERSION, op: Any = "ping", id_: Any = 5, body: Any = None) -> bytes:
    doc = {"v": v, "op": op, "id": id_}
    if body is not None:
        doc["body"] = body
    return msgpack.packb(doc, use_bin_type=True)


# -- the client socket --------------------------------------------------------------------------


@seeded
@SOME
@given(data=st.data())
def test_a_wrong_value_in_any_field_of_any_client_op_is_refused_naming_it(live, data):
    """Without schema checks a wrong type would reach a handler (an internal error, or a
    command with a nonsense argument recorded for ever); without the field in the message
    an operator could not tell what to fix."""
    for _ in range(data.draw(st.integers(BATCH // 2, BATCH), "inputs")):
        op = data.draw(st.sampled_from(ops_with_fields(CLIENT_OPS)), "op")
        name, frame = data.draw(mutated(op), "mutation")
        TRIED["client field"] += 1
        error = refused(live.send("client", frame), name)
        assert error["code"] == str(ErrorCode.BAD_FIELD)
    live.still_serving()


@seeded
@SOME
@given(frames=batch(st.binary(max_size=512)))
def test_random_bytes_on_the_client_socket(live, frames):
    for frame in frames:
        TRIED["client bytes"] += 1
        refused(live.send("client", frame))
    live.still_serving()


def _messages() -> st.SearchStrategy[bytes]:
    ops = ops_with_fields(CLIENT_OPS | AGENT_OPS)
    return st.sampled_from(ops).map(lambda op: p.encode(op, good_body(op), 3))


@seeded
@FEW
@given(cases=batch(st.tuples(_messages(), st.floats(0, 0.999))))
def test_truncated_messages_are_refused(live, cases):
    """No proper prefix of a msgpack map is a message: each is a bad_message, never a hang."""
    for frame, cut in cases:
        TRIED["client truncated"] += 1
        error = refused(live.send("client", frame[: int(len(frame) * cut)]))
        assert error["code"] == str(ErrorCode.BAD_MESSAGE)
    live.still_serving()


def _nested_frame(depth: int, where: str) -> bytes:
    nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    if len(nested) > MAX_MESSAGE - 64:
        nested = nested[: MAX_MESSAGE - 64]  # the nesting, cut short: truncated as well
    head = {"v": p.PROTOCOL_VERSION, "op": "lock", "id": 4}
    if where == "bare":
        return nested
    if where == "group":
        return msgpack.packb({**head, "body": {}})[:-1] + b"\x81\xa5group" + nested
    rest = {k: v for k, v in head.items() if k != where}
    return bytes([0x80 | (len(rest) + 1)]) + b"".join(
        msgpack.packb(k) + msgpack.packb(v) for k, v in rest.items()) + msgpack.packb(where) + nested


@seeded
@FEW
@given(cases=batch(st.tuples(st.integers(1, 200_000), st.sampled_from(["bare", "id", "op", "body", "group"]))))
def test_deeply_nested_msgpack_is_refused(live, cases):
    """Nesting a recursive decoder could overflow on; msgpack's own limit must turn into
    a refusal, not a crashed loop."""
    for depth, where in cases:
        TRIED["client nested"] += 1
        refused(live.send("client", _nested_frame(depth, where)))
    live.still_serving()


@seeded
@FEW
@given(versions=batch(st.one_of(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != p.PROTOCOL_VERSION),
                                st.just(True), st.just(float(p.PROTOCOL_VERSION)), st.text(max_size=5), st.none())))
def test_unknown_versions_are_refused(live, versions):
    for v in versions:
        TRIED["client version"] += 1
        error = refused(live.send("client", envelope(v=v)), "v:")
        assert error["code"] == str(ErrorCode.BAD_VERSION)
    live.still_serving()


@seeded
@FEW
@given(ops=batch(st.one_of(st.text(max_size=30).filter(lambda s: s not in {str(o) for o in Op}),
                           st.sampled_from(sorted(str(o) for o in Op if o not in CLIENT_OPS)),
                           _WIRE_INTS, st.none(), st.lists(_WIRE_INTS, max_size=3))))
def test_unknown_and_misplaced_ops_are_refused(live, ops):
    """Agent operations (register, heartbeat, ...) are no client's business either."""
    for op in ops:
        TRIED["client op"] += 1
        error = refused(live.send("client", envelope(op=op)), "op:")
        assert error["code"] == str(ErrorCode.UNKNOWN_OP)
    live.still_serving()


@seeded
@FEW
@given(cases=batch(st.tuples(
    st.one_of(st.integers(-(2**63), -1), st.just(2**64 - 1), st.floats(), st.text(max_size=4),
              st.booleans(), st.none()),
    st.sampled_from([None, [], "x", 3]))))
def test_bad_ids_and_bodies_are_refused(live, cases):
    for id_, body in cases:
        TRIED["client envelope"] += 1
        refused(live.send("client", envelope(id_=id_, body=body)), "id:")
        TRIED["client envelope"] += 1
        refused(live.send("client", envelope(body=body if body is not None else 7)), "body:")
    live.still_serving()


@seeded
@FEW
@given(cases=batch(st.tuples(st.integers(1, MAX_MESSAGE - 200), st.sampled_from(["op", "key", "array", "group"]))))
def test_huge_strings_and_arrays_within_the_limit_are_refused_naming_the_field(live, cases):
    for size, how in cases:
        TRIED["client huge"] += 1
        if how == "op":
            frame, names = envelope(op="x" * size), ("op:",)
        elif how == "key":
            frame, names = envelope(op="stats", body={"k" * size: 1}), ("stats.k",)
        elif how == "array":
            frame, names = envelope(op="stats", body={"group": [0] * size}), ("stats.group",)
        else:
            frame, names = envelope(op="set_ubatches", body={"n": "9" * size}), ("set_ubatches.n",)
        assert len(frame) <= MAX_MESSAGE
        refused(live.send("client", frame), *names)
    live.still_serving()


@seeded
@FEW
@given(sizes=batch(st.integers(MAX_MESSAGE + 1, HARD_LIMIT - 64), most=4))
def test_messages_over_max_message_bytes_are_refused_as_too_large(live, sizes):
    for size in sizes:
        TRIED["client oversize"] += 1
        error = refused(live.send("client", envelope(op="x" * size)), "max_message_bytes")
        assert error["code"] == str(ErrorCode.TOO_LARGE)
    live.still_serving()


@seeded
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(size=st.integers(HARD_LIMIT + 1, 4 * HARD_LIMIT))
def test_messages_over_the_hard_limit_are_dropped_with_the_connection(live, size):
    """ZeroMQ's MAXMSGSIZE cuts the sender off instead of buffering whatever it sends
    (a second of silence is the evidence: a refusal would come in milliseconds)."""
    TRIED["client dropped"] += 1
    assert live.send("client", b"\x00" * size, wait_ms=1000) is None
    live.reset("client")
    live.still_serving()


@seeded
@SOME
@given(messages=batch(st.lists(st.binary(max_size=64), min_size=2, max_size=5)))
def test_multi_frame_garbage_is_refused(live, messages):
    """One message is one frame (a REQ's empty delimiter aside): anything else is refused."""
    for frames in messages:
        TRIED["client multi-frame"] += 1
        refused(live.send("client", *frames))
    live.still_serving()


# -- the agent socket -------------------------------------------------------------------------------


def rejected(reply: dict[str, Any] | None, name: str | None = None) -> None:
    """Refused (REJECTED naming the field) or dropped (no answer): never anything else."""
    if reply is None:
        return
    message = p.decode(msgpack.packb(reply), p.COORDINATOR_OPS)
    assert message.op is Op.REJECTED, message
    assert message.body["code"] in REFUSALS, message.body
    if name is not None:
        assert name in message.body["message"], (name, message.body)


@seeded
@SOME
@given(data=st.data())
def test_a_wrong_value_in_any_field_of_any_agent_op_is_rejected_naming_it(live, data):
    """An agent speaking garbage is refused clearly and never registered; the good rank
    beside it stays live and the coordinator's state is untouched."""
    for _ in range(data.draw(st.integers(BATCH // 2, BATCH), "inputs")):
        op = data.draw(st.sampled_from(ops_with_fields(AGENT_OPS)), "op")
        name, frame = data.draw(mutated(op), "mutation")
        TRIED["agent field"] += 1
        reply = live.send("agent", frame)
        assert reply is not None, f"no REJECTED for {name}"
        rejected(reply, name)
    live.still_serving()


@seeded
@SOME
@given(messages=batch(st.lists(st.one_of(st.binary(max_size=256), _messages().map(lambda f: f[:-1]),
                                         st.sampled_from([envelope(op="lock"),
                                                          envelope(v=p.PROTOCOL_VERSION + 1, op="heartbeat"),
                                                          envelope(op="register", body={"rank": "0"})])),
                               min_size=1, max_size=4)))
def test_garbage_from_an_agent_is_rejected_or_dropped(live, messages):
    for frames in messages:
        TRIED["agent garbage"] += 1
        rejected(live.send("agent", *frames))
    live.still_serving()


@seeded
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=batch(st.integers(MAX_MESSAGE, 8 * HARD_LIMIT), most=4))
def test_oversize_frames_from_an_agent_are_rejected_or_dropped(live, sizes):
    """Each from a connection of its own, all at once: a second of silence is a drop."""
    names = [f"agent oversize {i}" for i in range(len(sizes))]
    for name, size in zip(names, sizes):
        TRIED["agent oversize"] += 1
        live.socket(name).send(b"\xa5" + b"\x00" * size)
    deadline = time.monotonic() + 1.0
    for name in names:
        rejected(live.receive(name, wait_ms=max(0, int((deadline - time.monotonic()) * 1000))))
        live.reset(name)
    live.still_serving()


def test_an_agent_of_another_world_is_refused_and_the_good_rank_stays(live):
    live.reset("agent")
    body = {**good_body(Op.REGISTER), "world_size": 3}
    TRIED["agent mismatch"] += 1
    reply = live.send("agent", p.encode(Op.REGISTER, body))
    message = p.decode(msgpack.packb(reply), p.COORDINATOR_OPS)
    assert message.op is Op.REJECTED and message.body["code"] == str(ErrorCode.MISMATCH)
    assert "world_size" in message.body["message"]
    live.still_serving()
    wait_until(lambda: live.client.ranks()["ranks"][0]["state"] == "live", 5, "rank 0 live")


# -- configuration files ----------------------------------------------------------------------------

_SECTIONS = config_module._SECTIONS  # the loader's own table: every section it knows


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)  # a TOML date or time, written as is


_CONFIG_WRONG: list[Any] = [
    "", "nope", "3 parsecs", "tcp//missing-colon", -1, 0, -(2**63), 2**63 - 1, 1e300, -0.5, NAN, INF, -INF,
    True, False, [], [1, 2], ["a"], {}, {"x": 1}, "1979-05-27T07:32:00Z",
]
_TOML_LITERALS = ["1979-05-27T07:32:00Z", "07:32:00", "1979-05-27"]


def _key_and_bad_value() -> st.SearchStrategy[tuple[str, str, str]]:
    """(section, key, TOML text of a value) for every key of every section."""
    pairs = [(s, f.name) for s, cls in _SECTIONS.items() for f in config_module.dataclasses.fields(cls)]
    values = st.one_of(st.sampled_from(_CONFIG_WRONG).map(_toml), st.sampled_from(_TOML_LITERALS))
    return st.tuples(st.sampled_from(pairs), values).map(lambda t: (*t[0], t[1]))


def _load(text: str) -> tuple[str, ConfigError | None]:
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="hostile-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            config_module.load_config(path, env={})
        except ConfigError as e:
            return path, e
        return path, None
    finally:
        os.unlink(path)


@settings(max_examples=300, deadline=None)
@given(case=_key_and_bad_value())
def test_a_bad_value_for_any_config_key_fails_naming_file_and_key(case):
    """Each key of each section (read from the config dataclasses) with values of every
    wrong type and out of range: the loader must raise ConfigError naming the file and the
    key, or accept a value that is valid; never another exception (a TypeError from a
    dataclass, a crash in an enum lookup)."""
    section, key, value = case
    TRIED["config value"] += 1
    path, error = _load(f"[{section}]\n{key} = {value}\n")
    if error is not None:
        assert path in str(error) and key in str(error), (section, key, value, str(error))


_PRINTABLE = st.characters(blacklist_categories=("Cs", "Cc"))


@settings(max_examples=100, deadline=None)
@given(section=st.sampled_from(sorted(_SECTIONS)), key=st.text(_PRINTABLE, min_size=1, max_size=20))
def test_an_unknown_key_in_any_section_fails_naming_file_and_key(section, key):
    known = {f.name for f in config_module.dataclasses.fields(_SECTIONS[section])}
    if key in known:
        return
    TRIED["config key"] += 1
    path, error = _load(f"[{section}]\n{_toml(key)} = 1\n")
    assert error is not None and path in str(error) and f"[{section}] {key!r}" in str(error), error


@settings(max_examples=60, deadline=None)
@given(section=st.text(_PRINTABLE, min_size=1, max_size=20).filter(lambda s: s not in _SECTIONS),
       as_table=st.booleans())
def test_an_unknown_or_malformed_section_fails_naming_file_and_section(section, as_table):
    TRIED["config section"] += 1
    text = f"[{_toml(section)}]\nx = 1\n" if as_table else f"{_toml(section)} = 1\n"
    path, error = _load(text)
    assert error is not None and path in str(error) and "unknown section" in str(error), error


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=200))
def test_random_text_as_a_config_file_fails_only_with_config_error(text):
    """Whatever the file holds: loaded, or ConfigError naming the file."""
    TRIED["config text"] += 1
    try:
        path, error = _load(text)
    except UnicodeEncodeError:
        return  # not writable as a file: nothing to load
    if error is not None:
        assert path in str(error), error


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_as_a_config_file_fail_only_with_config_error(raw, tmp_path_factory):
    """Bytes that are not UTF-8 are no TOML either: ConfigError naming the file, not a
    UnicodeDecodeError out of the loader."""
    TRIED["config bytes"] += 1
    path = tmp_path_factory.getbasetemp() / "hostile-bytes.toml"
    path.write_bytes(raw)
    try:
        config_module.load_config(path, env={})
    except ConfigError as e:
        assert str(path) in str(e), e
