"""Engine names: what a name may hold, and the default engine's. Imports nothing from wsd.

An engine is one world of ranks that one coordinator serves beside others (a vLLM
replica, a data-parallel engine, a ``wsd up`` cluster). Its name is part of a file
name (the engine's state file, ``STATE_FILE@NAME``), a Prometheus label value and a
command-line argument, so it is kept to letters, digits, ``_`` and ``-``.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_ENGINE", "ENGINE_NAME", "MAX_ENGINE_NAME", "engine_name", "engine_name_problem"]

DEFAULT_ENGINE = "default"
"""The engine of an agent that names none, unless ``[coordinator] engine`` says otherwise."""
MAX_ENGINE_NAME = 128
ENGINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def engine_name_problem(name: object) -> str | None:
    """What is wrong with ``name`` as an engine's name, or None."""
    if not isinstance(name, str):
        return f"an engine name is a string, got {type(name).__name__}"
    if not 0 < len(name) <= MAX_ENGINE_NAME:
        return f"an engine name holds 1 to {MAX_ENGINE_NAME} characters, got {len(name)}"
    if not ENGINE_NAME.fullmatch(name):
        return (f"engine name {name[:40]!r}: letters, digits, '_' and '-' only, starting with a "
                f"letter or digit")
    return None


def engine_name(text: str) -> str:
    """``text`` (a host, a model, ...) made into a valid engine name: every other character
    becomes ``-``, runs of them one, cut to the maximum length."""
    name = re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-_")[:MAX_ENGINE_NAME].rstrip("-_")
    return name or DEFAULT_ENGINE
