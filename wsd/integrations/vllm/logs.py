"""wsd's log lines in vLLM's log, in vLLM's format.

vLLM configures its own logger only (``vllm``, which does not propagate), and
later than plugins load: without this, wsd's lines would reach no handler but
Python's last resort, WARNING and up, unformatted, and an operator would never
see that wsd attached.
"""

from __future__ import annotations

import logging

__all__ = ["log_with_vllm"]


class _ToVllmLog(logging.Handler):
    """Hands wsd's log records to vLLM's own handlers, as they are when the record comes.

    vLLM configures its own logger only (``vllm``, which does not propagate), and
    later than plugins load: wsd's lines would otherwise reach no handler but
    Python's last resort, WARNING and up, unformatted, and an operator would never
    see that wsd attached. Before vLLM has a handler (a plugin that fails to load
    says so then), WARNING and up go to standard error, with their level and time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.early = logging.StreamHandler()  # sys.stderr
        self.early.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger("vllm")
        handlers = theirs.handlers
        try:
            if handlers:
                if record.levelno >= theirs.getEffectiveLevel():
                    if not hasattr(record, "vllm_process_name"):  # made before vLLM's record factory
                        record.vllm_process_name = record.processName
                    for handler in handlers:
                        if record.levelno >= handler.level:
                            handler.handle(record)
            elif record.levelno >= logging.WARNING:
                self.early.handle(record)
        except Exception:
            self.handleError(record)


def log_with_vllm() -> None:
    """wsd's log lines in vLLM's log, in vLLM's format (unless logging is configured already)."""
    ours = logging.getLogger("wsd")
    if ours.handlers or logging.getLogger().handlers:
        return
    ours.addHandler(_ToVllmLog())
    ours.setLevel(logging.INFO)  # vLLM's own level decides, at each record
    ours.propagate = False
