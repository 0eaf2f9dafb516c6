"""The Python client of a wsd coordinator. Imports no torch.

One method per operation; every call has a timeout. Read-only operations are
retried with a fresh socket when no reply comes (the "lazy pirate" pattern);
state-changing ones are not, since each would be a new command. Errors are
raised as ``ClientError`` with the coordinator's code.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import zmq

from wsd.commands import COMMANDS, CommandResult
from wsd.errors import ClientError, ConfigError, Unavailable
from wsd.wire import protocol as p
from wsd.wire.curve import ClientKeys
from wsd.wire.protocol import ErrorCode, Op

__all__ = ["DEFAULT_ENDPOINT", "Client", "ClientError", "CommandResult", "Unavailable"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7601"
# Of a call's timeout, what the coordinator may spend waiting on ranks, so that
# its partial answer arrives before the client gives up.
_SERVER_SHARE = 0.8


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
        server_key = curve_server_key or os.environ.get("WSD_CURVE_SERVER_KEY")
        client_key = curve_client_key or os.environ.get("WSD_CURVE_CLIENT_KEY")
        if bool(server_key) != bool(client_key):
            raise ConfigError("CURVE needs both the coordinator's public key (--curve-server-key, "
                              "WSD_CURVE_SERVER_KEY) and this client's secret key "
                              "(--curve-client-key, WSD_CURVE_CLIENT_KEY); only one is given")
        self._curve = ClientKeys.load(client_key, server_key) if client_key and server_key else None
        self.timeout = timeout
        self.retries = retries
        self._context = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(sock)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise ClientError(ErrorCode.UNAVAILABLE, f"cannot connect to {self.endpoint}: {e}") from e
            self._sock = sock
        return self._sock

    def call(self, op: Op, body: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Send one request and return its result, or raise ClientError/Unavailable."""
        timeout = self.timeout if timeout is None else timeout
        attempts = 1 + (self.retries if op in p.READ_ONLY_OPS else 0)
        for _ in range(attempts):
            request_id = next(self._ids)
            sock = self._socket()
            try:
                sock.send(p.encode(op, body, request_id), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection yet: wait for the reply we will not get, then retry
            reply = self._await(sock, request_id, time.monotonic() + timeout)
            if reply is not None:
                if not reply.ok:
                    raise ClientError(reply.code or ErrorCode.INTERNAL, reply.message)
                return reply.result
            self.close()  # lazy pirate: a fresh socket for the next attempt
        raise Unavailable(
            ErrorCode.UNAVAILABLE,
            f"no reply from {self.endpoint} to {op} within {timeout:g} s "
            f"({attempts} attempt{'s' if attempts > 1 else ''})",
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

    def ping(self) -> dict[str, Any]:
        return self.call(Op.PING)

    def status(self) -> dict[str, Any]:
        return self.call(Op.STATUS)

    def ranks(self) -> dict[str, Any]:
        return self.call(Op.RANKS)

    def stats(self, group: int | None = None, *, timeout: float | None = None, fresh: bool = False) -> dict[str, Any]:
        """Per rank, slot and TP group; ``complete`` is False and ``missing`` says who is absent.

        From the snapshots the ranks pushed, as the coordinator remembers them:
        each rank's ``age`` says how many seconds ago its snapshot was known
        current, and ``stale`` (a rank's, and the answer's list) marks those
        older than ``[coordinator] stats_stale_after``. ``fresh``: every live rank
        is asked now instead, and the answer waits for the slowest (``age`` 0).

        The coordinator's compact answer: each rank's and group's ``slots`` are
        columns. ``wsd_client.rows.stats_rows(answer)`` gives one map per slot
        (the shape ``wsctl stats --json`` prints).
        """
        timeout = self.timeout if timeout is None else timeout
        return self.call(Op.STATS, {"group": group, "timeout": timeout * _SERVER_SHARE, "fresh": fresh},
                         timeout=timeout)

    def events(self, cursor: int = 0, limit: int = 100) -> dict[str, Any]:
        """Events after ``cursor``; pass back the returned ``cursor`` to follow."""
        return self.call(Op.EVENTS, {"cursor": cursor, "limit": limit})

    # -- state-changing ------------------------------------------------------------

    def _command(self, op: Op, extra: dict[str, Any], group: int | None, wait: bool,
                 timeout: float | None) -> CommandResult:
        timeout = self.timeout if timeout is None else timeout
        body = {**extra, "group": group, "wait": wait, "timeout": timeout * _SERVER_SHARE}
        return CommandResult.from_dict(self.call(op, body, timeout=timeout))

    def command(self, action: str, group: int | None = None, *, wait: bool = True, timeout: float | None = None,
                **args: Any) -> CommandResult:
        """Any command of the table (``wsd.commands.COMMANDS``) by its name, with its arguments."""
        if action not in COMMANDS:
            raise ValueError(f"unknown command {action!r} (commands: {', '.join(COMMANDS)})")
        return self._command(Op(action), args, group, wait, timeout)

    def lock(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None) -> CommandResult:
        return self._command(Op.LOCK, {}, group, wait, timeout)

    def unlock(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None) -> CommandResult:
        return self._command(Op.UNLOCK, {}, group, wait, timeout)

    def set_ubatches(self, n: int, group: int | None = None, *, wait: bool = True,
                     timeout: float | None = None) -> CommandResult:
        return self._command(Op.SET_UBATCHES, {"n": n}, group, wait, timeout)

    def reserve(self, nbytes: int, group: int | None = None, *, wait: bool = True,
                timeout: float | None = None) -> CommandResult:
        return self._command(Op.RESERVE, {"bytes": nbytes}, group, wait, timeout)

    def equalize(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None) -> CommandResult:
        return self._command(Op.EQUALIZE, {}, group, wait, timeout)

    def trim(self, group: int | None = None, *, wait: bool = True, timeout: float | None = None) -> CommandResult:
        return self._command(Op.TRIM, {}, group, wait, timeout)
