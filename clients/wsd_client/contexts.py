"""Contexts: each cluster's endpoint and CURVE keys under a name, in one file, as kubectl's.

The file is ``$WSCTL_CONFIG``, else ``$XDG_CONFIG_HOME/wsd/wsctl.toml`` (else
``~/.config/wsd/wsctl.toml``)::

    current = "prod"

    [contexts.prod]
    endpoint = "tcp://head-0:7601"
    server_key = "keys/coordinator.key"      # the coordinator's public certificate
    client_key = "keys/ops.key_secret"       # yours; both keys or neither

    [contexts.lab]
    endpoint = "tcp://127.0.0.1:7601"

Relative key paths are read from the file's folder. ``wsctl --context NAME``
uses one; ``wsctl config use-context NAME`` sets ``current``, which applies
when neither ``--endpoint`` nor ``$WSD_ENDPOINT`` names a coordinator. A bad
file is a ``ConfigError`` naming the file and the key; so is one that group or
others can write, as a public key file is (``wsd.wire.curve.load_public``): the
file decides which server key wsctl trusts. Imports no torch.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wsd.errors import ConfigError
from wsd.files import read_owned
from wsd.tomlread import parse_toml
from wsd_client.client import Client, endpoint_problem

if sys.version_info >= (3, 11):
    pass
else:  # the 3.10 floor: the same parser, by its older name (a dependency there)
    pass

__all__ = ["CONFIG_ENV", "Context", "Contexts", "client", "default_path"]

CONFIG_ENV = "WSCTL_CONFIG"
"""The environment variable naming the contexts file, before the XDG default."""

_CONTEXT_KEYS = ("endpoint", "server_key", "client_key")
_MAX_CONTEXTS_BYTES = 1 << 20
"""The largest contexts file read: a few dozen contexts take a few KiB."""
# The top-level ``current = ...`` line, which ``use`` rewrites in place (keeping comments).
_CURRENT_LINE = re.compile(r"^\s*current\s*=")


def default_path() -> Path:
    """``$WSCTL_CONFIG``, else ``$XDG_CONFIG_HOME/wsd/wsctl.toml``, else ``~/.config/wsd/wsctl.toml``."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "wsd" / "wsctl.toml"


@dataclass(frozen=True)
class Context:
    """One cluster: where its coordinator's client endpoint is, and the keys to reach it."""

    name: str
    endpoint: str
    server_key: str | None = None
    """The coordinator's public certificate (a path), for CURVE."""
    client_key: str | None = None
    """This client's ``NAME.key_secret`` (a path), for CURVE."""


@dataclass(frozen=True)
class Contexts:
    """A contexts file as read: its contexts by name and the current one (None: none set)."""

    path: Path
    current: str | None
    contexts: dict[str, Context]

    @classmethod
    def load(cls, path: Path | None = None) -> Contexts:
        """The file at ``path`` (default ``default_path()``); none at all when it does not exist."""
        path = path or default_path()
        if not os.path.lexists(path):
            return cls(path, None, {})
        # It names the server keys wsctl trusts: a file of this user's (or root's) that no one
        # else may write, a regular one (a FIFO once hung wsctl), of a bounded size.
        raw = read_owned(path, "the contexts file (it names the server keys wsctl trusts)", private=False,
                         limit=_MAX_CONTEXTS_BYTES)
        return cls._parse(path, raw)

    @classmethod
    def _parse(cls, path: Path, raw: bytes) -> Contexts:
        doc = parse_toml(raw, str(path))
        unknown = sorted(set(doc) - {"current", "contexts"})
        if unknown:
            raise ConfigError(f"{path}: {unknown[0]}: unknown key (allowed: current, contexts)")
        tables = doc.get("contexts", {})
        if not isinstance(tables, dict):
            raise ConfigError(f"{path}: contexts: must be a table of [contexts.NAME] tables")
        contexts = {name: _context(path, name, table) for name, table in tables.items()}
        current = doc.get("current")
        if current is not None and not isinstance(current, str):
            raise ConfigError(f"{path}: current: must be a context's name (a string), got {current!r}")
        if current is not None and current not in contexts:
            raise ConfigError(f"{path}: current: no context {current!r} {_known(contexts)}")
        return cls(path, current, contexts)

    def get(self, name: str) -> Context:
        """The context ``name``, or ConfigError naming the file and the contexts it has."""
        if name not in self.contexts:
            where = f"{self.path}" if self.path.exists() else f"{self.path} (no such file)"
            raise ConfigError(f"{where}: no context {name!r} {_known(self.contexts)}")
        return self.contexts[name]

    def use(self, name: str) -> Contexts:
        """The file with ``current = name`` written in place of the old line (or first), its other
        lines kept as they are; written atomically, with the file's mode."""
        self.get(name)
        lines = self.path.read_text().splitlines(keepends=True)
        setting = f"current = {json.dumps(name)}\n"  # a JSON string is a TOML basic string
        tables_start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
        at = next((i for i in range(tables_start) if _CURRENT_LINE.match(lines[i])), None)
        if at is None:
            lines.insert(0, setting)
        else:
            lines[at] = setting
        text = "".join(lines)
        updated = self._parse(self.path, text.encode())  # refuse to write what would not read back
        _write(self.path, text)
        return updated


def _context(path: Path, name: str, table: Any) -> Context:
    where = f"{path}: contexts.{name}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table ([contexts.{name}]) with endpoint, server_key, client_key")
    unknown = sorted(set(table) - set(_CONTEXT_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(_CONTEXT_KEYS)})")
    for key in _CONTEXT_KEYS:
        if key in table and not isinstance(table[key], str):
            raise ConfigError(f"{where}.{key}: must be a string, got {table[key]!r}")
    if "endpoint" not in table:
        raise ConfigError(f"{where}.endpoint: missing (the coordinator's client endpoint, tcp://HOST:PORT)")
    problem = endpoint_problem(table["endpoint"])
    if problem is not None:
        raise ConfigError(f"{where}.endpoint: {problem}")
    if ("server_key" in table) != ("client_key" in table):
        given, lacking = ("server_key", "client_key") if "server_key" in table else ("client_key", "server_key")
        raise ConfigError(f"{where}.{lacking}: missing: CURVE needs both keys, and {given} is given")
    keys = {k: str(path.parent / os.path.expanduser(table[k])) for k in ("server_key", "client_key") if k in table}
    return Context(name=name, endpoint=table["endpoint"], **keys)


def _known(contexts: dict[str, Context]) -> str:
    return f"(contexts: {', '.join(sorted(contexts))})" if contexts else "(it has none)"


def _write(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def client(name: str | None = None, *, path: Path | None = None, **options: Any) -> Client:
    """A ``Client`` for the context ``name`` (default: the file's ``current``), with its endpoint
    and keys; ``options`` as ``Client`` takes them (``timeout=``, ...)."""
    contexts = Contexts.load(path)
    chosen = name or contexts.current
    if chosen is None:
        raise ConfigError(f"{contexts.path}: no current context: name one, or set `current`")
    context = contexts.get(chosen)
    return Client(context.endpoint, curve_server_key=context.server_key, curve_client_key=context.client_key,
                  **options)
