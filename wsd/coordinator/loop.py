"""The coordinator's socket loop: two ROUTER sockets driving ``CoordinatorCore``.

Agents connect (DEALER) to the agent ROUTER, clients to the client ROUTER. The
loop only moves frames between the sockets and the core; every decision is
the core's. It runs in the foreground (``serve``) or in a thread (``start``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import zmq

from wsd.config import CoordinatorConfig
from wsd.coordinator.core import AGENT, CLIENT, CoordinatorCore, Out
from wsd.coordinator.metrics_server import MetricsServer
from wsd.errors import WsdError
from wsd.security import SecurityConfig, load_agent_token
from wsd.wire.curve import AGENT_DOMAIN, CLIENT_DOMAIN, CurveGate, Role, is_loopback, refusal, user_id
from wsd.wire.protocol import READ_ONLY_OPS, ErrorCode, error_reply, peek_op
from wsd.wire.transport import bind, make_socket, raise_fd_limit, send_nowait

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)

# Frames handled per socket before the loop looks at the other one and the clock.
_BATCH = 256
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# A frame up to this many times max_message_bytes is read and refused with a
# TOO_LARGE reply; beyond it ZeroMQ drops the connection (MAXMSGSIZE) so that a
# hostile client cannot make the coordinator buffer gigabytes.
_HARD_LIMIT_FACTOR = 4
# The loop wakes at least this often to notice stop().
_MAX_POLL = 0.1
# Descriptors beyond one per agent connection: clients, ZAP, the metrics endpoint, logs.
_FD_HEADROOM = 256


class Coordinator:
    """Binds the configured endpoints and serves until stopped."""

    def __init__(self, config: CoordinatorConfig, *, context: zmq.Context | None = None,
                 security: SecurityConfig | None = None, agent_token: bytes | None = None) -> None:
        """``agent_token`` None: ``[security] agent_token_file``, else ``$WSD_AGENT_TOKEN``,
        else registrations are not authenticated (ConfigError for a bad token file)."""
        self.config = config
        if agent_token is None:
            agent_token = load_agent_token(security or SecurityConfig())
        self.core = CoordinatorCore(config, agent_token=agent_token)
        self._own_context = context is None
        self._context = context or zmq.Context()
        try:  # keys checked and ZAP running before any socket exists
            self._gate = CurveGate(security or SecurityConfig(), self._context)
        except Exception:
            if self._own_context:
                self._context.term()
            raise
        if config.world_size is not None:  # one descriptor per agent connection
            raise_fd_limit(config.world_size + _FD_HEADROOM)
        self._stop = threading.Event()
        self.metrics: MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._agents = make_socket(self._context, zmq.ROUTER, hwm=config.high_water_mark)
        self._clients = make_socket(self._context, zmq.ROUTER, hwm=config.high_water_mark)
        for sock in (self._agents, self._clients):
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._clients.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes * _HARD_LIMIT_FACTOR)
        # An agent's frame past this drops its connection unread (it reconnects).
        self._agents.setsockopt(zmq.MAXMSGSIZE, config.max_agent_message_bytes)
        curve = {"agents": self._gate.secure(self._agents, AGENT_DOMAIN),
                 "clients": self._gate.secure(self._clients, CLIENT_DOMAIN)}
        try:
            self.agent_endpoint = bind(self._agents, config.agent_endpoint)
            self.client_endpoint = bind(self._clients, config.client_endpoint)
        except WsdError:
            self._close()
            raise
        for who, endpoint in (("agents", self.agent_endpoint), ("clients", self.client_endpoint)):
            if not curve[who] and not is_loopback(endpoint):
                logger.warning("%s endpoint %s is reachable from other hosts without CURVE: anyone "
                               "who reaches it may connect; set [security] curve_%s", who, endpoint, who)
        if config.metrics_port is not None:
            try:  # bound now, as the sockets are; it serves whatever the core last published
                self.metrics = MetricsServer.from_config(lambda: self.core.published, config)
            except WsdError:
                self._close()
                raise
            if not is_loopback(f"tcp://{config.metrics_host}:{self.metrics.port}") \
                    and not config.metrics_client_auth_required:
                logger.warning("metrics endpoint %s is reachable from other hosts: anyone who reaches it "
                               "may read every rank's figures; set [coordinator] metrics_host to keep it "
                               "local, or metrics_client_auth_required with HTTPS", self.metrics.url)
        self.dropped_sends = 0
        logger.info("coordinator %s: agents on %s, clients on %s (seq %d%s)",
                    self.core.epoch[:8], self.agent_endpoint, self.client_endpoint,
                    self.core.engine().log.seq, ", recovered" if self.core.recovered else "")
        if self.metrics is not None:
            logger.info("coordinator metrics on %s", self.metrics.url)

    @property
    def metrics_url(self) -> str | None:
        """``http(s)://HOST:PORT/metrics`` with the bound port, or None with no metrics port."""
        return None if self.metrics is None else self.metrics.url

    def start(self) -> Coordinator:
        """Serve in a background thread; returns self."""
        self._thread = threading.Thread(target=self.serve, name="wsd-coordinator", daemon=True)
        self._thread.start()
        return self

    @property
    def serving(self) -> bool:
        """True while the loop started by ``start()`` runs; False once it ended, for any reason."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close the sockets; waits at most ``timeout`` for the loop."""
        self._stop.set()
        if self._thread is None:
            self._close()  # never served: nothing else will close the sockets
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WsdError(f"coordinator loop did not stop within {timeout} s")
        self._thread = None

    def serve(self) -> None:
        """Serve in this thread until ``stop()``."""
        poller = zmq.Poller()
        poller.register(self._agents, zmq.POLLIN)
        poller.register(self._clients, zmq.POLLIN)
        core = self.core
        handle_agent = core.handle_agent
        # Every agent frame that arrived before this (monotonic) time has been read:
        # liveness is judged up to it, so that frames waiting unread behind a burst
        # (hostile or not) never make a live rank look silent.
        heard_until = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = min(max(core.next_deadline() - time.monotonic(), 0.0), _MAX_POLL)
                ready = dict(poller.poll(int(wait * 1000)))  # int(): as pyzmq does with a float
                polled = time.monotonic()
                out: list[Out] = []
                if self._agents in ready:
                    frames, emptied = self._drain(self._agents)
                    for route, frame in frames:
                        out += handle_agent(route, frame)
                    if emptied:
                        heard_until = polled  # the socket was empty when the drain ended
                else:
                    heard_until = polled
                if self._clients in ready:
                    for route, frame, identity in self._drain_clients():
                        out += self._client_frame(route, frame, identity)
                # Timers run only once one is due: while replies stream in, most
                # passes have nothing for them, and a round is one pass per reply.
                core.note_heard(heard_until)
                if time.monotonic() >= core.next_deadline():
                    try:
                        out += core.tick()
                    except Exception:  # a bug: log it, keep serving what we have
                        logger.exception("coordinator timers failed; serving on")
                self._send(out)
        finally:
            try:
                core.close()  # the sizing profiles learned since their last write
            finally:
                self._close()

    def _client_frame(self, route: tuple[bytes, ...], frame: bytes, identity: str | None) -> list[Out]:
        """``identity``: the sender's ZAP User-Id (``ROLE:KEY NAME``), None without CURVE."""
        role, key = user_id(identity) if identity is not None else (None, None)
        if not route:
            return []
        if len(route) > 2 or (len(route) == 2 and route[1] != b""):
            # Neither DEALER ([id, msg]) nor REQ ([id, "", msg]) framing.
            reply = error_reply(None, ErrorCode.BAD_MESSAGE, "expected one frame per message")
            return [(CLIENT, route[:1], reply)]
        # A viewer's frame is decoded once: a read-only op (the op alone peeked, its body
        # untouched) goes to the core, which decodes it; only what may be a command is
        # decoded here, and refused before the core sees it.
        if role is not None and role != Role.ADMIN and peek_op(frame) not in READ_ONLY_OPS:
            refused = refusal(role, frame)
            if refused is not None:  # a viewer's command: answered here, so it consumes no seq
                return [(CLIENT, route, refused)]
        return self.core.handle_client(route, frame, role, key)

    def _drain_clients(self) -> list[tuple[tuple[bytes, ...], bytes, str | None]]:
        """Client frames with the sender's ZAP User-Id (``ROLE:KEY NAME``), None without CURVE."""
        if not self._gate.roles:
            return [(route, frame, None) for route, frame in self._drain(self._clients)[0]]
        frames: list[tuple[tuple[bytes, ...], bytes, str | None]] = []
        for _ in range(_BATCH):
            try:
                parts = self._clients.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(parts) >= 2:
                # No User-Id would be a libzmq surprise: treat it as the least privilege.
                # cast: pyzmq types every frame property int | str; User-Id is a str.
                identity = cast(str, parts[-1].get("User-Id")) or Role.VIEWER
                frames.append((tuple(f.bytes for f in parts[:-1]), parts[-1].bytes, identity))
        return frames

    @staticmethod
    def _drain(sock: zmq.Socket) -> tuple[list[tuple[tuple[bytes, ...], bytes]], bool]:
        """Up to ``_BATCH`` waiting messages, and whether that left the socket empty.

        The socket is asked whether a message waits (its EVENTS option, 1 us) rather
        than read until ``zmq.Again`` (3 us): while a round's replies stream in, most
        passes find one message, and each pass would end in that exception.
        """
        frames: list[tuple[tuple[bytes, ...], bytes]] = []
        for _ in range(_BATCH):
            # cast: pyzmq types every option's value int | bytes; EVENTS is an int.
            if not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                return frames, True
            parts = sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) >= 2:
                frames.append((tuple(parts[:-1]), parts[-1]))
        return frames, not cast(int, sock.getsockopt(_EVENTS)) & _POLLIN

    def _send(self, out: list[Out]) -> None:
        for kind, route, frame in out:
            sock = self._agents if kind == AGENT else self._clients
            if not send_nowait(sock, [*route, frame]):
                self.dropped_sends += 1
                logger.debug("dropped a %s frame to %s: peer gone or queue full", kind, route[0].hex())

    def _close(self) -> None:
        if self._agents.closed:
            return
        if self.metrics is not None:
            self.metrics.stop()
        self._agents.close(linger=0)
        self._clients.close(linger=0)
        self._gate.stop()
        if self._own_context:
            self._context.term()
