"""The Python client of a wsd coordinator. Imports no torch.

One method per operation; every call has a timeout. Read-only operations are
retried with a fresh socket when no reply comes (the "lazy pirate" pattern);
state-changing ones are not, since each would be a new command. A call's
timeout is one deadline across its attempts, and ``Client.deadline`` puts
several calls under one. Before the first request on a new connection to a
tcp endpoint, the port is probed with a plain TCP connect, so that a port
nothing listens on is ``Unavailable`` at once instead of after every attempt
(ZeroMQ connects lazily and would only wait). Errors are raised as
``ClientError`` with the coordinator's code; whatever keeps a call from reaching
the coordinator (a malformed endpoint included, ``BadEndpoint``) is
``Unavailable``, one of them. Read calls return typed answers
(``wsd_client.results``), commands a ``CommandResult``.
"""

from __future__ import annotations

import contextlib
import getpass
import itertools
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import zmq

from wsd.commands import COMMANDS, CommandResult
from wsd.endpoints import endpoint_problem
from wsd.errors import BadEndpoint, ClientError, ConfigError, TransportError, Unavailable
from wsd.wire import protocol as p
from wsd.wire import transport
from wsd.wire.protocol import ErrorCode, Op
from wsd.wire.schemas import MAX_PROFILE_PAGE
from wsd_client.profiles import Profiles
from wsd_client.results import Engines, Events, PerEngine, Pong, Ranks, Stats, Status, per_engine
from wsd_client.stacks import Stacks

if TYPE_CHECKING:
    from wsd.wire.curve import ClientKeys

