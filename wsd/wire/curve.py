"""CURVE, all of it: key files, pyzmq's ZAP authenticator, client roles, key pairs.

Key files (``load_secret``, ``load_public``, ``load_folder``) are refused at
start-up when a secret one is readable or writable by anyone but its owner, or
a public one writable by others (``ConfigError`` naming the file and its mode).
The coordinator's ``CurveGate`` loads its keys and the folders of admitted
public keys (named by ``[security]``, ``wsd.security``, which the role that loaded it
hands in as ``CurveSettings``), starts pyzmq's ZAP
thread before any socket binds, and makes its ROUTER sockets CURVE servers. A key listed in no folder
gets no access at all: ZAP refuses the handshake, so the peer sees nothing
but a timeout. An admitted client key's role (viewer or admin) travels with
each of its messages as ZeroMQ's User-Id; ``refusal`` answers a viewer's
state-changing request with ``forbidden`` before the coordinator sees it.
Clients and agents connect with ``ClientKeys``. Imports no torch.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.auth
from zmq.utils import z85

from wsd.errors import ConfigError, StrEnum
from wsd.files import read_owned
from wsd.fmt import one_line
from wsd.wire import protocol as p
from wsd.wire.protocol import ErrorCode
from wsd.wire.transport import TransportError

__all__ = ["AGENT_DOMAIN", "CLIENT_DOMAIN", "ClientKeys", "CurveGate", "CurveSettings", "Role", "agent_keys",
           "is_loopback", "keygen", "load_folder", "load_public", "load_secret", "refusal", "user_id"]

logger = logging.getLogger(__name__)

# ZAP domains: the authenticator tells the two endpoints' key lists apart by them.
CLIENT_DOMAIN = "wsd-clients"
AGENT_DOMAIN = "wsd-agents"
# Keys refused are logged once each (a refused peer reconnects every few
# hundred milliseconds); past this many, no more are remembered or logged.
_REFUSED_LOGGED = 1024


class Role(StrEnum):
    """What an authenticated client key may do; carried as ZeroMQ's User-Id."""

    VIEWER = "viewer"
    """Read-only operations: ping, status, ranks, stats, events."""
    ADMIN = "admin"
    """Every operation, state-changing ones included, and ``stacks`` (which names the code
    and files each worker runs, and interrupts every worker asked)."""
    AGENT = "agent"
    """An agent on the agent endpoint."""


class CurveSettings(Protocol):
    """What CURVE reads of the ``[security]`` section (``wsd.security.SecurityConfig``).

    Named here rather than imported: the wire sits below the configuration
    sections, and is handed the section by the role that loaded it.
    """

    @property
    def curve_clients(self) -> bool: ...
    @property
    def curve_agents(self) -> bool: ...
    @property
    def server_secret_key(self) -> str | None: ...
    @property
    def server_public_key(self) -> str | None: ...
    @property
    def viewer_keys(self) -> str | None: ...
    @property
    def admin_keys(self) -> str | None: ...
    @property
    def agent_keys(self) -> str | None: ...
    @property
    def agent_secret_key(self) -> str | None: ...


# -- key files ---------------------------------------------------------------------------


_KEY_LINE = re.compile(rb'^\s*(public|secret)-key\s*=\s*"([^"]{40})"\s*$', re.MULTILINE)


def _load(path: str, what: str, *, private: bool) -> tuple[bytes, bytes | None]:
    """The keys of a ZeroMQ certificate (``wsctl keygen``'s), read as ``read_owned`` reads."""
    text = read_owned(path, what, private=private, limit=16 << 10)
    keys = {kind: value for kind, value in _KEY_LINE.findall(text)}
    if b"public" not in keys:
        raise ConfigError(f"{what}: {path} is not a ZeroMQ certificate (write one with `wsctl keygen`): "
                          f"no public-key line")
    return keys[b"public"], keys.get(b"secret")


