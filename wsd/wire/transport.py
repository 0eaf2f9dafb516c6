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

from wsd.endpoints import check_endpoint
from wsd.errors import BindError, TransportError

__all__ = ["BindError", "TransportError", "Waker", "answer_waiting", "bind", "check_endpoint", "connect",
           "make_socket", "raise_fd_limit", "send_nowait"]


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
