"""What the coordinator's logic hands its socket loop: frames addressed to an agent or a client.

Every decision is a plain method that returns ``list[Out]``, ``(AGENT | CLIENT, route,
frame)``; the loop (``wsd.coordinator.loop``) sends them. An answer that may come later
(a command waiting for its acknowledgements, a fresh stats round) goes to an ``Answer``.
Imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["AGENT", "CLIENT", "Answer", "Out", "Route"]

AGENT = "agent"
CLIENT = "client"
Route = tuple[bytes, ...]
Out = tuple[str, Route, bytes]
Answer = Callable[[dict[str, Any] | bytes], list[Out]]
"""Where a client's answer goes: called once with the result (a map, or one already
encoded), it returns the frames that carry it (to the client, or to a fan-out across engines)."""
