"""The coordinator's logic: engines, and what routes to them.

``CoordinatorCore`` makes every decision as plain methods with no I/O:
``handle_agent(route, frame)``, ``handle_client(route, frame)`` and ``tick()``
each return the frames to send as ``(AGENT | CLIENT, route, frame)``. The
socket loop that drives it is ``wsd.coordinator.loop.Coordinator``.

One coordinator serves many engines (``wsd.coordinator.engine.Engine``), each
its own world of ranks with its own command log. An agent frame goes to the
engine its connection registered with; a client request to the engine it
names, or, naming none, to the only engine served (the default engine while
none is), or to every engine, each answering for itself. What an agent
connection may send and cost, and whether a registration proves its identity,
is ``wsd.coordinator.admission.AgentGate``'s, for every engine. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from wsd.config import CoordinatorConfig
from wsd.coordinator.admission import TOO_LARGE, UNREGISTERED_FRAME, AgentGate, Unauthenticated
from wsd.coordinator.dispatch import RESEND_WINDOW
from wsd.coordinator.engine import Engine, Shared, refuse, state_path
from wsd.coordinator.events import EventKind, EventLog
from wsd.coordinator.metrics import CommandStats, Counters, EngineFigures, Published, StatsView
from wsd.coordinator.outbox import AGENT, CLIENT, Answer, Out, Route
from wsd.coordinator.profiles import MAX_PROFILES, ProfileKey, Profiles, profiles_path
from wsd.errors import StateFileError
from wsd.wire import protocol as p
from wsd.wire.curve import Role
from wsd.wire.protocol import ErrorCode, Op, ProtocolError

__all__ = ["AGENT", "CLIENT", "RESEND_WINDOW", "CoordinatorCore", "Out"]

logger = logging.getLogger(__name__)


@dataclass
class _Fanout:
    """A client request that every engine answers for itself: the answer waits for all of them."""

    route: Route
    request_id: int
    owed: set[str]
    results: dict[str, bytes] = field(default_factory=dict)

    def answer(self, engine: str) -> Answer:
        def take(result: dict[str, Any] | bytes) -> list[Out]:
            self.results[engine] = result if isinstance(result, bytes) else msgpack.packb(result, use_bin_type=True)
            self.owed.discard(engine)
            if self.owed:
                return []
            # {"engines": {name: answer}}, each answer as its engine encoded it.
            engines = p.spliced({}, dict(sorted(self.results.items())))
            return [(CLIENT, self.route, p.ok_reply_packed(self.request_id, p.spliced({}, {"engines": engines})))]
        return take


def _direct(route: Route, request_id: int) -> Answer:
    def send(result: dict[str, Any] | bytes) -> list[Out]:
        frame = p.ok_reply_packed(request_id, result) if isinstance(result, bytes) else p.ok_reply(request_id, result)
        return [(CLIENT, route, frame)]
    return send


ENGINE_GRACE = 10
"""Heartbeat timeouts after which an engine that holds nothing (no live rank, no command) is
forgotten: a restart of its ranks within that keeps its name and history."""


class CoordinatorCore:
    """Every decision of the coordinator, driven by messages and a clock."""

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        agent_token: bytes | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall
        self.epoch = uuid.uuid4().hex
        # What agents may send and cost, and whether a registration proves it holds
        # the agent token (None: not authenticated; a warning at start-up says so).
        self.gate = AgentGate(agent_token, config.heartbeat_timeout, clock)
        self.events = EventLog(config.event_capacity)
        # Advisory: a damaged profiles file is moved aside and the coordinator starts with none.
        self.profiles = Profiles(profiles_path(config.state_file), wall=wall, clock=clock,
                                 max_slot_bytes=config.max_profile_slot_bytes)
        self.shared = Shared(config, clock, wall, self.epoch, self.gate, self.events, CommandStats(), self.profiles)
        # The default engine is there from the start: its state file is the configured one,
        # and a command before any rank registered is its.
        default = Engine(config.engine, self.shared, config.state_file)
        self.engines: dict[str, Engine] = {config.engine: default}
        self.started = default.started
        # Which engine each registered connection belongs to (checked against that engine's
        # registry, which is the truth: a connection superseded there is forgotten here).
        self._peers: dict[bytes, Engine] = {}
        self._next_pulse = clock()
        self._dropped_bad_agent_frames = 0  # frames no engine read: the rest are each engine's
        # Metrics: counters kept on the loop thread; the HTTP thread reads only
        # ``published``, immutable views replaced whole (see wsd.coordinator.metrics).
        self.published = Published()
        self._metrics = config.metrics_port is not None
        self._next_refresh = clock() if self._metrics else math.inf
        self._client_ops: dict[Op, Callable[[Route, p.Message], list[Out]]] = {
            Op.PING: self._ping,
            Op.ENGINES: self._engines,
            Op.STATUS: self._status,
            Op.RANKS: self._ranks,
            Op.STATS: self._stats_request,
            Op.EVENTS: self._events,
            Op.STACKS: self._stacks,
            Op.PROFILES: self._profiles,
            Op.DROP_PROFILE: self._drop_profile,
            **{op: self._command for op in p.COMMAND_OPS},
        }
        if self._metrics:  # a scrape before the first tick sees every family too
            self._publish()

    def engine(self, name: str | None = None) -> Engine:
        """Engine ``name`` (None: the default engine); KeyError if the coordinator serves none of that name."""
        return self.engines[self.config.engine if name is None else name]

    @property
    def recovered(self) -> bool:
        """Whether the default engine's state was read from its state file at start."""
        return self.engine().recovered

    @property
    def dropped_bad_agent_frames(self) -> int:
        return self._dropped_bad_agent_frames + sum(e.dropped_bad_agent_frames for e in self.engines.values())

    # -- entry points --------------------------------------------------------

    def handle_client(self, route: Route, frame: bytes, role: str | None = None, key: str | None = None) -> list[Out]:
        """One client frame; ``role`` and ``key``: the sender's CURVE role and key name (ZAP's
        User-Id), None without CURVE."""
        request_id: int | None = None
        try:
            if len(frame) > self.config.max_message_bytes:
                raise ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"message of {len(frame)} bytes exceeds max_message_bytes={self.config.max_message_bytes}",
                )
            message = p.decode(frame, p.CLIENT_OPS)
            request_id = message.id
            if role is not None:  # who sent it, as the transport proved it: apart from the claim
                message = dataclasses.replace(message, proven={"role": role, **({"key": key} if key else {})})
            return self._client_ops[message.op](route, message)
        except ProtocolError as e:
            return [(CLIENT, route, p.error_reply(e.request_id, e.code, str(e)))]
        except StateFileError as e:  # storage, not a bug: the message names the file
            logger.error("%s", e)
            return [(CLIENT, route, p.error_reply(request_id, ErrorCode.STORAGE, str(e)))]
        except Exception as e:  # a bug: the client gets an answer and the loop goes on
            if self.gate.allow(("internal error", CLIENT)):  # a traceback at a bounded rate
                logger.exception("coordinator failed on a client request")
            return [(CLIENT, route, p.error_reply(request_id, ErrorCode.INTERNAL, f"internal error: {e!r}"))]

    def handle_agent(self, route: Route, frame: bytes) -> list[Out]:
        peer = route[0]
        engine = self._engine_of(peer)
        refused = self.gate.meter(peer, len(frame), registered=engine is not None)
        if refused is not None:  # dropped unread
            if refused == TOO_LARGE and self.gate.allow(("too large", peer)):
                # A real agent would otherwise retry for ever without a word of why.
                return [(AGENT, (peer,), p.encode(Op.REJECTED, {"code": str(ErrorCode.TOO_LARGE), "message": (
                    f"a frame of {len(frame)} bytes from a connection that has not registered: "
                    f"at most {UNREGISTERED_FRAME}")}))]
            return []
        if len(frame) > p.SMALL_FRAME and p.peek_op(frame) == Op.STATS_REPLY and not (
                engine is not None and engine.asked(peer)):
            self.gate.refused["stats reply not asked for"] += 1  # never decoded
            return []
        try:
            message = p.decode(frame, p.AGENT_OPS)
            if message.op is Op.REGISTER:
                return self._register(peer, message.body, engine)
            if message.op is Op.STATS_PUSH and engine is not None and not engine.push_affordable(peer, len(frame)):
                return []  # faster than any agent pushes: dropped, unacknowledged (its liveness noted)
            # An unregistered connection's frame goes to the default engine, which knows it
            # not and answers as it always did (a heartbeat: register again).
            return (engine or self.engine()).agent_ops[message.op](peer, message.body)
        except ProtocolError as e:
            self._dropped_bad_agent_frames += 1
            if self.gate.allow(("bad message",)):  # one log line, however many peers
                logger.warning("bad message from agent %s: %s (%d bad frames in all)", peer.hex(), e,
                               self.dropped_bad_agent_frames)
            return [(AGENT, (peer,), p.encode(Op.REJECTED, {"code": str(e.code), "message": str(e)}))]
        except StateFileError as e:
            logger.error("%s", e)
            return []
        except Exception:  # a bug, contained to this frame: logged at a bounded rate
            if self.gate.allow(("internal error", AGENT)):
                logger.exception("coordinator failed on an agent message")
            return []

    def _engine_of(self, peer: bytes) -> Engine | None:
        engine = self._peers.get(peer)
        if engine is not None and engine.registry.by_peer(peer) is None:
            del self._peers[peer]  # superseded or forgotten there
            return None
        return engine

    def _register(self, peer: bytes, body: dict[str, Any], engine: Engine | None) -> list[Out]:
        name = body["engine"] or self.config.engine
        if self.gate.token is not None and body["challenge"] is None:  # the first of two: challenge it
            if body["nonce"] is None:
                return refuse(self.shared, peer, body, ErrorCode.FORBIDDEN, (
                    f"rank {body['rank']}: registration refused: this coordinator has an agent token and "
                    f"challenges every registration, and this agent sends no nonce: it has no token (give the "
                    f"worker the same WSD_AGENT_TOKEN or [security] agent_token_file), or its wsd predates "
                    f"the challenge (upgrade it)"), engine=name)
            return [(AGENT, (peer,), p.encode(Op.CHALLENGE, self.gate.challenge(peer, body["nonce"])))]
        try:
            proven = self.gate.authenticate(peer, body)
        except Unauthenticated as e:
            return refuse(self.shared, peer, body, ErrorCode.FORBIDDEN, str(e), engine=name)
        if engine is not None and engine.name != name:
            return refuse(self.shared, peer, body, ErrorCode.MISMATCH, (
                f"this connection registered rank {engine.registry.by_peer(peer).rank} of engine "  # type: ignore[union-attr]
                f"{engine.name!r}; a rank of engine {name!r} connects on its own"), engine=name)
        target = self.engines.get(name)
        if target is None:
            try:
                target = self._add_engine(name)
            except ProtocolError as e:
                return refuse(self.shared, peer, body, e.code, str(e), engine=name)
        old = target.registry.ranks.get(body["rank"])
        out = target.register(peer, body, proven)
        if target.registry.by_peer(peer) is not None:
            self._peers[peer] = target
            if old is not None and old.peer != peer:
                self._peers.pop(old.peer, None)
        return out

    def _forget_engines(self, now: float, grace: float | None = None) -> None:
        """Forget every engine but the default one that holds nothing (no live rank, no command
        ever numbered: no desired state) and has held nothing for ``grace`` seconds (default
        ``ENGINE_GRACE`` heartbeat timeouts): junk names and engines long gone count toward no
        limit, and leave no file behind."""
        grace = ENGINE_GRACE * self.config.heartbeat_timeout if grace is None else grace
        for name, engine in list(self.engines.items()):
            if name == self.config.engine or engine.log.seq > 0:
                continue
            if engine.registry.live():
                engine.held_at = now
            elif now - engine.held_at >= grace:
                del self.engines[name]
                self._peers = {peer: e for peer, e in self._peers.items() if e is not engine}
                engine.log.discard()
                self.events.add(EventKind.ENGINE_FORGOTTEN, self.wall(), engine=name)

    def _add_engine(self, name: str) -> Engine:
        """A new engine, its command log loaded from its state file if it has one; a
        ProtocolError (``conflict``) beyond ``max_engines`` engines that hold something."""
        if len(self.engines) >= self.config.max_engines:
            self._forget_engines(self.clock(), grace=0.0)  # those that hold nothing count toward no limit
        if len(self.engines) >= self.config.max_engines:
            raise ProtocolError(ErrorCode.CONFLICT, (
                f"engine {name!r} would be engine {len(self.engines) + 1} of this coordinator, which "
                f"serves at most [coordinator] max_engines = {self.config.max_engines}"))
        engine = self.engines[name] = Engine(name, self.shared, state_path(
            self.config.state_file, name, self.config.engine), first=EventKind.ENGINE_ADDED)
        return engine

    def note_heard(self, until: float) -> None:
        """The socket loop: every agent frame that arrived before ``until`` has been read."""
        self.gate.note_heard(until)

    def tick(self, heard_until: float | None = None) -> list[Out]:
        """Time-driven work: lost ranks, timeouts, pulses to agents.

        ``heard_until``: as ``note_heard``; a rank is lost only if it was silent for
        the timeout before then (see ``AgentGate.heard``).
        """
        if heard_until is not None:
            self.note_heard(heard_until)
        now = self.clock()
        out: list[Out] = []
        heard = self.gate.heard(now)
        for engine in list(self.engines.values()):
            out += engine.tick(now, heard)
        self.profiles.tick(now)
        if now >= self._next_pulse:
            self._next_pulse = now + self.config.heartbeat_interval
            self._forget_engines(now)  # once an interval: it looks at every engine's ranks
            suppressed = self.events.take_over_budget() + Counter(self.gate.take_suppressed())
            if suppressed:  # one line for a flood, at most once an interval
                self.events.add(EventKind.SUPPRESSED, self.wall(), counts=dict(suppressed))
            pulse = p.encode(Op.PULSE, {"epoch": self.epoch})
            out += [(AGENT, (i.peer,), pulse) for e in self.engines.values() for i in e.registry.live()]
            if self._metrics:
                self._publish_core()
        if now >= self._next_refresh:
            self._next_refresh = now + self.config.metrics_refresh
            self._publish()
        return out

    def next_deadline(self) -> float:
        """When ``tick`` next has something to do (monotonic clock)."""
        return min(self._next_pulse, self._next_refresh, self.profiles.next_deadline(),
                   *(e.next_deadline() for e in self.engines.values()))

    def close(self) -> None:
        """The coordinator stops: what it keeps outside the command log (the sizing profiles)
        is written."""
        self.profiles.close()

    # -- metrics --------------------------------------------------------------

    def _publish(self) -> None:
        """Give the metrics endpoint the stats and core views of now. The metrics copy what is
        remembered: no rank is asked."""
        self._publish_core(tuple(e.snapshots.view() for e in self.engines.values()))

    def _publish_core(self, stats: tuple[StatsView, ...] | None = None) -> None:
        """Give the metrics endpoint a fresh copy of the registries and counters (replaced whole);
        the stats views as they were unless given."""
        kept = {f.name: f.stats for f in self.published.engines}
        views = stats if stats is not None else tuple(kept.get(name) for name in self.engines)
        counts, latency = self.shared.command_stats.snapshot()
        counters = Counters(heartbeats=sum(e.heartbeats for e in self.engines.values()), commands=counts,
                            latency=latency, refused=tuple(sorted(self.gate.refused.items())),
                            events=tuple(sorted(self.events.counts.items())))
        engines = tuple(EngineFigures(name, e.core_view(), view)
                        for (name, e), view in zip(self.engines.items(), views))
        self.published = replace(self.published, counters=counters, engines=engines)

    # -- clients ----------------------------------------------------------

    def _addressed(self, name: str | None, *, add: bool = False) -> list[Engine]:
        """The engines a request is for: the one it names, else the only one in use (the
        default engine while none is), else every engine in use. ``add``: one named that the
        coordinator does not serve yet is added (a command with ``new_engine`` sets an engine's
        desired state before its first rank starts); else it is refused, naming those served."""
        if name is not None:
            engine = self.engines.get(name)
            if engine is None and add:
                return [self._add_engine(name)]
            if engine is None:
                raise ProtocolError(ErrorCode.BAD_FIELD, (
                    f"engine: this coordinator serves no engine {name!r} (it serves "
                    f"{', '.join(sorted(self.engines))}); a command that sets the state an engine not "
                    f"started yet starts into says so (wsctl --new-engine, new_engine=True)"))
            return [engine]
        used = [e for e in self.engines.values() if e.in_use]
        return used if used else [self.engine()]

    def _answer(self, route: Route, message: p.Message, engines: list[Engine],
                ask: Callable[[Engine, Answer], list[Out]]) -> list[Out]:
        """Ask one engine, answered as it answers; or several, answered ``{"engines": {name: answer}}``
        once all have."""
        if len(engines) == 1:
            return ask(engines[0], _direct(route, message.id))
        fan = _Fanout(route, message.id, {e.name for e in engines})
        out: list[Out] = []
        for engine in engines:
            out += ask(engine, fan.answer(engine.name))
        return out

    def _ping(self, route: Route, message: p.Message) -> list[Out]:
        answer = {"epoch": self.epoch, "time": self.wall(), "seq": self.engine().log.seq,
                  "engines": {name: e.log.seq for name, e in sorted(self.engines.items())}}
        return [(CLIENT, route, p.ok_reply(message.id, answer))]

    def _engines(self, route: Route, message: p.Message) -> list[Out]:
        rows = [e.summary() for name, e in sorted(self.engines.items()) if e.in_use or name == self.config.engine]
        return [(CLIENT, route, p.ok_reply(message.id, {"engines": rows, "default": self.config.engine}))]

    def _command(self, route: Route, message: p.Message) -> list[Out]:
        engines = self._addressed(message.body["engine"], add=message.body["new_engine"])
        action = str(message.op)
        for engine in engines:  # refused by one: numbered by none
            engine.check_group(message.body["group"])
            engine.dispatch.check(action, message.body["group"])
        return self._answer(route, message, engines,
                            lambda e, answer: e.dispatch.command(action, message.body, answer,
                                                                 issuer=message.issuer()))

    def _stats_request(self, route: Route, message: p.Message) -> list[Out]:
        body = message.body
        engines = self._addressed(body["engine"])
        for engine in engines:
            engine.check_group(body["group"])
        if body["fresh"]:  # ask every live rank now, and wait
            timeout = body["timeout"] or self.config.stats_timeout
            return self._answer(route, message, engines,
                                lambda e, answer: e.snapshots.start(answer, body["group"], timeout))
        return self._answer(route, message, engines,
                            lambda e, answer: answer(e.snapshots.remembered(body["group"])))

    def _stacks(self, route: Route, message: p.Message) -> list[Out]:
        body = message.body
        engines = self._addressed(body["engine"])
        targets = {e.name: e.stack_targets(body["group"], body["rank"]) for e in engines}
        timeout = body["timeout"] or self.config.stats_timeout
        return self._answer(route, message, engines,
                            lambda e, answer: e.stacks.start(answer, targets[e.name], timeout))

    def _profiles(self, route: Route, message: p.Message) -> list[Out]:
        body = message.body
        result = {"profiles": self.profiles.public(body["offset"], body["limit"]), "offset": body["offset"],
                  "profiles_total": len(self.profiles.profiles), "file": self.profiles.path,
                  "max_profiles": MAX_PROFILES, "max_slot_bytes": self.profiles.max_slot_bytes}
        return [(CLIENT, route, p.ok_reply(message.id, result))]

    def _drop_profile(self, route: Route, message: p.Message) -> list[Out]:
        text = message.body["key"]
        try:
            key = ProfileKey.parse(text)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"key: {e}") from None
        if not self.profiles.drop(key):
            known = ", ".join(str(k) for k in list(self.profiles.profiles)[:8]) or "none"
            raise ProtocolError(ErrorCode.BAD_FIELD, f"key: no sizing profile {text!r} (known: {known})")
        saved = self.profiles.save()  # at once: an operator's change is durable when answered
        self.events.add(EventKind.PROFILE_DROPPED, self.wall(), key=text, **message.issuer())
        return [(CLIENT, route, p.ok_reply(message.id, {"dropped": text, "saved": saved}))]

    def _events(self, route: Route, message: p.Message) -> list[Out]:
        name = message.body["engine"]
        if name is not None:
            self._addressed(name)  # a name it serves, or an error that says which it does
        events, cursor = self.events.since(message.body["cursor"], message.body["limit"], engine=name)
        if (message.proven or {}).get("role") not in (None, Role.ADMIN):  # frames are an admin's, as stacks are
            events = [{**e, "stacks": None, "stacks_withheld": True} if e.get("stacks") else e for e in events]
        # The epoch tells a follower that ids started again (a restarted coordinator).
        result = {"events": events, "cursor": cursor, "epoch": self.epoch}
        return [(CLIENT, route, p.ok_reply(message.id, result))]

    def _ranks(self, route: Route, message: p.Message) -> list[Out]:
        return self._answer(route, message, self._addressed(message.body["engine"]),
                            lambda e, answer: answer(e.ranks()))

    def _status(self, route: Route, message: p.Message) -> list[Out]:
        body = message.body
        return self._answer(route, message, self._addressed(body["engine"]),
                            lambda e, answer: answer(e.status(body["offset"], body["limit"])))