__all__ = ["DEFAULT_ENDPOINT", "TAIL", "BadEndpoint", "Client", "ClientError", "CommandResult", "Events", "Pong",
           "Ranks", "Stats", "Status", "Unavailable", "endpoint_problem"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7601"
# Of a call's timeout, what the coordinator may spend waiting on ranks, so that
# its partial answer arrives before the client gives up.
_SERVER_SHARE = 0.8
# Longest wait for the TCP probe of the port; a coordinator's kernel accepts in
# well under a millisecond, so only a dropped packet (a firewall) takes this long,
# and then the request is tried as usual.
_PROBE_TIMEOUT = 0.5
TAIL = None
"""``events(cursor=TAIL)``: no events, and the cursor of the newest one, to follow from now."""
# What the coordinator is asked for the tail: a cursor past any id (the protocol's largest).
_PAST_EVERY_ID = 2**63 - 1


def issuer() -> dict[str, str]:
    """Who this client is, as a command's event will say (``wsd.wire.protocol.ISSUER_KEYS``):
    the user and host it runs as, each cut to what the protocol takes; not proof of either."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's numeric user)
        user = f"uid {os.getuid()}"
    said = {"user": user, "host": socket.gethostname()}
    cut = p.MAX_ISSUER_TEXT
    return {k: v[:cut] for k, v in said.items() if v and v[:cut].isprintable()}


def _probe(endpoint: str, seconds: float) -> str | None:
    """Why nothing can answer at ``endpoint`` (refused, unresolvable, unreachable), or None.

    None also when the probe is inconclusive (a timeout: the packets may be
    dropped by a firewall while ZeroMQ still gets through), or not tcp.
    """
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        addresses = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"cannot resolve host {host!r}: {e.strerror}"
    except UnicodeError as e:  # the idna codec: a label over 63 characters, say
        return f"cannot resolve host {host[:80]!r}: not a valid host name ({e})"
    deadline = time.monotonic() + seconds
    reasons = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                s.connect(address)
            except ConnectionRefusedError:
                reasons.append(f"connection refused: nothing listens on {where}")
            except OSError as e:  # a timeout, unreachable network or host: not proof enough alone
                if isinstance(e, TimeoutError):
                    return None
                reasons.append(f"cannot reach {where}: {e.strerror or e}")
            else:
                return None
    return reasons[0] if reasons else None


class Client:
    """A connection to one coordinator's client endpoint."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        retries: int = 2,
        context: zmq.Context | None = None,
        curve_server_key: str | None = None,
        curve_client_key: str | None = None,
    ) -> None:
        """``curve_server_key``: the coordinator's public certificate; ``curve_client_key``:
        this client's NAME.key_secret (default ``$WSD_CURVE_SERVER_KEY``,
        ``$WSD_CURVE_CLIENT_KEY``); both, to connect with CURVE, or neither."""
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.endpoint = endpoint or os.environ.get("WSD_ENDPOINT") or DEFAULT_ENDPOINT
        problem = endpoint_problem(self.endpoint)
        if problem is not None:
            source = "endpoint" if endpoint else "environment variable WSD_ENDPOINT"
            raise BadEndpoint(ErrorCode.BAD_FIELD, f"{source} {problem}")
        server_key = curve_server_key or os.environ.get("WSD_CURVE_SERVER_KEY")
        client_key = curve_client_key or os.environ.get("WSD_CURVE_CLIENT_KEY")
        if bool(server_key) != bool(client_key):
            raise ConfigError("CURVE needs both the coordinator's public key (--curve-server-key, "
                              "WSD_CURVE_SERVER_KEY) and this client's secret key "
                              "(--curve-client-key, WSD_CURVE_CLIENT_KEY); only one is given")
        self._by = issuer()
        self._curve: ClientKeys | None = None
        if client_key and server_key:
            from wsd.wire.curve import ClientKeys  # CURVE's key files: only where they are used

            self._curve = ClientKeys.load(client_key, server_key)
        self.timeout = timeout
        self.retries = retries
        self._context = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._deadline: tuple[float, float] | None = None  # (monotonic time, its length in seconds)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Every call inside ends within ``seconds`` from now, all together, retries included."""
        outer = self._deadline
        self._deadline = (time.monotonic() + seconds, seconds)
        if outer is not None and outer[0] < self._deadline[0]:
            self._deadline = outer
        try:
            yield
        finally:
            self._deadline = outer

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            try:
                sock = self._context.socket(zmq.DEALER)
            except zmq.ZMQError as e:  # the context was terminated
                raise Unavailable(ErrorCode.UNAVAILABLE, f"cannot open a socket to {self.endpoint}: {e}") from e
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(sock)
            try:
                transport.connect(sock, self.endpoint)  # IPv6 enabled for tcp://[...]
            except TransportError as e:
                sock.close(linger=0)
                raise Unavailable(ErrorCode.UNAVAILABLE, str(e)) from e
            self._sock = sock
        return self._sock

    def call(self, op: Op, body: dict[str, Any] | None = None, *, timeout: float | None = None,
             server_wait: bool = False) -> Any:
        """Send one request and return its result, or raise ClientError/Unavailable.

        ``timeout``: seconds for the whole call, every attempt included (and no
        later than an enclosing ``deadline``). ``server_wait``: the body gets a
        ``timeout`` for the coordinator's own wait, a share of each attempt's.
        """
        seconds = self.timeout if timeout is None else timeout
        end = time.monotonic() + seconds
        if self._deadline is not None and self._deadline[0] < end:
            end, seconds = self._deadline
        attempts = 1 + (self.retries if op in p.READ_ONLY_OPS or op in p.OPERATOR_READ_OPS else 0)
        if self._sock is None:  # a new connection: is anything there at all?
            reason = _probe(self.endpoint, min(_PROBE_TIMEOUT, max(end - time.monotonic(), 0.001)))
            if reason is not None:
                raise Unavailable(ErrorCode.UNAVAILABLE, f"no reply from {self.endpoint} to {op}: {reason}")
        tried = 0
        while tried < attempts and (left := end - time.monotonic()) > 0:
            wait = left / (attempts - tried)  # the time left, shared by the attempts left
            tried += 1
            request_id = next(self._ids)
            sock = self._socket()
            if server_wait:
                body = {**(body or {}), "timeout": wait * _SERVER_SHARE}
            try:
                sock.send(p.encode(op, body, request_id, by=self._by if op in p.COMMAND_OPS else None),
                          zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection yet: wait for the reply we will not get, then retry
            except zmq.ZMQError as e:  # the socket or its context is gone
                self.close()
                raise Unavailable(ErrorCode.UNAVAILABLE, f"cannot send {op} to {self.endpoint}: {e}") from e
            reply = self._await(sock, request_id, time.monotonic() + wait)
            if reply is not None:
                if not reply.ok:
                    raise ClientError(reply.code or ErrorCode.INTERNAL, reply.message)
                return reply.result
            self.close()  # lazy pirate: a fresh socket for the next attempt
        raise Unavailable(
            ErrorCode.UNAVAILABLE,
            f"no reply from {self.endpoint} to {op} within {seconds:g} s "
            f"({tried} attempt{'s' if tried != 1 else ''})",
        )

    @staticmethod
    def _await(sock: zmq.Socket, request_id: int, deadline: float) -> p.Reply | None:
        while True:
            left = deadline - time.monotonic()
            # int(): as pyzmq does with a float, which its stubs do not admit.
            if left <= 0 or not sock.poll(int(left * 1000), zmq.POLLIN):
                return None
            try:
                reply = p.decode_reply(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except p.ProtocolError as e:
                raise ClientError(e.code, f"bad reply from the coordinator: {e}") from e
            if reply.id == request_id or (reply.id == 0 and not reply.ok):
                return reply
            # a late reply to an earlier attempt: drop it

    # -- read-only ---------------------------------------------------------------

    def ping(self) -> Pong:
        return Pong(self.call(Op.PING))

    def engines(self) -> Engines:
        """Every engine the coordinator serves: name, model, ranks, lock, slots, scratch, violations."""
        return Engines(self.call(Op.ENGINES))

    # Every call below takes ``engine``: the engine to ask (None: the only one the coordinator
    # serves, or, when it serves several, every one, each answering for itself in a
    # ``PerEngine``; ``by_engine`` reads either alike).

    def status(self, *, engine: str | None = None, offset: int = 0, limit: int = 512) -> Status | PerEngine[Status]:
        """The world, the desired state, and the TP groups ``offset`` to ``offset + limit`` (at most
        4,096 a call; ``groups_total`` says how many there are)."""
        return per_engine(self.call(Op.STATUS, {"engine": engine, "offset": offset, "limit": limit}), Status)

    def ranks(self, *, engine: str | None = None) -> Ranks | PerEngine[Ranks]:
        return per_engine(self.call(Op.RANKS, {"engine": engine}), Ranks)

    def stats(self, group: int | None = None, *, timeout: float | None = None, fresh: bool = False,
              engine: str | None = None) -> Stats | PerEngine[Stats]:
        """Per rank, slot and TP group; ``complete`` is False and ``missing`` says who is absent.

        From the snapshots the ranks pushed, as the coordinator remembers them:
        each rank's ``age`` says how many seconds ago its snapshot was known
        current, and ``stale`` (a rank's, and the answer's list) marks those
        older than ``[coordinator] stats_stale_after``. ``fresh``: every live rank
        is asked now instead, and the answer waits for the slowest (``age`` 0).

        The coordinator's compact answer, as it came (slots as columns): ``rows()``
        gives one map per slot, the document ``wsctl stats --json`` prints.
        """
        return per_engine(self.call(Op.STATS, {"group": group, "fresh": fresh, "engine": engine}, timeout=timeout,
                                    server_wait=True), Stats)

    def events(self, cursor: int | None = 0, limit: int = 100, *, engine: str | None = None) -> Events:
        """Events after ``cursor`` (0: from the oldest the coordinator holds); pass back the
        returned ``cursor`` to follow. ``cursor=TAIL`` (None): none, and the newest event's id
        as the cursor, to follow from now; ids are consecutive, so ``cursor - n`` then gives
        the last ``n``. ``engine``: only that engine's events (and the coordinator's own)."""
        if cursor is TAIL:
            return Events(self.call(Op.EVENTS, {"cursor": _PAST_EVERY_ID, "limit": 1, "engine": engine}))
        return Events(self.call(Op.EVENTS, {"cursor": cursor, "limit": limit, "engine": engine}))

    def stacks(self, rank: int | None = None, group: int | None = None, *, timeout: float | None = None,
               engine: str | None = None) -> Stacks | PerEngine[Stacks]:
        """Every thread's Python stack of the live ranks asked (``rank``, else ``group``'s, else
        every one), the engine's thread first, gathered by each agent's own thread; ``missing``
        names the ranks asked that did not answer within ``timeout`` (default: the
        coordinator's ``stats_timeout``). Under CURVE, an admin key's only."""
        return per_engine(self.call(Op.STACKS, {"rank": rank, "group": group, "timeout": timeout,
                                                "engine": engine}), Stacks)

    def profiles(self, offset: int | None = None, limit: int = MAX_PROFILE_PAGE) -> Profiles:
        """Every sizing profile the coordinator keeps: per engine profile (``NAME:tpT:ubU:lnL``),
        the largest request each slot has served or refused (docs/manager.md, "Sizing profiles").
        The coordinator answers a page at a time: with ``offset``, that page (``limit``
        profiles, by key); without, every page in turn, as one answer."""
        if offset is not None:
            return Profiles(self.call(Op.PROFILES, {"offset": offset, "limit": limit}))
        doc = dict(self.call(Op.PROFILES, {"offset": 0, "limit": limit}))
        profiles = list(doc["profiles"])
        while doc["profiles"] and len(profiles) < doc.get("profiles_total", 0):
            doc = dict(self.call(Op.PROFILES, {"offset": len(profiles), "limit": limit}))
            profiles += doc["profiles"]
        return Profiles({**doc, "profiles": profiles, "offset": 0})

    def drop_profile(self, key: str) -> dict[str, Any]:
        """Forget sizing profile ``key`` (as ``profiles`` lists it): ``{dropped, saved}``. Under
        CURVE, an admin key's only; an unknown key is a ClientError (``bad_field``)."""
        return dict(self.call(Op.DROP_PROFILE, {"key": key}))

    # -- state-changing ------------------------------------------------------------

    def _command(self, op: Op, extra: dict[str, Any], group: int | None, wait: bool,
                 timeout: float | None, engine: str | None) -> CommandResult | PerEngine[CommandResult]:
        body = {**extra, "group": group, "wait": wait, "engine": engine}
        return per_engine(self.call(op, body, timeout=timeout, server_wait=True), CommandResult.from_dict)

    def command(self, action: str, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
                engine: str | None = None, new_engine: bool = False,
                **args: Any) -> CommandResult | PerEngine[CommandResult]:
        """Any command of the table (``wsd.commands.COMMANDS``) by its name, with its arguments.
        Naming no engine where the coordinator serves several, every engine numbers and applies
        it, each answering for itself. An ``engine`` the coordinator does not serve is refused
        (``bad_field``, naming those it does) unless ``new_engine``: the command then sets the
        desired state that engine starts into."""
        if action not in COMMANDS:
            raise ValueError(f"unknown command {action!r} (commands: {', '.join(COMMANDS)})")
        extra = {**args, "new_engine": True} if new_engine else args
        return self._command(Op(action), extra, group, wait, timeout, engine)

    def lock(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
             engine: str | None = None) -> CommandResult | PerEngine[CommandResult]:
        return self._command(Op.LOCK, {}, group, wait, timeout, engine)

    def unlock(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
               engine: str | None = None) -> CommandResult | PerEngine[CommandResult]:
        return self._command(Op.UNLOCK, {}, group, wait, timeout, engine)

    def set_ubatches(self, n: int, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
                     engine: str | None = None) -> CommandResult | PerEngine[CommandResult]:
        return self._command(Op.SET_UBATCHES, {"n": n}, group, wait, timeout, engine)

    def reserve_bytes(self, nbytes: int, group: int | None = None, *, wait: bool = True,
                      timeout: float | None = None, engine: str | None = None
                      ) -> CommandResult | PerEngine[CommandResult]:
        """Grow every slot to at least ``nbytes``: the manager's ``reserve_bytes`` on every rank."""
        return self._command(Op.RESERVE, {"bytes": nbytes}, group, wait, timeout, engine)

    def reserve(self, nbytes: int, group: int | None = None, *, wait: bool = True,
                timeout: float | None = None) -> CommandResult | PerEngine[CommandResult]:
        """Deprecated: ``reserve_bytes``, named as the manager's method it calls (the manager's
        ``reserve`` takes shapes and dtypes, not bytes)."""
        warnings.warn("Client.reserve(nbytes) is deprecated: use Client.reserve_bytes(nbytes)",
                      DeprecationWarning, stacklevel=2)
        return self.reserve_bytes(nbytes, group, wait=wait, timeout=timeout)

    def equalize(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
                 engine: str | None = None) -> CommandResult | PerEngine[CommandResult]:
        return self._command(Op.EQUALIZE, {}, group, wait, timeout, engine)

    def trim(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
             engine: str | None = None) -> CommandResult | PerEngine[CommandResult]:
        return self._command(Op.TRIM, {}, group, wait, timeout, engine)
