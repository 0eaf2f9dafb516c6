"""``[security]``: the configuration section of CURVE keys and the agent token.

``[security]`` turns on ZeroMQ's CURVE (encryption and authentication by
public key) on the coordinator's client endpoint, its agent endpoint, or both.
Keys are ZeroMQ certificate files (``wsctl keygen`` writes them): NAME.key holds
a public key, NAME.key_secret both halves. The coordinator lists the public
keys it admits in folders: ``viewer_keys`` (may ping, status, ranks, stats,
events), ``admin_keys`` (everything) and ``agent_keys``. Everything CURVE
does, its key files and client roles included, is ``wsd.wire.curve``'s; this module is
the section, and the agent token (read here, checked by ``wsd.coordinator.admission``).

A token file readable by anyone but its owner is refused at start-up
(``ConfigError`` naming the file and its mode). Imports neither torch, nor
ZeroMQ, nor the protocol: ``wsd.config`` loads this section.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wsd.errors import ConfigError
from wsd.files import read_owned

__all__ = ["AGENT_TOKEN_ENV", "NONCE_BYTES", "SecurityConfig", "challenge_proof", "command_mac",
           "load_agent_token", "new_nonce", "registered_proof", "registration_proof", "same_proof", "session_key"]

AGENT_TOKEN_ENV = "WSD_AGENT_TOKEN"
"""The environment variable by which launchers hand the agent token to a coordinator
and its workers (``wsd up`` and the embedded mode make one up)."""
_MIN_TOKEN = 16


def _check_path(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be a path, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """``[security]``: CURVE on the coordinator's endpoints, keys and client roles."""

    curve_clients: bool = False
    """CURVE on the client endpoint: only keys in ``viewer_keys`` or ``admin_keys`` connect."""
    curve_agents: bool = False
    """CURVE on the agent endpoint: only keys in ``agent_keys`` connect."""
    server_secret_key: str | None = None
    """The coordinator's certificate with its secret key (NAME.key_secret, mode 0600)."""
    server_public_key: str | None = None
    """The coordinator's public certificate (NAME.key), as agents read it;
    None: the public half of ``server_secret_key``."""
    viewer_keys: str | None = None
    """Folder of public certificates (*.key) of clients that may only read."""
    admin_keys: str | None = None
    """Folder of public certificates (*.key) of clients that may do everything."""
    agent_keys: str | None = None
    """Folder of public certificates (*.key) of the agents admitted on the agent endpoint."""
    agent_secret_key: str | None = None
    """The agents' own certificate with its secret key (NAME.key_secret, mode 0600)."""
    agent_token_file: str | None = None
    """A file (mode 0600) holding the agent token: a registration is accepted only from
    a process that proves it holds the same token. None: the ``WSD_AGENT_TOKEN``
    environment variable, if set; else registrations are not authenticated."""

    def __post_init__(self) -> None:
        for name in ("curve_clients", "curve_agents"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("server_secret_key", "server_public_key", "viewer_keys", "admin_keys",
                     "agent_keys", "agent_secret_key", "agent_token_file"):
            _check_path(name, getattr(self, name))
        if self.curve_clients and self.viewer_keys is None and self.admin_keys is None:
            raise ValueError("curve_clients is true but neither viewer_keys nor admin_keys is set: "
                             "no client could connect")
        if (self.curve_clients or self.curve_agents) and \
                self.server_secret_key is None and self.server_public_key is None:
            raise ValueError("curve_clients or curve_agents is true: set server_secret_key "
                             "(the coordinator) or server_public_key (agents)")


# -- the agent token ---------------------------------------------------------------------


def load_agent_token(security: SecurityConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The agent token: from ``agent_token_file``, else ``$WSD_AGENT_TOKEN``, else None.

    ConfigError for a file others may read, or a token shorter than 16 characters.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if security.agent_token_file is not None:
        path, what = security.agent_token_file, "[security] agent_token_file"
        token = read_owned(path, what, private=True, limit=4096).strip()
    else:
        what = f"${AGENT_TOKEN_ENV}"
        value = env.get(AGENT_TOKEN_ENV)
        if not value:
            return None
        token = value.strip().encode()
    if len(token) < _MIN_TOKEN:
        raise ConfigError(f"{what}: an agent token has at least {_MIN_TOKEN} characters, got {len(token)} "
                          f"(make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return token


# The agent token's handshake. Both sides prove they hold the token on every connection, to
# each other, bound to two nonces: the agent's (in its first REGISTER) and the coordinator's
# (in its CHALLENGE), each fresh per registration. So a proof seen on the wire is worth nothing
# on another connection or later, an endpoint squatted without the token gets no proof from an
# agent, and a key derived from the token and both nonces authenticates every command of that
# registration. Each HMAC is over its own prefix, so that no proof can stand for another.

NONCE_BYTES = 16
"""Random bytes per nonce (hex on the wire)."""


def _mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, ":".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def challenge_proof(token: bytes, nonce: str, challenge: str) -> str:
    """The coordinator's proof, in its CHALLENGE, that it holds ``token``: over the agent's
    ``nonce`` and its own ``challenge``."""
    return _mac(token, "wsd-challenge", nonce, challenge)


def registration_proof(token: bytes, rank: int, instance: str, engine: str | None, nonce: str,
                       challenge: str) -> str:
    """The agent's proof, in its second REGISTER, that it holds ``token``: over who it
    registers as and both nonces (the token itself never travels)."""
    return _mac(token, "wsd-register", rank, instance, engine or "", nonce, challenge)


def registered_proof(token: bytes, nonce: str, challenge: str, epoch: str, baseline_seq: int) -> str:
    """The coordinator's proof, in REGISTERED, that this answer is its own, to this registration."""
    return _mac(token, "wsd-registered", nonce, challenge, epoch, baseline_seq)


def session_key(token: bytes, nonce: str, challenge: str) -> bytes:
    """The key of one registration: it authenticates every command sent under it."""
    return hmac.new(token, f"wsd-session:{nonce}:{challenge}".encode(), hashlib.sha256).digest()


def command_mac(key: bytes, command: Mapping[str, Any]) -> str:
    """A command's authentication under a registration's ``session_key``: over its seq,
    action, arguments and group (``Command.to_wire()``, its ``mac`` left out)."""
    fields = {k: v for k, v in command.items() if k != "mac"}
    return _mac(key, "wsd-command", json.dumps(fields, sort_keys=True, separators=(",", ":")))


def same_proof(given: object, expected: str) -> bool:
    """Whether ``given`` (a peer's, any type) is ``expected``, in constant time."""
    # As bytes: compare_digest refuses a str that is not ASCII (a TypeError, not a refusal).
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
