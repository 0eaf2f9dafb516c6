"""Reading a TOML file with a bounded cost: a regular file, of a bounded size, not nested
beyond what the parser's stack allows; every failure a ConfigError naming the file.
Imports nothing from wsd but its errors and ``wsd.files`` (the configuration loader and
wsctl's contexts file both read TOML this way).
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

from wsd.errors import ConfigError
from wsd.files import check_owned

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["MAX_CONFIG_BYTES", "parse_toml", "read_toml"]

MAX_CONFIG_BYTES = 1 << 20
"""The largest configuration file read: wsd's own take a few KiB."""


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML document at ``path``; ConfigError naming the file if it cannot be read or parsed.

    A regular file of at most ``MAX_CONFIG_BYTES`` (a FIFO would hang the reader, a device
    such as ``/dev/zero`` would never end), owned by this user or root and writable by no one
    else, nested no deeper than the parser's stack allows.
    """
    source = str(path)
    not_regular = f"{source}: not a regular file (a folder, a FIFO or a device): give a configuration file"
    try:
        # Non-blocking, then checked on the open file: a FIFO neither hangs the open nor is read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(not_regular)
            # It names the token and key files and the endpoints to trust, as they are checked.
            check_owned(info, source, "configuration file", private=False)
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{source}: configuration file not found") from None
    except IsADirectoryError:
        raise ConfigError(not_regular) from None  # a folder: refused by the read, not the open
    except OSError as e:
        raise ConfigError(f"{source}: cannot read configuration file: {e}") from e
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: a configuration file of more than {MAX_CONFIG_BYTES} bytes: not one of wsd's")
    return parse_toml(data, source)


def parse_toml(data: bytes, source: str) -> dict[str, Any]:
    """``data`` as TOML; ConfigError naming ``source`` if it is not valid."""
    try:
        return tomllib.loads(data.decode())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except RecursionError:  # arrays or tables nested thousands deep: tomllib recurses per level
        raise ConfigError(f"{source}: not valid TOML for wsd: nested too deeply") from None
