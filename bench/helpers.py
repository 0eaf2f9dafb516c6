"""What the benchmarks share: spawned helper processes and a coordinator to run in one.

Helpers are spawned (each starts clean: no torch, no state inherited from the
benchmark) and talk to the benchmark over a pipe; ``Helper.stop`` is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from wsd.config import CoordinatorConfig
from wsd.coordinator.loop import Coordinator
from wsd_client.results import PerEngine

__all__ = ["START_TIMEOUT", "Helper", "Row", "one_engine", "run_coordinator", "timed_us"]

T = TypeVar("T")

START_TIMEOUT = 30.0


def run_coordinator(conn: Any, state_file: str, options: dict[str, Any] | None = None) -> None:
    """A coordinator on loopback ports until told to stop; sends (agent, client) endpoints first,
    or with ``metrics_port`` in ``options`` (agent, client, metrics URL)."""
    options = options or {}
    config = CoordinatorConfig(agent_endpoint="tcp://127.0.0.1:0", client_endpoint="tcp://127.0.0.1:0",
                               state_file=state_file, **options)
    coordinator = Coordinator(config).start()
    endpoints = (coordinator.agent_endpoint, coordinator.client_endpoint)
    conn.send(endpoints if config.metrics_port is None else (*endpoints, coordinator.metrics_url))
    conn.recv()  # until told to stop
    coordinator.stop()


class Helper:
    """A spawned helper process, stopped (bounded) by ``stop``."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()

    def result(self, timeout: float = START_TIMEOUT) -> Any:
        """The helper's next message; exits the benchmark if none comes within ``timeout``."""
        if not self._conn.poll(timeout):
            raise SystemExit(f"helper {self.process.name} did not answer within {timeout} s")
        return self._conn.recv()

    def ask(self, request: Any, timeout: float = START_TIMEOUT) -> Any:
        self._conn.send(request)
        return self.result(timeout)

    def stop(self) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


def one_engine(answer: T | PerEngine[T]) -> T:
    """A client call's answer from a coordinator serving one engine, as every benchmark's does
    (the client's calls are typed for several: one ``PerEngine`` answer each)."""
    if isinstance(answer, PerEngine):
        raise SystemExit(f"one engine's answer expected, got one from each of {sorted(answer)}")
    return answer


def timed_us(fn: Callable[[], object]) -> float:
    """Microseconds one call of ``fn`` takes."""
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


@dataclass(frozen=True)
class Row:
    """One line of ``python -m bench``'s table: a figure against its baseline."""

    name: str
    value: float
    baseline: str
    """What the figure is measured against, in the same run ("absolute" for a bare figure)."""
    target: float | None = None
    """The figure must be at most this (at least, with ``at_least``); None: reported, no target."""
    unit: str = "x"
    at_least: bool = False
    """The target is a floor (a throughput ratio), not a ceiling."""

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value >= self.target if self.at_least else self.value <= self.target
