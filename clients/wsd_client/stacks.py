"""``wsctl stacks``: every thread's Python stack of the workers asked, the engine's first.

What an operator paged for a hung engine wants to see first: where each rank's
engine thread waits (a collective, a lock, a kernel launch), read by each
agent's own thread while the engine's is blocked. The answer and its rendering;
the request is ``Client.stacks``, the command ``wsd_client.queries.stacks``. Imports no torch.
"""

from __future__ import annotations

from typing import Any

from wsd_client.results import Answer

__all__ = ["Stacks", "render"]


class Stacks(Answer):
    """``stacks``: per rank that answered, ``{rank, tp_group, host, pid, step, in_step, threads}``
    (each thread ``{name, engine, daemon, frames, dropped}``, the engine's first, frames
    ``file:line:function`` outermost first); ``missing``: the ranks asked that did not answer."""

    __slots__ = ()

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return list(self.doc["ranks"])

    @property
    def missing(self) -> list[dict[str, Any]]:
        return list(self.doc["missing"])


def render(doc: dict[str, Any]) -> str:
    """Each rank's threads as Python prints a traceback: the innermost frame last."""
    lines = []
    for rank in doc["ranks"]:
        seconds = rank["in_step"]
        inside = "between steps" if seconds is None else f"inside its step for {seconds:.1f} s"
        lines.append(f"rank {rank['rank']} (TP group {rank['tp_group']}, {rank['host']} pid {rank['pid']}): {inside}")
        for thread in rank["threads"]:
            what = "engine thread" if thread["engine"] else ("daemon thread" if thread["daemon"] else "thread")
            lines.append(f"  {what} {thread['name']!r}:")
            if thread["dropped"]:
                lines.append(f"    ... {thread['dropped']} outer frames left out")
            lines += [f"    {frame}" for frame in thread["frames"]]
        lines.append("")
    for gone in doc["missing"]:
        lines.append(f"rank {gone['rank']}: no stacks ({gone['reason']})")
    return "\n".join(lines).rstrip("\n") or "no rank asked"
