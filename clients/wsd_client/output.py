"""Where ``wsctl``'s results go: one JSON document per line, or the human rendering, escaped.

Every command's handler (``Handler``) writes through ``Output``, so that whatever a
peer put in a name or a message is made printable once, here, before it reaches a
terminal; only ``watch``'s own redraw (``CLEAR``) goes out as it is.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, TextIO

from wsd.errors import ExitCode as Exit
from wsd.fmt import printable
from wsd_client.client import Client

__all__ = ["CLEAR", "Handler", "Output"]

# ANSI: cursor home, clear screen; ``watch`` redraws in place on a terminal.
CLEAR = "\x1b[H\x1b[2J"


class Output:
    """Where results go: one JSON document per line, or the human rendering."""

    def __init__(self, as_json: bool, stream: TextIO) -> None:
        self.as_json = as_json
        self.stream = stream
        self.closed = False
        """The reader went away (``wsctl stats | head -1``): nothing more is written, and a
        command that follows (``watch``, ``events -f``) stops."""

    def emit(self, doc: Any, human: Callable[[], str]) -> None:
        if self.closed:
            return
        if self.as_json:  # JSON escapes control characters itself
            text = json.dumps(doc, sort_keys=True)
        else:
            # Escaped here, once, for every table and line: names and messages from peers
            # never reach a terminal raw. Only watch's own redraw (first) is sent as it is.
            text = human()
            ours = CLEAR if text.startswith(CLEAR) else ""
            text = ours + printable(text[len(ours):])
        try:
            print(text, file=self.stream, flush=True)
        except BrokenPipeError:
            # The command still ends with the code for what it saw (3 for a partial
            # answer); Python must not complain again when it flushes at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            self.closed = True


Handler = Callable[[Client, argparse.Namespace, Output], Exit]
