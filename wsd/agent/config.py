"""``[agent]``: the agent inside each worker process. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from wsd.fieldchecks import check_positive, check_range
from wsd.names import engine_name_problem

__all__ = ["AgentConfig"]


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """``[agent]``: the agent inside each worker process."""

    apply_every: int | None = None
    """Apply commands at every k-th ``step()`` (the TP group agrees then). None: the
    engine's default, 1 for the built-in engine loop, 16 in vLLM (whose idle or busy
    engine is also woken for one agreement step when a command waits)."""
    connect_timeout: float = 10.0
    """Seconds ``Agent.start`` waits for its I/O thread to come up."""
    engine: str | None = None
    """The engine this worker's rank belongs to (``WSD_ENGINE`` too): ranks are unique within an
    engine, and one coordinator serves many. None: the coordinator's default engine (``[coordinator]
    engine``); inside vLLM, a name derived from the deployment (see docs/vllm.md)."""

    def __post_init__(self) -> None:
        if self.apply_every is not None:
            check_range("apply_every", self.apply_every, 1, 1_000_000)
        check_positive("connect_timeout", self.connect_timeout, 3600.0)
        if self.engine is not None:
            problem = engine_name_problem(self.engine)
            if problem is not None:
                raise ValueError(f"engine: {problem}")
