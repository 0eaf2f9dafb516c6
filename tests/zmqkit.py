"""ZeroMQ in tests, one way everywhere: ``Sockets``, a context and every socket made from it.

Each socket has LINGER 0 and is bound to a random loopback port or connected;
``close`` closes them all and terminates the context within a bound, failing
instead of hanging when some socket was left open. The ``zmq_context`` and
``zmq_socket`` fixtures (conftest.py) hand one out per test; harnesses that
live for a module (the hostile suites) and helper processes (flood.py) hold
one of their own.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

TERM_TIMEOUT = 5.0
"""Seconds a context may take to terminate once its sockets are closed."""


class Sockets:
    def __init__(self) -> None:
        self.context = zmq.Context()
        self._made: list[zmq.Socket] = []

    def socket(self, kind: int, *, connect: str | None = None, bind: bool = False, **options: Any) -> zmq.Socket:
        """A socket of ``kind`` with LINGER 0 and ``options`` (``sndhwm=0``, ...); bound to a
        random loopback port (its endpoint: ``sock.LAST_ENDPOINT``) or connected to ``connect``."""
        self._made = [s for s in self._made if not s.closed]  # a long-lived harness replaces sockets
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name.upper()), value)
        self._made.append(sock)
        if bind:
            sock.bind_to_random_port("tcp://127.0.0.1")
        if connect is not None:
            sock.connect(connect)
        return sock

    def close(self) -> None:
        """Close every socket made here and terminate the context; AssertionError if that
        takes longer than TERM_TIMEOUT (a socket made elsewhere on this context is open)."""
        for sock in self._made:
            sock.close(linger=0)
        self._made.clear()
        ended = threading.Thread(target=self.context.term, name="zmq-term", daemon=True)
        ended.start()
        ended.join(TERM_TIMEOUT)
        assert not ended.is_alive(), f"zmq context not terminated within {TERM_TIMEOUT} s: a socket was left open"
