"""Reading a small file that wsd trusts: a key, a token, the contexts file.

``read_owned`` refuses a file that another user could have written, or, for a
secret, read, naming the file and the fix. A module of the shared floor: the
wire's key files (``wsd.wire.curve``), the ``[security]`` section's agent token
(``wsd.security``) and ``wsctl``'s contexts file read through it; the configuration
file's reader (``wsd.tomlread``) checks its owner and mode with ``check_owned``.
"""

from __future__ import annotations

import os
import stat

from wsd.errors import ConfigError

__all__ = ["check_owned", "read_owned"]

_SPECIAL = ("/proc/", "/sys/", "/dev/")


def check_owned(info: os.stat_result, path: str | os.PathLike[str], what: str, *, private: bool) -> None:
    """ConfigError naming ``what``, the file and the fix unless the file ``info`` describes is
    owned by this user or root (a file of another user's is theirs to rewrite) and group and
    others may not write it (``private``: nor read it)."""
    if info.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"{what}: {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}) "
                          f"or root: whoever owns it can rewrite it")
    mode = stat.S_IMODE(info.st_mode)
    if private and mode & 0o077:
        raise ConfigError(f"{what}: {path} has mode {mode:04o}: group and others must have no access to it "
                          f"(chmod 600 {path})")
    if mode & 0o022:
        raise ConfigError(f"{what}: {path} has mode {mode:04o}: group and others must not be able to write "
                          f"it (chmod 644 {path})")


def read_owned(path: str | os.PathLike[str], what: str, *, private: bool, limit: int = 64 << 10) -> bytes:
    """The bytes of a file its reader may trust, or ConfigError naming ``what``, the file and the fix.

    A regular file (never a FIFO, which would hang the read, a device, or a link to
    ``/proc`` such as ``/proc/self/environ``), owned by this user or root (a file of
    another user's is theirs to rewrite), that group and others may not write
    (``private``: nor read); at most ``limit`` bytes. Checked on the file opened,
    not on one put in its place since.
    """
    real = os.path.realpath(path)
    if real.startswith(_SPECIAL) or real in ("/proc", "/sys", "/dev"):
        raise ConfigError(f"{what}: {path} is {real}, not a file of yours")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what}: file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read file {path}: {e.strerror or e}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what}: {path} is not a regular file")
        check_owned(info, path, what, private=private)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ConfigError(f"{what}: {path} is over {limit} bytes")
        return b"".join(chunks)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read file {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
