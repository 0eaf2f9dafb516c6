"""ZeroMQ plumbing shared by the coordinator, the agent and the clients.

Socket options in one place, endpoints with port 0 resolved to the port the
kernel chose, and zmq's errors translated into wsd's at this boundary.
"""

from __future__ import annotations

import os
import re
import resource
import threading
from collections.abc import Callable

import zmq

from wsd.errors import WsdError

__all__ = ["TransportError", "Waker", "answer_waiting", "bind", "connect", "make_socket", "raise_fd_limit",
           "send_nowait"]


class TransportError(WsdError):
    """A socket could not be bound or connected; the message names the endpoint."""


def make_socket(context: zmq.Context, kind: int, *, hwm: int = 10_000) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # close never waits on undelivered messages
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind, with ``:0`` meaning a free port; returns the endpoint actually bound."""
    wanted = re.sub(r":0$", ":*", endpoint) if endpoint.startswith("tcp://") else endpoint
    try:
        sock.bind(wanted)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot bind {endpoint}: {e}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, endpoint: str) -> None:
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
    (what ``wsd.protocol`` encodes), as nothing here checks them first.
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
    while sock.getsockopt(_EVENTS) & _POLLIN:
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