def load_secret(path: str, what: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a certificate only its owner may read, or ConfigError."""
    public, secret = _load(path, what, private=True)
    if secret is None:
        raise ConfigError(f"{what}: {path} holds no secret key: "
                          f"give the NAME.key_secret file, not NAME.key")
    return public, secret


def load_public(path: str, what: str) -> bytes:
    """A z85 public key from a certificate others cannot rewrite, or ConfigError."""
    return _load(path, what, private=False)[0]


def load_folder(folder: str, what: str) -> dict[bytes, str]:
    """{z85 public key: file} of every *.key certificate in ``folder``."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".key"))
    except OSError as e:
        raise ConfigError(f"{what}: cannot list key folder {folder}: {e}") from e
    return {load_public(os.path.join(folder, n), what): os.path.join(folder, n) for n in names}


# -- the coordinator's side ------------------------------------------------------------------


class _KeyList:
    """A ZAP credentials provider: admits the listed keys of one domain."""

    def __init__(self, keys: dict[bytes, str]) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if len(self.refused) < _REFUSED_LOGGED and key not in self.refused:
            self.refused.add(key)
            logger.warning("refused a CURVE key listed nowhere on %s: %s", domain, key.decode())
        return False


def _role_authenticator(context: zmq.Context, roles: dict[bytes, Role], names: dict[bytes, str]) -> Any:
    """pyzmq's ZAP thread, with the User-Id of a client key set to ``ROLE:NAME``: its role and
    its key file's name (``alice`` for ``admin_keys/alice.key``), which the coordinator reads
    as what CURVE proved of the sender (``user_id``).

    Its module is imported here, by the coordinator only: it imports asyncio, which
    a client's start (``wsctl``) has no use for.
    """
    from zmq.auth.thread import ThreadAuthenticator

    class RoleAuthenticator(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            key = z85.encode(client_public_key)
            role = roles.get(key)
            return Role.AGENT if role is None else f"{role}:{names[key]}"

    return RoleAuthenticator(context, log=logger)


class CurveGate:
    """The coordinator's CURVE: its keys, the ZAP thread, and its sockets' options.

    Loading fails with ConfigError (file, key, mode); the ZAP thread starts
    before any socket binds, so no connection slips in unauthenticated.
    """

    def __init__(self, security: CurveSettings, context: zmq.Context) -> None:
        self.security = security
        self._auth: Any = None  # the ZAP thread (_role_authenticator), once started
        if not (security.curve_clients or security.curve_agents):
            return
        if security.server_secret_key is None:
            raise ConfigError("[security] server_secret_key must be set on the coordinator "
                              "when curve_clients or curve_agents is true")
        self.public, self.secret = load_secret(security.server_secret_key, "[security] server_secret_key")
        roles: dict[bytes, Role] = {}
        names: dict[bytes, str] = {}
        providers: dict[str, _KeyList] = {}
        if security.curve_clients:
            clients: dict[bytes, str] = {}
            for role, folder in ((Role.VIEWER, security.viewer_keys), (Role.ADMIN, security.admin_keys)):
                for key, path in (load_folder(folder, f"[security] {role}_keys") if folder else {}).items():
                    if key in clients:
                        raise ConfigError(f"[security] the same key is in {clients[key]} and {path}: "
                                          f"a client key has one role; remove one of them")
                    clients[key], roles[key] = path, role
                    names[key] = one_line(Path(path).stem)[:64]
            providers[CLIENT_DOMAIN] = _KeyList(clients)
        if security.curve_agents:
            if security.agent_keys is None:
                raise ConfigError("[security] agent_keys must be set when curve_agents is true")
            providers[AGENT_DOMAIN] = _KeyList(load_folder(security.agent_keys, "[security] agent_keys"))
        auth = _role_authenticator(context, roles, names)
        try:
            auth.start()
        except zmq.ZMQError as e:
            raise TransportError(f"cannot start the ZAP authenticator ({e}): one runs already "
                                 f"in this ZeroMQ context; give the coordinator its own") from e
        for domain, provider in providers.items():
            auth.configure_curve_callback(domain, provider)
        self._auth = auth

    @property
    def roles(self) -> bool:
        """True when client messages carry a role to check."""
        return self.security.curve_clients

    def secure(self, sock: zmq.Socket, domain: str) -> bool:
        """Make ``sock`` a CURVE server of ``domain`` if configured; True if it is one now."""
        on = self.security.curve_clients if domain == CLIENT_DOMAIN else self.security.curve_agents
        if on:
            sock.curve_server = True
            sock.curve_publickey = self.public
            sock.curve_secretkey = self.secret
            sock.zap_domain = domain.encode()
        return on

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def refusal(role: str | None, frame: bytes) -> bytes | None:
    """The ``forbidden`` reply to a state-changing request, or a stacks request, from a
    non-admin key, else None.

    ``role`` None means no CURVE on the client endpoint: every client is
    admin, as the loopback binding is the protection. Frames that do not
    decode pass on: the coordinator answers them with the protocol error.
    """
    if role is None or role == Role.ADMIN:
        return None
    try:
        message = p.decode(frame, p.CLIENT_OPS)
    except p.ProtocolError:
        return None
    if message.op in p.READ_ONLY_OPS:
        return None
    if message.op in p.OPERATOR_READ_OPS:
        return p.error_reply(message.id, ErrorCode.FORBIDDEN,
                             f"op: {message.op} reads every thread's stack of the workers asked (the code and "
                             f"files they run) and interrupts each, and this client's key is a {role} key: "
                             f"only keys in [security] admin_keys may")
    return p.error_reply(message.id, ErrorCode.FORBIDDEN,
                         f"op: {message.op} changes state, and this client's key is a {role} key: "
                         f"only keys in [security] admin_keys may")


def user_id(text: str | None) -> tuple[str, str | None]:
    """A client frame's ZAP User-Id (``ROLE:NAME``) as its role and key name; none (a libzmq
    surprise) is the least privilege."""
    role, _, name = (text or Role.VIEWER).partition(":")
    return role, name or None


def is_loopback(endpoint: str) -> bool:
    """True for a tcp endpoint on a loopback address, and for ipc and inproc ones."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or interface: reachable from elsewhere, as far as we know
        return False


# -- the connecting side (clients and agents) ---------------------------------------------------


@dataclass(frozen=True)
class ClientKeys:
    """A CURVE client's keys (z85): its own pair and the coordinator's public key."""

    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, client_key: str, server_key: str) -> ClientKeys:
        """From the client's NAME.key_secret and the coordinator's certificate."""
        public, secret = load_secret(client_key, "--curve-client-key")
        return cls(public, secret, load_public(server_key, "--curve-server-key"))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client; before connect."""
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def agent_keys(security: CurveSettings) -> ClientKeys | None:
    """The agents' CURVE keys when ``curve_agents`` is on, else None; ConfigError when incomplete."""
    if not security.curve_agents:
        return None
    if security.agent_secret_key is None:
        raise ConfigError("[security] agent_secret_key must be set when curve_agents is true")
    public, secret = load_secret(security.agent_secret_key, "[security] agent_secret_key")
    if security.server_public_key is not None:
        server = load_public(security.server_public_key, "[security] server_public_key")
    else:
        assert security.server_secret_key is not None  # SecurityConfig checks that one is set
        server = load_secret(security.server_secret_key, "[security] server_secret_key")[0]
    return ClientKeys(public, secret, server)


_MAX_KEY_NAME = 200
"""Bytes of a key's name: with ``.key_secret`` after it, within any file system's 255."""


def keygen(name: str, directory: str | os.PathLike[str] = ".") -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (mode 0600) in ``directory``; never overwrites.

    The pair is written in a private (0700) temporary folder first, so the
    secret is never readable by others, then linked into place.
    """
    if not name or os.sep in name or name.startswith(".") or "\0" in name:
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    if len(name.encode()) > _MAX_KEY_NAME:  # NAME.key_secret must fit a file name (255 bytes)
        raise ConfigError(f"key name must be at most {_MAX_KEY_NAME} bytes, got {len(name.encode())}")
    directory = Path(directory)
    targets = (directory / f"{name}.key", directory / f"{name}.key_secret")
    try:
        for target in targets:
            if target.exists():
                raise ConfigError(f"{target} exists already: remove it or choose another name")
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".wsd-keygen-") as private:
            written = zmq.auth.create_certificates(private, name)
            os.chmod(written[0], 0o644)
            os.chmod(written[1], 0o600)
            for source, target in zip(written, targets):
                os.link(source, target)  # fails rather than replace a key made meanwhile
    except OSError as e:
        raise ConfigError(f"cannot write a key pair in {directory}: {e}") from e
    return targets
