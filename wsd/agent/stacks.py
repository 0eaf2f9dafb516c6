"""Every thread's Python stack, as the agent's thread reads it while the engine's is blocked.

``sys._current_frames()`` gives each thread's innermost frame without stopping
it; walking ``f_back`` from there reads file, line and function only (no
locals, no source: nothing the operator did not ask for, and nothing that
takes a lock the blocked thread may hold). A Python-only dump takes
milliseconds where a native one takes minutes.

Bounded: at most ``MAX_THREADS`` threads (the engine's first, then by name),
``MAX_FRAMES`` frames each (the innermost; the count of those left out is
kept), each frame's text cut to ``MAX_FRAME_TEXT`` characters in the middle,
where the file's name and the line survive. No torch, nothing of wsd's.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["MAX_FRAMES", "MAX_FRAME_TEXT", "MAX_THREADS", "StepClock", "thread_stacks"]

MAX_THREADS = 64
MAX_FRAMES = 48
MAX_FRAME_TEXT = 240


def _cut(text: str) -> str:
    if len(text) <= MAX_FRAME_TEXT:
        return text
    keep = (MAX_FRAME_TEXT - 3) // 2
    return f"{text[:keep]}...{text[-keep:]}"


def _frames(frame: FrameType | None) -> tuple[list[str], int]:
    """``file:line:function`` per frame, outermost first; and how many were left out."""
    out: list[str] = []
    while frame is not None:
        code = frame.f_code
        out.append(_cut(f"{code.co_filename}:{frame.f_lineno}:{code.co_name}"))
        frame = frame.f_back
    dropped = max(0, len(out) - MAX_FRAMES)
    innermost = out[:MAX_FRAMES]
    innermost.reverse()
    return innermost, dropped


def thread_stacks(engine: int | None = None, *, skip: int | None = None) -> list[dict[str, Any]]:
    """This process's threads, each ``{name, ident, engine, daemon, frames, dropped}``: the
    thread whose ident is ``engine`` first, then by name; ``skip`` (the caller's own thread,
    say) left out."""
    names = {t.ident: t for t in threading.enumerate()}
    frames = sys._current_frames()
    idents = [i for i in frames if i != skip]
    idents.sort(key=lambda i: (i != engine, getattr(names.get(i), "name", ""), i))
    out = []
    for ident in idents[:MAX_THREADS]:
        thread = names.get(ident)
        lines, dropped = _frames(frames[ident])
        out.append({"name": _cut(thread.name if thread is not None else f"thread-{ident}"), "ident": ident,
                    "engine": ident == engine, "daemon": bool(thread is not None and thread.daemon),
                    "frames": lines, "dropped": dropped})
    return out


class StepClock:
    """Whether the engine's thread is inside a step, since when, and which thread that is.

    The engine's thread calls ``enter``/``leave`` around each step (and around each
    agreement, which may wait on a peer); any thread reads ``inside``. Plain attribute
    writes: no lock on the engine's path. Nested entries count as one (an agreement
    inside a step).
    """

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._depth = 0
        self.since: float | None = None
        """When the current step began (``clock()``); None between steps."""
        self.thread: int | None = None
        """The ident of the thread that last entered: the engine's."""
        self.step = 0
        """Steps entered so far (the outermost entries)."""

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self.thread = threading.get_ident()
            self.step += 1
            self.since = self._clock()

    def leave(self) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self._depth = 0
            self.since = None

    def inside(self) -> float | None:
        """Seconds the engine has been inside its current step; None between steps."""
        since = self.since
        return None if since is None else max(0.0, self._clock() - since)
