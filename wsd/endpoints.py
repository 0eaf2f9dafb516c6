"""What a ZeroMQ endpoint wsd binds or connects to may be: checked as text, before any socket.

A module of the shared floor: it imports nothing of wsd's, so that configuration
(``wsd.fieldchecks``) checks endpoints without loading ZeroMQ.
"""

from __future__ import annotations

import re

__all__ = ["check_endpoint", "endpoint_problem"]

# tcp://HOST:PORT, HOST a name or an IPv4 address, [an IPv6 address] or *.
_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+)"
                  r":(?P<port>-?[0-9]{1,12})")


def check_endpoint(endpoint: str, *, bind: bool) -> None:
    """ValueError, saying what is allowed, unless wsd can ``bind`` (else connect to) ``endpoint``.

    ZeroMQ accepts more than it should: it binds port 99999 as some random
    port and -1 as 65535 without a word, and binds ``*`` as a host (every
    interface), which cannot be connected to. A bound endpoint may ask for
    port 0, any free port; ``bind`` returns the one the kernel chose.
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"must be a ZeroMQ endpoint such as tcp://127.0.0.1:7600, got {endpoint!r}")
    scheme, sep, address = endpoint.partition("://")
    if scheme in ("ipc", "inproc") and sep and address:
        return
    match = _TCP.fullmatch(endpoint)
    if match is None:
        wildcards = " or * for every interface; PORT 0 for any free one" if bind else ""
        raise ValueError(f"must be a ZeroMQ endpoint: tcp://HOST:PORT (HOST a name, an IPv4 address, "
                         f"[an IPv6 address]{wildcards}), ipc://PATH or inproc://NAME, got {endpoint!r}")
    host = match["host"]
    if not host.startswith(("[", "*")) and (len(host) > 253 or any(len(label) > 63 for label in host.split("."))):
        shown = endpoint if len(endpoint) <= 80 else f"{endpoint[:80]}..."
        raise ValueError(f"must have a host name of at most 253 characters, each dot-separated part at most "
                         f"63 (what DNS allows), got {shown!r}")
    if match["host"] == "*" and not bind:
        raise ValueError(f"must name the host to connect to (* means every interface, to bind), "
                         f"got {endpoint!r}")
    if not (0 if bind else 1) <= int(match["port"]) <= 65535:
        ports = "0 (any free port) to 65535" if bind else "1 to 65535"
        raise ValueError(f"must have a port from {ports}, got {endpoint!r}")


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with ``endpoint`` to connect to ("must be ..., got ..."), or None."""
    try:
        check_endpoint(endpoint, bind=False)
    except ValueError as e:
        hint = f"; did you mean 'tcp://{endpoint}'?" if isinstance(endpoint, str) and "://" not in endpoint else ""
        return f"{e}{hint}"
    return None
