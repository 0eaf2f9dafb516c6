"""The error vocabulary of wsd, in one place: the exceptions, the wire's error codes, the exit codes.

Every error says what went wrong and what the caller should do about it. Errors
from libraries (zmq, msgpack, torch, tomllib) are translated into these at the
boundary where they happen, chained with ``from``.

A module of the shared floor: it imports nothing of wsd's, so that the wire
(``wsd.wire.protocol``, which carries ``ErrorCode`` in its error replies) and
everything above it share one vocabulary without a cycle.
"""

from __future__ import annotations

import enum

__all__ = [
    "AgentError",
    "BadEndpoint",
    "BindError",
    "ClientError",
    "ConfigError",
    "ErrorCode",
    "ExitCode",
    "LaunchError",
    "ProtocolError",
    "RankTaken",
    "RegistrationError",
    "SimulationError",
    "SlotOutOfRangeError",
    "StateFileError",
    "StrEnum",
    "TorchrunEnvError",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "VllmIntegrationError",
    "WorkspaceCaptureError",
    "WorkspaceError",
    "WorkspaceHeadroomError",
    "WorkspaceLimitError",
    "WorkspaceLockHeldError",
    "WorkspaceLockedError",
    "WorkspaceNotInitializedError",
    "WsdError",
]

_MiB = 1024 * 1024


class StrEnum(str, enum.Enum):
    """``enum.StrEnum`` for Python 3.10 too: members are their string values."""

    def __str__(self) -> str:
        return str(self.value)


class ErrorCode(StrEnum):
    """Why a request was refused: the ``code`` of an error reply on the wire."""

    BAD_MESSAGE = "bad_message"
    """Not a msgpack map, or no usable envelope: fix the sender."""
    BAD_VERSION = "bad_version"
    """Another protocol version: upgrade the older side."""
    UNKNOWN_OP = "unknown_op"
    """No such operation (or not on this socket)."""
    BAD_FIELD = "bad_field"
    """A field missing, of the wrong type or out of range: the message names it."""
    TOO_LARGE = "too_large"
    """Larger than the socket's message limit."""
    MISMATCH = "mismatch"
    """A rank's world does not match the coordinator's: fix the launch."""
    CONFLICT = "conflict"
    """Refused by the desired state (e.g. reserve while locked): unlock first."""
    FORBIDDEN = "forbidden"
    """This client's key may only read."""
    TIMEOUT = "timeout"
    """No reply in time: retry, or check the coordinator."""
    UNAVAILABLE = "unavailable"
    """The coordinator cannot be reached: check it runs and the endpoint."""
    STORAGE = "storage"
    """The coordinator cannot write its state file (a full disk, permissions): the
    message names the file. Nothing was numbered or sent; free space and retry."""
    INTERNAL = "internal"
    """A bug in wsd: report it with the coordinator's log."""


class ExitCode(enum.IntEnum):
    """The exit codes of wsd's processes: ``wsd``, its workers, torchrun as ``wsd up`` runs it,
    and ``wsctl``."""

    OK = 0
    ERROR = 1
    """Anything else: fix what the last line says, and start again."""
    USAGE = 2
    """A bad command line, configuration file, variable or state file, refused before it ran:
    fix the one named, and start again."""
    PARTIAL = 3
    """Not every rank is there: one was lost (``wsd up``, and a worker that stopped because
    another rank was gone), or, for ``wsctl``, some ranks are lost, stopped or missing."""
    RANK_LOST = 3
    """``PARTIAL``, as ``wsd up`` and the workers mean it: a rank of the job is gone."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C where that is not how it ends normally (``wsctl`` but ``watch``)."""


class WsdError(Exception):
    """Base class of every error wsd raises on purpose."""


class ConfigError(WsdError, ValueError):
    """A configuration file, environment variable or flag is invalid.

    Fix the named file, key or variable and start again.
    """


class TorchrunEnvError(ConfigError):
    """A torchrun environment variable (RANK, WORLD_SIZE, ...) is missing or malformed.

    Start the worker under ``torchrun`` (or ``wsd up``), which sets them, or
    set the named variable yourself.
    """


class LaunchError(WsdError):
    """A process wsd starts (coordinator, torchrun) failed to come up in time.

    The message names the process and what it printed; fix that and start again.
    """


class WorkspaceError(WsdError):
    """Base class of the per-rank workspace manager's errors."""


class WorkspaceNotInitializedError(WorkspaceError, AssertionError, RuntimeError):
    """No process-wide manager yet: call ``init_workspace_manager`` first.

    An ``AssertionError``, as vLLM's ``current_workspace_manager`` raises (and a
    ``RuntimeError``, as wsd raised before).
    """


class SlotOutOfRangeError(WorkspaceError, RuntimeError, IndexError):
    """A ubatch or lane id outside the configured count.

    The engine selected a slot the manager was not sized for: configure
    ``num_ubatches``/``num_lanes`` to cover it, or fix the id. A
    ``RuntimeError`` whose message starts as vLLM's ("Workspace lane 2 is not
    configured; manager has 2 lane(s).").
    """

    def __init__(self, kind: str, value: object, count: int) -> None:
        self.kind = kind
        self.value = value
        self.count = count
        plural = "lane(s)" if kind == "lane" else "ubatch(es)"
        super().__init__(
            f"Workspace {kind} {value!r} is not configured; manager has {count} {plural}. "
            f"{kind} id {value!r} is out of range: the workspace is configured "
            f"with {'num_ubatches' if kind == 'ubatch' else 'num_lanes'}={count}, "
            f"so valid ids are 0..{count - 1}"
        )


