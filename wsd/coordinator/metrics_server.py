"""The coordinator's ``/metrics`` endpoint: HTTP, or HTTPS with prometheus_client's TLS options.

Why not prometheus_client's own server (``start_http_server``), whose TLS
options these are: it renders a scrape only through its registry of metric
objects (about 300 ms for the 50,000 samples of 1,024 ranks of 8 slots, where
``Collector`` writes the text in about 30 ms), and it does the TLS handshake in
its one accepting thread with no timeout, so that one client that connects
and says nothing stops every scrape until it leaves. This server is the
standard library's threaded WSGI server, as prometheus_client's is, with an
``ssl.SSLContext`` built as prometheus_client builds it (``tls_context``):
the same option names, the same meaning. What it adds, so that no client can
take its threads or its memory:

- at most ``MAX_CONNECTIONS`` connections at once, each on a thread of its own,
  and ``MAX_PER_ADDRESS`` from one client address; one more evicts the oldest
  that has not yet sent its request (a scrape sends it at once: an idle or
  trickling client is the one to go), else the one answered longest (a scrape
  takes tens of milliseconds: a client that does not read is the one to go);
- a deadline on every write, ``WRITE_TIMEOUT``: a client that stops reading
  frees its connection within it, whatever the answer's size;
- one deadline per connection, ``HANDSHAKE_TIMEOUT`` for the TLS handshake and
  the request line and headers together, then ``RESPONSE_TIMEOUT`` for the
  answer, enforced by the accepting thread, which shuts the socket down (a
  per-read timeout let a client sending a byte at a time stay for ever);
- one text per published view, shared by concurrent scrapes (``Collector``),
  and sent as it lies rather than joined into a copy per scrape.

GET or HEAD ``/metrics`` is a scrape, gzip-compressed when the client accepts
it (Prometheus does); any other path is 404, any other method 405. Imports no torch.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from wsd.coordinator.config import CoordinatorConfig
from wsd.coordinator.metrics import CONTENT_TYPE, Collector, Published
from wsd.errors import ConfigError, WsdError
from wsd.wire.transport import BindError

__all__ = ["HANDSHAKE_TIMEOUT", "MAX_CONNECTIONS", "MAX_PER_ADDRESS", "PATH", "RESPONSE_TIMEOUT", "WRITE_TIMEOUT",
           "MetricsServer", "tls_context"]

logger = logging.getLogger(__name__)

PATH = "/metrics"
"""The one path that is a scrape."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connection has, from its accept, for its TLS handshake and its request line and
headers together; then it is shut down, however it trickles."""

RESPONSE_TIMEOUT = 60.0
"""Seconds a connection has, from its request, to take the answer (a scrape of 4,096 ranks
is 14 MB, under 1 MB gzipped: a slow reader has time)."""

MAX_CONNECTIONS = 16
"""Connections served at once (a thread each): Prometheus keeps one per target, two for an
HA pair, and a scrape takes tens of milliseconds."""

MAX_PER_ADDRESS = 4
"""Connections served at once from one client address: 16 clients of one host that send a
request and never read its answer once held every connection (no real scrape got in)."""

WRITE_TIMEOUT = 5.0
"""Seconds each write of an answer may wait for the client to read."""
# stop() waits this long at most for the server's loop to notice shutdown.
_POLL_INTERVAL = 0.1
# gzip level 1: 3.6 MB of text shrinks to 198 KiB in 7 ms; level 9 (prometheus_client's)
# to 135 KiB in 167 ms (docs/metrics.md, Cost).
_GZIP_LEVEL = 1


def _readable(key: str, path: str, *, folder: bool = False) -> None:
    """ConfigError naming ``[coordinator] key`` unless ``path`` is a readable file (or folder)."""
    what = f"[coordinator] {key}"
    if not os.path.exists(path):
        raise ConfigError(f"{what}: {'folder' if folder else 'file'} {path} not found")
    if folder != os.path.isdir(path):
        raise ConfigError(f"{what}: {path} is {'not ' if folder else ''}a folder; a "
                          f"{'folder of CA certificates' if folder else 'PEM file'} is expected")
    if not os.access(path, os.R_OK | (os.X_OK if folder else 0)):
        raise ConfigError(f"{what}: cannot read {path}: permission denied")


def tls_context(config: CoordinatorConfig) -> ssl.SSLContext | None:
    """The endpoint's TLS context, or None for plain HTTP (no ``metrics_certfile``).

    As prometheus_client's ``start_http_server(certfile, keyfile, client_cafile,
    client_capath, client_auth_required)``: a server context (``PROTOCOL_TLS_SERVER``,
    so TLS 1.2 at least); with ``client_auth_required``, client certificates are asked
    for, required, and verified against ``client_cafile`` and ``client_capath`` alone.
    Unlike prometheus_client, never against the system's CAs (any certificate a public
    CA signed would do): ``CoordinatorConfig`` refuses ``client_auth_required`` without
    a CA file or folder, and either without it. ConfigError naming the key for a missing
    or unreadable file, or one that is not what it should be.
    """
    if config.metrics_certfile is None or config.metrics_keyfile is None:
        return None
    _readable("metrics_certfile", config.metrics_certfile)
    _readable("metrics_keyfile", config.metrics_keyfile)
    if config.metrics_client_cafile is not None:
        _readable("metrics_client_cafile", config.metrics_client_cafile)
    if config.metrics_client_capath is not None:
        _readable("metrics_client_capath", config.metrics_client_capath, folder=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if config.metrics_client_auth_required:  # with a CA file or folder: the config checked it
        try:
            context.load_verify_locations(config.metrics_client_cafile, config.metrics_client_capath)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise ConfigError(f"[coordinator] metrics_client_cafile {config.metrics_client_cafile}, "
                              f"metrics_client_capath {config.metrics_client_capath}: cannot load the client CA "
                              f"certificates: {e}") from e
        context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(config.metrics_certfile, config.metrics_keyfile)
    except (OSError, ValueError) as e:
        raise ConfigError(f"[coordinator] metrics_certfile {config.metrics_certfile}, metrics_keyfile "
                          f"{config.metrics_keyfile}: not a certificate and its private key in PEM: {e}") from e
    return context


class _Connection:
    """One accepted connection, as the accepting thread watches it (under ``_Server.lock``)."""

    __slots__ = ("address", "deadline", "dropped", "requested", "sock")

    def __init__(self, sock: socket.socket, address: str, deadline: float) -> None:
        self.sock = sock
        self.address = address
        """The client's address (its host, not its port)."""
        """The socket to shut down: the TCP one, then the TLS one wrapped around it."""
        self.deadline = deadline
        """Monotonic time at which it is shut down, whatever it is doing."""
        self.requested = False
        """True once its request line and headers are read: it is being answered."""
        self.dropped = False


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds up the coordinator's exit
    allow_reuse_address = True
    request_queue_size = 128  # a burst of connections waits to be accepted (or evicted), not refused
    tls: ssl.SSLContext | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lock = threading.Lock()
        self.open: list[_Connection] = []
        """Connections not yet finished, oldest first."""
        self._local = threading.local()  # each connection thread's own _Connection
        super().__init__(*args, **kwargs)

    # -- the accepting thread ------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection, within ``MAX_CONNECTIONS`` and ``MAX_PER_ADDRESS``: one past
        either evicts, of those it competes with, the oldest still without a request, else the
        one answered longest."""
        address = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        with self.lock:
            same = [c for c in self.open if c.address == address]
            for rivals, limit in ((same, MAX_PER_ADDRESS), (self.open, MAX_CONNECTIONS)):
                if len(rivals) >= limit:
                    idle = next((c for c in rivals if not c.requested), None)
                    self._drop(idle if idle is not None else rivals[0])  # oldest first: answered longest
                    break
            connection = _Connection(request, address, time.monotonic() + HANDSHAKE_TIMEOUT)
            self.open.append(connection)
        threading.Thread(target=self._serve, args=(connection, request, client_address),
                         name="wsd-metrics-connection", daemon=True).start()

    def service_actions(self) -> None:
        """Between accepts, at least every ``_POLL_INTERVAL``: connections past their deadline are shut."""
        now = time.monotonic()
        with self.lock:
            for connection in [c for c in self.open if c.deadline <= now]:
                self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        """Shut the connection's socket down (under ``lock``): its thread's read or write ends at once."""
        connection.dropped = True
        self.open.remove(connection)
        try:  # socket.socket's own shutdown, also for a TLS socket: no close_notify to a stalled peer
            socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def close_all(self) -> None:
        """Shut every open connection down (at stop)."""
        with self.lock:
            for connection in list(self.open):
                self._drop(connection)

    # -- each connection's thread --------------------------------------------------------------

    def _serve(self, connection: _Connection, request: Any, client_address: Any) -> None:
        self._local.connection = connection
        try:
            self.process_request_thread(request, client_address)  # closes the socket
        finally:
            with self.lock:
                if not connection.dropped:
                    self.open.remove(connection)

    def answering(self) -> None:
        """The request is read: from now on ``RESPONSE_TIMEOUT`` to take the answer."""
        connection: _Connection = self._local.connection
        with self.lock:
            connection.requested = True
            connection.deadline = time.monotonic() + RESPONSE_TIMEOUT

    def finish_request(self, request: Any, client_address: Any) -> None:
        """The TLS handshake, then the request, both within the connection's deadline."""
        request.settimeout(HANDSHAKE_TIMEOUT)  # no read ever waits past the deadline, reaped or not
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        connection: _Connection = self._local.connection
        try:
            secure = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except OSError as e:
            logger.debug("metrics: TLS with %s failed: %s", client_address, e)
            return
        with secure:
            with self.lock:  # the TCP socket is detached now: the deadline shuts the TLS one
                connection.sock = secure
                if connection.dropped:
                    return
            try:  # a plain-HTTP client, a missing or unknown client certificate, a silent client
                secure.do_handshake()
            except OSError as e:
                logger.debug("metrics: TLS handshake with %s failed: %s", client_address, e)
                return
            super().finish_request(secure, client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = WRITE_TIMEOUT  # each write; a read is bounded by the connection's deadline too

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        cast(_Server, self.server).answering()
        return True

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape is noise; errors still reach the log through wsgiref


def _app(collector: Collector) -> Callable[..., list[bytes]]:
    """The WSGI application: GET or HEAD ``/metrics`` is a fresh scrape."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO") != PATH:
            body = f"not found: the metrics are at {PATH}\n".encode()
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("Content-Length", str(len(body)))])
            return [b"" if method == "HEAD" else body]
        # The text as the collector holds it, shared with every other scrape of the same view.
        chunks = collector.chunks()
        headers = [("Content-Type", CONTENT_TYPE)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            packer = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # the gzip format
            chunks = [b"".join([*map(packer.compress, chunks), packer.flush()])]
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", [*headers, ("Content-Length", str(sum(map(len, chunks))))])
        return [b""] if method == "HEAD" else chunks

    return app


class MetricsServer:
    """``/metrics`` over HTTP or HTTPS in a thread of its own, serving a fresh ``Collector`` scrape."""

    def __init__(self, source: Callable[[], Published], host: str, port: int, *,
                 tls: ssl.SSLContext | None = None, slots: bool = True,
                 wall: Callable[[], float] = time.time) -> None:
        """``tls`` None: plain HTTP. ``slots`` False: no per-slot samples (``Collector``).
        BindError naming the keys when the address cannot be bound."""
        collector = Collector(source, wall=wall, slots=slots)
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            server_class: type[_Server] = type("_MetricsServer", (_Server,), {"address_family": family, "tls": tls})
            # address[0] is the host as a string for every stream family getaddrinfo returns.
            self._server = make_server(str(address[0]), port, _app(collector), server_class,
                                       handler_class=_QuietHandler)
        except OSError as e:  # in use, not this host's, a privileged port: configuration
            raise BindError(f"cannot serve metrics on {host}:{port} ([coordinator] metrics_host, "
                            f"metrics_port): {e.strerror or e}") from e
        self.host = host
        self.port: int = self._server.server_address[1]
        """The bound port: the one asked for, or the one the OS chose for port 0."""
        self.tls = tls is not None
        bracketed = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if self.tls else 'http'}://{bracketed}:{self.port}{PATH}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(_POLL_INTERVAL,),
                                        name="wsd-metrics", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, source: Callable[[], Published], config: CoordinatorConfig) -> MetricsServer:
        """The endpoint ``[coordinator]`` describes (``metrics_port`` must be set); ConfigError
        for a TLS file that is missing or unreadable, BindError for the address."""
        if config.metrics_port is None:
            raise ValueError("metrics_port is not set: no metrics endpoint to serve")
        return cls(source, config.metrics_host, config.metrics_port, tls=tls_context(config),
                   slots=config.metrics_slots)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; waits at most ``timeout`` for the thread."""
        if self._thread.is_alive():
            # shutdown() waits for serve_forever to notice, which it does within
            # _POLL_INTERVAL; a thread that has already ended would never answer.
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.close_all()
        self._server.server_close()
        if self._thread.is_alive():
            raise WsdError(f"metrics server did not stop within {timeout} s")
