"""ZeroMQ plumbing shared by the coordinator, the agent and the clients.

Socket options in one place, endpoints checked before ZeroMQ sees them (it
binds some other port than a bad one asks for, without a word), port 0
resolved to the port the kernel chose, and zmq's errors translated into wsd's
at this boundary.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import threading
from collections.abc import Callable

import zmq

from wsd.errors import BindError, TransportError

__all__ = ["BindError", "TransportError", "Waker", "answer_waiting", "bind", "check_endpoint", "connect",
           "make_socket", "raise_fd_limit", "send_nowait"]


# tcp://HOST:PORT, HOST a name or an IPv4 address, [an IPv6 address] or *.
_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+)"
                  r":(?P<port>-?[0-9]{1,12})")


def check_endpoint(endpoint: str, *, bind: bool) -> None:
    """ValueError, saying what is allowed, unless wsd can ``bind`` (else connect to) ``endpoint``.

    ZeroMQ accepts more than it should: it binds port 99999 as some random
    port and -1 as 65535 without a word, and binds ``*`` as a host (every
    interface), which cannot be connected to. A bound endpoint may ask for
    port 0, any free port; ``bind`` returns the one the kernel chose.
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"must be a ZeroMQ endpoint such as tcp://127.0.0.1:7600, got {endpoint!r}")
    scheme, sep, address = endpoint.partition("://")
    if scheme in ("ipc", "inproc") and sep and address:
        return
    match = _TCP.fullmatch(endpoint)
    if match is None:
        wildcards = " or * for every interface; PORT 0 for any free one" if bind else ""
        raise ValueError(f"must be a ZeroMQ endpoint: tcp://HOST:PORT (HOST a name, an IPv4 address, "
                         f"[an IPv6 address]{wildcards}), ipc://PATH or inproc://NAME, got {endpoint!r}")
    host = match["host"]
    if not host.startswith(("[", "*")) and (len(host) > 253 or any(len(label) > 63 for label in host.split("."))):
        shown = endpoint if len(endpoint) <= 80 else f"{endpoint[:80]}..."
        raise ValueError(f"must have a host name of at most 253 characters, each dot-separated part at most "
                         f"63 (what DNS allows), got {shown!r}")
    if match["host"] == "*" and not bind:
        raise ValueError(f"must name the host to connect to (* means every interface, to bind), "
                         f"got {endpoint!r}")
    if not (0 if bind else 1) <= int(match["port"]) <= 65535:
        ports = "0 (any free port) to 65535" if bind else "1 to 65535"
        raise ValueError(f"must have a port from {ports}, got {endpoint!r}")


def _ipv6(sock: zmq.Socket, endpoint: str) -> None:
    # ZeroMQ sockets are IPv4 only unless told otherwise: tcp://[::1]:7600
    # would fail with "No such device".
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def make_socket(context: zmq.Context, kind: int, *, hwm: int = 10_000) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close never waits on undelivered messages
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind, with port 0 meaning a free port; returns the endpoint actually bound.

    BindError names the endpoint and the reason (address in use, not this
    host's, permission).
    """
    try:
        check_endpoint(endpoint, bind=True)
    except ValueError as e:
        raise BindError(f"cannot bind {endpoint}: {e}") from None
    _ipv6(sock, endpoint)
    try:
        sock.bind(re.sub(r":0$", ":*", endpoint) if endpoint.startswith("tcp://") else endpoint)
    except zmq.ZMQError as e:
        # libzmq says "No such device" for a host it cannot resolve to one of this host's addresses.
        if e.errno == errno.ENODEV:
            reason = "not an address or interface of this host"
        else:
            reason = zmq.strerror(e.errno) if e.errno is not None else str(e)
        raise BindError(f"cannot bind {endpoint}: {reason}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, endpoint: str) -> None:
    try:
        check_endpoint(endpoint, bind=False)
    except ValueError as e:
        raise TransportError(f"cannot connect to {endpoint}: {e}") from None
    _ipv6(sock, endpoint)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot connect to {endpoint}: {e}") from e


# The flags as plain ints: pyzmq's send_multipart combines its enum flags for
# every frame, which costs more than the send itself for the small frames the
# coordinator sends by the thousand.
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def send_nowait(sock: zmq.Socket, parts: list[bytes]) -> bool:
    """Send without ever blocking; False if the peer is gone or its queue is full.

    A multipart message is sent whole or not at all: a ROUTER refuses it at its
    first frame (no such peer, or the peer's queue full), and ZeroMQ takes the
    rest of a message once its first frame was taken. Every part must be bytes
    (what ``wsd.wire.protocol`` encodes), as nothing here checks them first.
    """
    try:
        for part in parts[:-1]:
            sock.send(part, _MORE)
        sock.send(parts[-1], _LAST)
    except zmq.Again:
        return False
    except zmq.ZMQError as e:
        if e.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: that peer is not connected
            return False
        raise
    return True


def answer_waiting(sock: zmq.Socket, handle: Callable[[bytes], list[bytes]]) -> None:
    """Hand every frame waiting on ``sock`` (a DEALER) to ``handle``; send what it returns.

    The socket is asked whether a frame waits rather than read until
    ``zmq.Again``: a rank usually has one frame waiting, and raising Again cost
    more (2.8 us) than reading the EVENTS option (1.1 us).
    """
    # pyzmq types every option's value int | bytes; EVENTS is an int. An ignore
    # rather than a cast: this runs for every frame a rank reads.
    while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
        for reply in handle(sock.recv(_LAST)):
            send_nowait(sock, [reply])


def raise_fd_limit(wanted: int) -> None:
    """Raise this process's soft descriptor limit to ``wanted`` (at most the hard limit).

    Each ZeroMQ connection holds a descriptor: a coordinator of a thousand
    agents, or one process of a thousand simulated ranks, passes the usual
    soft limit of 1024, and libzmq then fails to accept connections silently.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class Waker:
    """A self-pipe that wakes a thread's poller from any other thread.

    Register ``fd`` with the poller and call ``drain()`` when it is readable.
    ``wake()`` never blocks and is safe after ``close()``: a late wake-up (an
    acknowledgement or a lock violation from the engine thread while the agent
    stops) must not write to a descriptor number the process may have reused.
    """

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the poller is awake already

    def drain(self) -> None:
        try:
            os.read(self.fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends; idempotent."""
        with self._lock:
            for fd in (self.fd, self._write_fd):
                if fd >= 0:
                    os.close(fd)
            self.fd = self._write_fd = -1