class WorkspaceLockedError(WorkspaceError, AssertionError):
    """A locked workspace was asked to grow or to create something new.

    A subclass of ``AssertionError``, like vLLM's, so an engine that catches
    that keeps working. Warm up with the largest request (or ``reserve`` it)
    before locking, or ``unlock`` first.
    """

    def __init__(
        self,
        *,
        caller: str,
        ubatch: int,
        lane: int,
        requested: int,
        capacity: int,
        what: str = "allocation",
        persistent_key: object = None,
    ) -> None:
        self.caller = caller
        self.ubatch = ubatch
        self.lane = lane
        self.requested = requested
        self.capacity = capacity
        if persistent_key is not None:
            # vLLM's phrase first: its callers and tests match on it.
            message = (
                f"Workspace is locked but {persistent_key!r} was not allocated during warmup "
                f"for the current ubatch and lane ({what} asked from '{caller}', slot "
                f"ubatch={ubatch} lane={lane}, {requested} bytes). Create every persistent "
                f"buffer and resource in every slot during warm-up, before lock()."
            )
        else:
            message = (
                f"Workspace is locked but {what} from '{caller}' requires "
                f"{requested / _MiB:.2f} MB, current size is {capacity / _MiB:.2f} MB "
                f"(slot ubatch={ubatch} lane={lane}: requested {requested} bytes, "
                f"capacity {capacity} bytes). Workspace growth is not allowed after "
                f"locking: warm up with the largest request, or reserve it, before lock()."
            )
        super().__init__(message)


class WorkspaceLockHeldError(WorkspaceError, RuntimeError):
    """An operation that would move or drop buffers was refused because of a lock.

    Not a lock violation (no kernel asked for memory): an operator asked for
    ``trim`` while locked, or for ``unlock``, ``trim``, ``reserve`` or
    ``equalize`` while the engine holds its own lock (vLLM takes it after
    CUDA-graph capture; buffers under captured graphs must never move). Unlock
    first, or, for the engine's lock, leave the buffers as they are.
    """


class WorkspaceCaptureError(WorkspaceError, RuntimeError):
    """The workspace was asked to grow while a CUDA graph is being captured.

    A buffer allocated during capture would be freed or moved under the graph.
    Warm up (run the largest request eagerly) before capturing.
    """


class WorkspaceLimitError(WorkspaceError, ValueError):
    """A request larger than the configured ``max_slot_bytes`` of a slot.

    Raise ``[workspace] max_slot_bytes`` or make the request smaller.
    """


class WorkspaceHeadroomError(WorkspaceError, MemoryError):
    """An operator's command (``reserve``, ``equalize``, ``set-ubatches``, ``presize``) would
    grow the workspace beyond what the device allocator may still reserve under its cap
    (vLLM's extensible KV cache caps it after warm-up). Refused before anything is allocated;
    ``stats`` shows the cap and the headroom.
    """


class StateFileError(WsdError):
    """The coordinator's state file (snapshot and journal) cannot be read or written.

    The message names the file, what is wrong and what to do. At start-up
    (damage, a journal cut or missing, a folder that does not exist) the
    coordinator refuses to start rather than lose an acknowledged command:
    restore the named file, or move the snapshot and its journal aside to start
    afresh, forgetting the desired state and command log (docs/state-file.md).
    While running (a full disk, a read-only file system, permissions) the
    command was not numbered: free space or fix the permissions, and retry.
    """


# -- the wire and the coordinator ------------------------------------------------------------


class ProtocolError(WsdError):
    """A message that cannot be accepted; ``code`` (an ``ErrorCode``) says why, the message
    names the field."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class RegistrationError(WsdError):
    """A registration that does not match the expected world; the message says how."""


class RankTaken(RegistrationError):
    """A registration for a rank that another agent process holds and is still live on."""


class Unauthenticated(RegistrationError):
    """A registration without a valid proof of the agent token."""


class TransportError(WsdError):
    """A socket could not be bound or connected; the message names the endpoint."""


class BindError(TransportError, ConfigError):
    """An endpoint could not be bound: in use, not an address of this host, a privileged port.

    A configuration problem (``wsd`` exits 2): choose another endpoint, or stop
    whatever holds this one, and start again.
    """


# -- clients ------------------------------------------------------------------------------------


class ClientError(WsdError):
    """The coordinator answered with an error; ``code`` is an ``ErrorCode``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Unavailable(ClientError):
    """The coordinator could not be reached: no reply in time, nothing listening, a socket
    that failed, a malformed endpoint. Check the coordinator runs and the endpoint
    (--endpoint, WSD_ENDPOINT), then retry."""


class BadEndpoint(Unavailable, ValueError):
    """The endpoint is malformed: give one such as tcp://127.0.0.1:7601 (--endpoint, WSD_ENDPOINT).

    ``Unavailable``, as everything that keeps a call from reaching the coordinator is, so
    that one ``except Unavailable`` covers them all; a ``ValueError`` too, since no retry
    helps. The message names the endpoint and what is allowed.
    """


# -- workers and engines -------------------------------------------------------------------------


class AgentError(WsdError):
    """The agent could not start or stop in time; the message says which."""


class SimulationError(WsdError):
    """Simulated ranks could not start or stop in time; the message says which."""


class VllmIntegrationError(WsdError):
    """vLLM's internals differ from what wsd's plugin was checked against.

    The message names the vLLM version and the patch point. Use a vLLM release
    listed in ``CHECKED_VERSIONS``, or unset WSD_COORDINATOR_CONNECT_ENDPOINT /
    WSD_CONFIG to run vLLM without wsd.
    """
